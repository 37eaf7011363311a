"""PyTorch memory snapshots (``torch.cuda.memory._snapshot()`` / ``_dump_snapshot()``): the one
parser.

A snapshot is a pickle (often gzipped) of a dict with ``segments`` (the allocator's state when the
snapshot was taken), ``device_traces`` (one list of trace entries per device) and
``allocator_settings``. Each trace entry has ``action``, ``addr``, ``size``, ``stream`` and
``time_us``. ``parse_snapshot`` reads one device's part into a ``PyTorchSnapshot``, which both
the allocation-trace reader (``read_pytorch_snapshot``, for replay) and ``sim.replay.fidelity`` use:

- ``alloc`` opens an allocation (``size`` is the size asked for, before rounding);
  ``free_completed`` closes it (``free_requested`` only when the trace holds no completions:
  a block is not reusable until its free completes). Addresses are reused, so an address maps
  to the allocation currently living there.
- Recording is a ring buffer and usually starts after the weights are loaded, so the trace can
  free an address it never saw allocated: such an allocation was made before recording. Blocks
  still ``active_*`` in ``segments`` whose address the trace never touched were allocated
  before recording and never freed. Both are ``pre_trace`` allocations; the trace reader puts
  them at time 0 with tag ``"pre-trace"``.
- ``segment_*`` and ``oom`` entries are the allocator's own decisions, not requests: they are
  ``segment_events``, so an emulation can be compared with the real allocator.
- Raw stream handles become small ints in order of appearance (0 stays the default stream).
  The trace reader makes ``time_us`` relative to the device's first trace entry.
"""

from __future__ import annotations

import pickle
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from traces.errors import TraceFormatError, shown
from traces.snapshot_stream import (
    CHUNK_BYTES,
    STREAM_GLOBAL,
    StreamedEntries,
    find_device_list,
    load_streaming,
    release_freed_memory,
)
from traces.source import (
    GZIP_MAGIC,
    ThreadedInflate,
    TraceSource,
    max_trace_bytes,
    open_source,
    trace_name,
)

# numpy, pandas and ``traces.events`` (which imports both) are imported where the trace table is
# made (``snapshot_to_trace`` and its helpers), not here: the parse is the standard library's, so a
# read ahead (``traces.read_ahead``) parses in a process that never imports them.
if TYPE_CHECKING:
    import numpy as np

    from traces.events import AllocTrace

__all__ = [
    "SNAPSHOT_FORMAT",
    "SEGMENT_ACTIONS",
    "RESERVED_SIGN",
    "SMALL_SEGMENT_BYTES",
    "PyTorchSnapshot",
    "SnapshotRequests",
    "SegmentEvents",
    "SnapshotSegment",
    "PreTraceAllocation",
    "is_pickle_head",
    "load_snapshot_dict",
    "parse_snapshot",
    "read_snapshot",
    "read_snapshot_overlapped",
    "read_pytorch_snapshot",
    "snapshot_to_trace",
    "PoolInference",
    "infer_request_pools",
    "DEFAULT_POOL_ID",
    "empty_cache_frees",
    "empty_cache_points",
    "snapshot_max_split_size_bytes",
]

SNAPSHOT_FORMAT = "pytorch-snapshot"

#: Actions that describe the allocator's segments rather than requests.
SEGMENT_ACTIONS = frozenset(
    {"segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom"}
)
#: How each segment action changes reserved memory.
RESERVED_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
#: PyTorch's ``kSmallBuffer``: small-pool segments are exactly this size.
SMALL_SEGMENT_BYTES = 2 << 20
#: Block states that still occupy memory in the final ``segments`` table.
_LIVE_BLOCK_STATES = frozenset({"active_allocated", "active_pending_free"})
#: The only globals a snapshot may name: it is plain containers, and unpickling anything else
#: could run code from the file.
_ALLOWED_GLOBALS = frozenset({("collections", "OrderedDict")})
_SUFFIXES = (".pickle", ".pkl")


# ---------------------------------------------------------------------------- the parsed snapshot
@dataclass(frozen=True, slots=True)
class SnapshotRequests:
    """The program's requests (``alloc`` and the free action), in trace order, one list per column.

    Columns, not one object per request: a trace holds 10^5-10^6 entries, and the trace reader
    turns each column into one NumPy array. The number columns are ``array('q')`` (``is_alloc``
    ``array('b')``): 8 bytes a request, no int object each; they index and iterate as lists do.
    ``time_us`` is a list, with None, only when some entry has no time.

    Attributes:
        entry: index of the trace entry in ``device_traces[device]``.
        time_us: the entry's raw ``time_us`` (None where it has none).
        is_alloc: True for ``alloc``, False for a free.
        address: the recorded address.
        nbytes: bytes asked for (a free: those of the allocation it closes).
        stream: small-int stream.
        alloc_id: the allocation opened or closed; ids are dense, in order of first appearance
            (an allocation made before recording gets its id at its free).
        tag: ``user_metadata`` of an ``alloc`` (``""`` for none and for frees).
    """

    entry: Sequence[int]
    time_us: Sequence[int | None]
    is_alloc: Sequence[int]
    address: Sequence[int]
    nbytes: Sequence[int]
    stream: Sequence[int]
    alloc_id: Sequence[int]
    tag: list[str]

    def __len__(self) -> int:
        return len(self.entry)


@dataclass(frozen=True, slots=True)
class SegmentEvents:
    """The allocator's ``segment_*`` and ``oom`` entries in trace order, one list per column
    (``entry``, raw ``time_us``, ``action``, ``address``, ``nbytes``, small-int ``stream``)."""

    entry: list[int]
    time_us: list[int | None]
    action: list[str]
    address: list[int]
    nbytes: list[int]
    stream: list[int]

    def __len__(self) -> int:
        return len(self.entry)


@dataclass(frozen=True, slots=True)
class SnapshotSegment:
    """One segment: a ``cudaMalloc`` the allocator holds.

    ``segment_type`` is ``"small"``/``"large"`` as recorded, None where the snapshot does not say
    (older snapshots, and segments known only from a ``segment_free``); ``allocated_bytes`` is 0
    for the latter.
    """

    address: int
    total_bytes: int
    allocated_bytes: int
    stream: int
    segment_type: str | None
    is_expandable: bool
    pool_id: tuple[int, int] | None = (
        None  # ``segment_pool_id``; None where the snapshot does not say
    )

    @property
    def is_small(self) -> bool:
        """In the small pool: as recorded, else told by the size (small segments are 2 MiB)."""
        if self.segment_type is None:
            return self.total_bytes == SMALL_SEGMENT_BYTES
        return self.segment_type == "small"


@dataclass(frozen=True, slots=True)
class PreTraceAllocation:
    """An allocation made before recording began.

    Attributes:
        address: where it lives.
        requested_bytes: bytes asked for.
        stream: small-int stream.
        block_bytes: the recorded block size when it is still live at the end; None when only
            the trace's free of it shows it existed.
        freed_at: index into ``requests`` of its free; None when it is still live at the end.
    """

    address: int
    requested_bytes: int
    stream: int
    block_bytes: int | None
    freed_at: int | None


