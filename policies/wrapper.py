"""Wrapper policies: a policy that adds control on top of another registered policy (its *base*).

Composition, not flags (RMM's resource adaptors): ``elastic``, ``compacting`` and ``tag-limits``
build their base from a spec string, so any registered policy, third-party ones and other
wrappers included, can be wrapped: ``tag-limits:base=[elastic:base=[best-fit]],limits=[kv=8GiB]``.

``WrapperPolicy`` holds what they share:

- the base is built with the wrapper's ``capacity_bytes`` and ``device`` and owns every segment
  and segment counter, so ``stats()``, ``segments()``, ``free_extents()`` and
  ``largest_free_bytes()`` are the base's; the wrapper mirrors the base's byte and segment
  counters as attributes (``_sync``), for callers that read ``policy.reserved_bytes``;
- the wrapper hands out its own ``Allocation`` objects (``_wrap``; ``handle`` is the base's
  allocation), which must be freed through the wrapper, and counts requests itself: its
  ``num_failures`` are what the caller saw fail, not the base's attempts before a retry;
- ``freeze()`` freezes the base too;
- **moves**: a policy that can move live allocations (``compacting``) has
  ``moves_allocations = True`` and reports each move to its listeners. A wrapper over such a
  base keeps a map from the base's allocations to its own and updates the caller's handle
  (``extents``) in place, then reports the move upwards: callers at any depth hold handles
  that stay right. ``on_move(allocation, old_offset, new_offset, nbytes)``, when set, is called
  for every move with this layer's allocation (``realgpu`` copies the bytes there).

- **capabilities** (``Policy``'s declared ones: ``moves_allocations``, ``can_reserve``/``reserve``,
  ``can_compact``/``compact``, ``empty_cache``, ``page_size_bytes``, ...) are the base's,
  forwarded explicitly, so a caller asks the outermost policy and never searches the stack. A
  wrapper that adds a capability (``elastic``: ``reserve``; ``compacting``: ``compact``)
  overrides the flag and the method.

``layers(policy)`` walks a stack of wrappers from the outside in (for display and tests).
"""

from __future__ import annotations

import contextlib

from typing import Any, Callable, Iterator

from policies.base import Allocation, Policy, PoolStats, Segment
from policies.device import Device
from policies.device_kind import DeviceKind
from policies.errors import PolicyError

__all__ = ["WrapperPolicy", "MoveCallback", "layers"]

#: ``on_move(allocation, old_offset, new_offset, nbytes)``: copy with memmove semantics (the
#: ranges may overlap); moves are reported in an order in which copying each one then is safe.
MoveCallback = Callable[[Allocation, int, int, int], None]


def layers(policy: Policy) -> Iterator[Policy]:
    """``policy``, then its base, its base's base, ... (the stack of wrappers, outside in)."""
    while policy is not None:
        yield policy
        policy = policy.base_policy


