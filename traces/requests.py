"""The request table every request-trace reader and generator produces.

One row per LLM request, in arrival order:

==============  =======  ======================================================================
column          dtype    meaning
==============  =======  ======================================================================
request_id      int64    0..n-1 in arrival order
arrival_s       float64  seconds since the first request (so the first row is 0.0), sorted
prompt_tokens   int64    prompt (context, prefill) length, >= 1
output_tokens   int64    tokens generated (decode length), >= 1
session_id      str      conversation the request belongs to, "" if none
hash_ids        object   tuple of ints: one id per prompt block (``meta["hash_block_tokens"]``
                         tokens each, 512 for Mooncake); equal ids across requests are a shared
                         prefix; the empty tuple when the trace has none
==============  =======  ======================================================================

``validate_requests`` checks these invariants; ``make_requests`` builds a table that meets them
(sorting by arrival and rebasing times to the first request).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import pandas as pd

from traces.errors import TraceFormatError

__all__ = [
    "REQUEST_COLUMNS",
    "MAX_TOKENS",
    "MAX_TIME_S",
    "RequestTrace",
    "make_requests",
    "validate_requests",
]

REQUEST_COLUMNS = [
    "request_id",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "session_id",
    "hash_ids",
]
#: Most tokens one request may have (prompt or output): no model's context comes near it, so more
#: is a corrupt field (and past 2**63 it would wrap in int64). Readers refuse more, generators
#: refuse specs that could draw more.
MAX_TOKENS = 2**31 - 1
#: Latest arrival time in seconds (epoch seconds are about 1.7e9; 1e11 is 3,000 years): more is
#: a unit mistake (microseconds in a seconds column) or corruption. Readers refuse a later time
#: or a longer span of date-times; generators refuse a trace that would last longer.
MAX_TIME_S = 1e11


@dataclass
class RequestTrace:
    """A request trace: the table plus where it came from.

    Attributes:
        requests: the table described in the module docstring.
        name: short name for reports (file stem by default).
        source: the file it was read from ("" when generated).
        format: the reader or generator that produced it ("azure", "mooncake", "synth", ...).
        meta: reader-specific facts (rows dropped and why, ``hash_block_tokens``, generator knobs).
    """

    requests: pd.DataFrame
    name: str
    source: str = ""
    format: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(arrival_s, prompt_tokens, output_tokens)`` as numpy arrays, for simulation loops."""
        df = self.requests
        return (
            df["arrival_s"].to_numpy(np.float64),
            df["prompt_tokens"].to_numpy(np.int64),
            df["output_tokens"].to_numpy(np.int64),
        )

    @property
    def duration_s(self) -> float:
        """Arrival time of the last request (0.0 for an empty or one-request trace)."""
        return float(self.requests["arrival_s"].iloc[-1]) if len(self) else 0.0

    def _derive(self, df: pd.DataFrame, **meta: Any) -> RequestTrace:
        return replace(self, requests=df, meta={**self.meta, **meta})

    def scale_rate(self, factor: float) -> RequestTrace:
        """Compress arrival times by ``factor``: 2 means twice the request rate, 0.5 half."""
        factor = float(factor)
        if not np.isfinite(factor) or factor <= 0:
            raise ValueError(f"rate scale factor {factor!r} must be a finite number > 0")
        df = self.requests.copy()
        with np.errstate(over="ignore"):  # past float64 is inf, refused below
            df["arrival_s"] = df["arrival_s"].to_numpy(np.float64) / factor
        if len(df) and not df["arrival_s"].iloc[-1] <= MAX_TIME_S:
            raise ValueError(
                f"rate scale factor {factor!r} puts the last arrival "
                f"at {df['arrival_s'].iloc[-1]:g} s, later than {MAX_TIME_S:g} s"
            )
        return self._derive(df, rate_scale=self.meta.get("rate_scale", 1.0) * factor)

    def window(self, start_s: float, end_s: float | None = None) -> RequestTrace:
        """Requests arriving in ``[start_s, end_s)``, times rebased to the first of them."""
        end = np.inf if end_s is None else float(end_s)
        if not float(start_s) <= end:
            raise ValueError(f"window start_s={start_s!r} must not be after end_s={end_s!r}")
        t = self.requests["arrival_s"].to_numpy()
        lo, hi = np.searchsorted(t, [float(start_s), end], side="left")
        return self._derive(_renumber(self.requests.iloc[lo:hi]), window_s=(float(start_s), end_s))

    def head(self, num_requests: int) -> RequestTrace:
        """The first ``num_requests`` requests."""
        if num_requests < 0:
            raise ValueError(f"head(num_requests={num_requests!r}) must not be negative")
        return self._derive(_renumber(self.requests.iloc[:num_requests]))

    def repeat(
        self, times: int, *, period_s: float | None = None, distinct: bool = True
    ) -> RequestTrace:
        """Tile the trace ``times`` times back to back (2x/4x-length scaling runs).

        Args:
            times: number of copies (1 returns an equal trace).
            period_s: start of copy k is ``k * period_s``; by default the last arrival plus the
                mean gap between arrivals, so the request rate is unchanged.
            distinct: give each copy its own session ids and hash ids, so a prefix cache sees
                the same reuse in every copy as in the first; False replays identical ids.
        """
        if int(times) != times or times < 1:
            raise ValueError(f"repeat(times={times!r}) must be a whole number >= 1")
        n = len(self)
        if period_s is None:
            if n < 2:
                raise ValueError(f"repeat() of a trace with {n} request(s) needs period_s")
            period_s = self.duration_s * n / (n - 1)
        if not np.isfinite(period_s) or period_s < self.duration_s:
            raise ValueError(
                f"repeat(period_s={period_s!r}) must be >= the trace's duration {self.duration_s} s"
            )
        df = self.requests
        hash_span = 1 + max((max(h) for h in df["hash_ids"] if h), default=-1)
        copies = []
        for k in range(int(times)):
            c = df.copy()
            c["arrival_s"] = c["arrival_s"].to_numpy() + k * period_s
            if distinct and k:
                c["session_id"] = [f"{s}#{k}" if s else "" for s in c["session_id"]]
                c["hash_ids"] = [tuple(i + k * hash_span for i in h) for h in c["hash_ids"]]
            copies.append(c)
        out = pd.concat(copies, ignore_index=True)
        out["request_id"] = np.arange(len(out), dtype=np.int64)
        return self._derive(out, repeat=self.meta.get("repeat", 1) * int(times))

    def describe(self) -> dict[str, Any]:
        """One flat row of summary figures (counts, rate, length percentiles, prefix reuse)."""
        df = self.requests
        n = len(df)
        t, prompt, output = self.arrays()
        gaps = np.diff(t)
        row: dict[str, Any] = {
            "name": self.name,
            "format": self.format,
            "num_requests": n,
            "duration_s": self.duration_s,
            "rate_rps": (n - 1) / self.duration_s if self.duration_s > 0 else float("nan"),
            "interarrival_cv": float(gaps.std() / gaps.mean())
            if gaps.size and gaps.mean() > 0
            else float("nan"),
        }
        for col, values in (("prompt_tokens", prompt), ("output_tokens", output)):
            p50, p99 = np.percentile(values, [50, 99]) if n else (np.nan, np.nan)
            row.update(
                {
                    f"{col}_mean": float(values.mean()) if n else float("nan"),
                    f"{col}_p50": float(p50),
                    f"{col}_p99": float(p99),
                    f"{col}_max": int(values.max()) if n else 0,
                }
            )
        sessions = df["session_id"]
        row["num_sessions"] = int(sessions[sessions != ""].nunique())
        num_blocks = int(sum(len(h) for h in df["hash_ids"]))
        num_unique = len({i for h in df["hash_ids"] for i in h})
        row["num_hash_blocks"] = num_blocks
        row["num_unique_hash_blocks"] = num_unique
        row["hash_block_reuse_frac"] = 1.0 - num_unique / num_blocks if num_blocks else 0.0
        return row