@dataclass(frozen=True, slots=True)
class PyTorchSnapshot:
    """One device's part of a memory snapshot, parsed (see the module docstring).

    Attributes:
        name, source: short name for reports and the file (or ``"<snapshot>"``).
        device: the device read.
        free_action: ``"free_completed"``, or ``"free_requested"`` when the trace has no
            completions.
        time_origin_us: raw ``time_us`` of the device's first trace entry (None: no entries).
        requests: the program's allocations and frees.
        segment_events: the allocator's segment decisions and ``oom`` entries.
        segments_at_end: the final ``segments`` table of ``device``, in snapshot order.
        segments_at_start: the segments that existed when recording began, by address: final
            segments with no ``segment_alloc`` still in effect in the trace, and those a
            ``segment_free`` returns without a ``segment_alloc``.
        pre_trace: allocations made before recording: those the trace frees (in trace order),
            then those still live at the end (in segment and block order).
        allocator_settings: the snapshot's ``allocator_settings``.
        stream_handles: raw stream handle -> small-int stream.
        ignored_actions: count of each trace action that is neither a request nor a decision.
        num_deferred_frees: frees completed only after other entries followed their
            ``free_requested`` (a CUDA event held the block: ``record_stream`` or a cross-stream
            use).
    """

    name: str
    source: str
    device: int
    free_action: str
    time_origin_us: int | None
    requests: SnapshotRequests
    segment_events: SegmentEvents
    segments_at_end: tuple[SnapshotSegment, ...]
    segments_at_start: tuple[SnapshotSegment, ...]
    pre_trace: tuple[PreTraceAllocation, ...]
    allocator_settings: dict[str, Any]
    stream_handles: dict[Any, int]
    ignored_actions: dict[str, int]
    num_deferred_frees: int = 0

    @property
    def entry_unit(self) -> str:
        """How errors name a trace entry's index (``TraceFormatError(..., unit=...)``)."""
        return f"device_traces[{self.device}] index"


# ---------------------------------------------------------------------------- reading
class _SnapshotUnpickler(pickle.Unpickler):
    #: What ``traces.snapshot_stream.STREAM_GLOBAL`` resolves to: set by ``load_streaming`` on its
    #: own unpickler only.
    stream_global = None

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == STREAM_GLOBAL and self.stream_global is not None:
            return self.stream_global
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a memory snapshot holds only plain data"
        )


