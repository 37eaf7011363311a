"""``expandable``: PyTorch's caching allocator with ``expandable_segments:True``, as its own policy.

The rules are ``torch-caching``'s with ``expandable_segments=True`` (one code path,
``policies.torch_caching``): one growing virtual range per (pool, small/large, stream), 2 MiB /
20 MiB pages mapped on a miss, whole free pages unmapped by ``empty_cache`` and the
out-of-memory retry. This name exists so that "PyTorch's expandable segments" is one word in a
sweep next to ``vmm-stitch`` and ``page-pool``; its spec and
``torch-caching:expandable_segments=true`` decide alike.
"""

from __future__ import annotations

from typing import Any

from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from policies.torch_caching import K_LARGE_BUFFER, TorchCaching

__all__ = ["Expandable"]


class Expandable(TorchCaching):
    """``torch-caching`` with expandable segments always on (see ``TorchCaching`` for the knobs)."""

    name = "expandable"
    device_kind = DeviceKind.PAGE_MAPPED

    def __init__(
        self,
        *,
        max_split_size_bytes: int | None = None,
        max_non_split_rounding_bytes: int = K_LARGE_BUFFER,
        roundup_power2_divisions: int | str = 0,
        garbage_collection_threshold: float = 0.0,
        expandable_segments: bool = True,
        capacity_bytes: int | None = None,
        device=None,
    ):
        if expandable_segments is not True:
            raise PolicyError(
                "expandable: expandable_segments is always true here (use torch-caching for false)"
            )
        super().__init__(
            max_split_size_bytes=max_split_size_bytes,
            max_non_split_rounding_bytes=max_non_split_rounding_bytes,
            roundup_power2_divisions=roundup_power2_divisions,
            garbage_collection_threshold=garbage_collection_threshold,
            expandable_segments=True,
            capacity_bytes=capacity_bytes,
            device=device,
        )

    @classmethod
    def device_kind_for(cls, params: dict[str, Any]) -> DeviceKind:
        return DeviceKind.PAGE_MAPPED
