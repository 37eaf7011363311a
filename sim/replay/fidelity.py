"""Does an emulation decide what the real allocator decided? A PyTorch snapshot, replayed and
compared.

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
3. **Explicit ``empty_cache()``.** A run of ``segment_free`` entries between two requests is the
   program calling ``empty_cache()`` (``torch.cuda.graph`` calls it before every capture), also
   when a reservation follows: the replay calls the policy's ``empty_cache()`` (``trim()``
   unless a policy has its own rule) at that point. An out-of-memory retry frees the same
   segments right before the same reservation, so reading it as ``empty_cache`` replays it the
   same way; the one exception kept as a retry is ``release_available_cached_blocks`` (with
   ``max_split_size``, every freed segment at least that large), which frees fewer.
4. **Private pools** (CUDA graphs, ``torch.compile`` reduce-overhead, ``MemPool``). Each request's
   pool is inferred from the segment holding its address (``infer_request_pools``); the replay
   calls ``begin_allocate_to_pool`` / ``end_allocate_to_pool`` around each capture window.
   Graph destruction (``releasePool``) is not recorded: private pools stay in use to the end.

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
from policies.device import SEGMENT_ALIGNMENT_BYTES, DeviceInFront, UnmodelledDriver, VirtualDevice
from policies.errors import PolicyError
from policies.mapped_device import PageMappedDevice
from policies.device_kind import DeviceKind
from policies.registry import device_kind
from policies.torch_caching import TorchCaching, params_from_settings, spec_from_settings
from policies.units import round_up
from sim.replay import engine
from traces.errors import TraceFormatError
from traces.spec_grammar import parse_items
from traces.pytorch_snapshot import RESERVED_SIGN as _RESERVE_ACTIONS
from traces.pytorch_snapshot import (
    DEFAULT_POOL_ID,
    PyTorchSnapshot,
    empty_cache_frees,
    infer_request_pools,
    read_snapshot,
    snapshot_max_split_size_bytes,
)

__all__ = [
    "Recording",
    "SeedSegment",
    "FidelityResult",
    "read_recording",
    "snapshot_to_recording",
    "StartedReplay",
    "start_replay",
    "replay_recording",
    "fidelity",
    "RecordedAddressDevice",
    "ADDRESS_MODES",
]

ADDRESS_MODES = ("recorded", "virtual")
MiB = 1 << 20
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
    pool_id: tuple[int, int] = DEFAULT_POOL_ID
    range_offset: int | None = None  # expandable: where the mapped run starts in its range
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
        pool_calls: op index -> ``[(call, pool, stream)]`` to make before that op (``call`` is
            ``"begin"`` or ``"end"``: ``begin_allocate_to_pool`` / ``end_allocate_to_pool``).
        num_unknown_pool: allocations whose pool the snapshot cannot tell (taken as default).
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
    pool_calls: dict[int, list[tuple[str, tuple[int, int], int]]] = field(default_factory=dict)
    num_unknown_pool: int = 0
    num_deferred_frees: int = 0
    entry_unit: str = "device_traces entry"

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
    return snapshot_to_recording(read_snapshot(path, device=device))


def snapshot_to_recording(snap: PyTorchSnapshot) -> Recording:
    """A parsed snapshot as a ``Recording`` (see the module docstring)."""
    ops, addrs, sizes, streams, entries, segment_rows, request_ops = _requests_and_decisions(snap)
    seeds, unplaced = _starting_state(snap)
    inferred = infer_request_pools(snap)
    pool_calls: dict[int, list] = {}
    for first, last, pool, stream in inferred.windows:
        pool_calls.setdefault(request_ops[first], []).append(("begin", pool, stream))
        pool_calls.setdefault(request_ops[last] + 1, []).insert(0, ("end", pool, stream))
    return Recording(
        pool_calls=pool_calls,
        num_unknown_pool=inferred.num_unknown,
        num_deferred_frees=snap.num_deferred_frees,
        entry_unit=snap.entry_unit,
        name=snap.name,
        source=snap.source,
        ops=ops,
        addrs=addrs,
        sizes=sizes,
        streams=streams,
        entries=entries,
        segment_events=pd.DataFrame(
            segment_rows, columns=["at", "action", "address", "nbytes", "entry"]
        ),
        seed_segments=seeds,
        unplaced=unplaced,
        initial_reserved_bytes=sum(s.nbytes for s in seeds),
        settings=snap.allocator_settings,
        free_action=snap.free_action,
    )


def _requests_and_decisions(
    snap: PyTorchSnapshot,
) -> tuple[list[int], list[int], list[int], list[int], list[int], list[list]]:
    """The requests as ops, with ``EMPTY_CACHE`` markers, and each segment event tied to an op.

    Walks requests and segment events together in trace order; returns ``(ops, addrs, sizes,
    streams, entries, segment_rows)`` with rows ``[at, action, address, nbytes, entry]``.
    """
    req, ev = snap.requests, snap.segment_events
    ops: list[int] = []
    addrs: list[int] = []
    sizes: list[int] = []
    streams: list[int] = []
    index: list[int] = []
    pending: list[list] = []  # segment rows waiting for the request they serve
    segment_rows: list[list] = []
    request_ops: list[int] = []  # request k -> its op index
    max_split = snapshot_max_split_size_bytes(snap.allocator_settings)
    j, num_events = 0, len(ev)
    for k, i in enumerate(req.entry):
        while j < num_events and ev.entry[j] < i:
            pending.append([-1, ev.action[j], ev.address[j], ev.nbytes[j], ev.entry[j]])
            j += 1
        if pending:  # segment decisions made before this request
            _flush(pending, segment_rows, ops, addrs, sizes, streams, index, max_split)
            pending.clear()
        request_ops.append(len(ops))
        ops.append(ALLOC if req.is_alloc[k] else FREE)
        addrs.append(req.address[k])
        sizes.append(req.nbytes[k])
        streams.append(req.stream[k])
        index.append(i)
    pending.extend(
        [-1, ev.action[j], ev.address[j], ev.nbytes[j], ev.entry[j]] for j in range(j, num_events)
    )
    if pending:
        _flush(pending, segment_rows, ops, addrs, sizes, streams, index, max_split)
    return ops, addrs, sizes, streams, index, segment_rows, request_ops


def _flush(
    pending: list[list],
    segment_rows: list[list],
    ops,
    addrs,
    sizes,
    streams,
    index,
    max_split_size_bytes: int | None,
) -> None:
    """Attach the segment events seen since the last request to the request that follows.

    The frees ``empty_cache_frees`` reads as the program calling ``empty_cache()`` get an
    ``EMPTY_CACHE`` op of their own, placed before the request (or at the end of the trace); the
    rest (reservations, ``oom``, retry frees) belong to the request.
    """
    num_calls = empty_cache_frees(
        [row[1] for row in pending], [row[3] for row in pending], max_split_size_bytes
    )
    if num_calls:
        ops.append(EMPTY_CACHE)
        addrs.append(0)
        sizes.append(0)
        streams.append(0)
        index.append(pending[0][4])
        for row in pending[:num_calls]:
            row[0] = len(ops) - 1
        segment_rows.extend(pending[:num_calls])
        pending = pending[num_calls:]
    for row in pending:
        row[0] = len(ops)
    segment_rows.extend(pending)


def _starting_state(snap: PyTorchSnapshot) -> tuple[list[SeedSegment], list[tuple[int, int, int]]]:
    """The segments that existed before recording and the allocations live in them then."""
    seeds = {
        s.address: SeedSegment(
            s.address, s.total_bytes, s.is_small, s.stream, s.pool_id or DEFAULT_POOL_ID
        )
        for s in snap.segments_at_start
    }
    expandable = any(s.is_expandable for s in snap.segments_at_start)
    starts = list(seeds)  # segments_at_start is sorted by address
    placed: dict[
        int, list[tuple[int, int | None, int]]
    ] = {}  # segment -> [(addr, block bytes or None, asked)]
    unplaced: list[tuple[int, int, int]] = []
    starting = [(p.address, p.block_bytes, p.requested_bytes, p.stream) for p in snap.pre_trace]
    for addr, block_bytes, requested, stream in sorted(starting):
        j = bisect.bisect_right(starts, addr) - 1
        if j >= 0 and addr < starts[j] + seeds[starts[j]].nbytes:
            placed.setdefault(starts[j], []).append((addr, block_bytes, requested))
        else:
            unplaced.append((addr, requested, stream))
    rounding = _rounding(snap.allocator_settings)
    for seg_addr, items in placed.items():
        seed = seeds[seg_addr]
        for n, (addr, block_bytes, requested) in enumerate(items):
            nxt = items[n + 1][0] if n + 1 < len(items) else seg_addr + seed.nbytes
            if block_bytes is None:
                block_bytes = _inferred_block_bytes(requested, nxt - addr, seed.small, rounding)
            seed.blocks.append((addr - seg_addr, min(block_bytes, nxt - addr), requested))
            seed.block_addrs.append(addr)
    if expandable:
        _place_in_ranges(list(seeds.values()))
    return [seeds[a] for a in starts], unplaced


def _place_in_ranges(seeds: list[SeedSegment]) -> None:
    """Expandable segments: each mapped run's offset in its (pool, small, stream) range, taking
    the lowest run's address as the range's start (the snapshot does not record the reserved
    range; PyTorch maps from the start of it upward, so the lowest run starts it unless its
    first pages were unmapped before recording)."""
    base: dict[tuple, int] = {}
    for s in seeds:
        key = (s.pool_id, s.small, s.stream)
        base[key] = min(base.get(key, s.address), s.address)
    for s in seeds:
        s.range_offset = s.address - base[(s.pool_id, s.small, s.stream)]


def _rounding(settings: dict) -> TorchCaching:
    """A ``TorchCaching`` with the snapshot's rounding and split settings (to size inferred
    blocks)."""
    params = params_from_settings(settings)
    params.pop("expandable_segments", None)
    return TorchCaching(**params)


def _inferred_block_bytes(requested: int, room: int, small: bool, pool) -> int:
    """PyTorch's block for a request freed by the trace: rounded, plus a remainder it would not
    split."""
    size = pool.round_size(requested)
    remaining = room - size
    if remaining <= 0:
        return size
    if small:
        return room if remaining < 512 else size
    if size >= pool._max_split:
        return room if remaining < pool.max_non_split_rounding_bytes else size
    return room if remaining <= MiB else size


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
            self._next_fresh += round_up(nbytes, SEGMENT_ALIGNMENT_BYTES) + SEGMENT_ALIGNMENT_BYTES
        bisect.insort(self._held_starts, addr)
        self._held[addr] = nbytes
        self.used_bytes += nbytes
        return addr

    def release(self, offset: int, nbytes: int) -> None:
        del self._held[offset]
        self._held_starts.remove(offset)
        self.used_bytes -= nbytes


class _LoggingDevice(DeviceInFront):
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


class _LoggingMappedDevice(PageMappedDevice):
    """A page-mapped device that logs each ``map_new`` / ``unmap_release`` as PyTorch's
    ``segment_map`` / ``segment_unmap`` entries (one per call, as ``map_block`` / ``unmap_block``
    record them), with the op being replayed."""

    def __init__(self):
        super().__init__()
        self.at = -1
        self.log: list[tuple[int, str, int, int]] = []

    def map_new(self, offset: int, nbytes: int, page_bytes: int | None = None) -> bool:
        ok = super().map_new(offset, nbytes, page_bytes)
        if ok:
            self.log.append((self.at, "segment_map", offset, nbytes))
        return ok

    def unmap_release(self, offset: int, nbytes: int) -> None:
        super().unmap_release(offset, nbytes)
        self.log.append((self.at, "segment_unmap", offset, nbytes))

    def pin(self, address: int) -> None:
        pass  # a range's address is the device's; runs are placed by their offset in it


# ---------------------------------------------------------------------------- replay and compare
@dataclass
class FidelityResult:
    """The comparison of one replay with the recording.

    Attributes:
        table: one row per metric: ``metric``, ``recorded``, ``emulated``, ``difference``,
            ``difference_pct`` (of the recorded value) and ``within_1pct``.
        segment_events: recorded and emulated segment events, tidy: ``side``, ``at`` (the op
            they served), ``action``, ``address``, ``nbytes``, ``reserved_bytes`` after it.
        segment_events: also ``event`` (position in the compared sequence of its side; -1 for
            ``oom`` entries, which are not compared) and ``entry`` (the raw trace entry of the op
            it served).
        first_divergence: the first position where the two sequences of (op, action, bytes)
            differ, as ``{"index", "entry", "entry_unit", "recorded", "emulated", "cause"}``:
            ``index`` is the ``event`` number in ``segment_events`` on both sides, ``entry`` the
            raw trace entry index; ``cause`` is the likely cause class (``CAUSES``). None when
            they agree throughout.
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
        view["difference_pct"] = view["difference_pct"].map(
            lambda v: "" if v != v else f"{v:+.2f} %"
        )
        view["within_1pct"] = view["within_1pct"].map({True: "yes", False: "NO", None: ""})
        lines = [
            f"{self.name}: {self.spec} (addresses: {self.addresses})",
            view.to_string(index=False),
        ]
        d = self.first_divergence
        if d is None:
            lines.append("segment decisions: identical to the recording, in order")
        else:
            lines.append(
                f"first divergence at segment event {d['index']} "
                f"(segment_events.csv event={d['index']}, {d['entry_unit']} {d['entry']}): "
                f"recorded {d['recorded']}, emulated {d['emulated']}; likely cause: {d['cause']}"
            )
        return "\n".join(lines)


