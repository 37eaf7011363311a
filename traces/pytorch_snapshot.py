"""PyTorch memory snapshots (``torch.cuda.memory._snapshot()`` / ``_dump_snapshot()``) as an AllocTrace.

A snapshot is a pickle (often gzipped) of a dict with ``segments`` (the allocator's state when the
snapshot was taken), ``device_traces`` (one list of trace entries per device) and
``allocator_settings``. Each trace entry has ``action``, ``addr``, ``size``, ``stream`` and
``time_us``. How entries become events:

- ``alloc`` opens an allocation (``size`` is the size asked for, before rounding);
  ``free_completed`` closes it (``free_requested`` only when the trace holds no completions:
  a block is not reusable until its free completes). Addresses are reused, so an address maps
  to the allocation currently living there.
- Recording is a ring buffer and usually starts after the weights are loaded, so the trace can
  free an address it never saw allocated: such an allocation is synthesised at time 0 with tag
  ``"pre-trace"``. Blocks still ``active_*`` in ``segments`` whose address the trace never
  touched were allocated before recording and never freed: also ``"pre-trace"`` allocations
  at time 0, live at the end.
- ``segment_*`` and ``oom`` entries are the allocator's own decisions, not requests: they go to
  ``meta["segment_events"]`` (with ``meta["segments"]``, the final segment table, and
  ``meta["allocator_settings"]``) so an emulation can be compared with the real allocator.
- ``time_us`` is made relative to the device's first trace entry; raw stream handles become
  small ints in order of appearance (0 stays the default stream).
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from traces.errors import TraceFormatError
from traces.events import PRE_TRACE_TAG, AllocTrace, make_events, trace_name

__all__ = ["SNAPSHOT_FORMAT", "read_pytorch_snapshot", "load_snapshot_dict", "snapshot_to_trace"]

SNAPSHOT_FORMAT = "pytorch-snapshot"

#: Actions that describe the allocator's segments rather than requests (kept in meta).
SEGMENT_ACTIONS = frozenset({"segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom"})
#: How each segment action changes reserved memory.
_RESERVED_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
#: Block states that still occupy memory in the final ``segments`` table.
_LIVE_BLOCK_STATES = frozenset({"active_allocated", "active_pending_free"})
#: The only globals a snapshot may name: it is plain containers, and unpickling anything else
#: could run code from the file.
_ALLOWED_GLOBALS = frozenset({("collections", "OrderedDict")})


class _SnapshotUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a memory snapshot holds only plain data")


def load_snapshot_dict(path: str | Path) -> dict:
    """Unpickle a (gzipped or plain) snapshot file without running code from it."""
    path = Path(path)
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as f:
            snap = _SnapshotUnpickler(f).load()
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as exc:  # a truncated gzip or pickle fails in many ways; all mean one thing
        what = "gzipped pickle" if gzipped else "pickle"
        raise TraceFormatError(path, None, f"not a readable {what} ({type(exc).__name__}: {exc})") from exc
    if not isinstance(snap, dict) or not ("device_traces" in snap or "segments" in snap):
        raise TraceFormatError(path, None,
                               "pickle holds no 'device_traces' or 'segments': not a PyTorch memory snapshot")
    return snap


def read_pytorch_snapshot(path: str | Path, *, device: int | None = None) -> AllocTrace:
    """Read a snapshot file into an AllocTrace.

    Args:
        path: a pickle or gzipped pickle from ``torch.cuda.memory._dump_snapshot``.
        device: which device's trace to read; default: the first device with trace entries.
    """
    path = Path(path)
    trace = snapshot_to_trace(load_snapshot_dict(path), source=str(path), device=device)
    trace.name = trace_name(path, (".pickle", ".pkl"))
    return trace


def snapshot_to_trace(snap: dict, *, source: str = "<snapshot>", device: int | None = None) -> AllocTrace:
    """Turn an unpickled snapshot dict into an AllocTrace (see the module docstring)."""
    device_traces = snap.get("device_traces") or []
    segments = snap.get("segments") or []
    if not isinstance(device_traces, list) or not isinstance(segments, list):
        raise TraceFormatError(source, None, "'device_traces' and 'segments' must be lists")
    dev = _pick_device(device_traces, segments, device, source)
    entries = device_traces[dev] if dev < len(device_traces) else []
    unit = f"device_traces[{dev}] index"
    parsed = _parse_entries(entries, source, unit)
    streams = parsed["streams"]
    seg_table, live_blocks = _parse_segments(segments, dev, streams, source)

    # blocks live at the end whose address the trace never touched: allocated before recording
    seen = parsed["seen_addrs"]
    pre_live = [(size, stream) for addr, size, stream in live_blocks if addr not in seen]
    pre_freed = parsed["pre_freed"]  # (id, size, stream) of frees of never-seen addresses
    n_pre = len(pre_freed) + len(pre_live)
    next_id = parsed["num_ids"]
    pre_ids = [i for i, _, _ in pre_freed] + list(range(next_id, next_id + len(pre_live)))

    t_raw = parsed["time"]
    t0 = int(entries[0]["time_us"]) if entries else 0
    # clocks of a ring-buffered trace are monotonic in practice; clamp rather than reject jitter
    t_rel = np.maximum.accumulate(t_raw - t0) if t_raw.size else t_raw
    num_time_clamped = int(np.count_nonzero(t_rel != t_raw - t0))
    time_us = np.concatenate([np.zeros(n_pre, np.int64), t_rel])
    is_alloc = np.concatenate([np.ones(n_pre, bool), np.asarray(parsed["is_alloc"], dtype=bool)])
    ids = np.concatenate([np.asarray(pre_ids, np.int64), np.asarray(parsed["ids"], np.int64)])
    nbytes = np.concatenate([np.asarray([s for _, s, _ in pre_freed] + [s for s, _ in pre_live], np.int64),
                             np.asarray(parsed["sizes"], np.int64)])
    stream = np.concatenate([np.asarray([s for _, _, s in pre_freed] + [s for _, s in pre_live], np.int64),
                             np.asarray(parsed["streams_col"], np.int64)])
    tags = [PRE_TRACE_TAG] * n_pre + parsed["tags"]
    ids = _renumber_by_alloc_order(ids, is_alloc, next_id + len(pre_live))
    events = make_events(time_us, np.where(is_alloc, "alloc", "free"), ids, nbytes, stream, tags)

    seg_events = pd.DataFrame(parsed["segment_rows"], columns=["time_us", "action", "addr", "size", "stream"])
    seg_events["time_us"] = seg_events["time_us"].astype(np.int64) - t0
    reserved_end = int(seg_table["total_size"].sum()) if len(seg_table) else 0
    sign = seg_events["action"].map(_RESERVED_SIGN).fillna(0).to_numpy(np.int64)
    delta = sign * seg_events["size"].to_numpy(np.int64)
    reserved = reserved_end - int(delta.sum()) + np.concatenate([[0], np.cumsum(delta)])
    meta = {
        "device": dev,
        "free_action": parsed["free_action"],
        "time_origin_us": t0,
        "num_pre_trace_freed": len(pre_freed),
        "num_pre_trace_live": len(pre_live),
        "num_oom": int((seg_events["action"] == "oom").sum()),
        "num_time_clamped": num_time_clamped,
        "ignored_actions": parsed["ignored"],
        "stream_handles": {handle: i for handle, i in streams.items()},
        "segment_events": seg_events,
        "segments": seg_table,
        "allocator_settings": snap.get("allocator_settings", {}),
        # reserved bytes over the trace, rebuilt backwards from the final segment table
        "recorded_peak_reserved_bytes": int(reserved.max()),
        "recorded_reserved_end_bytes": reserved_end,
    }
    return AllocTrace(events, name=Path(source).name, source=source, format=SNAPSHOT_FORMAT, meta=meta)


def _pick_device(device_traces: list, segments: list, device: int | None, source: str) -> int:
    if device is not None:
        known = set(range(len(device_traces))) | {s.get("device") for s in segments if isinstance(s, dict)}
        if device not in known:
            devices = sorted(d for d in known if d is not None)
            raise TraceFormatError(source, None, f"device {device} is not in the snapshot (devices: {devices})")
        return device
    for dev, entries in enumerate(device_traces):
        if entries:
            return dev
    devices = sorted({s.get("device", 0) for s in segments if isinstance(s, dict)})
    return devices[0] if devices else 0


def _parse_entries(entries: list, source: str, unit: str) -> dict[str, Any]:
    """One pass over the trace entries; the hot loop of the reader."""
    free_action = "free_completed"
    if not any(isinstance(e, dict) and e.get("action") == "free_completed" for e in entries):
        free_action = "free_requested"
    live: dict[int, tuple[int, int]] = {}  # addr -> (alloc id, size): the allocation living there now
    seen_addrs: set[int] = set()
    streams: dict[Any, int] = {0: 0}
    time, is_alloc, ids, sizes, streams_col, tags = [], [], [], [], [], []
    pre_freed: list[tuple[int, int, int]] = []
    segment_rows: list[tuple] = []
    ignored: dict[str, int] = {}
    next_id = 0
    i = -1
    try:
        for i, e in enumerate(entries):
            action = e["action"]
            if action == "alloc":
                addr, size = e["addr"], e["size"]
                if type(size) is not int or type(addr) is not int or not 0 < size < _INT64_LIMIT:
                    raise TraceFormatError(source, i, _bad_entry_numbers("alloc", addr, size), unit=unit)
                if addr in live:
                    raise TraceFormatError(source, i, f"alloc at address {addr:#x}, where allocation "
                                                      f"{live[addr][0]} is still live", unit=unit)
                s = streams.get(e["stream"])
                if s is None:
                    s = streams[e["stream"]] = len(streams)
                live[addr] = (next_id, size)
                seen_addrs.add(addr)
                time.append(e["time_us"]); is_alloc.append(True); ids.append(next_id)
                sizes.append(size); streams_col.append(s); tags.append(e.get("user_metadata") or "")
                next_id += 1
            elif action == free_action:
                addr = e["addr"]
                s = streams.get(e["stream"])
                if s is None:
                    s = streams[e["stream"]] = len(streams)
                found = live.pop(addr, None)
                if found is None:  # allocated before recording began
                    size = e["size"]
                    if type(size) is not int or not 0 < size < _INT64_LIMIT:
                        raise TraceFormatError(source, i, f"free of never-seen address {addr:#x} with size {size!r}",
                                               unit=unit)
                    found = (next_id, size)
                    pre_freed.append((next_id, size, s))
                    seen_addrs.add(addr)
                    next_id += 1
                time.append(e["time_us"]); is_alloc.append(False); ids.append(found[0])
                sizes.append(found[1]); streams_col.append(s); tags.append("")
            elif action in SEGMENT_ACTIONS:
                s = streams.get(e["stream"])
                if s is None:
                    s = streams[e["stream"]] = len(streams)
                _check_segment_numbers(e)
                segment_rows.append((e["time_us"], action, e["addr"], e["size"], s))
            elif action != "free_requested" and action != "free_completed":
                ignored[action] = ignored.get(action, 0) + 1
    except TraceFormatError:
        raise
    except KeyError as exc:
        raise TraceFormatError(source, i, f"trace entry lacks key {exc}", unit=unit) from None
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(source, i, f"malformed trace entry {_short(entries[i])} ({exc})", unit=unit) from None
    time = np.asarray(time) if time else np.zeros(0, np.int64)
    if time.dtype.kind != "i":  # a list of Python ints that fit in int64 only becomes an integer array
        k = next(k for k, e in enumerate(entries) if _bad_time(e.get("time_us")))
        raise TraceFormatError(source, k, f"time_us {entries[k].get('time_us')!r} is not an integer", unit=unit)
    tags = [t if isinstance(t, str) else str(t) for t in tags]
    return {"free_action": free_action, "seen_addrs": seen_addrs, "streams": streams, "time": time,
            "is_alloc": is_alloc, "ids": ids, "sizes": sizes, "streams_col": streams_col, "tags": tags,
            "pre_freed": pre_freed, "segment_rows": segment_rows, "ignored": ignored, "num_ids": next_id}


def _parse_segments(segments: list, dev: int, streams: dict, source: str
                    ) -> tuple[pd.DataFrame, list[tuple[int, int, int]]]:
    """The final segment table of ``dev`` and its live blocks as (addr, requested size, stream)."""
    rows, live_blocks = [], []
    for k, seg in enumerate(segments):
        try:
            if seg.get("device", dev) != dev:
                continue
            s = streams.get(seg["stream"])
            if s is None:
                s = streams[seg["stream"]] = len(streams)
            _check_segment_numbers(seg)
            rows.append((seg["address"], seg["total_size"], seg.get("allocated_size", 0), s,
                         seg.get("segment_type", ""), bool(seg.get("is_expandable", False))))
            addr = seg["address"]
            for b in seg.get("blocks", []):
                b_addr = b.get("address", addr)  # older snapshots lack block addresses: blocks tile the segment
                if b["state"] in _LIVE_BLOCK_STATES:
                    live_blocks.append((b_addr, b.get("requested_size") or b["size"], s))
                addr = b_addr + b["size"]
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise TraceFormatError(source, k, f"malformed segment ({type(exc).__name__}: {exc})",
                                   unit="segments index") from None
    table = pd.DataFrame(rows, columns=["address", "total_size", "allocated_size", "stream", "segment_type",
                                        "is_expandable"])
    return table, live_blocks


# -- number checks: every size, address and time becomes int64 downstream ----------------------
_INT64_LIMIT = 2**63


def _bad_entry_numbers(action: str, addr: Any, size: Any) -> str:
    """Why an entry's size or address cannot be one (the entry failed the inline check)."""
    if type(addr) is not int:
        return f"{action} at address {addr!r}: must be an integer"
    return f"{action} of size {size!r}: must be a whole number of bytes > 0 and < 2**63"


def _bad_time(value: Any) -> bool:
    return type(value) is not int or not -_INT64_LIMIT <= value < _INT64_LIMIT


def _check_segment_numbers(seg: dict) -> None:
    """ValueError unless the sizes of a segment (or segment event) and its blocks are byte counts."""
    sizes = [seg.get(k, 0) for k in ("size", "total_size", "allocated_size")]
    sizes += [b.get("size", 0) for b in seg.get("blocks", ()) if isinstance(b, dict)]
    bad = next((v for v in sizes if type(v) is not int or not 0 <= v < _INT64_LIMIT), None)
    if bad is not None:
        raise ValueError(f"size {bad!r} is not a whole number of bytes below 2**63")


def _renumber_by_alloc_order(ids: np.ndarray, is_alloc: np.ndarray, num_ids: int) -> np.ndarray:
    """Ids ``0..n-1`` in the order the allocations appear in the table (ids are dense already)."""
    new = np.empty(num_ids, np.int64)
    alloc_ids = ids[is_alloc]
    assert alloc_ids.size == num_ids, "every id is allocated exactly once"
    new[alloc_ids] = np.arange(num_ids)
    return new[ids]


def _short(obj: Any, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[:limit] + "..."
