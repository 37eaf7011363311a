"""A trace file's bytes: any path (regular file, pipe, FIFO, ``<(...)``, gzip) read once, under a
size limit.

Every reader and every format sniffer takes its bytes from ``open_source``, so detection and
reading see the same bytes, a pipe is read only once (detection used to eat its first 4 KiB), and
no file is parsed past the limits:

- ``POOLLAB_MAX_TRACE_BYTES`` (default ``DEFAULT_MAX_TRACE_BYTES``, 1 GiB) bounds the bytes of
  the file and, for gzip, the bytes it decompresses to. A larger file is refused before it is
  read (its size is known for a regular file), a stream or a gzip bomb as soon as it passes the
  limit; the error names the limit and the variable that raises it.
- ``POOLLAB_STREAM_TIMEOUT_S`` (default ``DEFAULT_STREAM_TIMEOUT_S``) bounds how long a pipe or
  FIFO may go without sending a byte (a FIFO that nobody opens for writing would block forever).

Settings files (a calibration, a cost model, a model or GPU JSON, SWEEP.yaml) are read the same
way, whole and once, by ``read_settings_bytes``, under ``MAX_SETTINGS_BYTES``: a FIFO or
``/dev/stdin`` works, ``/dev/zero`` or a 200 MB file is refused, never read forever.

A pipe or FIFO can be read only once; a second ``open_source`` of the same stream in the same
process (the command line detects the format, then reads, then looks for a hint of the other
kind of trace) gets the bytes of the first. A damaged gzip stream is not an error here: the
source keeps the bytes that decompressed, so a sniffer can still tell the format, and the reader
calls ``require_intact`` before it trusts them.
"""

from __future__ import annotations

import io
import math
import os
import select
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path

from traces.errors import TraceFormatError

__all__ = [
    "TraceSource",
    "open_source",
    "read_settings_bytes",
    "MAX_SETTINGS_BYTES",
    "max_trace_bytes",
    "stream_timeout_s",
    "GZIP_MAGIC",
    "MAX_TRACE_BYTES_ENV",
    "STREAM_TIMEOUT_ENV",
    "DEFAULT_MAX_TRACE_BYTES",
    "DEFAULT_STREAM_TIMEOUT_S",
    "trace_name",
    "inflate_pieces",
    "ThreadedInflate",
]

GZIP_MAGIC = b"\x1f\x8b"
MAX_TRACE_BYTES_ENV = "POOLLAB_MAX_TRACE_BYTES"
STREAM_TIMEOUT_ENV = "POOLLAB_STREAM_TIMEOUT_S"
#: Largest trace, in file bytes and in decompressed bytes: a real trace of 10^7 events is well
#: below it, and parsing takes a few times this much memory.
DEFAULT_MAX_TRACE_BYTES = 1 << 30
#: Longest wait for the next byte of a pipe or FIFO.
DEFAULT_STREAM_TIMEOUT_S = 60.0
_CHUNK_BYTES = 1 << 24
#: Largest settings file: the largest real one (a fitted calibration) is a few KiB, so a file
#: past this is no settings file (``/dev/zero``, a trace given by mistake), not one to read.
MAX_SETTINGS_BYTES = 16 << 20
#: Streams already read in this process, by (path, device, inode): a pipe cannot be read twice.
_STREAMS: dict[tuple[str, int, int], "TraceSource"] = {}


@dataclass(frozen=True, eq=False)
class TraceSource:
    """The content of one trace file, read once.

    Attributes:
        path: the path as given (errors name it).
        data: the content; decompressed when the file is gzip.
        gzipped: the file was gzip (its first bytes are the gzip magic, whatever its name says).
        damage: why a gzip stream stopped early (truncated, corrupt); ``data`` then holds what
            decompressed before. None for an intact file.
        is_stream: the path is a pipe, FIFO or device rather than a regular file.
        released: ``release`` let the content go (``data`` is empty; ``reopened`` reads again).
    """

    path: Path
    data: bytes
    gzipped: bool = False
    damage: str | None = None
    is_stream: bool = False
    released: bool = False  # ``release`` let ``data`` go: ``reopened`` reads the file again

    def __str__(self) -> str:
        return str(self.path)

    def head(self, num_bytes: int) -> bytes:
        """The first ``num_bytes`` bytes (of the decompressed content)."""
        return self.data[:num_bytes]

    def stream(self) -> io.BytesIO:
        """A fresh binary file object over the content (shares the bytes, copies nothing)."""
        return io.BytesIO(self.data)

    def release(self) -> None:
        """Let the content go: for a reader that has parsed all it needs and builds large tables
        next (the million-event snapshot's 104 MB would otherwise stay resident while its trace
        table is made). Later reads see an empty file. A stream's source is kept as it is: it is
        the only copy a second reader of the same pipe gets (``open_source``)."""
        if not self.is_stream:
            object.__setattr__(self, "data", b"")
            object.__setattr__(self, "released", True)

    def reopened(self) -> "TraceSource":
        """This source, or once released the file read again (``open_source`` of its path)."""
        return open_source(self.path) if self.released else self

    def require_intact(self) -> None:
        """TraceFormatError naming the file when its gzip stream is damaged."""
        if self.damage is not None:
            raise TraceFormatError(self.path, None, self.damage)