def _fmt(metric: str, value: Any) -> str:
    if value is None or value != value:
        return ""
    if metric.endswith("bytes"):
        return f"{value / MiB:,.1f} MiB"
    if metric.endswith("%"):
        return f"{value:.2f}"
    return f"{int(value):,}"


@dataclass
class StartedReplay:
    """A policy put in the recording's starting state, ready for ``engine.run`` over ``rec.ops``.

    Attributes:
        pool: the policy, its starting segments and allocations in place.
        device: the device it reserves from (it logs each segment call with ``device.at``).
        live: recorded address -> allocation live when recording began (``engine.run``'s ``live``).
        addresses: the address mode the device really uses (page-mapped policies: ``"virtual"``).
        pool_calls: ``Recording.pool_calls`` when the pool has private pools, else empty.
    """

    pool: Policy
    device: Any
    live: dict[int, Allocation]
    addresses: str
    pool_calls: dict[int, list[tuple[str, tuple[int, int], int]]]

    def pool_call(self, k: int) -> None:
        """Make the private-pool calls due before op ``k`` (``begin`` /
        ``end_allocate_to_pool``)."""
        for call, pool_id, stream in self.pool_calls.get(k, ()):
            if call == "begin":
                self.pool.begin_allocate_to_pool(pool_id, stream)
            else:
                self.pool.end_allocate_to_pool(pool_id)


