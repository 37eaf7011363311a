"""``elastic``: a watermark controller that wraps any other policy.

The wrapped (*base*) policy keeps deciding where requests go; the controller decides when the
pool maps another segment or gives free ones back, from the base's use
(``allocated / reserved``):

- after an allocation leaves use above ``high``, it maps ``grow_bytes`` more, so the next
  requests find room without a device call on their hot path;
- when an allocation fails, it maps a segment big enough for the request and retries once;
- when use stays below ``low`` for ``patience`` consecutive frees, it releases fully free
  segments (never below ``min_reserved_bytes``). It releases only down to the middle of the
  watermark band, so a trim cannot push use straight back above ``high`` (hysteresis: the pool
  does not thrash between growing and trimming);
- ``reserve(nbytes)`` is a hint from the layer above (before a prefill): pre-grow so that at
  least ``nbytes`` are free.

Composition, not flags (RMM's resource adaptors): the base is built from a spec string, so
``elastic:base=[size-class:classes_per_doubling=8],high=0.9`` wraps any registered policy,
third-party ones and other wrappers included (``policies.wrapper``). A frozen pool
(``freeze()``) neither grows nor trims: memory it gave back could not come back.
"""

from __future__ import annotations

import math
from typing import Any

from policies.base import Allocation, check_positive_int
from policies.device import Device
from policies.errors import PolicyError
from policies.wrapper import WrapperPolicy

__all__ = ["Elastic"]


def _check_fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise PolicyError(f"{name}(={value!r}) must be a number between 0 and 1")
    return value


