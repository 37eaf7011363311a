"""Does an emulation decide what the real allocator decided? A PyTorch snapshot, replayed and compared.

A memory snapshot records both the program's requests (``alloc``, ``free_completed``) and the
caching allocator's own decisions (``segment_alloc``, ``segment_free``, ``oom``). Replaying the
requests through ``torch-caching`` and comparing its segment reservations with the recorded
ones measures the emulation's fidelity:

1. **Starting state.** Recording usually starts after the weights are loaded. The segments that
   existed then are the final ``segments`` whose address has no ``segment_alloc`` in the trace
   (and those a ``segment_free`` returns without a ``segment_alloc``). The allocations live at
   the start are the final blocks still active whose address the trace never touches, and the
   addresses the trace frees without having allocated them. Each is put back at its real
   offset (``TorchCaching.seed_segment``) with PyTorch's block size: the recorded one for final
   blocks, else the request rounded up plus any remainder PyTorch would not have split off.
   The rest of each segment is free.
2. **Addresses.** PyTorch breaks ties between equal-size free blocks by address, and
   ``cudaMalloc`` picks addresses, so ``addresses="recorded"`` (default) replays with a device
   that hands out the recorded segment addresses (the first unused recorded address of the
   requested size that does not overlap a held segment; a fresh address past them otherwise).
   The emulation still decides on its own when to reserve and how much. ``"virtual"`` uses the
   usual ``VirtualDevice`` (increasing addresses), to show how much the tie-break matters.
3. **Explicit ``empty_cache()``.** A run of ``segment_free`` entries not followed by a
   ``segment_alloc`` or ``oom`` is the program calling ``empty_cache()``; the replay calls the
   policy's ``empty_cache()`` (``trim()`` unless a policy has its own rule) at that point.

The recorded reserved bytes are the starting segments' bytes plus the running sum of segment
allocations minus frees. Policies without ``seed_segment`` get the starting allocations through
``allocate()`` at time 0 (their sizes, in address order), so only ``torch-caching`` starts from
the real layout.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

import policies
from policies.base import Allocation, Policy
from policies.device import SEGMENT_ALIGNMENT_BYTES, UnmodelledDriver, VirtualDevice
from policies.errors import PolicyError
from sim import engine
from traces.errors import TraceFormatError
from traces.pytorch_snapshot import load_snapshot_dict

__all__ = ["Recording", "SeedSegment", "FidelityResult", "read_recording", "snapshot_to_recording",
           "spec_from_settings", "replay_recording", "fidelity", "RecordedAddressDevice", "ADDRESS_MODES"]

ADDRESS_MODES = ("recorded", "virtual")
MiB = 1 << 20
_SMALL_SEGMENT_BYTES = 2 * MiB  # PyTorch's kSmallBuffer: small-pool segments are exactly this size
_LIVE_STATES = frozenset({"active_allocated", "active_pending_free"})
_RESERVE_ACTIONS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
# op codes of Recording.ops
ALLOC, FREE, EMPTY_CACHE = engine.ALLOC, engine.FREE, engine.FLUSH


@dataclass(slots=True)
class SeedSegment:
    """A segment that existed before recording began, with the allocations live in it then.

    ``blocks`` are ``(offset_in_segment, block_bytes, requested_bytes)``; ``block_addrs`` the
    recorded address of each (the trace frees them by address).
    """

    address: int
    nbytes: int
    small: bool
    stream: int
    blocks: list[tuple[int, int, int]] = field(default_factory=list)
    block_addrs: list[int] = field(default_factory=list)


@dataclass
class Recording:
    """What a snapshot says: the starting state, the requests and the allocator's decisions.

    Attributes:
        ops, addrs, sizes, streams, entries: the requests in trace order: op code (ALLOC, FREE or
            EMPTY_CACHE), recorded address, bytes asked for, stream (small ints, 0 first) and the
            trace entry index it came from.
        segment_events: the recorded ``segment_*`` and ``oom`` entries: ``at`` (index into
            ``ops`` of the request they served, or of the ``empty_cache`` marker), ``action``,
            ``address``, ``nbytes``.
        seed_segments: the segments that existed before recording began.
        unplaced: starting allocations outside every known segment, ``(address, nbytes, stream)``.
        initial_reserved_bytes: bytes held in ``seed_segments``.
        settings: the snapshot's ``allocator_settings``.
    """

    name: str
    source: str
    ops: list[int]
    addrs: list[int]
    sizes: list[int]
    streams: list[int]
    entries: list[int]
    segment_events: pd.DataFrame
    seed_segments: list[SeedSegment]
    unplaced: list[tuple[int, int, int]]
    initial_reserved_bytes: int
    settings: dict[str, Any]
    free_action: str = "free_completed"

    @property
    def num_allocs(self) -> int:
        return self.ops.count(ALLOC)

    def recorded_reserved(self) -> pd.Series:
        """Reserved bytes after each recorded segment event (indexed like ``segment_events``)."""
        sign = self.segment_events["action"].map(_RESERVE_ACTIONS).fillna(0).astype("int64")
        return self.initial_reserved_bytes + (sign * self.segment_events["nbytes"]).cumsum()


# ---------------------------------------------------------------------------- reading
def read_recording(path: str | Path, *, device: int | None = None) -> Recording:
    """Read a snapshot file (pickle or gzipped pickle) into a ``Recording``."""
    path = Path(path)
    rec = snapshot_to_recording(load_snapshot_dict(path), source=str(path), device=device)
    name = path.name
    for suffix in (".gz", ".pickle", ".pkl"):
        name = name.removesuffix(suffix)
    rec.name = name or path.name
    return rec


def snapshot_to_recording(snap: dict, *, source: str = "<snapshot>", device: int | None = None) -> Recording:
    """Turn an unpickled snapshot dict into a ``Recording`` (see the module docstring)."""
    traces = snap.get("device_traces") or []
    segments = snap.get("segments") or []
    if not isinstance(traces, list) or not isinstance(segments, list):
        raise TraceFormatError(source, None, "'device_traces' and 'segments' must be lists")
    if device is None:
        device = next((d for d, t in enumerate(traces) if t), 0)
    entries = traces[device] if device < len(traces) else []
    segments = [s for s in segments if isinstance(s, dict) and s.get("device", device) == device]
    settings = snap.get("allocator_settings") or {}
    parsed = _parse_entries(entries, source, device)
    seeds, unplaced = _starting_state(segments, parsed, settings, source)
    return Recording(
        name=Path(source).name, source=source, ops=parsed["ops"], addrs=parsed["addrs"], sizes=parsed["sizes"],
        streams=parsed["streams"], entries=parsed["entries"],
        segment_events=pd.DataFrame(parsed["segment_rows"], columns=["at", "action", "address", "nbytes", "entry"]),
        seed_segments=seeds, unplaced=unplaced, initial_reserved_bytes=sum(s.nbytes for s in seeds),
        settings=settings, free_action=parsed["free_action"])


def _parse_entries(entries: list, source: str, device: int) -> dict[str, Any]:
    """One pass over the trace: requests, segment decisions and the addresses seen."""
    unit = f"device_traces[{device}] index"
    has_completed = any(isinstance(e, dict) and e.get("action") == "free_completed" for e in entries)
    free_action = "free_completed" if has_completed else "free_requested"
    ops: list[int] = []
    addrs: list[int] = []
    sizes: list[int] = []
    streams: list[int] = []
    index: list[int] = []
    stream_ids: dict[Any, int] = {0: 0}
    live: dict[int, int] = {}  # address -> bytes asked, for allocations the trace made
    seen: set[int] = set()
    pre_freed: list[tuple[int, int, int]] = []  # (address, bytes asked, stream) freed, never allocated
    pending: list[list] = []  # segment rows waiting for the request they serve
    segment_rows: list[list] = []
    seg_alloced: set[int] = set()  # addresses with a segment_alloc in the trace, held now
    seg_pre_freed: list[tuple[int, int, int]] = []  # (address, bytes, stream) freed, never allocated
    i = -1
    try:
        for i, e in enumerate(entries):
            action = e["action"]
            if action == "alloc" or action == free_action:
                if pending:  # segment decisions made before this request
                    _flush(pending, segment_rows, ops, addrs, sizes, streams, index)
                stream = stream_ids.setdefault(e["stream"], len(stream_ids))
                addr, size = e["addr"], e["size"]
                if action == "alloc":
                    if not size > 0:
                        raise TraceFormatError(source, i, f"alloc of size {size!r}: must be > 0", unit=unit)
                    if addr in live:
                        raise TraceFormatError(source, i, f"alloc at address {addr:#x}, which is still live", unit=unit)
                    live[addr] = size
                    seen.add(addr)
                    ops.append(ALLOC)
                elif addr in live:
                    size = live.pop(addr)
                    ops.append(FREE)
                else:  # allocated before recording began
                    if not size > 0:
                        raise TraceFormatError(source, i, f"free of never-seen address {addr:#x} with size {size!r}",
                                               unit=unit)
                    pre_freed.append((addr, size, stream))
                    seen.add(addr)
                    ops.append(FREE)
                addrs.append(addr)
                sizes.append(size)
                streams.append(stream)
                index.append(i)
            elif action in _RESERVE_ACTIONS or action == "oom":
                stream = stream_ids.setdefault(e["stream"], len(stream_ids))
                addr = e.get("addr", e.get("device_free", 0))
                if action == "segment_alloc":
                    seg_alloced.add(addr)
                elif action == "segment_free":
                    if addr in seg_alloced:
                        seg_alloced.discard(addr)
                    else:
                        seg_pre_freed.append((addr, e["size"], stream))
                pending.append([-1, action, addr, e["size"], i])
    except TraceFormatError:
        raise
    except (KeyError, TypeError) as exc:
        raise TraceFormatError(source, i, f"malformed trace entry ({type(exc).__name__}: {exc})", unit=unit) from None
    if pending:
        _flush(pending, segment_rows, ops, addrs, sizes, streams, index)
    return {"free_action": free_action, "ops": ops, "addrs": addrs, "sizes": sizes, "streams": streams,
            "entries": index, "segment_rows": segment_rows, "seen": seen, "pre_freed": pre_freed,
            "seg_alloced": seg_alloced, "seg_pre_freed": seg_pre_freed, "stream_ids": stream_ids}


def _flush(pending: list[list], segment_rows: list[list], ops, addrs, sizes, streams, index) -> None:
    """Attach the segment events seen since the last request to the request that follows.

    The allocator reserves (and, on a miss, frees) segments only while serving an allocation,
    so events that include a reservation or an ``oom`` belong to the next request. Events with
    none (frees only) are the program calling ``empty_cache()``: they get an ``EMPTY_CACHE`` op
    of their own, placed before the request (or at the end of the trace).
    """
    if not any(row[1] in ("segment_alloc", "segment_map", "oom") for row in pending):
        ops.append(EMPTY_CACHE)
        addrs.append(0)
        sizes.append(0)
        streams.append(0)
        index.append(pending[0][4])
        at = len(ops) - 1
    else:
        at = len(ops)
    for row in pending:
        row[0] = at
    segment_rows.extend(pending)
    pending.clear()


def _starting_state(segments: list[dict], parsed: dict, settings: dict, source: str
                    ) -> tuple[list[SeedSegment], list[tuple[int, int, int]]]:
    """The segments that existed before recording and the allocations live in them then."""
    stream_ids = parsed["stream_ids"]
    seeds: dict[int, SeedSegment] = {}
    known: dict[int, int] = {}  # address of a starting allocation -> its recorded block size
    for k, seg in enumerate(segments):
        try:
            addr = seg["address"]
            stream = stream_ids.setdefault(seg["stream"], len(stream_ids))
            if addr not in parsed["seg_alloced"]:
                small = seg.get("segment_type", "large" if seg["total_size"] != _SMALL_SEGMENT_BYTES else "small") == "small"
                seeds[addr] = SeedSegment(addr, seg["total_size"], small, stream)
            for b in seg.get("blocks", []):
                if b["state"] in _LIVE_STATES and b["address"] not in parsed["seen"]:
                    known[b["address"]] = (b["size"], b.get("requested_size") or b["size"], stream)
        except (KeyError, TypeError) as exc:
            raise TraceFormatError(source, k, f"malformed segment ({type(exc).__name__}: {exc})",
                                   unit="segments index") from None
    for addr, nbytes, stream in parsed["seg_pre_freed"]:
        seeds.setdefault(addr, SeedSegment(addr, nbytes, nbytes == _SMALL_SEGMENT_BYTES, stream))
    starts = sorted(seeds)
    placed: dict[int, list[tuple[int, int | None, int]]] = {}  # segment -> [(addr, block bytes or None, asked)]
    unplaced: list[tuple[int, int, int]] = []
    starting = [(a, size, req, s) for a, (size, req, s) in known.items()]
    starting += [(a, None, req, s) for a, req, s in parsed["pre_freed"]]
    for addr, block_bytes, requested, stream in sorted(starting):
        j = bisect.bisect_right(starts, addr) - 1
        if j >= 0 and addr < starts[j] + seeds[starts[j]].nbytes:
            placed.setdefault(starts[j], []).append((addr, block_bytes, requested))
        else:
            unplaced.append((addr, requested, stream))
    rounding = _rounding(settings)
    for seg_addr, items in placed.items():
        seed = seeds[seg_addr]
        for n, (addr, block_bytes, requested) in enumerate(items):
            nxt = items[n + 1][0] if n + 1 < len(items) else seg_addr + seed.nbytes
            if block_bytes is None:
                block_bytes = _inferred_block_bytes(requested, nxt - addr, seed.small, rounding)
            seed.blocks.append((addr - seg_addr, min(block_bytes, nxt - addr), requested))
            seed.block_addrs.append(addr)
    return [seeds[a] for a in starts], unplaced


def _rounding(settings: dict) -> Any:
    """A ``TorchCaching`` with the snapshot's rounding and split settings (to size inferred blocks)."""
    from policies.torch_caching import TorchCaching

    params = _params_from_settings(settings)
    params.pop("expandable_segments", None)
    return TorchCaching(**params)