def is_pickle_head(head: bytes) -> bool:
    """Whether a file's first (decompressed) bytes open a pickle: the ``PROTO`` opcode, protocols
    2-5 (what ``_dump_snapshot`` writes)."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def load_snapshot_dict(path: str | Path | TraceSource) -> dict:
    """Unpickle a (gzipped or plain) snapshot file, read once (``traces.source``), without running
    code from it."""
    src = open_source(path)
    return _checked_snapshot(src, _unpickled(src, lambda: _SnapshotUnpickler(src.stream()).load()))


def _unpickled(src: TraceSource, load) -> Any:
    """What ``load()`` unpickles; any failure to unpickle is one ``TraceFormatError`` naming the
    file."""
    what = "gzipped pickle" if src.gzipped else "pickle"
    try:
        src.require_intact()
        return load()
    except TraceFormatError as exc:
        raise TraceFormatError(src.path, None, f"not a readable {what} ({exc.reason})") from None
    except RecursionError:
        raise TraceFormatError(
            src.path, None, f"not a readable {what} (nested too deeply)"
        ) from None
    except Exception as exc:  # a truncated pickle fails in many ways; all mean one thing
        raise TraceFormatError(
            src.path, None, f"not a readable {what} ({type(exc).__name__}: {exc})"
        ) from None


def _checked_snapshot(src: TraceSource, snap: Any) -> dict:
    if not isinstance(snap, dict) or not ("device_traces" in snap or "segments" in snap):
        raise TraceFormatError(
            src.path,
            None,
            "pickle holds no 'device_traces' or 'segments': not a PyTorch memory snapshot",
        )
    return snap


def _read_streamed(
    src: TraceSource, device: int | None, name: str, inflating: ThreadedInflate | None = None
) -> PyTorchSnapshot | None:
    """``read_snapshot`` with the device's entries parsed as they are unpickled
    (``traces.snapshot_stream``): the same result, without the whole list of entry dicts in memory.
    None where the file's layout (or an entry shared by two places) needs the whole-file read.

    A trace with no ``free_completed`` closes allocations with ``free_requested``; a streamed
    read knows that only at the end, so such a file is unpickled twice.

    ``inflating``: the rest of the content, still being decompressed (``src.data`` is its first
    piece; ``read_snapshot_overlapped``): None when its stream is damaged or too large; a second
    pass reads the whole file.
    """
    found = find_device_list(src.data, device)
    if found is None:
        return None
    source, unit = str(src.path), f"device_traces[{found[1]}] index"
    parser = _EntryParser({0: 0}, source, unit, "free_completed", assumed=True)
    for _ in range(2):
        src = src.reopened()  # the second pass reads the file again (the first let it go)
        try:
            got = _unpickled(
                src,
                lambda: load_streaming(
                    src.data,
                    found,
                    _SnapshotUnpickler,
                    parser.feed,
                    # a pipe's source is kept (``TraceSource.release``): no copy to let it go
                    # into; nor is a first piece (the rest comes from ``inflating``)
                    release=None if src.is_stream or inflating else src.release,
                    more=None if inflating is None else iter(inflating),
                ),
            )
        except TraceFormatError:
            if inflating is not None and not _inflated_intact(inflating):
                return None  # a damaged stream: the whole-file read tells how
            raise
        if inflating is not None and not _inflated_intact(inflating):
            return None
        if got is None or got[1].fallback:
            return None
        snap, entries = got
        release_freed_memory()  # the emptied entries and the memo, before the columns are copied
        if parser.assumed and not parser.seen_completed and len(entries):
            parser = _EntryParser({0: 0}, source, unit, "free_requested")  # read again, knowing
            if inflating is not None:
                # the pieces are gone: the second pass reads the file whole (``found`` holds
                # there too: the first piece is a prefix of the content)
                src, inflating = open_source(src.path), None
            continue
        try:
            return _parse_snapshot(
                _checked_snapshot(src, snap), source, device, name, streamed=(entries, parser)
            )
        except RecursionError:
            raise TraceFormatError(
                source, None, "a field is nested too deeply to be part of a memory snapshot"
            ) from None
        except _NotStreamable:
            return None
    return None


def read_snapshot_overlapped(
    path: str | Path, *, device: int | None = None
) -> PyTorchSnapshot | None:
    """``read_snapshot(path, device=)`` of a gzipped regular file with the decompression in a thread
    (``traces.source.ThreadedInflate``), running ahead of the streamed unpickle and parse, which
    take each piece as it comes: on a spare core the read takes the time of the unpickle and
    parse, not that plus the gunzip (~0.2 s of the million-event snapshot's 2.1 s on the dev
    container), and the content is never whole in memory.

    Returns None, having raised nothing, wherever the plain read might go otherwise: no gzip, no
    pickle, over the size limit, a damaged stream, a layout the streamed read does not take from
    the first piece (a trace that needs a second pass reads the whole file for it). A malformed
    snapshot raises as the plain read does; ``traces.read_ahead``'s child, the one caller, reads
    again with ``read_snapshot`` on any failure, and its parent reads again in-process, so every
    error is the plain read's.
    """
    import stat

    path = Path(path)
    limit = max_trace_bytes(path)
    st = path.stat()
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        return None
    raw = path.read_bytes()
    if raw[:2] != GZIP_MAGIC or len(raw) > limit:
        return None
    inflating = ThreadedInflate(raw, limit, path, piece_bytes=CHUNK_BYTES)
    del raw
    try:
        pieces = iter(inflating)
        first = next(pieces, b"")
        if not is_pickle_head(first[:2]):
            return None
        src = TraceSource(path, first, gzipped=True)
        del first
        return _read_streamed(src, device, trace_name(path, _SUFFIXES), inflating)
    finally:
        inflating.cancel()


def _inflated_intact(inflating: ThreadedInflate) -> bool:
    """Whether the decompression ended with the stream whole and under the size limit."""
    try:
        return inflating.outcome() is None
    except TraceFormatError:
        return False


class _NotStreamable(Exception):
    """The streamed device list is not the one the parse picks (the whole-file read decides)."""


def read_snapshot(path: str | Path | TraceSource, *, device: int | None = None) -> PyTorchSnapshot:
    """Read and parse a snapshot file (a pickle or gzipped pickle from ``_dump_snapshot``).

    Args:
        path: the file (any stream, ``traces.source``) or its ``TraceSource``.
        device: which device's part to read; default: the first device with trace entries.

    Raises:
        TraceFormatError: the file is no snapshot or a record is malformed (names file and record).
    """
    src = open_source(path)
    name = trace_name(src.path, _SUFFIXES)
    streamed = _read_streamed(src, device, name)
    if streamed is not None:
        return streamed
    src = src.reopened()  # a streamed read that gave up may have let the content go
    return parse_snapshot(load_snapshot_dict(src), source=str(src.path), device=device, name=name)


def parse_snapshot(
    snap: dict, *, source: str = "<snapshot>", device: int | None = None, name: str | None = None
) -> PyTorchSnapshot:
    """Parse an unpickled snapshot dict (see the module docstring); ``name`` defaults to the
    source's.

    Every field is checked before use (``TraceFormatError`` naming the list and index): trace
    entries and segments are dicts, devices whole numbers, addresses and sizes whole numbers
    below 2**63, each block inside its segment, segments of one device apart, requested sizes
    at most their block's.
    """
    try:
        return _parse_snapshot(snap, source, device, name)
    except RecursionError:  # a field nested thousands deep (a hostile pickle): no snapshot has one
        raise TraceFormatError(
            source, None, "a field is nested too deeply to be part of a memory snapshot"
        ) from None


def _parse_snapshot(
    snap: dict,
    source: str,
    device: int | None,
    name: str | None,
    streamed: "tuple[StreamedEntries, _EntryParser] | None" = None,
) -> PyTorchSnapshot:
    device_traces = snap.get("device_traces") or []
    segments = snap.get("segments") or []
    if not isinstance(device_traces, list) or not isinstance(segments, list):
        raise TraceFormatError(source, None, "'device_traces' and 'segments' must be lists")
    settings = snap.get("allocator_settings") or {}
    if not isinstance(settings, dict):
        raise TraceFormatError(
            source, None, f"'allocator_settings' must be a dict, not {type(settings).__name__}"
        )
    for d, entries in enumerate(device_traces):
        if not isinstance(entries, (list, StreamedEntries)):
            raise TraceFormatError(
                source,
                d,
                f"is {shown(entries, 40)}, not a list of trace entries",
                unit="device_traces index",
            )
    _check_devices(segments, source)
    dev = _pick_device(device_traces, segments, device, source)
    entries = device_traces[dev] if dev < len(device_traces) else []
    if streamed is not None:
        if entries is not streamed[0]:
            raise _NotStreamable()
        parser = streamed[1]
        streams = parser.streams
        requests, events, pre_freed, seen_addrs, free_action, ignored, num_deferred = (
            parser.finish()
        )
    else:
        if any(isinstance(e, StreamedEntries) for e in device_traces):
            raise _NotStreamable()
        streams = {0: 0}
        requests, events, pre_freed, seen_addrs, free_action, ignored, num_deferred = (
            _parse_entries(entries, streams, source, f"device_traces[{dev}] index")
        )
    at_end, live_blocks = _parse_segments(segments, dev, streams, source)
    pre_live = tuple(
        PreTraceAllocation(addr, requested, stream, block_bytes, None)
        for addr, block_bytes, requested, stream in live_blocks
        if addr not in seen_addrs
    )
    if isinstance(entries, StreamedEntries):
        time_origin_us = entries.first_time_us
    else:
        first = entries[0] if entries else None
        time_origin_us = first.get("time_us") if isinstance(first, dict) else None
    return PyTorchSnapshot(
        name=Path(source).name if name is None else name,
        source=source,
        device=dev,
        free_action=free_action,
        time_origin_us=time_origin_us,
        requests=requests,
        segment_events=events,
        segments_at_end=at_end,
        segments_at_start=_segments_at_start(at_end, events),
        pre_trace=tuple(pre_freed) + pre_live,
        allocator_settings=settings,
        stream_handles=streams,
        ignored_actions=ignored,
        num_deferred_frees=num_deferred,
    )


def _check_devices(segments: list, source: str) -> None:
    """TraceFormatError unless every segment is a dict whose ``device`` (when given) is a device
    index."""
    for k, seg in enumerate(segments):
        if not isinstance(seg, dict):
            raise TraceFormatError(
                source, k, f"malformed segment {shown(seg, 40)} (not a dict)", unit="segments index"
            )
        d = seg.get("device")
        if d is not None and (type(d) is not int or not 0 <= d < _MAX_DEVICES):
            raise TraceFormatError(
                source,
                k,
                f"device {shown(d, 40)} is not a device index "
                f"(a whole number >= 0 and < {_MAX_DEVICES})",
                unit="segments index",
            )


def _pick_device(device_traces: list, segments: list, device: int | None, source: str) -> int:
    if device is not None:
        known = set(range(len(device_traces))) | {
            s.get("device") for s in segments if isinstance(s, dict)
        }
        if device not in known:
            devices = sorted(d for d in known if d is not None)
            raise TraceFormatError(
                source, None, f"device {device} is not in the snapshot (devices: {devices})"
            )
        return device
    for dev, entries in enumerate(device_traces):
        if entries:
            return dev
    devices = sorted({s.get("device", 0) for s in segments if isinstance(s, dict)})
    return devices[0] if devices else 0


def _parse_entries(entries: list, streams: dict[Any, int], source: str, unit: str):
    """One pass over a list of trace entries (``_EntryParser``); see ``_EntryParser.finish`` for
    what it returns."""
    free_action = "free_completed"
    if not any(isinstance(e, dict) and e.get("action") == "free_completed" for e in entries):
        free_action = "free_requested"
    parser = _EntryParser(streams, source, unit, free_action)
    for start in range(0, len(entries), _PARSE_BATCH_ENTRIES):  # the batch lists stay small
        parser.feed(entries[start : start + _PARSE_BATCH_ENTRIES], start)
    return parser.finish()


#: Entries a whole-list parse gives ``_EntryParser.feed`` at once: its per-batch lists (seven
#: numbers a request, a Python int each) stay a few hundred kB, as in a streamed read's batches.
_PARSE_BATCH_ENTRIES = 4096


class _EntryParser:
    """The trace entries of one device as columns: requests, decisions, pre-trace frees (the hot
    loop).

    ``feed(batch, start)`` parses entries ``start, start + 1, ...`` (whole lists, or the batches of
    a streamed read: ``traces.snapshot_stream``); ``finish()`` checks the times and returns the
    tables. A malformed entry's ``TraceFormatError`` is kept and raised by ``finish``, so that a
    streamed read raises it where a whole read would (after the checks of segments and devices).

    ``free_action`` is the action that closes an allocation: ``free_completed``, or
    ``free_requested`` when the trace holds no completion. A streamed read cannot know that
    before the end: it assumes completions (``assumed=True``) and ``seen_completed`` tells, at
    the end, whether the trace had one (else it is read again with ``free_requested``).
    """

    def __init__(
        self,
        streams: dict[Any, int],
        source: str,
        unit: str,
        free_action: str,
        *,
        assumed: bool = False,
    ):
        self.streams, self.source, self.unit, self.free_action = streams, source, unit, free_action
        self.assumed = assumed
        self.seen_completed = False
        self.live: dict[
            int, tuple[int, int]
        ] = {}  # addr -> (alloc id, size): the allocation living there now
        self.seen_addrs: set[int] = set()
        # request columns: array('q') (8 bytes a number, no int object each); tags a list of the few
        # strings
        self.r_entry, self.r_time, self.r_addr, self.r_size, self.r_stream, self.r_id = (
            array("q") for _ in range(6)
        )
        self.r_is_alloc = array("b")
        self.r_tag: list[str] = []
        self.untimed: list[int] = []  # requests whose entry has no time_us
        self.bad_time: tuple[int, Any] | None = (
            None  # (request, value): the first time_us that is no int64
        )
        self.s_entry, self.s_time, self.s_action, self.s_addr, self.s_size, self.s_stream = (
            [],
            [],
            [],
            [],
            [],
            [],
        )
        self.pre_freed: list[PreTraceAllocation] = []
        self.ignored: dict[str, int] = {}
        self.requested_at: dict[int, int] = {}  # address -> entry of its pending free_requested
        self.num_deferred = 0
        self.next_id = 0
        self.error: TraceFormatError | None = None

    def _odd_time(self, value: Any, request: int) -> int:
        """A request's time_us that is no int64 (absent, or malformed: reported by ``finish``); 0
        stands in."""
        if value is None:
            self.untimed.append(request)
        elif self.bad_time is None:
            self.bad_time = (request, value)
        return 0

    def feed(self, entries: list, start: int) -> None:
        if (
            self.error is not None
        ):  # the error stands; a streamed read only still needs to know the free action
            if self.assumed and not self.seen_completed:
                self.seen_completed = any(
                    isinstance(e, dict) and e.get("action") == "free_completed" for e in entries
                )
            return
        source, unit, streams, live, free_action = (
            self.source,
            self.unit,
            self.streams,
            self.live,
            self.free_action,
        )
        requested_at, pre_freed, ignored = self.requested_at, self.pre_freed, self.ignored
        seen_add, odd_time, tags = self.seen_addrs.add, self._odd_time, self.r_tag
        # the batch's request numbers go to lists first, into the array columns at its end
        # (``_add_batch``): CPython specialises ``list.append`` (an array's is a general call),
        # the million-event snapshot's parse 0.85 -> 0.71 s, on the read's critical path
        b_entry, b_time, b_is_alloc, b_addr, b_size, b_stream, b_id = ([] for _ in range(7))
        batch = (b_entry, b_time, b_is_alloc, b_addr, b_size, b_stream, b_id)
        first_request = len(self.r_entry)  # the index of this batch's first request
        lim = _INT64_LIMIT
        next_id, num_deferred, completed = self.next_id, self.num_deferred, False
        i = start - 1
        try:
            for i, e in enumerate(entries, start):
                action = e["action"]
                if action == "alloc":
                    addr, size = e["addr"], e["size"]
                    if (
                        type(size) is not int
                        or type(addr) is not int
                        or not 0 < size < lim
                        or not 0 <= addr < lim
                    ):
                        raise TraceFormatError(
                            source, i, _bad_entry_numbers("alloc", addr, size), unit=unit
                        )
                    if addr in live:
                        raise TraceFormatError(
                            source,
                            i,
                            f"alloc at address {addr:#x}, "
                            f"where allocation {live[addr][0]} is still live",
                            unit=unit,
                        )
                    s = streams.get(e["stream"])
                    if s is None:
                        s = _new_stream(streams, e["stream"])
                    live[addr] = (next_id, size)
                    seen_add(addr)
                    t = e.get("time_us")
                    if type(t) is not int or not -lim <= t < lim:
                        t = odd_time(t, first_request + len(b_entry))
                    tag = e.get("user_metadata") or ""
                    if type(tag) is not str and not isinstance(tag, str):
                        tag = str(tag)
                    b_entry.append(i)
                    b_time.append(t)
                    b_is_alloc.append(1)
                    b_addr.append(addr)
                    b_size.append(size)
                    b_stream.append(s)
                    b_id.append(next_id)
                    tags.append(tag)
                    next_id += 1
                elif action == free_action:
                    completed = True
                    addr = e["addr"]
                    if (
                        type(addr) is not int or not 0 <= addr < lim
                    ):  # the trace keeps every address
                        raise TraceFormatError(
                            source, i, _bad_entry_numbers(action, addr, None), unit=unit
                        )
                    if requested_at and requested_at.pop(addr, i - 1) < i - 1:
                        num_deferred += (
                            1  # completed after other entries: an event (record_stream) held it
                        )
                    s = streams.get(e["stream"])
                    if s is None:
                        s = _new_stream(streams, e["stream"])
                    found = live.pop(addr, None)
                    if found is None:  # allocated before recording began
                        size = e["size"]
                        if type(size) is not int or not 0 < size < lim:
                            raise TraceFormatError(
                                source,
                                i,
                                f"free of never-seen address {addr:#x} with size {shown(size, 40)}",
                                unit=unit,
                            )
                        found = (next_id, size)
                        request = first_request + len(b_entry)
                        pre_freed.append(PreTraceAllocation(addr, size, s, None, request))
                        seen_add(addr)
                        next_id += 1
                    t = e.get("time_us")
                    if type(t) is not int or not -lim <= t < lim:
                        t = odd_time(t, first_request + len(b_entry))
                    b_entry.append(i)
                    b_time.append(t)
                    b_is_alloc.append(0)
                    b_addr.append(addr)
                    b_size.append(found[1])
                    b_stream.append(s)
                    b_id.append(found[0])
                    tags.append("")
                elif action == "free_requested":  # before its free_completed (counted in ignored)
                    requested_at[e["addr"]] = i
                    ignored[action] = ignored.get(action, 0) + 1
                elif action in SEGMENT_ACTIONS:
                    s = streams.get(e["stream"])
                    if s is None:
                        s = _new_stream(streams, e["stream"])
                    _check_segment_numbers(e, is_oom=action == "oom")
                    # an oom entry's address field is the device's free memory in some versions
                    addr = e.get("addr", e.get("device_free", 0))
                    _check_address(addr)
                    self.s_entry.append(i)
                    self.s_time.append(e.get("time_us"))
                    self.s_action.append(action)
                    self.s_addr.append(addr)
                    self.s_size.append(e["size"])
                    self.s_stream.append(s)
                elif action != "free_completed":
                    ignored[action] = ignored.get(action, 0) + 1
        except TraceFormatError as exc:
            self.error = exc
        except KeyError as exc:
            self.error = TraceFormatError(source, i, f"trace entry lacks key {exc}", unit=unit)
        except (TypeError, ValueError, AttributeError) as exc:
            self.error = TraceFormatError(
                source, i, f"malformed trace entry {shown(entries[i - start])} ({exc})", unit=unit
            )
        self._add_batch(batch)
        self.next_id, self.num_deferred = next_id, num_deferred
        if completed and free_action == "free_completed":
            self.seen_completed = True
        if self.error is not None and self.assumed and not self.seen_completed:
            self.seen_completed = any(
                isinstance(e, dict) and e.get("action") == "free_completed" for e in entries
            )

    def _add_batch(self, batch: tuple[list[int], ...]) -> None:
        """Append a batch's request numbers (``feed``'s lists, in the columns' order below; each
        number checked there to fit) to the request columns, one C conversion a column."""
        for values, column in zip(
            batch,
            (
                self.r_entry,
                self.r_time,
                self.r_is_alloc,
                self.r_addr,
                self.r_size,
                self.r_stream,
                self.r_id,
            ),
        ):
            column.fromlist(values)

    def finish(self):
        """``(requests, segment_events, pre_freed, seen_addrs, free_action, ignored,
        num_deferred_frees)``.

        Raises:
            TraceFormatError: the first malformed entry, else the first request (then segment
                event) whose ``time_us`` is no int64.
        """
        if self.error is not None:
            raise self.error
        if self.bad_time is not None:
            k, value = self.bad_time
            raise TraceFormatError(
                self.source,
                self.r_entry[k],
                f"time_us {shown(value, 40)} is not an integer",
                unit=self.unit,
            )
        k = next((k for k, t in enumerate(self.s_time) if t is not None and _bad_time(t)), None)
        if k is not None:
            raise TraceFormatError(
                self.source,
                self.s_entry[k],
                f"time_us {shown(self.s_time[k], 40)} is not an integer",
                unit=self.unit,
            )
        times: Any = self.r_time
        # None where an entry has no time (the trace reader refuses it; fidelity does not need it)
        if self.untimed:
            times = list(times)
            for k in self.untimed:
                times[k] = None
        requests = SnapshotRequests(
            self.r_entry,
            times,
            self.r_is_alloc,
            self.r_addr,
            self.r_size,
            self.r_stream,
            self.r_id,
            self.r_tag,
        )
        events = SegmentEvents(
            self.s_entry, self.s_time, self.s_action, self.s_addr, self.s_size, self.s_stream
        )
        return (
            requests,
            events,
            self.pre_freed,
            self.seen_addrs,
            self.free_action,
            self.ignored,
            self.num_deferred,
        )


def _parse_segments(
    segments: list, dev: int, streams: dict, source: str
) -> tuple[tuple[SnapshotSegment, ...], list[tuple[int, int, int, int]]]:
    """The final segment table of ``dev`` and its live blocks as (addr, block bytes, requested
    bytes, stream).

    A segment's blocks lie inside it, one after another; its ``allocated_size`` is at most its
    size; the segments of ``dev`` do not overlap (``TraceFormatError`` naming the segment).
    """
    table, live_blocks, index = [], [], []
    for k, seg in enumerate(segments):
        try:
            if seg.get("device", dev) != dev:
                continue
            s = streams.get(seg["stream"])
            if s is None:
                s = _new_stream(streams, seg["stream"])
            _check_segment_numbers(seg)
            addr = seg["address"]
            _check_address(addr)
            end = addr + seg["total_size"]
            if seg.get("allocated_size", 0) > seg["total_size"]:
                raise ValueError(
                    f"allocated_size {seg['allocated_size']} is more "
                    f"than total_size {seg['total_size']}"
                )
            pool_id = seg.get("segment_pool_id")
            table.append(
                SnapshotSegment(
                    addr,
                    seg["total_size"],
                    seg.get("allocated_size", 0),
                    s,
                    seg.get("segment_type"),
                    bool(seg.get("is_expandable", False)),
                    tuple(pool_id) if pool_id is not None else None,
                )
            )
            index.append(k)
            for j, b in enumerate(seg.get("blocks", [])):
                b_addr = b.get(
                    "address", addr
                )  # older snapshots lack block addresses: blocks tile the segment
                _check_address(b_addr)
                if b_addr < addr or b_addr + b["size"] > end:
                    raise ValueError(
                        f"block {j} [{b_addr:#x}, {b_addr + b['size']:#x}) "
                        f"does not lie inside the segment [{seg['address']:#x}, {end:#x})"
                    )
                requested = b.get("requested_size")
                if requested is not None and (type(requested) is not int or requested < 0):
                    raise ValueError(
                        f"block {j} requested_size {shown(requested, 40)} is not a byte count"
                    )
                if b["state"] in _LIVE_BLOCK_STATES:
                    if requested is not None and requested > b["size"]:
                        raise ValueError(
                            f"block {j} requested_size {requested} is more "
                            f"than its size {b['size']}"
                        )
                    live_blocks.append((b_addr, b["size"], requested or b["size"], s))
                addr = b_addr + b["size"]
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise TraceFormatError(
                source, k, f"malformed segment ({type(exc).__name__}: {exc})", unit="segments index"
            ) from None
    order = sorted(range(len(table)), key=lambda i: table[i].address)
    for a, b in zip(order, order[1:]):
        first, second = table[a], table[b]
        if first.address + first.total_bytes > second.address:
            raise TraceFormatError(
                source,
                index[b],
                f"segment at {second.address:#x} overlaps segments index {index[a]} "
                f"[{first.address:#x}, {first.address + first.total_bytes:#x})",
                unit="segments index",
            )
    return tuple(table), live_blocks


def _segments_at_start(
    at_end: tuple[SnapshotSegment, ...], events: SegmentEvents
) -> tuple[SnapshotSegment, ...]:
    """The segments held when recording began, by address (see ``PyTorchSnapshot``)."""
    if (
        any(seg.is_expandable for seg in at_end)
        or "segment_map" in events.action
        or "segment_unmap" in events.action
    ):
        return _mapped_runs_at_start(at_end, events)
    held: set[int] = set()  # addresses of a segment_alloc in the trace not freed since
    freed_unseen: list[SnapshotSegment] = []
    for action, addr, nbytes, stream in zip(
        events.action, events.address, events.nbytes, events.stream
    ):
        if action == "segment_alloc":
            held.add(addr)
        elif action == "segment_free":
            if addr in held:
                held.discard(addr)
            else:
                freed_unseen.append(SnapshotSegment(addr, nbytes, 0, stream, None, False))
    start = {seg.address: seg for seg in at_end if seg.address not in held}
    for seg in freed_unseen:
        start.setdefault(seg.address, seg)
    return tuple(start[a] for a in sorted(start))


def _mapped_runs_at_start(
    at_end: tuple[SnapshotSegment, ...], events: SegmentEvents
) -> tuple[SnapshotSegment, ...]:
    """Expandable segments: the runs of pages mapped when recording began.

    The final table lists each mapped run as a segment; undoing the trace's ``segment_map`` /
    ``segment_unmap`` entries, last first, leaves the pages mapped at the start (2 MiB, the
    smallest page). A run takes the pool, stream and small/large type of the final segment
    nearest to it on its stream (expandable ranges lie far apart); where there is none it is
    small when its size is a 2 MiB page count below 20 MiB (a guess the snapshot cannot settle).
    """
    page = SMALL_SEGMENT_BYTES
    # ranges, not one entry per page: a (hostile) map of 2**55 bytes is one range, not 2**34 pages
    mapped = _PageRanges(page)
    for seg in at_end:
        mapped.add(seg.address, seg.total_bytes)
    unmapped_streams: list[
        tuple[int, int, int]
    ] = []  # (address, bytes, stream), earliest unmap last
    for action, addr, nbytes, stream in zip(
        reversed(events.action),
        reversed(events.address),
        reversed(events.nbytes),
        reversed(events.stream),
    ):
        if action == "segment_map":
            mapped.remove(addr, nbytes)
        elif action == "segment_unmap":
            mapped.add(addr, nbytes)
            unmapped_streams.append((addr, nbytes, stream))

    def stream_of(start: int, default):
        """The stream of the earliest unmap of the page at ``start`` (undone last), else
        ``default``."""
        for addr, nbytes, stream in reversed(unmapped_streams):
            if addr <= start < addr + nbytes and (start - addr) % page == 0:
                return stream
        return default

    runs: list[SnapshotSegment] = []
    for start, nbytes in mapped.runs():
        near = [s for s in at_end if s.stream == stream_of(start, s.stream)]
        like = min(near, key=lambda s: abs(s.address - start), default=None)
        if like is None:
            runs.append(SnapshotSegment(start, nbytes, 0, stream_of(start, 0), None, True))
        else:
            runs.append(
                SnapshotSegment(
                    start, nbytes, 0, like.stream, like.segment_type, True, like.pool_id
                )
            )
    return tuple(runs)


class _PageRanges:
    """A set of pages (``page`` bytes each, starting where a range starts), kept as sorted disjoint
    runs.

    ``add(addr, nbytes)`` holds the pages ``addr, addr + page, ...`` below ``addr + nbytes``, as
    ``set.update(range(addr, addr + nbytes, page))`` would, and ``remove`` drops them; adjacent
    runs merge. Equal to a set of page addresses whenever the addresses are page-aligned (the
    allocator maps whole pages); the cost is per run, not per page.
    """

    def __init__(self, page: int):
        self.page = page
        self.starts: list[int] = []
        self.ends: list[int] = []

    def _span(self, addr: int, nbytes: int) -> tuple[int, int]:
        return addr, addr + -(-max(nbytes, 0) // self.page) * self.page

    def add(self, addr: int, nbytes: int) -> None:
        lo, hi = self._span(addr, nbytes)
        if lo == hi:
            return
        i = bisect_left(
            self.ends, lo
        )  # first run ending at or after lo: it touches or follows [lo, hi)
        j = i
        while j < len(self.starts) and self.starts[j] <= hi:
            lo, hi = min(lo, self.starts[j]), max(hi, self.ends[j])
            j += 1
        self.starts[i:j], self.ends[i:j] = [lo], [hi]

    def remove(self, addr: int, nbytes: int) -> None:
        lo, hi = self._span(addr, nbytes)
        if lo == hi:
            return
        i = bisect_left(self.ends, lo + 1)  # first run ending after lo
        j = i
        keep_s, keep_e = [], []
        while j < len(self.starts) and self.starts[j] < hi:
            if self.starts[j] < lo:
                keep_s.append(self.starts[j])
                keep_e.append(lo)
            if self.ends[j] > hi:
                keep_s.append(hi)
                keep_e.append(self.ends[j])
            j += 1
        self.starts[i:j], self.ends[i:j] = keep_s, keep_e

    def runs(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each run, by address."""
        return [(lo, hi - lo) for lo, hi in zip(self.starts, self.ends)]