class Elastic(WrapperPolicy):
    """Grows a base policy ahead of demand and trims it behind demand, between two watermarks.

    The base policy does all placement and owns every segment and segment counter, so
    ``stats()``, ``segments()``, ``free_extents()`` and ``largest_free_bytes()`` are the
    base's. The wrapper counts requests itself (its ``num_failures`` are requests the caller
    saw fail, not the base's attempts before a retry) and hands out its own ``Allocation``
    objects, which must be freed through the wrapper (see ``policies.wrapper``).

    Args:
        base: spec string of the wrapped policy (``"best-fit"``, ``"size-class:..."``, or
            another wrapper); built with this pool's ``capacity_bytes`` and ``device``.
        high: use above which an allocation triggers a pre-grow (1 disables pre-growing).
        low: use below which frees count towards a trim (0 disables trimming).
        patience: consecutive frees below ``low`` before a trim.
        grow_bytes: bytes mapped by each pre-grow (also the least a failure retry maps).
            32 MiB, the base contract's default segment: cudaMalloc of 64 MiB costs about
            64 us on an H200 (docs/field-notes.md), so fewer, larger maps are cheap.
        min_reserved_bytes: the controller never trims the pool below this many bytes.
        capacity_bytes: most bytes the base may reserve; None for no limit.
        device: the base's upstream (a ``VirtualDevice`` by default).

    Attributes:
        base_policy: the wrapped policy.
        mapped_bytes / unmapped_bytes: bytes the wrapper mapped (pre-grows, retries, ``reserve``,
            ``grow``) and unmapped (its trims, ``trim``) on top of what the base does on its own.
    """

    name = "elastic"
    can_reserve = True

    def __init__(
        self,
        *,
        base: str = "best-fit",
        high: float = 0.85,
        low: float = 0.30,
        patience: int = 16,
        grow_bytes: int = 32 << 20,
        min_reserved_bytes: int = 0,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        _check_fraction("high", high)
        _check_fraction("low", low)
        if not low < high:
            raise PolicyError(f"elastic watermarks need low(={low!r}) < high(={high!r})")
        check_positive_int("patience", patience)
        check_positive_int("grow_bytes", grow_bytes)
        check_positive_int("min_reserved_bytes", min_reserved_bytes, minimum=0)
        if (
            capacity_bytes is not None
            and isinstance(capacity_bytes, int)
            and min_reserved_bytes > capacity_bytes
        ):
            raise PolicyError(
                f"min_reserved_bytes(={min_reserved_bytes}) "
                f"exceeds capacity_bytes(={capacity_bytes})"
            )
        self.high = high
        self.low = low
        self.patience = patience
        self.grow_bytes = grow_bytes
        self.min_reserved_bytes = min_reserved_bytes
        super().__init__(base=base, capacity_bytes=capacity_bytes, device=device)

    # ----------------------------------------------------------------- controller
    @property
    def usage(self) -> float:
        """The base's ``allocated / reserved`` (0 when nothing is reserved)."""
        b = self.base_policy
        return b.allocated_bytes / b.reserved_bytes if b.reserved_bytes else 0.0

    def reserve(self, nbytes: int) -> bool:
        """Pre-grow so that at least ``nbytes`` are free (a hint before a prefill).

        Returns:
            True when that many bytes are free afterwards; False when capacity or the device
            refused (nothing changes then).
        """
        b = self.base_policy
        missing = nbytes - (b.reserved_bytes - b.allocated_bytes)
        if missing <= 0:
            return True
        size = max(self.grow_bytes, missing)
        if not self._fits_capacity(size):
            size = missing
        ok = self._fits_capacity(size) and self._map(size)
        self._sync()
        return ok

    def elastic_stats(self) -> dict[str, Any]:
        """What the controller did since the last reset, and the base's use now."""
        return {
            "usage": self.usage,
            "mapped_bytes": self.mapped_bytes,
            "unmapped_bytes": self.unmapped_bytes,
            "num_maps": self.num_maps,
            "num_unmaps": self.num_unmaps,
            "num_retries": self.num_retries,
            "num_low_frees": self._num_low_frees,
        }

    def _fits_capacity(self, nbytes: int) -> bool:
        """Would a grow of ``nbytes`` fit under capacity? Checked first because a refused grow
        makes the base release its free segments (its trim-and-retry), the opposite of what a
        pre-grow wants."""
        b = self.base_policy
        if b.capacity_bytes is None:
            return True
        return b.reserved_bytes + b._segment_size_for(nbytes) <= b.capacity_bytes

    def _map(self, nbytes: int) -> bool:
        b = self.base_policy
        grown, shrunk = b.grown_bytes, b.shrunk_bytes
        ok = b.grow(nbytes)
        self.mapped_bytes += b.grown_bytes - grown
        self.unmapped_bytes += b.shrunk_bytes - shrunk
        self.num_maps += ok
        return ok

    def _unmap(self, max_bytes: int | None) -> int:
        released = self.base_policy.trim(max_bytes)
        self.unmapped_bytes += released
        self.num_unmaps += released > 0
        return released

    def _trim_to(self, keep_bytes: int) -> int:
        """Release fully free segments of the base without taking it below ``keep_bytes``.

        ``trim(max_bytes)`` is a target a base may overshoot by one segment (the built-ins
        release until at least ``max_bytes``), so ask for the budget less the largest free
        segment, or for everything when every free segment fits the budget.
        """
        b = self.base_policy
        budget = b.reserved_bytes - keep_bytes
        if budget <= 0:
            return 0
        free_sizes = [s.nbytes for s in b.segments() if s.num_live == 0]
        if not free_sizes:
            return 0
        if sum(free_sizes) <= budget:
            return self._unmap(None)
        ask = budget - max(free_sizes)
        return self._unmap(ask) if ask > 0 else 0

    # ----------------------------------------------------------------- Policy hooks
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        b = self.base_policy
        inner = b.allocate(nbytes, stream=stream, tag=tag)
        if inner is None:
            # map room for the request and retry once; the base counted its attempt as a
            # failure, the caller sees one failure at most (ours)
            if not self._map(max(self.grow_bytes, nbytes)):
                self._note_failure()
                return None
            self.num_retries += 1
            inner = b.allocate(nbytes, stream=stream, tag=tag)
            if inner is None:
                self._note_failure()
                return None
        allocated, reserved = b.allocated_bytes, b.reserved_bytes
        if allocated > self.high * reserved and self._fits_capacity(self.grow_bytes):
            self._map(self.grow_bytes)
            reserved = b.reserved_bytes
        if allocated >= self.low * reserved:
            self._num_low_frees = 0
        if reserved != self.reserved_bytes or b.num_grows != self.num_grows:
            self._sync()
        else:  # the hot path: no segment changed hands
            self.allocated_bytes = allocated
        return self._wrap(inner, nbytes, stream, tag)

    def _free(self, allocation: Allocation) -> None:
        b = self.base_policy
        self._free_inner(allocation)
        allocated, reserved = b.allocated_bytes, b.reserved_bytes
        if (
            allocated < self.low * reserved
            and reserved > self.min_reserved_bytes
            and not self._frozen
        ):
            self._num_low_frees += 1
            if self._num_low_frees >= self.patience:
                self._num_low_frees = 0
                # keep enough for use to sit mid-band, so the next allocations do not re-grow
                self._trim_to(
                    max(self.min_reserved_bytes, math.ceil(allocated * 2 / (self.low + self.high)))
                )
        else:
            self._num_low_frees = 0
        if b.reserved_bytes != self.reserved_bytes or b.num_shrinks != self.num_shrinks:
            self._sync()
        else:  # the hot path: no segment changed hands
            self.allocated_bytes = allocated

    def _release_free_segments(self, max_bytes: int | None) -> int:
        released = self._unmap(max_bytes)
        self._sync()
        return released

    def _reset_state(self) -> None:
        self.mapped_bytes = 0
        self.unmapped_bytes = 0
        self.num_maps = 0
        self.num_unmaps = 0
        self.num_retries = 0
        self._num_low_frees = 0
        super()._reset_state()

    def grow(self, nbytes: int) -> bool:
        ok = self._map(nbytes)
        self._sync()
        return ok
