"""Read a PyTorch snapshot in a child process while this process does other work (issue 33).

``poollab replay`` of a large snapshot starts with two independent pieces of work: importing what
the replay needs (pandas, the policies, the replay engine: 0.5 s on the dev container, 0.65 s
wall on the H200 host) and parsing the snapshot (gunzip, the streamed unpickle and the per-entry
parse of ``traces.pytorch_snapshot``: 2-3 s for a million events). The parse needs the standard
library only, so ``start_read`` starts a child that runs it (``read_snapshot``) while the caller
imports; ``ReadAhead.result()`` takes the parsed snapshot back through a pipe and makes the trace
table here (``snapshot_to_trace``, numpy and pandas). The trace is the one
``traces.read_alloc_trace`` returns: the same parse and the same table, only in two processes.

The child is a fresh interpreter (``sys.executable -I -S``, started by ``subprocess``, which
``exec``s at once), not a fork of this process: a fork copies whatever lock another thread holds
at that instant (CI's test process, a notebook, a library's pool all have threads), and Python
3.12 warns on it. The fresh interpreter imports only the parse's modules, found where this
process found them (the ``traces`` package's parent folder is the child's first path entry;
``-I -S``: no environment variables, user or site paths, no ``site`` start-up): ~0.05 s of CPU
before the parse starts.

The child runs only where it can pay and cannot change the outcome: a regular file of at least
``MIN_READ_AHEAD_BYTES`` whose content opens a pickle (plain or gzipped), no format given or the
built-in ``pytorch-snapshot``, and a known interpreter (``sys.executable``). Whenever it does not
run, or it fails in any way (a malformed snapshot included, or it could not be started), or a
third party has replaced the built-in snapshot format by the time of ``result()``, ``result()``
reads in this process with ``traces.read_alloc_trace``: the errors raised are the ones the plain
read raises, file and entry named as always.

Why the replay's jobs wait for the whole read (issue 33; session 22's study, measured in
``benchmarks/RESULTS.md``): on a many-core host the lever that looked left was to replay while
the read goes on, each parsed batch handed to the workers through shared memory. But a run's
first events and its parameters depend on the file's last entries, so no worker can start before
the read ends and give the results it gives today:

- the table's first rows are the pre-trace allocations (``snapshot_to_trace``): blocks of the
  final segment table that no entry touches (149 in the million-event snapshot), known after the
  last entry, and frees of never-seen addresses, which may come anywhere;
- a run's sampling follows its event count, which a pickled list does not say ahead: the
  monitor's stride (``default_sample_every``) picks the samples that ``frag_ext_mean``,
  ``frag_ext_max`` and ``internal_waste_frac`` average, the share of timed calls (20,000 / n) the
  latency mask;
- ``allocator_settings`` follows ``device_traces`` in PyTorch's pickle, and its
  ``max_split_size`` decides which segment frees are ``empty_cache`` calls (rows of the table);
  which action closes an allocation (``free_completed`` or ``free_requested``) is known at the
  end too (``parser.assumed``: a second pass);
- the bounds job's planner is offline: it needs every lifetime (``planner="auto"`` chooses from
  all of them), so it starts after the read whatever the policies do.

So a perfect overlap of the five policies would still leave read + serial phases + bounds on the
critical path (on the H200 host 3.5-3.75 + 0.34-0.37 + 1.8-2.1 s, against today's read + serial
phases + longest job, 6.6-7.0 s), and it would need speculation (guess the count and the
pre-trace rows, replay, check at the end, replay again on a miss) or monitoring at every event to
stay identical. What remains is the read itself: of its main thread's 1.5-1.65 s on dev (the
million-event snapshot), the C unpickle is about 0.65 s and the per-entry parse
(``traces.pytorch_snapshot._EntryParser.feed``) was 0.85-0.9 s (0.7-0.75 s since its batches go
through lists): the parse, pure Python, is the part to cut. Shipping the unpickled batches to a
second, parsing process costs more than it saves (pickling or marshalling them takes 0.7-0.8 s,
loading them back 2.5-3 s).
"""

from __future__ import annotations

import os
import pickle
import stat
import sys
import time
import zlib
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traces.source import GZIP_MAGIC

if TYPE_CHECKING:
    import subprocess

    from traces.events import AllocTrace

__all__ = ["ReadAhead", "start_read", "MIN_READ_AHEAD_BYTES"]

#: Smallest file read ahead: below it the read takes well under the child's start and the pipe.
MIN_READ_AHEAD_BYTES = 1 << 20
#: Raw bytes of a gzipped file decompressed to see whether it holds a pickle.
_SNIFF_RAW_BYTES = 4096
#: What the child interpreter runs: ``argv`` = [the folder holding ``traces``, the pipe's file
#: descriptor, the parent's ``perf_counter`` at the start, the path, the device ("" for none),
#: the format ("" for none)].
_CHILD_CODE = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from traces.read_ahead import _child_main; _child_main(sys.argv[2:])"
)