# ---------------------------------------------------------------------------- private pools
DEFAULT_POOL_ID = (0, 0)


@dataclass(frozen=True, slots=True)
class PoolInference:
    """Which pool each request went to, recovered from a snapshot (``infer_request_pools``).

    Attributes:
        pools: per request (index into ``requests``), the ``MempoolId`` of its pool.
        windows: capture windows ``(first, last, pool, stream)``: requests ``first..last`` (indices
            into ``requests``) ran while allocation to private ``pool`` was underway on ``stream``.
        num_unknown: allocations whose pool cannot be known (their segment was freed during the
            trace, or existed before it and is gone at the end); counted in the default pool.
    """

    pools: list[tuple[int, int]]
    windows: list[tuple[int, int, tuple[int, int], int]]
    num_unknown: int

    @property
    def private_pools(self) -> list[tuple[int, int]]:
        return sorted({w[2] for w in self.windows})


def infer_request_pools(snap: PyTorchSnapshot) -> PoolInference:
    """The pool of every request, by address containment, and the capture windows they imply.

    Trace entries do not say which pool served them; segments at the end do
    (``segment_pool_id``). A segment reserved in the trace and still held at the end has the
    final table's pool; an allocation belongs to the pool of the segment holding its address at
    that moment; a free to that of its allocation. A segment freed during the trace (or one
    known only from its free) does not say: its allocations are counted in the default pool
    and in ``num_unknown`` (a private pool's segment is freed only after ``releasePool``, which
    the trace does not record either). A capture window on stream S into pool P runs from an
    allocation on S that went to P to the last one before an allocation on S that did not
    (PyTorch routes by the capturing stream, ``captures_underway``).
    """
    final_pool = {seg.address: seg.pool_id for seg in snap.segments_at_end}
    ev = snap.segment_events
    last_alloc_at: dict[int, int] = {}  # address -> event index of its last segment_alloc/map
    freed_after: set[int] = set()  # event indices of segment_allocs freed later
    for j, (action, addr) in enumerate(zip(ev.action, ev.address)):
        if action == "segment_alloc":
            last_alloc_at[addr] = j
        elif action == "segment_free" and addr in last_alloc_at:
            freed_after.add(last_alloc_at.pop(addr))
    starts: list[int] = []
    held: dict[
        int, tuple[int, tuple[int, int] | None]
    ] = {}  # start -> (end, pool or None: unknown)

    def hold(addr: int, nbytes: int, pool) -> None:
        i = bisect_left(starts, addr)
        if i == len(starts) or starts[i] != addr:
            starts.insert(i, addr)
        held[addr] = (addr + nbytes, pool)

    for seg in snap.segments_at_start:
        hold(seg.address, seg.total_bytes, seg.pool_id)
    req = snap.requests
    pools: list[tuple[int, int]] = []
    alloc_pool: dict[int, tuple[int, int]] = {}  # alloc id -> pool
    num_unknown, j = 0, 0
    for k, entry in enumerate(req.entry):
        while j < len(ev) and ev.entry[j] < entry:
            action, addr = ev.action[j], ev.address[j]
            if action == "segment_alloc":
                hold(addr, ev.nbytes[j], None if j in freed_after else final_pool.get(addr))
            elif action == "segment_free" and addr in held:
                del held[addr]
                del starts[bisect_left(starts, addr)]
            j += 1
        if req.is_alloc[k]:
            i = bisect_left(starts, req.address[k] + 1) - 1
            pool = held[starts[i]][1] if i >= 0 and req.address[k] < held[starts[i]][0] else None
            if pool is None:
                num_unknown += 1
                pool = DEFAULT_POOL_ID
            alloc_pool[req.alloc_id[k]] = pool
        else:
            pool = alloc_pool.pop(req.alloc_id[k], DEFAULT_POOL_ID)
        pools.append(pool)
    windows: list[tuple[int, int, tuple[int, int], int]] = []
    open_at: dict[int, list] = {}  # stream -> [first, last, pool] of the window open on it
    for k, pool in enumerate(pools):
        if not req.is_alloc[k]:
            continue
        stream, window = req.stream[k], open_at.get(req.stream[k])
        if window is not None and window[2] != pool:
            windows.append((window[0], window[1], window[2], stream))
            del open_at[stream]
            window = None
        if pool != DEFAULT_POOL_ID:
            if window is None:
                open_at[stream] = [k, k, pool]
            else:
                window[1] = k
    windows.extend((w[0], w[1], w[2], stream) for stream, w in open_at.items())
    windows.sort()
    return PoolInference(pools, windows, num_unknown)