def _inferred_block_bytes(requested: int, room: int, small: bool, pool) -> int:
    """PyTorch's block for a request freed by the trace: rounded, plus a remainder it would not split."""
    size = pool.round_size(requested)
    remaining = room - size
    if remaining <= 0:
        return size
    if small:
        return room if remaining < 512 else size
    if size >= pool._max_split:
        return room if remaining < pool.max_non_split_rounding_bytes else size
    return room if remaining <= MiB else size


# ---------------------------------------------------------------------------- settings
def _params_from_settings(settings: dict) -> dict[str, Any]:
    params: dict[str, Any] = {}
    max_split = settings.get("max_split_size", -1)
    if isinstance(max_split, int) and 0 < max_split < 1 << 62:
        params["max_split_size_bytes"] = max_split
    conf = str(settings.get("PYTORCH_CUDA_ALLOC_CONF") or "")
    for item in conf.replace(" ", "").split(","):
        key, _, value = item.partition(":")
        if key == "max_non_split_rounding_mb" and value.isdigit():
            params["max_non_split_rounding_bytes"] = int(value) * MiB
    divisions = settings.get("roundup_power2_divisions")
    if isinstance(divisions, dict) and divisions:
        values = [int(v) for _, v in sorted(divisions.items(), key=lambda kv: int(kv[0]))]
        if len(set(values)) == 1:
            if values[0] > 1:
                params["roundup_power2_divisions"] = values[0]
        else:
            params["roundup_power2_divisions"] = ",".join(f"{1 << k}:{v}" for k, v in enumerate(values))
    elif isinstance(divisions, int) and divisions > 1:
        params["roundup_power2_divisions"] = divisions
    gc = settings.get("garbage_collection_threshold") or 0.0
    if gc:
        params["garbage_collection_threshold"] = float(gc)
    if settings.get("expandable_segments"):
        params["expandable_segments"] = True
    return params