def start_replay(
    rec: Recording,
    policy: str | Policy | None = None,
    *,
    addresses: str = "recorded",
    capacity_bytes: int | None = None,
) -> StartedReplay:
    """Build ``policy`` on the device ``addresses`` asks for and seed the recording's starting
    state.

    The part of ``replay_recording`` before the loop, shared with ``sim.planner.plan`` (which
    replays the same recording many times with some request sizes changed). Raises ``PolicyError``
    when the starting allocations do not fit ``capacity_bytes``.
    """
    if addresses not in ADDRESS_MODES:
        raise ValueError(f"addresses(={addresses!r}) must be one of {', '.join(ADDRESS_MODES)}")
    spec = (
        policy
        if isinstance(policy, str)
        else spec_from_settings(rec.settings)
        if policy is None
        else policy
    )
    recorded_allocs = rec.segment_events.loc[
        rec.segment_events["action"] == "segment_alloc", ["address", "nbytes"]
    ]
    if device_kind(spec) is DeviceKind.PAGE_MAPPED:
        device = _LoggingMappedDevice()
        addresses = (
            "virtual"  # ranges are the device's; runs keep their offsets, not their addresses
        )
    else:
        inner = (
            RecordedAddressDevice(list(recorded_allocs.itertuples(index=False, name=None)))
            if addresses == "recorded"
            else VirtualDevice()
        )
        device = _LoggingDevice(inner, pin=inner.pin if addresses == "recorded" else None)
    pool = policies.create(spec, capacity_bytes=capacity_bytes, device=device)
    live = _seed(pool, rec, device)
    return StartedReplay(
        pool, device, live, addresses, rec.pool_calls if pool.has_private_pools else {}
    )