# --------------------------------------------------------------------------- as an allocation trace
def read_pytorch_snapshot(
    path: str | Path | TraceSource, *, device: int | None = None
) -> AllocTrace:
    """Read a snapshot file into an AllocTrace (``snapshot_to_trace`` of ``read_snapshot``).

    Args:
        path: a pickle or gzipped pickle from ``torch.cuda.memory._dump_snapshot``, or its
            ``TraceSource``, whose content this lets go once parsed (``TraceSource.release``).
        device: which device's trace to read; default: the first device with trace entries.
    """
    src = open_source(path)
    snap = read_snapshot(src, device=device)
    src.release()  # parsed: the decompressed bytes go before the trace's columns are made
    trace = snapshot_to_trace(snap)
    # the parse's columns and copies: freed, but held by the heap until handed back
    release_freed_memory()
    return trace


#: Segment actions that reserve (or fail to): the allocator takes them only while serving a request.
_RESERVING_ACTIONS = ("segment_alloc", "segment_map", "oom")


def snapshot_max_split_size_bytes(settings: dict[str, Any]) -> int | None:
    """The snapshot's ``max_split_size`` in bytes; None when unset (PyTorch reports
    ``SIZE_MAX``)."""
    max_split = settings.get("max_split_size", -1)
    return max_split if isinstance(max_split, int) and 0 < max_split < 1 << 62 else None