def spec_from_settings(settings: dict) -> str:
    """The ``torch-caching`` spec matching a snapshot's ``allocator_settings``."""
    from policies.spec import format_spec

    return format_spec("torch-caching", _params_from_settings(settings))


# ---------------------------------------------------------------------------- devices
class RecordedAddressDevice(UnmodelledDriver):
    """Hands out the addresses the recorded ``cudaMalloc`` calls returned.

    ``pin(address)`` makes the next ``reserve`` return that address (for the starting
    segments). Otherwise a reservation of ``n`` bytes takes the earliest recorded segment of
    ``n`` bytes not yet handed out that overlaps no held segment, or else a fresh address past
    every recorded one. Logs every call as ``(action, address, nbytes)``.
    """

    def __init__(self, recorded: list[tuple[int, int]]):
        self._by_size: dict[int, list[int]] = {}
        for addr, n in recorded:
            self._by_size.setdefault(n, []).append(addr)
        top = max((a + n for a, n in recorded), default=0)
        self._next_fresh = (top // SEGMENT_ALIGNMENT_BYTES + 2) * SEGMENT_ALIGNMENT_BYTES
        self._held_starts: list[int] = []
        self._held: dict[int, int] = {}
        self._pinned: int | None = None
        self.used_bytes = 0

    def pin(self, address: int) -> None:
        self._pinned = address

    def _overlaps(self, addr: int, n: int) -> bool:
        i = bisect.bisect_left(self._held_starts, addr + n)
        return i > 0 and self._held_starts[i - 1] + self._held[self._held_starts[i - 1]] > addr

    def reserve(self, nbytes: int) -> int | None:
        addr = self._pinned
        self._pinned = None
        if addr is None:
            for k, cand in enumerate(self._by_size.get(nbytes, ())):
                if not self._overlaps(cand, nbytes):
                    addr = self._by_size[nbytes].pop(k)
                    break
        if addr is None or self._overlaps(addr, nbytes):
            addr = self._next_fresh
            self._next_fresh += -(-nbytes // SEGMENT_ALIGNMENT_BYTES) * SEGMENT_ALIGNMENT_BYTES + SEGMENT_ALIGNMENT_BYTES
        bisect.insort(self._held_starts, addr)
        self._held[addr] = nbytes
        self.used_bytes += nbytes
        return addr

    def release(self, offset: int, nbytes: int) -> None:
        del self._held[offset]
        self._held_starts.remove(offset)
        self.used_bytes -= nbytes


class _LoggingDevice:
    """Wraps a device and logs each segment call with the op being replayed.

    Args:
        inner: the device handing out addresses.
        pin: ``pin(address)`` of a device that can be told the next address (None: ignored).
    """

    def __init__(self, inner, pin=None):
        self.inner = inner
        self._pin = pin
        self.at = -1
        self.log: list[tuple[int, str, int, int]] = []

    def take_driver_ns(self) -> int:
        return self.inner.take_driver_ns()

    @property
    def driver_ns_total(self) -> int:
        return self.inner.driver_ns_total

    def copy_ns(self, nbytes: int) -> int:
        return self.inner.copy_ns(nbytes)

    def reserve(self, nbytes: int) -> int | None:
        addr = self.inner.reserve(nbytes)
        if addr is not None:
            self.log.append((self.at, "segment_alloc", addr, nbytes))
        return addr

    def release(self, offset: int, nbytes: int) -> None:
        self.inner.release(offset, nbytes)
        self.log.append((self.at, "segment_free", offset, nbytes))

    def pin(self, address: int) -> None:
        if self._pin is not None:
            self._pin(address)


# ---------------------------------------------------------------------------- replay and compare
@dataclass
class FidelityResult:
    """The comparison of one replay with the recording.

    Attributes:
        table: one row per metric: ``metric``, ``recorded``, ``emulated``, ``difference``,
            ``difference_pct`` (of the recorded value) and ``within_1pct``.
        segment_events: recorded and emulated segment events, tidy: ``side``, ``at`` (the op
            they served), ``action``, ``address``, ``nbytes``, ``reserved_bytes`` after it.
        first_divergence: the first position where the two sequences of (op, action, bytes)
            differ, as ``{"index", "recorded", "emulated"}``; None when they agree throughout.
        policy: the policy after the replay.
    """

    name: str
    spec: str
    addresses: str
    table: pd.DataFrame
    segment_events: pd.DataFrame
    first_divergence: dict[str, Any] | None
    policy: Policy

    def summary(self) -> dict[str, Any]:
        """The table as ``{metric: (recorded, emulated)}``."""
        return {r.metric: (r.recorded, r.emulated) for r in self.table.itertuples()}

    def format(self) -> str:
        """The comparison as text, sizes in MiB."""
        view = self.table.copy()
        for col in ("recorded", "emulated", "difference"):
            view[col] = [_fmt(m, v) for m, v in zip(view["metric"], view[col])]
        view["difference_pct"] = view["difference_pct"].map(lambda v: "" if v != v else f"{v:+.2f} %")
        view["within_1pct"] = view["within_1pct"].map({True: "yes", False: "NO", None: ""})
        lines = [f"{self.name}: {self.spec} (addresses: {self.addresses})", view.to_string(index=False)]
        d = self.first_divergence
        if d is None:
            lines.append("segment decisions: identical to the recording, in order")
        else:
            lines.append(f"first divergence at segment event {d['index']}: recorded {d['recorded']}, "
                         f"emulated {d['emulated']}")
        return "\n".join(lines)


def _fmt(metric: str, value: Any) -> str:
    if value is None or value != value:
        return ""
    if metric.endswith("bytes"):
        return f"{value / MiB:,.1f} MiB"
    if metric.endswith("%"):
        return f"{value:.2f}"
    return f"{int(value):,}"


def replay_recording(rec: Recording, policy: str | Policy | None = None, *, addresses: str = "recorded",
                     capacity_bytes: int | None = None) -> FidelityResult:
    """Replay ``rec``'s requests through ``policy`` from the recorded starting state and compare.

    Args:
        rec: the recording.
        policy: a spec string (default: ``torch-caching`` with the snapshot's settings) or a
            policy class; a spec is built on the device ``addresses`` asks for.
        addresses: ``"recorded"`` or ``"virtual"`` (see the module docstring).
        capacity_bytes: a limit for the replayed pool (PyTorch's memory fraction), None for none.
    """
    if addresses not in ADDRESS_MODES:
        raise ValueError(f"addresses(={addresses!r}) must be one of {', '.join(ADDRESS_MODES)}")
    spec = policy if isinstance(policy, str) else spec_from_settings(rec.settings) if policy is None else policy
    recorded_allocs = rec.segment_events.loc[rec.segment_events["action"] == "segment_alloc", ["address", "nbytes"]]
    inner = (RecordedAddressDevice(list(recorded_allocs.itertuples(index=False, name=None)))
             if addresses == "recorded" else VirtualDevice())
    device = _LoggingDevice(inner, pin=inner.pin if addresses == "recorded" else None)
    pool = policies.create(spec, capacity_bytes=capacity_bytes, device=device)
    live = _seed(pool, rec, device)
    seeded_events, start_reserved = len(device.log), pool.reserved_bytes
    num_at_address = 0

    def at(k: int) -> None:
        device.at = k

    def on_alloc(a: Allocation, nbytes: int, addr: int) -> None:
        nonlocal num_at_address
        num_at_address += a.extents[0][0] == addr

    def unknown_free(k: int, addr: int) -> Exception:
        return TraceFormatError(rec.source, rec.entries[k], f"frees {addr:#x}, which is not live",
                                unit="device_traces entry")

    # the recording's op codes are the engine's (ALLOC, FREE, and EMPTY_CACHE as its FLUSH)
    run = engine.run(rec.ops, rec.addrs, rec.sizes, streams=rec.streams, target=engine.policy_target(pool),
                     live=live, before=at, on_alloc=on_alloc, unknown_free=unknown_free)
    emulated = pd.DataFrame(device.log[seeded_events:], columns=["at", "action", "address", "nbytes"])
    return _compare(rec, pool, emulated, start_reserved, run.num_failed, num_at_address, addresses)


def _seed(pool: Policy, rec: Recording, device: _LoggingDevice) -> dict[int, Allocation]:
    """Put the starting segments and allocations in place; returns recorded address -> allocation."""
    live: dict[int, Allocation] = {}
    if pool.can_seed_segments:
        for s in rec.seed_segments:
            device.pin(s.address)
            for addr, a in zip(s.block_addrs, pool.seed_segment(s.nbytes, small=s.small, stream=s.stream, blocks=s.blocks)):
                live[addr] = a
    else:
        for s in rec.seed_segments:
            for addr, (_, _, requested) in zip(s.block_addrs, s.blocks):
                live[addr] = _must(pool.allocate(requested, stream=s.stream), rec, addr)
    for addr, requested, stream in rec.unplaced:
        live[addr] = _must(pool.allocate(requested, stream=stream), rec, addr)
    return live


def _must(a: Allocation | None, rec: Recording, addr: int) -> Allocation:
    if a is None:
        raise PolicyError(f"{rec.source}: the allocation live at {addr:#x} when recording began does not fit "
                          "the replayed pool (raise its capacity)")
    return a


def _compare(rec: Recording, pool: Policy, emulated: pd.DataFrame, start_reserved: int, num_failed: int,
             num_at_address: int, addresses: str) -> FidelityResult:
    recorded = rec.segment_events[["at", "action", "address", "nbytes"]].copy()
    recorded["reserved_bytes"] = rec.recorded_reserved().to_numpy() if len(recorded) else []
    sign = emulated["action"].map(_RESERVE_ACTIONS).astype("int64") if len(emulated) else emulated["nbytes"]
    emulated["reserved_bytes"] = start_reserved + (sign * emulated["nbytes"]).cumsum()
    stats = pool.stats()

    def side(df: pd.DataFrame, start: int) -> dict[str, int]:
        allocs = df["action"].isin(("segment_alloc", "segment_map"))
        frees = df["action"].isin(("segment_free", "segment_unmap"))
        reserved = df["reserved_bytes"]
        return {"segment allocations": int(allocs.sum()), "segment allocation bytes": int(df.loc[allocs, "nbytes"].sum()),
                "segment frees": int(frees.sum()), "segment free bytes": int(df.loc[frees, "nbytes"].sum()),
                "peak reserved bytes": int(max(reserved.max() if len(df) else 0, start)),
                "reserved at end bytes": int(reserved.iloc[-1]) if len(df) else start}

    r, e = side(recorded, rec.initial_reserved_bytes), side(emulated, start_reserved)
    r["failed allocations (oom)"] = int((recorded["action"] == "oom").sum())
    e["failed allocations (oom)"] = num_failed
    num_allocs = rec.num_allocs
    key_r = list(zip(recorded["at"], recorded["action"], recorded["nbytes"]))
    key_r = [k for k in key_r if k[1] != "oom"]
    key_e = list(zip(emulated["at"], emulated["action"], emulated["nbytes"]))
    same = next((i for i, (x, y) in enumerate(zip(key_r, key_e)) if x != y), min(len(key_r), len(key_e)))
    divergence = None
    if same < max(len(key_r), len(key_e)):
        divergence = {"index": same, "recorded": _describe(rec, key_r, same), "emulated": _describe(rec, key_e, same)}
    rows = []
    for metric in r:
        rows.append(_row(metric, r[metric], e[metric]))
    rows.append(_row("segment decisions in recorded order", len(key_r), same))
    if addresses == "recorded" and num_allocs:
        rows.append(_row("allocations at the recorded address %", 100.0, 100.0 * num_at_address / num_allocs))
    rows.append(_row("peak allocated bytes", None, stats.peak_allocated_bytes))  # the snapshot does not say
    events = pd.concat([recorded.assign(side="recorded"), emulated.assign(side="emulated")], ignore_index=True)
    events = events[["side", "at", "action", "address", "nbytes", "reserved_bytes"]]
    spec = pool.spec
    return FidelityResult(name=rec.name, spec=spec, addresses=addresses, table=pd.DataFrame(rows),
                          segment_events=events, first_divergence=divergence, policy=pool)


def _row(metric: str, recorded: Any, emulated: Any) -> dict[str, Any]:
    if recorded is None or emulated != emulated:
        return {"metric": metric, "recorded": recorded, "emulated": emulated, "difference": None,
                "difference_pct": float("nan"), "within_1pct": None}
    diff = emulated - recorded
    pct = 100.0 * diff / recorded if recorded else (0.0 if diff == 0 else float("inf"))
    return {"metric": metric, "recorded": recorded, "emulated": emulated, "difference": diff,
            "difference_pct": pct, "within_1pct": abs(pct) <= 1.0}


def _describe(rec: Recording, keys: list, i: int) -> str:
    if i >= len(keys):
        return "nothing"
    at, action, nbytes = keys[i]
    entry = rec.entries[at] if 0 <= at < len(rec.entries) else "?"
    return f"{action} of {nbytes / MiB:,.1f} MiB serving trace entry {entry}"


def fidelity(path: str | Path, policy: str | None = None, *, addresses: str = "recorded",
             capacity_bytes: int | None = None, device: int | None = None) -> FidelityResult:
    """Read a snapshot, replay it through ``policy`` (default: ``torch-caching`` with the
    snapshot's settings) and compare with what the real allocator recorded."""
    return replay_recording(read_recording(path, device=device), policy, addresses=addresses,
                            capacity_bytes=capacity_bytes)