def replay_recording(
    rec: Recording,
    policy: str | Policy | None = None,
    *,
    addresses: str = "recorded",
    capacity_bytes: int | None = None,
    progress: str | None = None,
) -> FidelityResult:
    """Replay ``rec``'s requests through ``policy`` from the recorded starting state and compare.

    Args:
        rec: the recording.
        policy: a spec string (default: ``torch-caching`` with the snapshot's settings) or a
            policy class; a spec is built on the device ``addresses`` asks for.
        addresses: ``"recorded"`` or ``"virtual"`` (see the module docstring).
        capacity_bytes: a limit for the replayed pool (PyTorch's memory fraction), None for none.
        progress: a progress bar's title (``sim.replay.progress.progress_bar``, on a terminal only);
            None for none.
    """
    started = start_replay(rec, policy, addresses=addresses, capacity_bytes=capacity_bytes)
    pool, device, live = started.pool, started.device, started.live
    seeded_events, start_reserved = len(device.log), pool.reserved_bytes
    num_at_address = 0

    def at(k: int) -> None:
        device.at = k
        started.pool_call(k)

    def on_alloc(a: Allocation, nbytes: int, addr: int) -> None:
        nonlocal num_at_address
        num_at_address += a.extents[0][0] == addr

    def unknown_free(k: int, addr: int) -> Exception:
        return TraceFormatError(
            rec.source,
            rec.entries[k],
            f"frees {addr:#x}, which is not live",
            unit="device_traces entry",
        )

    # the recording's op codes are the engine's (ALLOC, FREE, and EMPTY_CACHE as its FLUSH)
    run = engine.run(
        rec.ops,
        rec.addrs,
        rec.sizes,
        streams=rec.streams,
        target=engine.policy_target(pool),
        live=live,
        before=at,
        on_alloc=on_alloc,
        unknown_free=unknown_free,
        progress=progress,
    )
    emulated = pd.DataFrame(
        device.log[seeded_events:], columns=["at", "action", "address", "nbytes"]
    )
    return _compare(
        rec, pool, emulated, start_reserved, run.num_failed, num_at_address, started.addresses
    )


