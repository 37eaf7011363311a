"""``tag-limits``: per-tag caps and per-tag statistics over any policy.

A pool shared by weights, KV cache, activations and workspace can cap each tag, so that one
kind of memory cannot starve the others (RMM's ``limiting_resource_adaptor``, per tag). A
request whose tag would go over its limit fails before the base sees it and is counted; every
tag, capped or not, gets its own counters (``tag_stats()``, ``tag_rows()``), like RMM's
``statistics_resource_adaptor`` broken down by tag.

Limits cap the bytes requested (``nbytes``, the tag's live bytes), what the caller controls and
what can be checked before anything changes; what the base set aside after rounding is
reported per tag as ``allocated_bytes``.

Spec: ``tag-limits:base=[best-fit],limits=[kv=40GiB,activations=2GiB]``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from policies.base import Allocation
from policies.device import Device
from policies.errors import PolicyError
from policies.spec import check_spec_text
from policies.units import parse_bytes
from policies.wrapper import WrapperPolicy
from traces.spec_grammar import format_items, parse_items

__all__ = ["TagLimits", "TagStats", "parse_limits", "format_limits"]


def parse_limits(text: str) -> dict[str, int]:
    """``"kv=40GiB,activations=2GiB" -> {"kv": 42949672960, "activations": 2147483648}``.

    Raises:
        PolicyError: naming the item that is not ``tag=size`` (or a tag given twice).
    """
    if not isinstance(text, str):
        raise PolicyError(
            f"limits(={text!r}) must be a string 'tag=size,...' such as 'kv=40GiB,activations=2GiB'"
        )
    check_spec_text(text, "limits")
    items = parse_items(
        text,
        valid_key=bool,
        bad_item=lambda item: PolicyError(
            f"limits(={text!r}): {item!r} is not tag=size (e.g. kv=40GiB)"
        ),
        twice=lambda tag: PolicyError(f"limits(={text!r}): tag {tag!r} is given twice"),
    )
    limits: dict[str, int] = {}
    for tag, size in items.items():
        try:
            limits[tag] = parse_bytes(size)
        except PolicyError as exc:
            raise PolicyError(f"limits(={text!r}): tag {tag!r}: {exc}") from None
    return limits


def format_limits(limits: dict[str, int]) -> str:
    """The ``limits`` knob for a mapping: ``{"kv": 1 << 30} -> "kv=1073741824"``."""
    return format_items(limits)


@dataclass(slots=True)
class TagStats:
    """One tag's accounting. Bytes are exact; peaks are since the last reset."""

    limit_bytes: int | None  # None: not capped
    live_bytes: int = 0  # as asked, over the tag's live allocations
    allocated_bytes: int = 0  # what the base set aside for them
    num_live: int = 0
    num_allocs: int = 0
    num_frees: int = 0
    num_failures: int = 0  # every refused request of the tag
    num_limit_failures: int = 0  # of which refused by the tag's limit
    peak_live_bytes: int = 0
    peak_allocated_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TagLimits(WrapperPolicy):
    """Caps the live bytes of each listed tag; counts every tag apart.

    Args:
        base: spec string of the wrapped policy.
        limits: ``"tag=size,tag=size"`` (sizes as in ``2GiB``); tags not listed, and untagged
            requests, are not capped. Empty: no caps, statistics only.
        capacity_bytes, device: see ``Policy``.

    Attributes:
        num_limit_failures: requests refused by a tag's limit (also in ``num_failures``).
    """

    name = "tag-limits"

    def __init__(
        self,
        *,
        base: str = "best-fit",
        limits: str = "",
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        parse_limits(limits)  # refuse a bad knob before building anything
        self.limits = limits
        super().__init__(base=base, capacity_bytes=capacity_bytes, device=device)

    def tag_stats(self) -> dict[str | None, TagStats]:
        """A copy of every tag's counters (capped tags listed even before their first request)."""
        return {tag: TagStats(**s.as_dict()) for tag, s in self._tags.items()}

    def tag_rows(self) -> list[dict[str, Any]]:
        """``tag_stats()`` as rows (``pd.DataFrame(policy.tag_rows())``)."""
        return [{"tag": tag, **s.as_dict()} for tag, s in self._tags.items()]

    def _tag(self, tag: str | None) -> TagStats:
        s = self._tags.get(tag)
        if s is None:
            s = self._tags[tag] = TagStats(None)
        return s

    # ----------------------------------------------------------------- Policy hooks
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        s = self._tag(tag)
        limit = s.limit_bytes
        if limit is not None and s.live_bytes + nbytes > limit:
            s.num_failures += 1
            s.num_limit_failures += 1
            self.num_limit_failures += 1
            return None
        inner = self.base_policy.allocate(nbytes, stream=stream, tag=tag)
        if inner is None:
            s.num_failures += 1
            self._note_failure()
            return None
        s.num_allocs += 1
        s.num_live += 1
        live = s.live_bytes = s.live_bytes + nbytes
        if live > s.peak_live_bytes:
            s.peak_live_bytes = live
        allocated = s.allocated_bytes = s.allocated_bytes + inner.size_bytes
        if allocated > s.peak_allocated_bytes:
            s.peak_allocated_bytes = allocated
        self._mirror()
        return self._wrap(inner, nbytes, stream, tag)

    def _free(self, allocation: Allocation) -> None:
        s = self._tags[allocation.tag]
        self._free_inner(allocation)
        s.num_frees += 1
        s.num_live -= 1
        s.live_bytes -= allocation.nbytes
        s.allocated_bytes -= allocation.size_bytes
        self._mirror()

    def _reset_state(self) -> None:
        self._tags: dict[str | None, TagStats] = {
            tag: TagStats(n) for tag, n in parse_limits(self.limits).items()
        }
        self.num_limit_failures = 0
        super()._reset_state()