def empty_cache_frees(
    actions: list[str], sizes: list[int], max_split_size_bytes: int | None
) -> int:
    """How many segment events, of those between two requests (``actions``/``sizes`` in trace
    order), are the program calling ``empty_cache()``: the run of frees ahead of any reservation
    (0: none). The one rule both ``snapshot_to_trace`` and ``sim.replay.fidelity`` read the call
    with.

    The allocator reserves only while serving a request, so a reservation or an ``oom`` belongs
    to the next request, and frees ahead of it are ``empty_cache()`` (``torch.cuda.graph`` calls
    it before every capture). An out-of-memory retry frees the same segments right before the
    same reservation, so reading it as ``empty_cache`` replays it the same way; the exception kept
    as a retry is ``release_available_cached_blocks``, which with ``max_split_size`` frees only
    segments at least that large: a run of such frees followed by a reservation is not a call.
    """
    n = next((k for k, action in enumerate(actions) if action in _RESERVING_ACTIONS), len(actions))
    if (
        n
        and n < len(actions)
        and max_split_size_bytes is not None
        and all(nbytes >= max_split_size_bytes for nbytes in sizes[:n])
    ):
        return 0
    return n


def empty_cache_points(snap: PyTorchSnapshot) -> list[int]:
    """The requests (indices into ``snap.requests``; ``len`` for the end of the trace) before
    which the program called ``empty_cache()`` (``empty_cache_frees``), in order."""
    req, ev = snap.requests, snap.segment_events
    max_split = snapshot_max_split_size_bytes(snap.allocator_settings)
    points: list[int] = []
    j, num_events, num_requests = 0, len(ev), len(req.entry)
    # a walk over the segment events, a few hundred, not over the 10^6 requests: each run of events
    # lies before the first request whose entry follows them (found by bisection; entries ascend)
    while j < num_events:
        k = bisect_right(req.entry, ev.entry[j])
        end = req.entry[k] if k < num_requests else float("inf")
        start = j
        while j < num_events and ev.entry[j] < end:
            j += 1
        if empty_cache_frees(ev.action[start:j], ev.nbytes[start:j], max_split):
            points.append(k)
    return points


