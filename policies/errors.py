"""Errors a caller can cause. Broken internal invariants are ``assert``s, not these."""


class PolicyError(ValueError):
    """A bad request to a policy or the registry: names the value and what is wrong with it.

    Raised before any state changes, so the pool is exactly as it was.
    """