def _seed(pool: Policy, rec: Recording, device: _LoggingDevice) -> dict[int, Allocation]:
    """Put the starting segments and allocations in place; returns recorded address ->
    allocation."""
    live: dict[int, Allocation] = {}
    if pool.can_seed_segments:
        for s in rec.seed_segments:
            device.pin(s.address)
            kwargs = {"pool": s.pool_id} if pool.has_private_pools else {}
            if s.range_offset is not None and device_kind(pool) is DeviceKind.PAGE_MAPPED:
                kwargs["range_offset_bytes"] = s.range_offset
            seeded = pool.seed_segment(
                s.nbytes, small=s.small, stream=s.stream, blocks=s.blocks, **kwargs
            )
            for addr, a in zip(s.block_addrs, seeded):
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
        raise PolicyError(
            f"{rec.source}: the allocation live at {addr:#x} "
            "when recording began does not fit the replayed pool (raise its capacity)"
        )
    return a


def _compare(
    rec: Recording,
    pool: Policy,
    emulated: pd.DataFrame,
    start_reserved: int,
    num_failed: int,
    num_at_address: int,
    addresses: str,
) -> FidelityResult:
    recorded = rec.segment_events[["at", "action", "address", "nbytes"]].copy()
    recorded["reserved_bytes"] = rec.recorded_reserved().to_numpy() if len(recorded) else []
    sign = (
        emulated["action"].map(_RESERVE_ACTIONS).astype("int64")
        if len(emulated)
        else emulated["nbytes"]
    )
    emulated["reserved_bytes"] = start_reserved + (sign * emulated["nbytes"]).cumsum()
    stats = pool.stats()

    def side(df: pd.DataFrame, start: int) -> dict[str, int]:
        allocs = df["action"].isin(("segment_alloc", "segment_map"))
        frees = df["action"].isin(("segment_free", "segment_unmap"))
        reserved = df["reserved_bytes"]
        return {
            "segment allocations": int(allocs.sum()),
            "segment allocation bytes": int(df.loc[allocs, "nbytes"].sum()),
            "segment frees": int(frees.sum()),
            "segment free bytes": int(df.loc[frees, "nbytes"].sum()),
            "peak reserved bytes": int(max(reserved.max() if len(df) else 0, start)),
            "reserved at end bytes": int(reserved.iloc[-1]) if len(df) else start,
        }

    r, e = side(recorded, rec.initial_reserved_bytes), side(emulated, start_reserved)
    r["failed allocations (oom)"] = int((recorded["action"] == "oom").sum())
    e["failed allocations (oom)"] = num_failed
    num_allocs = rec.num_allocs
    decisions = recorded["action"] != "oom"
    recorded["event"] = -1
    recorded.loc[decisions, "event"] = range(int(decisions.sum()))
    emulated["event"] = range(len(emulated))
    for df in (recorded, emulated):
        df["entry"] = [rec.entries[at] if 0 <= at < len(rec.entries) else -1 for at in df["at"]]
    key_r = list(
        zip(
            recorded.loc[decisions, "at"],
            recorded.loc[decisions, "action"],
            recorded.loc[decisions, "nbytes"],
        )
    )
    key_e = list(zip(emulated["at"], emulated["action"], emulated["nbytes"]))
    same = next(
        (i for i, (x, y) in enumerate(zip(key_r, key_e)) if x != y), min(len(key_r), len(key_e))
    )
    divergence = None
    if same < max(len(key_r), len(key_e)):
        at = (key_r if same < len(key_r) else key_e)[same][0]
        divergence = {
            "index": same,
            "entry": rec.entries[at] if 0 <= at < len(rec.entries) else None,
            "entry_unit": rec.entry_unit,
            "recorded": _describe(key_r, same),
            "emulated": _describe(key_e, same),
            "cause": _likely_cause(
                rec,
                pool,
                key_r[same] if same < len(key_r) else None,
                key_e[same] if same < len(key_e) else None,
            ),
        }
    rows = []
    for metric in r:
        rows.append(_row(metric, r[metric], e[metric]))
    rows.append(_row("segment decisions in recorded order", len(key_r), same))
    if addresses == "recorded" and num_allocs:
        rows.append(
            _row(
                "allocations at the recorded address %", 100.0, 100.0 * num_at_address / num_allocs
            )
        )
    rows.append(
        _row("peak allocated bytes", None, stats.peak_allocated_bytes)
    )  # the snapshot does not say
    events = pd.concat(
        [recorded.assign(side="recorded"), emulated.assign(side="emulated")], ignore_index=True
    )
    events = events[
        ["side", "event", "entry", "at", "action", "address", "nbytes", "reserved_bytes"]
    ]
    spec = pool.spec
    return FidelityResult(
        name=rec.name,
        spec=spec,
        addresses=addresses,
        table=pd.DataFrame(rows),
        segment_events=events,
        first_divergence=divergence,
        policy=pool,
    )


