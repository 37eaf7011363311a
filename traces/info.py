"""Facts about an allocation trace, computed without replaying it (``poollab traces info``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from traces.events import ALLOC_OP, FREE_OP, PRE_TRACE_TAG, AllocTrace

__all__ = ["describe_alloc_trace", "live_bytes"]

UNTAGGED = "(untagged)"
#: What a reader changed or skipped to make a table of the file (``AllocTrace.meta`` counts):
#: ``traces info`` shows them, so nothing a reader adjusts goes unsaid.
READER_ADJUSTMENTS = (
    "num_time_clamped",
    "num_cross_stream_frees",
    "num_unmatched_frees_dropped",
    "num_free_size_mismatches",
    "num_failed_allocations",
    "num_zero_size_skipped",
)


def live_bytes(trace: AllocTrace) -> np.ndarray:
    """Bytes live after each event (sizes as asked for), vectorised: cumsum of +size / -size.

    A free subtracts its allocation's size, looked up by id, so a free row's own ``nbytes``
    does not matter. The sum is int64 while it cannot overflow (the sizes together stay below
    2**63) and exact Python ints otherwise (an object array), so a trace of huge sizes is
    described right, not wrapped.
    """
    ev = trace.events
    is_alloc = (ev["op"] == ALLOC_OP).to_numpy()
    is_free = (ev["op"] == FREE_OP).to_numpy()
    ids = ev["alloc_id"].to_numpy(np.int64)
    nbytes = ev["nbytes"].to_numpy(np.int64)
    pos = pd.Index(ids[is_alloc]).get_indexer(ids[is_free])
    free_sizes = np.where(pos >= 0, nbytes[is_alloc][np.maximum(pos, 0)], nbytes[is_free])
    delta = np.where(is_alloc, nbytes, 0)  # an empty_cache call changes no live bytes
    delta[is_free] = -free_sizes
    if _sum_may_overflow(nbytes[is_alloc]):
        return np.cumsum(delta.astype(object))
    return np.cumsum(delta)


def _sum_may_overflow(sizes: np.ndarray) -> bool:
    """Whether the sizes (each >= 0 and < 2**63) could sum past int64; float64 is close enough to
    tell."""
    return float(sizes.sum(dtype=np.float64)) >= 2.0**62


def _exact_sum(values: np.ndarray) -> int:
    """The sum as a Python int, exact even past int64 (where numpy's sum wraps around)."""
    if not _sum_may_overflow(values):
        return int(values.sum())
    return sum(values.tolist())


def describe_alloc_trace(trace: AllocTrace) -> dict[str, Any]:
    """A flat-ish dict of plain Python values (JSON-ready).

    Keys: ``name``, ``format``, ``source``, ``num_events``, ``num_allocs``, ``num_frees``,
    ``num_empty_cache``, ``num_never_freed``, ``num_pre_trace_allocs``, ``duration_us``,
    ``peak_live_bytes``, ``peak_live_time_us``, ``final_live_bytes``, ``total_alloc_bytes``,
    ``size_{min,p50,p90,p99,max}_bytes``, ``size_mean_bytes``, ``num_distinct_sizes``, ``streams``
    (stream -> allocations), ``tags`` (tag -> allocations) and ``tag_bytes`` (tag -> bytes
    allocated); untagged allocations are listed under ``"(untagged)"``; then each of
    ``READER_ADJUSTMENTS`` the reader counted.
    """
    ev = trace.events
    is_alloc = (ev["op"] == ALLOC_OP).to_numpy()
    is_free = (ev["op"] == FREE_OP).to_numpy()
    ids = ev["alloc_id"].to_numpy(np.int64)
    sizes = ev["nbytes"].to_numpy(np.int64)[is_alloc]
    time_us = ev["time_us"].to_numpy(np.int64)
    num_allocs = int(is_alloc.sum())
    num_frees = int(is_free.sum())
    freed = np.isin(ids[is_alloc], ids[is_free])
    live = live_bytes(trace)
    peak_at = int(np.argmax(live)) if live.size else -1
    alloc_tags = ev["tag"].to_numpy(dtype=object)[is_alloc]
    info: dict[str, Any] = {
        "name": trace.name,
        "format": trace.format,
        "source": trace.source,
        "num_events": int(len(ev)),
        "num_allocs": num_allocs,
        "num_frees": num_frees,
        "num_empty_cache": len(ev) - num_allocs - num_frees,
        "num_never_freed": int((~freed).sum()),
        "num_pre_trace_allocs": int((alloc_tags == PRE_TRACE_TAG).sum()),
        "duration_us": int(time_us.max() - time_us.min()) if time_us.size else 0,
        "peak_live_bytes": max(int(live[peak_at]), 0) if live.size else 0,
        "peak_live_time_us": int(time_us[peak_at]) if live.size else 0,
        "final_live_bytes": int(live[-1]) if live.size else 0,
        "total_alloc_bytes": _exact_sum(sizes),
    }
    if sizes.size:
        p50, p90, p99 = np.percentile(sizes, [50, 90, 99], method="lower")
        info.update(
            size_min_bytes=int(sizes.min()),
            size_p50_bytes=int(p50),
            size_p90_bytes=int(p90),
            size_p99_bytes=int(p99),
            size_max_bytes=int(sizes.max()),
            size_mean_bytes=_exact_sum(sizes) / sizes.size,
        )
    else:
        info.update(
            {
                k: 0
                for k in (
                    "size_min_bytes",
                    "size_p50_bytes",
                    "size_p90_bytes",
                    "size_p99_bytes",
                    "size_max_bytes",
                )
            },
            size_mean_bytes=0.0,
        )
    info["num_distinct_sizes"] = int(np.unique(sizes).size)
    streams = pd.Series(ev["stream"].to_numpy(np.int64)[is_alloc]).value_counts().sort_index()
    info["streams"] = {int(s): int(n) for s, n in streams.items()}
    by_tag = pd.DataFrame(
        {"tag": pd.Series(alloc_tags, dtype=object).replace("", UNTAGGED), "nbytes": sizes}
    )
    grouped = by_tag.groupby("tag", sort=True)["nbytes"]
    info["tags"] = {str(t): int(n) for t, n in grouped.count().items()}
    info["tag_bytes"] = {str(t): _exact_sum(g.to_numpy(np.int64)) for t, g in grouped}
    info.update({key: int(trace.meta[key]) for key in READER_ADJUSTMENTS if key in trace.meta})
    return info
