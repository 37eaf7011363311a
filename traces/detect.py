"""Which reader a file needs, told from its first bytes (the name may lie), and the one entry point.

=================  ===========================================================================
format             recognised by
=================  ===========================================================================
pytorch-snapshot   a pickle (``0x80`` protocol opcode), plain or inside gzip (``1f 8b``)
rmm-log            first line ``Thread,Time,Action,Pointer,Size,Stream`` (plain or gzipped)
csv                first line starting with ``time_us,op,alloc_id,nbytes,stream,tag``
parquet            the ``PAR1`` magic
=================  ===========================================================================
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

from traces.alloc_table import CSV_FORMAT, PARQUET_FORMAT, read_table_csv, read_table_parquet
from traces.errors import TraceFormatError
from traces.events import EVENT_COLUMNS, AllocTrace
from traces.pytorch_snapshot import SNAPSHOT_FORMAT, read_pytorch_snapshot
from traces.rmm_log import RMM_FORMAT, RMM_HEADER, read_rmm_log

__all__ = ["ALLOC_FORMATS", "detect_alloc_format", "read_alloc_trace"]

ALLOC_FORMATS = (SNAPSHOT_FORMAT, RMM_FORMAT, CSV_FORMAT, PARQUET_FORMAT)
_HEAD_BYTES = 4096


def detect_alloc_format(path: str | Path) -> str:
    """The format of an allocation-trace file, from its content.

    Raises:
        TraceFormatError: the content matches none of ``ALLOC_FORMATS``.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(_HEAD_BYTES)
    if not head:
        raise TraceFormatError(path, None, "empty file")
    if head[:4] == b"PAR1":
        return PARQUET_FORMAT
    if head[:2] == b"\x1f\x8b":
        try:
            with gzip.open(path, "rb") as f:
                head = f.read(_HEAD_BYTES)
        except (OSError, EOFError, zlib.error) as exc:
            # a truncated gzip still shows its first bytes; the reader reports the damage
            head = _partial_gunzip(path)
            if not head:
                raise TraceFormatError(path, None, f"corrupt gzip stream ({exc})") from None
        if not head:
            raise TraceFormatError(path, None, "gzip stream holds nothing")
    if _is_pickle(head):
        return SNAPSHOT_FORMAT
    first = head.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8-sig", errors="replace")
    fields = [c.strip() for c in first.split(",")]
    if fields == RMM_HEADER:
        return RMM_FORMAT
    if fields[: len(EVENT_COLUMNS)] == EVENT_COLUMNS:
        return CSV_FORMAT
    raise TraceFormatError(path, 1, f"cannot tell the format from the first line {first[:80]!r}: expected a PyTorch "
                                    f"snapshot pickle, an RMM log ({','.join(RMM_HEADER)}), our CSV "
                                    f"({','.join(EVENT_COLUMNS)}) or Parquet")


def read_alloc_trace(path: str | Path, *, format: str | None = None, device: int | None = None,
                     lenient: bool = False) -> AllocTrace:
    """Read an allocation trace of any supported format.

    Args:
        path: the file.
        format: one of ``ALLOC_FORMATS``; None detects it from the content.
        device: PyTorch snapshots only: which device's trace (default: the one with events).
        lenient: RMM logs only: drop frees of pointers that are not live instead of raising.

    Raises:
        TraceFormatError: the file is malformed (names the file, line or record, and why).
    """
    path = Path(path)
    fmt = detect_alloc_format(path) if format is None else format
    if fmt == SNAPSHOT_FORMAT:
        return read_pytorch_snapshot(path, device=device)
    if fmt == RMM_FORMAT:
        return read_rmm_log(path, lenient=lenient)
    if fmt == CSV_FORMAT:
        return read_table_csv(path)
    if fmt == PARQUET_FORMAT:
        return read_table_parquet(path)
    raise TraceFormatError(path, None, f"unknown format {fmt!r}; choose one of {', '.join(ALLOC_FORMATS)}")


def _is_pickle(head: bytes) -> bool:
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5  # PROTO opcode, protocols 2-5


def _partial_gunzip(path: Path) -> bytes:
    """As many leading bytes of a damaged gzip file as decompress."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        with open(path, "rb") as f:
            return d.decompress(f.read(1 << 16), _HEAD_BYTES)
    except zlib.error:
        return b""