def _row(metric: str, recorded: Any, emulated: Any) -> dict[str, Any]:
    if recorded is None or emulated != emulated:
        return {
            "metric": metric,
            "recorded": recorded,
            "emulated": emulated,
            "difference": None,
            "difference_pct": float("nan"),
            "within_1pct": None,
        }
    diff = emulated - recorded
    pct = 100.0 * diff / recorded if recorded else (0.0 if diff == 0 else float("inf"))
    return {
        "metric": metric,
        "recorded": recorded,
        "emulated": emulated,
        "difference": diff,
        "difference_pct": pct,
        "within_1pct": abs(pct) <= 1.0,
    }


def _describe(keys: list, i: int) -> str:
    if i >= len(keys):
        return "nothing"
    _at, action, nbytes = keys[i]
    return f"{action} of {nbytes / MiB:,.1f} MiB"


#: ``PYTORCH_CUDA_ALLOC_CONF`` keys ``params_from_settings`` models (or that do not change
#: decisions)
_MODELLED_CONF_KEYS = {
    "",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "backend",
}
CAUSES = ("unmodelled private pool", "external release", "unsupported setting", "record_stream")


def unmodelled_conf_keys(conf: str) -> list[str]:
    """The keys of a ``PYTORCH_CUDA_ALLOC_CONF`` the emulation does not model, sorted (a bracketed
    value such as ``roundup_power2_divisions:[256:1,512:2]`` is one item:
    ``traces.spec_grammar``)."""
    return sorted(
        set(parse_items(conf, bad_item=None, valid_key=bool, assign=":")) - _MODELLED_CONF_KEYS
    )


