"""Errors a caller can cause. Broken internal invariants are ``assert``s, not these."""

from __future__ import annotations


class PolicyError(ValueError):
    """A bad request to a policy or the registry: names the value and what is wrong with it.

    Raised before any state changes, so the pool is exactly as it was.

    ``reason`` is what is wrong; ``spec`` the policy spec string it came from, as the user wrote
    it, when a spec was being read or built (``policies.registry.create`` sets it, once, for the
    outermost spec: a wrapper's base is named inside ``reason``). ``str()`` is
    ``policy spec '<spec>': <reason>``, or the reason alone without a spec or when
    ``spec_in_reason`` (the spec grammar's length and bracket checks quote the spec themselves,
    a too-long one cut short).
    """

    def __init__(self, reason: str, *, spec: str | None = None, spec_in_reason: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.spec = spec
        self.spec_in_reason = spec_in_reason

    def __str__(self) -> str:
        if self.spec is None or self.spec_in_reason:
            return self.reason
        return f"policy spec {self.spec!r}: {self.reason}"

    def naming(self, spec: str) -> PolicyError:
        """This error naming ``spec``, the spec string being built when it was raised: itself
        when it names ``spec`` already, else a new one of its type whose reason keeps any other
        spec it named (a spec built inside another, not through a wrapper's ``base``)."""
        if self.spec == spec:
            return self
        return type(self)(self.reason if self.spec is None else str(self), spec=spec)

    def __reduce__(self):
        # a sweep's worker sends its error to the main process: keep the spec across the pickle
        return (_rebuild, (type(self), self.reason, self.spec, self.spec_in_reason))


def _rebuild(
    cls: type[PolicyError], reason: str, spec: str | None, spec_in_reason: bool
) -> PolicyError:
    return cls(reason, spec=spec, spec_in_reason=spec_in_reason)
