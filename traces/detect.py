"""Which reader a file needs, told from its first bytes (the name may lie), and the one entry point.

=================  ===========================================================================
format             recognised by
=================  ===========================================================================
pytorch-snapshot   a pickle (``0x80`` protocol opcode), plain or inside gzip (``1f 8b``)
rmm-log            first line ``Thread,Time,Action,Pointer,Size,Stream`` (plain or gzipped)
csv                first line starting with ``time_us,op,alloc_id,nbytes,stream,tag``
parquet            the ``PAR1`` magic
=================  ===========================================================================

The file is read once (``traces.source.open_source``): from a pipe, a FIFO or ``<(...)`` too,
and a gzip stream is looked into by its content, whatever its name.
"""

from __future__ import annotations

from pathlib import Path

from traces.alloc_table import CSV_FORMAT, PARQUET_FORMAT, read_table_csv, read_table_parquet
from traces.events import EVENT_COLUMNS, AllocTrace
from traces.formats import ALLOC
from traces.pytorch_snapshot import SNAPSHOT_FORMAT, is_pickle_head, read_pytorch_snapshot
from traces.rmm_log import RMM_FORMAT, RMM_HEADER, read_rmm_log
from traces.source import TraceSource

__all__ = ["ALLOC_FORMATS", "detect_alloc_format", "read_alloc_trace"]

#: The built-in formats (``traces.formats.ALLOC.names()`` lists third-party ones too).
ALLOC_FORMATS = (SNAPSHOT_FORMAT, RMM_FORMAT, CSV_FORMAT, PARQUET_FORMAT)


def detect_alloc_format(path: str | Path | TraceSource) -> str:
    """The format of an allocation-trace file, from its content (read once, ``traces.source``).

    Raises:
        TraceFormatError: the content matches no registered format (``traces.formats.ALLOC``), or
            the file is empty or over the size limit.
    """
    return ALLOC.detect(path)


def read_alloc_trace(
    path: str | Path | TraceSource,
    *,
    format: str | None = None,
    device: int | None = None,
    lenient: bool = False,
) -> AllocTrace:
    """Read an allocation trace of any registered format (``traces.formats.ALLOC``).

    Args:
        path: the file (a regular file, pipe or FIFO, plain or gzipped), or its ``TraceSource``;
            it is read once, for detection and reading alike.
        format: a registered format's name; None detects it from the content.
        device: PyTorch snapshots only: which device's trace (default: the one with events).
        lenient: RMM logs only: drop frees of pointers that are not live instead of raising.

    Raises:
        TraceFormatError: the file is malformed (names the file, line or record, and why).
    """
    return ALLOC.read(path, format=format, device=device, lenient=lenient)


def _first_fields(src: TraceSource) -> list[str]:
    first = src.head(4096).split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8-sig", errors="replace")
    return [c.strip() for c in first.split(",")]


def _is_parquet(src: TraceSource) -> bool:
    return not src.gzipped and src.head(4) == b"PAR1"


def _has_event_columns(src: TraceSource) -> bool:
    import pyarrow.parquet as pq

    return set(pq.read_schema(src.stream()).names) >= set(EVENT_COLUMNS)


# The built-in formats, in the order their sniffers are asked (their contents exclude each other).
def sniff_snapshot(src: TraceSource) -> bool:
    """The built-in snapshot format's sniffer (``traces.read_ahead`` asks whether it is still the
    one registered)."""
    return is_pickle_head(src.head(2))


def read_snapshot_format(src: TraceSource, device: int | None = None, **_) -> AllocTrace:
    """The built-in snapshot format's reader."""
    return read_pytorch_snapshot(src, device=device)


ALLOC.register(
    SNAPSHOT_FORMAT,
    sniff=sniff_snapshot,
    read=read_snapshot_format,
    describe="a PyTorch snapshot pickle",
    replace=True,
)
ALLOC.register(
    RMM_FORMAT,
    sniff=lambda src: _first_fields(src) == RMM_HEADER,
    read=lambda src, lenient=False, **_: read_rmm_log(src, lenient=lenient),
    describe=f"an RMM log ({','.join(RMM_HEADER)})",
    replace=True,
)
ALLOC.register(
    CSV_FORMAT,
    sniff=lambda src: _first_fields(src)[: len(EVENT_COLUMNS)] == EVENT_COLUMNS,
    read=lambda src, **_: read_table_csv(src),
    describe=f"our CSV ({','.join(EVENT_COLUMNS)})",
    replace=True,
)
ALLOC.register(
    PARQUET_FORMAT,
    sniff=_is_parquet,
    read=lambda src, **_: read_table_parquet(src),
    describe="Parquet",
    confirm=_has_event_columns,
    replace=True,
)