def open_source(
    path: str | Path | TraceSource,
    *,
    max_bytes: int | None = None,
    timeout_s: float | None = None,
    _limit_note: str | None = None,
) -> TraceSource:
    """Read ``path`` once, whole, under the limits (see the module docstring); a source is returned
    as is.

    Args:
        path: a regular file, pipe, FIFO, character device or a ``TraceSource``.
        max_bytes: most bytes of the file and of its decompressed content; default
            ``max_trace_bytes()``.
        timeout_s: longest wait for the next byte of a stream; default ``stream_timeout_s()``.
        _limit_note: what the too-large error says of the limit (``read_settings_bytes``);
            default: the limit on a trace and the variable that raises it.

    Raises:
        TraceFormatError: over a limit, or a stream that sent nothing for ``timeout_s``.
        OSError: the path cannot be opened (missing, a folder, no permission).
    """
    if isinstance(path, TraceSource):
        return path
    path = Path(path)
    limit = max_trace_bytes(path) if max_bytes is None else max_bytes
    note = _limit_note
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if stat.S_ISREG(st.st_mode):
            if st.st_size > limit:
                raise _too_big(path, f"is {st.st_size:,} bytes", limit, note)
            os.set_blocking(fd, True)
            raw = _read_regular(fd, st.st_size, limit, path, note)
            is_stream = False
        else:
            key = (str(path), st.st_dev, st.st_ino)
            if key in _STREAMS:
                return _STREAMS[key]
            raw = _read_stream(
                fd, limit, stream_timeout_s(path) if timeout_s is None else timeout_s, path, note
            )
            is_stream = True
    finally:
        os.close(fd)
    source = TraceSource(path, raw, is_stream=is_stream)
    if raw[:2] == GZIP_MAGIC:
        data, damage = _gunzip(raw, limit, path, note)
        source = TraceSource(path, data, gzipped=True, damage=damage, is_stream=is_stream)
    if is_stream:
        _STREAMS[key] = source
    return source


def read_settings_bytes(path: str | Path) -> bytes:
    """The whole content of a settings file (JSON or YAML: a calibration, a cost model, a model or
    GPU preset file, SWEEP.yaml), read once: a regular file, a pipe, a FIFO or ``/dev/stdin``
    alike (a gzip file decompressed), at most ``MAX_SETTINGS_BYTES``.

    Its caller parses the bytes and passes the result on; nothing opens the path again (a FIFO
    opened a second time waits for a writer that never comes).

    Raises:
        TraceFormatError: over the limit, a damaged gzip stream, or a stream that sent nothing
            for ``stream_timeout_s()``.
        OSError: the path cannot be opened (missing, a folder, no permission).
    """
    note = (
        "on a settings file (calibration, costs, model, GPU or sweep file: a few KiB each); "
        "is it the right file?"
    )
    source = open_source(path, max_bytes=MAX_SETTINGS_BYTES, _limit_note=note)
    source.require_intact()
    return source.data