def _tag_codes(req: SnapshotRequests, n_rows: int, pre_rows, req_rows) -> tuple[Any, list[str]]:
    """The trace table's tag column as ``(codes, values)`` (``coded_str_column``): a request's
    tag at its row (``req_rows``), ``"pre-trace"`` at the pre-trace allocations' (``pre_rows``),
    ``""`` at the rest (the empty_cache calls). Only the allocs' tags are looked up (a free's is
    ``""``): ``pd.factorize`` over the few distinct strings, their hashes cached in each str."""
    import numpy as np
    import pandas as pd

    from traces.events import PRE_TRACE_TAG

    values = ["", PRE_TRACE_TAG]
    codes = np.zeros(n_rows, np.int32)
    codes[pre_rows] = 1
    is_alloc = _as_numpy(req.is_alloc, bool)
    if is_alloc.any():
        tags = np.asarray(req.tag, object)[is_alloc]
        found, uniques = pd.factorize(tags)
        req_codes = np.zeros(len(is_alloc), np.int32)
        # -1: no tag (None, as ``make_events`` fills it); a "" or "pre-trace" among the uniques
        # decodes as the one already in ``values``
        req_codes[is_alloc] = np.where(found < 0, 0, found + len(values))
        codes[req_rows] = req_codes
        values += [str(u) for u in uniques]
    return codes, values