class WrapperPolicy(Policy):
    """Base of the policies that wrap another policy. See the module docstring.

    Args:
        base: spec string of the wrapped policy; built with this pool's ``capacity_bytes`` and
            ``device``.
        capacity_bytes: most bytes the base may reserve; None for no limit.
        device: the base's upstream (a ``VirtualDevice`` by default).

    Subclasses set their own knobs, then call ``super().__init__(base=..., ...)`` last; they
    may override ``_check_base`` to refuse a base they cannot wrap, and must call
    ``super()._reset_state()`` from their own.
    """

    def __init__(
        self,
        *,
        base: str = "best-fit",
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        if not isinstance(base, str):
            raise PolicyError(
                f"{self.name} base(={base!r}) must be a policy spec string such as 'best-fit'"
            )
        from policies.registry import create  # the registry lists wrapper modules: import it late

        with _naming_base(self.name, base):
            base_policy = create(base, capacity_bytes=capacity_bytes, device=device)
        self._check_base(base_policy)
        self.base = base
        self.base_policy = base_policy
        # what the checks and callers read off the class describe the base's placement
        self.contiguous = base_policy.contiguous
        self.coalesces = base_policy.coalesces
        #: called for every move of one of this layer's allocations (wiring, not a knob)
        self.on_move: MoveCallback | None = None
        self._move_listeners: list[MoveCallback] = []
        if base_policy.moves_allocations:
            base_policy.add_move_listener(self._base_moved)
        super().__init__(capacity_bytes=capacity_bytes, device=base_policy.device)

    @classmethod
    def device_kind_for(cls, params: dict[str, Any]) -> DeviceKind:
        """The base's: a wrapper reserves nothing itself."""
        from policies.registry import device_kind

        base = params.get("base", cls.param_defaults()["base"])
        with _naming_base(cls.name, base):
            return device_kind(base)

    @classmethod
    def can_hold_kv_for(cls, params: dict[str, Any]) -> bool:
        """The base's: the wrapper hands out the base's allocations."""
        from policies.registry import can_hold_kv

        base = params.get("base", cls.param_defaults()["base"])
        with _naming_base(cls.name, base):
            return can_hold_kv(base)

    def _check_base(self, base_policy: Policy) -> None:
        """Raise PolicyError when this wrapper cannot wrap ``base_policy``."""

    # ----------------------------------------------------------------- moves
    # ----------------------------------------------------------------- capabilities, forwarded
    @property
    def moves_allocations(self) -> bool:
        """Whether allocations of this pool may move (its base, at any depth, compacts)."""
        return self.base_policy.moves_allocations

    @property
    def moves_while_allocating(self) -> bool:
        return self.base_policy.moves_while_allocating

    @property
    def can_reserve(self) -> bool:
        return self.base_policy.can_reserve

    @property
    def can_compact(self) -> bool:
        return self.base_policy.can_compact

    @property
    def page_size_bytes(self) -> int | None:
        return self.base_policy.page_size_bytes

    @property
    def can_hold_kv(self) -> bool:
        return self.base_policy.can_hold_kv

    @property
    def block_cache(self) -> Policy | None:
        return self.base_policy.block_cache

    def reserve(self, nbytes: int) -> bool:
        ok = self.base_policy.reserve(nbytes)
        self._sync()
        return ok

    def compact(self, *, force: bool = False) -> Any:
        record = self.base_policy.compact(force=force)
        self._sync()
        return record

    def compaction_stats(self) -> dict[str, Any]:
        return self.base_policy.compaction_stats()

    def take_compaction_ns(self) -> int:
        return self.base_policy.take_compaction_ns()

    def empty_cache(self) -> int:
        released = self.base_policy.empty_cache()
        self._sync()
        return released

    @property
    def has_private_pools(self) -> bool:
        return self.base_policy.has_private_pools

    def begin_allocate_to_pool(self, pool_id: Any, stream: int) -> None:
        self.base_policy.begin_allocate_to_pool(pool_id, stream)

    def end_allocate_to_pool(self, pool_id: Any) -> None:
        self.base_policy.end_allocate_to_pool(pool_id)

    def release_pool(self, pool_id: Any) -> None:
        self.base_policy.release_pool(pool_id)
        self._sync()  # a pool's last user gone: its free segments may go back

    def add_move_listener(self, listener: MoveCallback) -> None:
        """Call ``listener`` after ``on_move`` for every move (how a wrapper above follows)."""
        self._move_listeners.append(listener)

    def _report_move(self, a: Allocation, old_offset: int, new_offset: int, nbytes: int) -> None:
        if self.on_move is not None:
            self.on_move(a, old_offset, new_offset, nbytes)
        for listener in self._move_listeners:
            listener(a, old_offset, new_offset, nbytes)

    def _base_moved(self, inner: Allocation, old_offset: int, new_offset: int, nbytes: int) -> None:
        a = self._outer_of.get(inner)
        assert a is not None, "the base moved an allocation this wrapper never handed out"
        a.extents = inner.extents
        self._report_move(a, old_offset, new_offset, nbytes)

    def _wrap(self, inner: Allocation, nbytes: int, stream: int, tag: str | None) -> Allocation:
        """This layer's handle on the base's allocation ``inner``."""
        a = Allocation(nbytes, inner.size_bytes, inner.extents, stream, tag, inner)
        outer_of = self._outer_of
        if outer_of is not None:
            outer_of[inner] = a
        return a

    def _free_inner(self, a: Allocation) -> None:
        """Free ``a``'s allocation in the base."""
        inner = a.handle
        if self._outer_of is not None:
            del self._outer_of[inner]
        self.base_policy.free(inner)

    # ----------------------------------------------------------------- counters
    def _sync(self) -> None:
        """Mirror the base's byte and segment counters, for callers that read attributes."""
        b = self.base_policy
        self.allocated_bytes = b.allocated_bytes
        self.reserved_bytes = b.reserved_bytes
        self.num_grows = b.num_grows
        self.num_shrinks = b.num_shrinks
        self.grown_bytes = b.grown_bytes
        self.shrunk_bytes = b.shrunk_bytes
        self.peak_reserved_bytes = b.peak_reserved_bytes

    def _mirror(self) -> None:
        """``_sync`` in the common case where no segment changed hands: the hot path."""
        b = self.base_policy
        if (
            b.reserved_bytes != self.reserved_bytes
            or b.num_grows != self.num_grows
            or b.num_shrinks != self.num_shrinks
        ):
            self._sync()
        else:
            self.allocated_bytes = b.allocated_bytes

    def _note_failure(self) -> None:
        """A request this wrapper passed to its base failed: count it as frozen when the base
        is frozen (a failure there means a grow was refused), then mirror the counters."""
        if self.base_policy.frozen:
            self._frozen_refusal_at = self.num_allocs + self.num_failures
        self._sync()

    # ----------------------------------------------------------------- Policy hooks
    def _reset_state(self) -> None:
        # base allocation -> ours, kept only when the base may move them (see the module docstring)
        moves = self.base_policy.moves_allocations
        self._outer_of: dict[Allocation, Allocation] | None = {} if moves else None
        self._sync()

    def _release_free_segments(self, max_bytes: int | None) -> int:
        released = self.base_policy.trim(max_bytes)
        self._sync()
        return released

    def _add_segment(self, segment: Segment) -> None:
        raise AssertionError(f"{type(self).__name__} never reserves segments itself; its base does")

    def _segment_size_for(self, nbytes: int) -> int:
        return self.base_policy._segment_size_for(nbytes)

    # ----------------------------------------------------------------- delegated to the base
    def grow(self, nbytes: int) -> bool:
        ok = self.base_policy.grow(nbytes)
        self._sync()
        return ok

    def freeze(self) -> None:
        super().freeze()
        self.base_policy.freeze()

    def unfreeze(self) -> None:
        super().unfreeze()
        self.base_policy.unfreeze()

    def reset(self) -> None:
        self.base_policy.reset()
        super().reset()

    def stats(self) -> PoolStats:
        s = self.base_policy.stats()
        # the base counted its own failed attempts, before retries; the caller saw ours
        s.num_failures = self.num_failures
        s.num_frozen_failures = self.num_frozen_failures
        return s

    def gauges(self) -> tuple[int, int, int, int, int]:
        return self.base_policy.gauges()

    def segments(self) -> list[Segment]:
        return self.base_policy.segments()

    def free_extents(self) -> list[tuple[int, int]]:
        return self.base_policy.free_extents()

    def largest_free_bytes(self) -> int:
        return self.base_policy.largest_free_bytes()

    def shared_extents(self) -> list[tuple[int, int]]:
        """The base's shared pages, where it has any (see ``policies.testing``)."""
        return self.base_policy.shared_extents()


@contextlib.contextmanager
def _naming_base(wrapper: str, base: Any) -> Iterator[None]:
    """A PolicyError about the base names it as this wrapper's ``base`` knob; the whole spec the
    user wrote is named by ``policies.registry.create``, once, around it."""
    try:
        yield
    except PolicyError as exc:
        own = isinstance(base, str) and exc.spec == base.strip()
        raise PolicyError(f"{wrapper} base(={base!r}): {exc.reason if own else exc}") from None