def max_trace_bytes(path: str | Path = "") -> int:
    """The byte limit on a trace: ``POOLLAB_MAX_TRACE_BYTES`` when set, else
    ``DEFAULT_MAX_TRACE_BYTES``."""
    text = os.environ.get(MAX_TRACE_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_TRACE_BYTES
    if not text.isdigit() or len(text) > 19 or int(text) < 1:
        raise TraceFormatError(
            path, None, f"{MAX_TRACE_BYTES_ENV}={text[:40]!r} is not a whole number of bytes >= 1"
        )
    return int(text)


def stream_timeout_s(path: str | Path = "") -> float:
    """The wait limit for a stream's next byte: ``POOLLAB_STREAM_TIMEOUT_S`` when set, else the
    default."""
    text = os.environ.get(STREAM_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_STREAM_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < 1e6):
        raise TraceFormatError(
            path,
            None,
            f"{STREAM_TIMEOUT_ENV}={text[:40]!r} is not a number of seconds > 0 and < 1e6",
        )
    return value


def _too_big(path: Path, what: str, limit: int, note: str | None = None) -> TraceFormatError:
    note = note or f"on a trace; set {MAX_TRACE_BYTES_ENV} to a larger byte count to read it"
    return TraceFormatError(path, None, f"{what}, more than the limit of {limit:,} bytes {note}")


def _read_regular(fd: int, size_bytes: int, limit: int, path: Path, note: str | None) -> bytes:
    with os.fdopen(fd, "rb", closefd=False, buffering=0) as f:
        data = f.read(
            size_bytes + 1
        )  # one read of the known size; a file that grows meanwhile reads on
        if len(data) <= size_bytes:
            return data
        parts = [data]
        total = len(data)
        while total <= limit:
            chunk = f.read(_CHUNK_BYTES)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            total += len(chunk)
    parts.clear()  # the traceback keeps this frame alive: let the bytes go now
    raise _too_big(path, "grew while it was read", limit, note)


def _read_stream(fd: int, limit: int, timeout_s: float, path: Path, note: str | None) -> bytes:
    """All of a pipe or FIFO (opened non-blocking): poll, then read what is there, until end of
    file."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    parts: list[bytes] = []
    total = 0
    while True:
        if not poller.poll(timeout_s * 1000):
            raise TraceFormatError(
                path,
                None,
                f"no data for {timeout_s:g} s (a pipe or FIFO that nobody writes to?); "
                f"set {STREAM_TIMEOUT_ENV} to wait longer",
            )
        try:
            chunk = os.read(fd, _CHUNK_BYTES)
        except BlockingIOError:
            continue
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            parts.clear()  # the traceback keeps this frame alive: let the bytes go now
            raise _too_big(path, "the stream sends more bytes", limit, note)


def _gunzip(raw: bytes, limit: int, path: Path, note: str | None) -> tuple[bytes, str | None]:
    """Decompress every gzip member of ``raw`` under ``limit`` output bytes: ``(data, damage)``
    (``inflate_pieces``'s pieces and damage).

    The pieces go into one growing buffer that becomes the result without a copy
    (``BytesIO.getvalue``): a list of pieces joined at the end held the content twice at its peak
    (208 MB for a 104 MB snapshot).
    """
    out = io.BytesIO()
    pieces = inflate_pieces(raw, limit, path, note=note)
    try:
        while True:
            out.write(next(pieces))
    except StopIteration as end:
        return out.getvalue(), end.value
    except TraceFormatError:
        out = None  # the traceback keeps this frame alive: let the bytes go now
        raise


def inflate_pieces(
    raw: bytes, limit: int, path: Path, piece_bytes: int = _CHUNK_BYTES, note: str | None = None
):
    """A generator of the decompressed pieces (at most ``piece_bytes`` each) of every gzip member
    of ``raw``; it returns the damage (``StopIteration.value``): None for an intact stream.

    As the ``gzip`` module does, members follow one another and zero bytes may pad the end; a
    truncated or corrupt member ends the pieces there with the damage saying why.

    Raises:
        TraceFormatError: the content passes ``limit`` bytes.
    """
    total = 0
    rest = raw
    while True:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        chunk = rest
        try:
            while chunk and not d.eof:
                # in steps: one call asked for the whole limit grows its buffer to a multiple of it
                piece = d.decompress(chunk, min(limit + 1 - total, piece_bytes))
                total += len(piece)
                if total > limit:
                    del piece
                    raise _too_big(path, "decompresses to more bytes", limit, note)
                yield piece
                del piece
                chunk = d.unconsumed_tail
        except zlib.error as exc:
            return f"truncated or corrupt gzip stream ({exc})"
        if not d.eof:
            return "truncated gzip stream (it ends before its end-of-stream marker)"
        rest = d.unused_data
        if not rest.strip(b"\0"):
            return None
        if rest[:2] != GZIP_MAGIC:
            return "corrupt gzip stream (bytes after its end that are not another gzip member)"


class ThreadedInflate:
    """``inflate_pieces`` run in a thread, its pieces taken in order by iterating this object:
    zlib lets go of the GIL while it inflates, so the decompression runs beside the caller's
    Python (a read that unpickles each piece as it comes, ``traces.read_ahead``'s child).

    ``outcome()`` waits for the thread and returns the damage (None: intact), or raises what
    ``inflate_pieces`` raised; ``cancel()`` stops it after the piece it is on.
    """

    def __init__(self, raw: bytes, limit: int, path: Path, piece_bytes: int = _CHUNK_BYTES):
        import queue
        import threading

        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._cancelled = False
        self._outcome: tuple[str | None, BaseException | None] | None = None
        self._thread = threading.Thread(
            target=self._run, args=(raw, limit, path, piece_bytes), daemon=True
        )
        self._thread.start()

    def _run(self, raw: bytes, limit: int, path: Path, piece_bytes: int) -> None:
        pieces = inflate_pieces(raw, limit, path, piece_bytes)
        del raw
        outcome: tuple[str | None, BaseException | None]
        try:
            while not self._cancelled:
                self._queue.put(next(pieces))
            outcome = ("cancelled", None)
        except StopIteration as end:
            outcome = (end.value, None)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller by ``outcome``)
            outcome = (None, exc)
        self._outcome = outcome
        self._queue.put(None)  # the end

    def __iter__(self):
        get = self._queue.get
        while (piece := get()) is not None:
            yield piece

    def outcome(self) -> str | None:
        self._thread.join()
        damage, error = self._outcome
        if error is not None:
            raise error
        return damage

    def cancel(self) -> None:
        self._cancelled = True


def trace_name(path: "str | Path", suffixes: tuple[str, ...]) -> str:
    """A trace's short name for reports: the file name without its data suffixes (``x.csv.gz ->
    x``)."""
    name = Path(path).name
    for suffix in (".gz",) + suffixes:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or Path(path).name