def _likely_cause(
    rec: Recording, pool: Policy, recorded: tuple | None, emulated: tuple | None
) -> str:
    """Which class of cause (``CAUSES``) most likely explains the first divergence, with why."""
    unknown = unmodelled_conf_keys(str(rec.settings.get("PYTORCH_CUDA_ALLOC_CONF") or ""))
    if unknown:
        return f"unsupported setting ({', '.join(unknown)} in PYTORCH_CUDA_ALLOC_CONF)"
    if rec.pool_calls and not pool.has_private_pools:
        return (
            f"unmodelled private pool ({pool.spec} has no private pools; "
            "the trace allocates to one)"
        )
    if (
        recorded is not None
        and recorded[1] in ("segment_free", "segment_unmap")
        and (emulated is None or emulated[1] not in ("segment_free", "segment_unmap"))
    ):
        return (
            "external release (the recording gives memory back "
            "where the emulation does not decide to)"
        )
    if rec.num_deferred_frees:
        return (
            f"record_stream ({rec.num_deferred_frees:,} frees completed late: events held "
            "the blocks)"
        )
    if rec.num_unknown_pool:
        return (
            f"unmodelled private pool ({rec.num_unknown_pool:,} allocations "
            "whose pool the snapshot cannot tell were put in the default pool)"
        )
    return "unmodelled private pool or external release (no sign in the trace points to either)"


def fidelity(
    path: str | Path,
    policy: str | None = None,
    *,
    addresses: str = "recorded",
    capacity_bytes: int | None = None,
    device: int | None = None,
) -> FidelityResult:
    """Read a snapshot, replay it through ``policy`` (default: ``torch-caching`` with the
    snapshot's settings) and compare with what the real allocator recorded."""
    return replay_recording(
        read_recording(path, device=device),
        policy,
        addresses=addresses,
        capacity_bytes=capacity_bytes,
    )