def _renumber(df: pd.DataFrame) -> pd.DataFrame:
    """Rows already in arrival order: ids 0..n-1 and times rebased to the first row."""
    out = df.reset_index(drop=True).copy()
    t = out["arrival_s"].to_numpy(np.float64)
    out["arrival_s"] = t - t[0] if t.size else t
    out["request_id"] = np.arange(len(out), dtype=np.int64)
    return out


def make_requests(
    arrival_s: Sequence[float] | np.ndarray,
    prompt_tokens: Sequence[int] | np.ndarray,
    output_tokens: Sequence[int] | np.ndarray,
    session_id: Sequence[str] | None = None,
    hash_ids: Sequence[Sequence[int]] | None = None,
) -> pd.DataFrame:
    """Build a request table with the canonical columns and dtypes.

    Rows are sorted by arrival (stable, so ties keep their given order), times are rebased to
    the first request and ids numbered 0..n-1. Values are not range-checked here; readers check
    them against the file first and ``validate_requests`` checks the result.
    """
    t = np.asarray(arrival_s, dtype=np.float64)
    n = t.size
    lengths = {
        "prompt_tokens": len(prompt_tokens),
        "output_tokens": len(output_tokens),
        "session_id": n if session_id is None else len(session_id),
        "hash_ids": n if hash_ids is None else len(hash_ids),
    }
    wrong = {k: v for k, v in lengths.items() if v != n}
    assert not wrong, f"make_requests: {n} arrival times but column lengths {wrong}"
    order = np.argsort(t, kind="stable")
    sessions = (
        np.full(n, "", dtype=object)
        if session_id is None
        else pd.Series(list(session_id), dtype=object).fillna("").astype(str).to_numpy(dtype=object)
    )
    hashes = np.empty(n, dtype=object)  # filled one by one: numpy would read tuples as a 2-D array
    if hash_ids is None:
        hashes.fill(())
    else:
        for i, h in enumerate(hash_ids):
            hashes[i] = h if type(h) is tuple else tuple(int(x) for x in h)
    t = t[order]
    return pd.DataFrame(
        {
            "request_id": np.arange(n, dtype=np.int64),
            "arrival_s": t - t[0] if n else t,
            "prompt_tokens": np.asarray(prompt_tokens, dtype=np.int64)[order],
            "output_tokens": np.asarray(output_tokens, dtype=np.int64)[order],
            "session_id": pd.Series(sessions[order], dtype=str),
            "hash_ids": pd.Series(hashes[order], dtype=object),
        }
    )