def snapshot_to_trace(snap: PyTorchSnapshot) -> AllocTrace:
    """The snapshot's requests as an AllocTrace, pre-trace allocations first at time 0.

    Where the program called ``empty_cache()`` (``empty_cache_points``) the trace has an
    ``empty_cache`` event, at the time of the request that follows it (of the last one at the end).

    ``meta`` keeps what replay compares with: ``segment_events`` (times relative to the first
    entry), ``segments`` (the final table), ``event_addresses`` (each event row's recorded block
    address, -1 for ``empty_cache``: where PyTorch put each block), ``allocator_settings`` and
    the reserved bytes over the trace.

    Raises:
        TraceFormatError: a request or segment event has no integer ``time_us``, or a request's
            is negative. A time that goes back from the entry before is raised to it (counted
            in ``meta["num_time_clamped"]``): a ring buffer's clock jitters, it is no error.
    """
    import numpy as np
    import pandas as pd

    from traces.events import (
        ALLOC_OP,
        EMPTY_CACHE_OP,
        FREE_OP,
        AllocTrace,
        coded_str_column,
        make_events,
    )

    source, req, ev = snap.source, snap.requests, snap.segment_events
    for times, index in ((req.time_us, req.entry), (ev.time_us, ev.entry)):
        if isinstance(times, list) and None in times:  # an array('q') of times has every one
            raise TraceFormatError(
                source,
                index[times.index(None)],
                "trace entry lacks key 'time_us'",
                unit=snap.entry_unit,
            )
    t0 = snap.time_origin_us
    if type(t0) is not int:
        if len(req) or len(ev):
            raise TraceFormatError(
                source,
                0,
                f"time_us {shown(t0, 40)} of the first entry is not an integer",
                unit=snap.entry_unit,
            )
        t0 = 0
    pre_freed = [p for p in snap.pre_trace if p.freed_at is not None]
    pre_live = [p for p in snap.pre_trace if p.freed_at is None]
    pre = pre_freed + pre_live
    n_pre = len(pre)
    next_id = int(np.max(np.asarray(req.alloc_id, np.int64))) + 1 if len(req) else 0
    pre_ids = [req.alloc_id[p.freed_at] for p in pre_freed] + list(
        range(next_id, next_id + len(pre_live))
    )

    # Each column is made once, at its final rows: a request table of 10^6 rows is 8 MB a column,
    # and copies (np.insert per column, an op column of one str object per row) doubled the peak.
    n_req = len(req)
    points = empty_cache_points(snap)
    n_rows = n_pre + n_req + len(points)
    is_call = np.zeros(
        n_rows, bool
    )  # each empty_cache call goes in ahead of its request: rows n_pre + k
    call_at = n_pre + np.asarray(points, np.int64)
    is_call[call_at + np.arange(len(points))] = True
    rows = np.flatnonzero(
        ~is_call
    )  # the table row of each event: pre-trace allocations, then the requests
    pre_rows, req_rows = rows[:n_pre], rows[n_pre:]
    del rows

    def column(pre_values, req_values, call_value, dtype=np.int64) -> np.ndarray:
        out = np.empty(n_rows, dtype)
        out[pre_rows] = np.asarray(pre_values, dtype) if n_pre else 0
        out[req_rows] = _as_numpy(req_values, dtype)
        out[is_call] = call_value
        return out

    t_raw = _as_numpy(req.time_us, np.int64)
    if t_raw.size and int(t_raw.min()) < 0:  # PyTorch's clock counts from 1970: none is < 0
        k = int(np.flatnonzero(t_raw < 0)[0])
        raise TraceFormatError(
            source, req.entry[k], f"time_us {int(t_raw[k])} must be >= 0", unit=snap.entry_unit
        )
    t_rel = t_raw - t0
    del t_raw
    # clocks of a ring-buffered trace are monotonic in practice; clamp rather than reject jitter
    clamped = np.maximum.accumulate(t_rel) if t_rel.size else t_rel
    num_time_clamped = int(np.count_nonzero(clamped != t_rel))
    del t_rel
    time_us = np.zeros(n_rows, np.int64)
    time_us[req_rows] = clamped
    if points:  # a call takes the time of the request it precedes (of the last one at the end)
        time_us[call_at + np.arange(len(points))] = (
            clamped[np.minimum(call_at - n_pre, n_req - 1)] if n_req else 0
        )
    del clamped
    is_alloc = column(np.ones(n_pre, bool), req.is_alloc, False, bool)
    ids = np.empty(n_rows, np.int64)
    ids[~is_call] = _renumber_by_alloc_order(
        np.concatenate([np.asarray(pre_ids, np.int64), _as_numpy(req.alloc_id, np.int64)]),
        np.concatenate([np.ones(n_pre, bool), _as_numpy(req.is_alloc, bool)]),
        next_id + len(pre_live),
    )
    ids[is_call] = -1
    nbytes = column([p.requested_bytes for p in pre], req.nbytes, 0)
    stream = column([p.stream for p in pre], req.stream, 0)
    addresses = column([p.address for p in pre], req.address, -1)
    # op and tag as codes into their few distinct strings: a column of 10^6 str objects costs
    # 0.15 s to convert to the table's string dtype, codes 0.02 s (``coded_str_column``)
    op_codes = np.where(is_alloc, np.int8(0), np.int8(1))
    op_codes[is_call] = 2
    op = coded_str_column(op_codes, [ALLOC_OP, FREE_OP, EMPTY_CACHE_OP])
    del op_codes
    tag_codes, tag_values = _tag_codes(req, n_rows, pre_rows, req_rows)
    tags = coded_str_column(tag_codes, tag_values)
    del tag_codes
    events = make_events(time_us, op, ids, nbytes, stream, tags)

    seg_events = pd.DataFrame(
        list(zip(ev.time_us, ev.action, ev.address, ev.nbytes, ev.stream)),
        columns=["time_us", "action", "addr", "size", "stream"],
    )
    seg_events["time_us"] = seg_events["time_us"].astype(np.int64) - t0
    seg_table = pd.DataFrame(
        [
            (
                s.address,
                s.total_bytes,
                s.allocated_bytes,
                s.stream,
                s.segment_type or "",
                s.is_expandable,
            )
            for s in snap.segments_at_end
        ],
        columns=[
            "address",
            "total_size",
            "allocated_size",
            "stream",
            "segment_type",
            "is_expandable",
        ],
    )
    reserved_end = int(seg_table["total_size"].sum()) if len(seg_table) else 0
    sign = seg_events["action"].map(RESERVED_SIGN).fillna(0).to_numpy(np.int64)
    delta = sign * seg_events["size"].to_numpy(np.int64)
    reserved = reserved_end - int(delta.sum()) + np.concatenate([[0], np.cumsum(delta)])
    meta = {
        "device": snap.device,
        "free_action": snap.free_action,
        "time_origin_us": t0,
        "num_pre_trace_freed": len(pre_freed),
        "num_pre_trace_live": len(pre_live),
        "num_oom": int((seg_events["action"] == "oom").sum()),
        "num_time_clamped": num_time_clamped,
        "ignored_actions": snap.ignored_actions,
        "stream_handles": dict(snap.stream_handles),
        "segment_events": seg_events,
        "segments": seg_table,
        "allocator_settings": snap.allocator_settings,
        # per event row: its block's recorded address (-1: empty_cache)
        "event_addresses": addresses,
        # reserved bytes over the trace, rebuilt backwards from the final segment table
        "recorded_peak_reserved_bytes": int(reserved.max()),
        "recorded_reserved_end_bytes": reserved_end,
    }
    return AllocTrace(events, name=snap.name, source=source, format=SNAPSHOT_FORMAT, meta=meta)


# -- number checks: every size, address and time becomes int64 downstream ----------------------
_INT64_LIMIT = 2**63


def _bad_entry_numbers(action: str, addr: Any, size: Any) -> str:
    """Why an entry's size or address cannot be one (the entry failed the inline check)."""
    if type(addr) is not int or not 0 <= addr < _INT64_LIMIT:
        return f"{action} at address {shown(addr, 40)}: must be an integer >= 0 and < 2**63"
    return f"{action} of size {shown(size, 40)}: must be a whole number of bytes > 0 and < 2**63"


#: Largest segment (or mapping) a snapshot may hold: 2**49 bytes, the 49-bit virtual address
#: space of a GPU; a device has far less memory than that.
MAX_SEGMENT_BYTES = 1 << 49
#: Most devices a snapshot may name (a device index is a small whole number).
_MAX_DEVICES = 1 << 16


def _check_address(addr: Any) -> None:
    """ValueError unless ``addr`` is an address: a whole number >= 0 and < 2**63 (int64
    downstream)."""
    if type(addr) is not int or not 0 <= addr < _INT64_LIMIT:
        raise ValueError(f"address {shown(addr, 40)} is not a whole number >= 0 and < 2**63")


def _new_stream(streams: dict[Any, int], handle: Any) -> int:
    """The small int of a stream handle met for the first time (a handle is a whole number, as
    CUDA's are)."""
    if type(handle) is not int or not -_INT64_LIMIT <= handle < 2 * _INT64_LIMIT:
        raise ValueError(f"stream {shown(handle, 40)} is not a stream handle (a whole number)")
    streams[handle] = len(streams)
    return streams[handle]


def _bad_time(value: Any) -> bool:
    return type(value) is not int or not -_INT64_LIMIT <= value < _INT64_LIMIT


def _check_segment_numbers(seg: dict, *, is_oom: bool = False) -> None:
    """ValueError unless the sizes of a segment (or segment event) and its blocks are byte counts,
    a segment's at most ``MAX_SEGMENT_BYTES`` (an ``oom`` entry's size is what the program asked
    for)."""
    sizes = [seg.get(k, 0) for k in ("size", "total_size", "allocated_size")]
    sizes += [b.get("size", 0) for b in seg.get("blocks", ()) if isinstance(b, dict)]
    bad = next((v for v in sizes if type(v) is not int or not 0 <= v < _INT64_LIMIT), None)
    if bad is not None:
        raise ValueError(f"size {shown(bad, 40)} is not a whole number of bytes below 2**63")
    if not is_oom and max(sizes) > MAX_SEGMENT_BYTES:
        raise ValueError(
            f"size {max(sizes):,} is more than a GPU's whole virtual address space "
            f"({MAX_SEGMENT_BYTES:,} bytes)"
        )


def _as_numpy(values: Sequence, dtype) -> np.ndarray:
    """A request column as NumPy: an ``array`` is read in place (no copy), a list converted."""
    import numpy as np

    if isinstance(values, array):
        out = (
            np.frombuffer(values, np.int8 if values.typecode == "b" else np.int64)
            if len(values)
            else np.zeros(0, np.int64)
        )
        return out.astype(dtype, copy=False)
    return np.asarray(values, dtype)


def _renumber_by_alloc_order(ids: np.ndarray, is_alloc: np.ndarray, num_ids: int) -> np.ndarray:
    """Ids ``0..n-1`` in the order the allocations appear in the table (ids are dense already)."""
    import numpy as np

    new = np.empty(num_ids, np.int64)
    alloc_ids = ids[is_alloc]
    assert alloc_ids.size == num_ids, "every id is allocated exactly once"
    new[alloc_ids] = np.arange(num_ids)
    return new[ids]