def start_read(
    path: str | Path, *, format: str | None = None, device: int | None = None
) -> "ReadAhead":
    """Start reading ``path`` (``traces.read_alloc_trace(path, format=, device=)``) in a child
    where it pays (the module docstring); ``result()`` of the returned object is that trace."""
    return ReadAhead(path, format=format, device=device)


class ReadAhead:
    """One allocation-trace read, running in a child process or left for ``result()``.

    Attributes:
        child_cpu_s: CPU seconds of the child's main thread: its interpreter's start-up, the
            unpickle and the parse, the read's critical path where the decompression thread has
            a core of its own (None until ``result()`` took a parsed snapshot from the child).
        child_all_cpu_s: the child's CPU seconds, every thread (the decompression's included).
        child_wall_s: seconds from the child's start to its parsed snapshot (monotonic clock).
        ran_in_child: whether ``result()``'s trace came from the child's parse.

    Use as a context manager (or call ``close``) so that a child whose result is never taken
    (the caller failed first) is stopped. Safe with other threads alive in this process.
    """

    def __init__(self, path: str | Path, *, format: str | None = None, device: int | None = None):
        self.path, self.format, self.device = path, format, device
        self.child_cpu_s: float | None = None
        self.child_all_cpu_s: float | None = None
        self.child_wall_s: float | None = None
        self.ran_in_child = False
        self._proc: "subprocess.Popen | None" = None
        self._fd: int | None = None
        if _worth_a_child(path, format):
            self._start()

    @property
    def started(self) -> bool:
        """Whether a child is reading (or has read) the file and is not yet reaped."""
        return self._proc is not None

    def _start(self) -> None:
        import subprocess

        import traces

        package_parent = Path(traces.__file__).resolve().parent.parent
        r, w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    _CHILD_CODE,
                    str(package_parent),
                    str(w),
                    repr(time.perf_counter()),  # CLOCK_MONOTONIC: one clock for every process
                    os.fsdecode(self.path),
                    "" if self.device is None else str(self.device),
                    self.format or "",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # a failure is told by the read in this process
                pass_fds=(w,),
            )
        except (OSError, ValueError, subprocess.SubprocessError):  # none started: result() reads
            os.close(r)
            return
        finally:
            os.close(w)
        self._fd = r

    def result(self) -> "AllocTrace":
        """The trace, as ``traces.read_alloc_trace(path, format=, device=)`` reads it.

        Raises:
            TraceFormatError: the file is malformed (raised by the read in this process).
        """
        snap = self._take()
        if snap is not None and _builtin_snapshot_format():
            from traces.pytorch_snapshot import snapshot_to_trace
            from traces.snapshot_stream import release_freed_memory

            trace = snapshot_to_trace(snap)
            del snap
            release_freed_memory()  # as ``read_pytorch_snapshot`` does: the parse's columns
            self.ran_in_child = True
            return trace
        from traces.detect import read_alloc_trace

        return read_alloc_trace(self.path, format=self.format, device=self.device)

    def _take(self) -> Any:
        """The child's parsed snapshot (None: no child, or it found no snapshot or failed)."""
        if self._fd is None:
            return None
        snap = None
        try:
            with os.fdopen(self._fd, "rb", buffering=1 << 20) as pipe:
                self._fd = None
                got = pickle.load(pipe)  # our own child's, of our own classes
                if isinstance(got, tuple) and len(got) == 5 and got[0] is not None:
                    snap = _with_raw_columns(got[0], got[4], pipe)
                    self.child_cpu_s, self.child_all_cpu_s, self.child_wall_s = got[1:4]
        except Exception:  # noqa: BLE001 (the child died mid-way: the read in this process tells)
            snap = None
        finally:
            self._reap()
        return snap

    def close(self) -> None:
        """Stop the child if its result was not taken (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self._proc is not None:
                self._proc.kill()  # a no-op once it has exited
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _worth_a_child(path: Any, format: str | None) -> bool:
    """Whether to read ``path`` in a child: see the module docstring."""
    from traces.pytorch_snapshot import SNAPSHOT_FORMAT, is_pickle_head

    if format not in (None, SNAPSHOT_FORMAT) or not isinstance(path, (str, os.PathLike)):
        return False
    if not sys.executable:  # an embedding interpreter: no child to start
        return False
    try:
        st = os.stat(path)  # before any open: opening a FIFO would wait for its writer
        if not stat.S_ISREG(st.st_mode) or st.st_size < MIN_READ_AHEAD_BYTES:
            return False
        with open(path, "rb") as f:
            head = f.read(_SNIFF_RAW_BYTES)
    except OSError:  # the read in this process reports it
        return False
    if head[:2] == GZIP_MAGIC:
        try:
            head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, 2)
        except zlib.error:
            return False
    return is_pickle_head(head[:2])


def _child_main(argv: list[str]) -> None:
    """In the child: ``read_snapshot(path)``, the main thread's CPU seconds, all threads' CPU
    seconds and the wall seconds since the start sent into the pipe ``argv[0]`` (``_send``;
    ``_CHILD_CODE`` names the fields); ``None`` for the snapshot when the content is none or the
    parse fails (the parent reads again, and raises).

    A gzipped file is read with its decompression in a thread ahead of the parse
    (``read_snapshot_overlapped``); wherever that gives no snapshot, or fails, the plain
    ``read_snapshot`` reads it here.
    """
    fd, started_s, path, device = int(argv[0]), float(argv[1]), argv[2], argv[3]
    format = argv[4] or None
    with os.fdopen(fd, "wb", buffering=1 << 20) as pipe:
        snap = None
        try:
            from traces.pytorch_snapshot import (
                is_pickle_head,
                read_snapshot,
                read_snapshot_overlapped,
            )
            from traces.source import open_source

            dev = int(device) if device else None
            try:
                snap = read_snapshot_overlapped(path, device=dev)
            except Exception:  # noqa: BLE001 (the plain read below raises it, or reads)
                snap = None
            if snap is None:
                src = open_source(path)
                if format is None and not is_pickle_head(src.head(2)):
                    snap = None
                else:
                    snap = read_snapshot(src, device=dev)
                del src
        except Exception:  # noqa: BLE001 (any failure: the parent's own read raises it)
            snap = None
        # process_time and thread_time count from the interpreter's start: the start-up is the
        # child's cost too
        times = (time.thread_time(), time.process_time(), time.perf_counter() - started_s)
        _send(pipe, snap, times)


def _send(pipe: Any, snap: Any, times: tuple[float, float, float]) -> None:
    """In the child: ``(snapshot, main thread's CPU s, all threads' CPU s, wall s, raw)`` pickled
    into ``pipe``, the snapshot without its ``array`` request columns, which follow the pickle as
    their raw bytes in ``raw``'s order (``raw``: ``(field, typecode, length)`` each).

    Pickling a column copies it twice in the child (``tobytes``, the pickle's frame) and
    unpickling twice more in the parent (50 MB for a million-event snapshot; the pickle's dump
    and load were 0.2 s of the replay's critical path on dev), against one copy into the pipe and
    one out of it, straight into the NumPy array the parent makes (``_with_raw_columns``).
    """
    raw: tuple[tuple[str, str, int], ...] = ()
    if snap is not None:
        from dataclasses import fields, replace

        req = snap.requests
        raw = tuple(
            (f.name, col.typecode, len(col))
            for f in fields(req)
            if isinstance(col := getattr(req, f.name), array)
        )
        light = replace(req, **{name: None for name, _, _ in raw})
        pickle.dump(
            (replace(snap, requests=light), *times, raw), pipe, protocol=pickle.HIGHEST_PROTOCOL
        )
        for name, _, _ in raw:
            pipe.write(memoryview(getattr(req, name)).cast("B"))
        return
    pickle.dump((None, *times, raw), pipe, protocol=pickle.HIGHEST_PROTOCOL)


def _with_raw_columns(snap: Any, raw: tuple[tuple[str, str, int], ...], pipe: Any) -> Any:
    """Here: ``snap`` with the request columns ``raw`` names read from ``pipe`` as NumPy arrays
    of the same type (``snapshot_to_trace`` takes any sequence; an ``array`` it read in place).

    Raises:
        EOFError: the pipe ended before the last column's last byte (the child died).
    """
    if not raw:
        return snap
    from dataclasses import replace

    import numpy as np

    columns = {}
    for name, typecode, length in raw:
        out = np.empty(length, np.dtype(typecode))  # "q": int64, "b": int8, as in ``array``
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            got = pipe.readinto(view[done:])
            if not got:
                raise EOFError(f"request column {name}: {done} of {len(view)} bytes")
            done += got
        columns[name] = out
    return replace(snap, requests=replace(snap.requests, **columns))


def _builtin_snapshot_format() -> bool:
    """Whether the format registry still reads a pickle as the built-in snapshot reader would."""
    from traces.formats import ALLOC
    from traces.pytorch_snapshot import SNAPSHOT_FORMAT

    if not ALLOC._loaded:  # nothing registered yet (a registration loads the built-ins first)
        return True  # and ``traces.detect`` (pyarrow's parquet and csv readers) is not needed
    from traces import detect

    try:
        fmt = ALLOC.get(SNAPSHOT_FORMAT)
    except Exception:  # noqa: BLE001 (unregistered)
        return False
    return (
        ALLOC.names()[0] == SNAPSHOT_FORMAT
        and fmt.sniff is detect.sniff_snapshot
        and fmt.read is detect.read_snapshot_format
    )