def validate_requests(
    df: pd.DataFrame, source: str = "<requests>", *, line_offset: int = 2
) -> None:
    """Raise TraceFormatError at the first row that breaks the table's invariants.

    ``line_offset`` maps a row index to a file line (2 for a CSV with one header line).
    """
    missing = [c for c in REQUEST_COLUMNS if c not in df.columns]
    if missing:
        raise TraceFormatError(
            source,
            None,
            f"missing column(s) {', '.join(missing)}; expected {', '.join(REQUEST_COLUMNS)}",
        )
    n = len(df)
    ids = df["request_id"].to_numpy()
    bad = np.flatnonzero(ids != np.arange(n))
    if bad.size:
        i = int(bad[0])
        raise TraceFormatError(
            source, i + line_offset, f"request_id {ids[i]} should be {i} (0..n-1 in arrival order)"
        )
    t = df["arrival_s"].to_numpy(np.float64)
    bad = np.flatnonzero(~np.isfinite(t))
    if bad.size:
        raise TraceFormatError(
            source, int(bad[0]) + line_offset, f"arrival_s {t[bad[0]]} is not a finite number"
        )
    bad = np.flatnonzero(t > MAX_TIME_S)
    if bad.size:
        raise TraceFormatError(
            source,
            int(bad[0]) + line_offset,
            f"arrival_s {t[bad[0]]:g} is later than {MAX_TIME_S:g} s",
        )
    if n and t[0] != 0.0:
        raise TraceFormatError(
            source,
            line_offset,
            f"arrival_s of the first request is {t[0]}, must be 0 (times are relative to it)",
        )
    bad = np.flatnonzero(np.diff(t) < 0)
    if bad.size:
        i = int(bad[0]) + 1
        raise TraceFormatError(
            source, i + line_offset, f"arrival_s {t[i]} goes back in time (previous {t[i - 1]})"
        )
    for col in ("prompt_tokens", "output_tokens"):
        v = df[col].to_numpy()
        bad = np.flatnonzero((v < 1) | (v > MAX_TOKENS))
        if bad.size:
            i = int(bad[0])
            reason = "must be >= 1" if v[i] < 1 else f"is more than {MAX_TOKENS:,} tokens"
            raise TraceFormatError(source, i + line_offset, f"{col} {v[i]} {reason}")
    sessions = df["session_id"]
    if not (pd.api.types.is_string_dtype(sessions.dtype) and not sessions.isna().any()):
        for i, s in enumerate(sessions):  # object column: look at each value
            if not isinstance(s, str):
                raise TraceFormatError(source, i + line_offset, f"session_id {s!r} is not a string")
    for i, h in enumerate(df["hash_ids"]):
        if type(h) is not tuple or (h and not all(isinstance(x, (int, np.integer)) for x in h)):
            raise TraceFormatError(
                source, i + line_offset, f"hash_ids {h!r} is not a tuple of ints"
            )
