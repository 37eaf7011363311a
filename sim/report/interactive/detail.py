"""Zoom detail of a run's time series: min/max levels, finer and finer, in compressed time chunks.

The page embeds an overview of ``DETAIL_POINTS`` rows per run; a long replay has far more (a
10-million-event replay sampled every 10th event: a million rows per run). So the page also
embeds *levels*: the rows cut into ``overview_points * factor**k`` consecutive buckets
(k = 1, 2, ...; the last level the rows themselves), each bucket keeping its first time and the
minimum AND the maximum of every metric, so neither a peak nor a trough is lost at any level.
Each level is split into chunks of ``CHUNK_BUCKETS`` buckets (the page decodes only the chunks
the shown range needs, and caches them). A chunk is its columns (``COLUMNS``) one after the
other: times as int64 microsecond differences (exact, and mostly small), byte counts as float64
(exact below 2**53), fractions as float32 cut to 17 significant bits (within 1 part in 65,536,
far below a pixel; the bits cut would cost a fifth of the chunk); each column byte-shuffled
(the i-th bytes of all its values together, as HDF5's shuffle filter: high bytes of nearby values
repeat, so gzip finds them), then gzip-compressed and base64-encoded: about 6 bytes a bucket on
the 10 M-event replay, against 56 as plain float64. The browser decodes it with its built-in
``DecompressionStream('gzip')`` (``report.js``: ``decodeChunk``, told the columns by each level).

Levels are added coarse to fine while the run's encoded bytes stay within its budget, so a page
is bounded in size whatever the length of the run: a run that does not fit its finest level
keeps the levels before it.
"""

from __future__ import annotations

import base64
import gzip
from typing import Any

import numpy as np

__all__ = [
    "METRICS",
    "COLUMNS",
    "CHUNK_BUCKETS",
    "LEVEL_FACTOR",
    "detail_levels",
    "encode_chunk",
    "decode_chunk",
]

#: Metrics the timelines draw, by the page's name for them (``report.js`` ``METRICS``) and the
#: storage of their values in a chunk.
METRICS = {
    "reserved_bytes": ("reserved", "f8"),
    "live_bytes": ("live", "f8"),
    "frag_ext": ("frag", "f4"),
}
#: A chunk's columns, in order: (the page's name, storage). "i8d": int64 differences from the
#: previous value (the first from 0); "f8"/"f4": float64/float32. Each level lists them for the
#: page.
COLUMNS = [("t_us", "i8d")] + [
    (page + end, kind) for page, kind in METRICS.values() for end in ("Min", "Max")
]
#: Buckets per chunk: small enough that decoding the chunks of a narrow range is instant.
CHUNK_BUCKETS = 8192
#: Each level has this many times the buckets of the one before.
LEVEL_FACTOR = 4


_DTYPES = {"i8d": "<i8", "f8": "<f8", "f4": "<f4"}


def encode_chunk(columns: list[np.ndarray], kinds: list[str]) -> str:
    """Equal-length columns stored as ``kinds`` (``COLUMNS``), each byte-shuffled, then together
    gzip-compressed (mtime 0: the same bytes every build) and base64-encoded: the string
    ``report.js`` ``decodeChunk`` reads back."""
    parts = []
    for values, kind in zip(columns, kinds):
        values = np.asarray(values)
        if kind == "i8d":
            values = np.diff(values.astype(np.int64), prepend=0)
        values = np.ascontiguousarray(values.astype(_DTYPES[kind]))
        if kind == "f4":
            values.view(np.uint32)[:] &= np.uint32(
                0xFFFF_FF80
            )  # low 7 of 23 mantissa bits: within 2**-16
        parts.append(values.view(np.uint8).reshape(len(values), -1).T.tobytes())
    return base64.b64encode(gzip.compress(b"".join(parts), compresslevel=6, mtime=0)).decode(
        "ascii"
    )


def decode_chunk(text: str, kinds: list[str], n: int) -> list[np.ndarray]:
    """``encode_chunk`` undone, for tests (the page decodes in JS): the columns, as float64."""
    raw, out, at = gzip.decompress(base64.b64decode(text)), [], 0
    for kind in kinds:
        width = np.dtype(_DTYPES[kind]).itemsize
        block = np.frombuffer(raw[at : at + n * width], dtype=np.uint8).reshape(width, n).T.copy()
        values = block.view(_DTYPES[kind]).reshape(n)
        out.append((np.cumsum(values) if kind == "i8d" else values).astype(np.float64))
        at += n * width
    return out


def _level(t_us: np.ndarray, series: dict[str, np.ndarray], num_buckets: int) -> list[np.ndarray]:
    """Time of each bucket's first row, then min and max of each metric per bucket (NaN where a
    metric is missing or all NaN), over ``num_buckets`` consecutive buckets of the rows."""
    from sim.report.bounded_tables import _bucket_starts

    n = len(t_us)
    starts = _bucket_starts(n, num_buckets) if num_buckets < n else np.arange(n)
    out = [t_us[starts]]
    for name in METRICS:
        v = series.get(name)
        if v is None:
            out += [np.full(len(starts), np.nan)] * 2
        elif len(starts) == n:
            out += [v, v]
        else:
            with np.errstate(invalid="ignore"):
                out += [np.fmin.reduceat(v, starts), np.fmax.reduceat(v, starts)]
    return out


def detail_levels(
    series: dict[str, np.ndarray], *, overview_points: int, budget_bytes: int
) -> list[dict[str, Any]]:
    """The zoom levels of one run (module docstring) from its rows (``time_us`` and ``METRICS``,
    in time order), coarse to fine, within ``budget_bytes`` of encoded text:
    ``[{"buckets", "rows", "columns", "chunks": [{"t0", "t1", "n", "data"}]}]`` (chunk times in
    seconds: its first and last bucket's). ``[]`` when the overview holds every row."""
    if "time_us" not in series:
        return []
    t_us = series["time_us"]
    n = len(t_us)
    kinds = [kind for _, kind in COLUMNS]
    levels: list[dict[str, Any]] = []
    used = 0
    num_buckets = overview_points
    while num_buckets < n:
        num_buckets = min(n, num_buckets * LEVEL_FACTOR)
        columns = _level(t_us, series, num_buckets)
        chunks = []
        for a in range(0, len(columns[0]), CHUNK_BUCKETS):
            part = [c[a : a + CHUNK_BUCKETS] for c in columns]
            data = encode_chunk(part, kinds)
            used += len(data)
            if used > budget_bytes:
                return levels
            chunks.append(
                {
                    "t0": float(part[0][0]) / 1e6,
                    "t1": float(part[0][-1]) / 1e6,
                    "n": len(part[0]),
                    "data": data,
                }
            )
        levels.append({"buckets": len(columns[0]), "rows": n, "columns": COLUMNS, "chunks": chunks})
    return levels
