"""What users feel: per-request latencies and the serving columns of the summary.

Definitions follow vLLM's serving benchmark (field notes):

- TTFT: first token time - arrival.
- TPOT: ``(e2e - TTFT) / (output tokens - 1)``; undefined (NaN) for one-token outputs.
- e2e: finish time - arrival.
- input_tok_s: prompt tokens of finished requests / duration (vLLM's "input token throughput";
  prefix-cache hits count, they are tokens served).
- output_tok_s: output tokens of finished requests / duration. ``throughput_tok_s`` is the same
  figure under its older name, kept for readers of earlier result folders.
- slo_attainment: share of *all* requests (rejected and unfinished ones miss) that finished
  meeting both the TTFT and the TPOT SLO, and the E2E SLO when one is set (DistServe, OSDI'24;
  a one-token output has no TPOT and cannot miss it). NaN when no SLO is set.
- goodput_rps: those requests / duration (DistServe's goodput at this request rate). NaN when no
  SLO is set: without one it would only be the completion rate, which ``n_finished`` already says.
- kv_token_util: see ``sim.serving.server.Server.kv_token_util`` (over all busy time, cached prefix
  blocks counted as used); kv_token_util_pressure: over the steps KV memory limited only, held
  tokens only (``Server.kv_token_util_pressure``); kv_pressure_share: the share of busy time those
  steps
  took.
- rejected_by: ``kind: count`` for each rejection kind (``sim.serving.scheduler.REJECT_KINDS``), ""
  when
  none.
- prefix_hit_rate, prefix_first_hit_rate: see ``prefix_hit_rates``.

``duration_s`` is the simulated time from the first arrival to the end of the run.
"""

from __future__ import annotations

import math
from array import array
from operator import attrgetter
from typing import Any, Iterable

import numpy as np
import pandas as pd

__all__ = [
    "REQUEST_TABLE_COLUMNS",
    "SERVING_COLUMNS",
    "LATENCY_COLUMNS",
    "prefix_hit_rates",
    "request_table",
    "request_frame",
    "RECORDED_COLUMNS",
    "RECORDED_NUMBER_DTYPES",
    "FINISHED",
    "REJECTED",
    "RUNNING",
    "rejected_by",
    "serving_summary",
    "add_latencies",
    "latency_percentiles",
]

REQUEST_TABLE_COLUMNS = [
    "request_id",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "num_generated",
    "first_token_s",
    "finish_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "num_preemptions",
    "num_swaps",
    "prefix_hit_tokens",
    "status",
    "reject_reason",
    "reject_kind",
]

#: The latency percentiles of a run (``latency_percentiles``' keys), in the summary's order.
LATENCY_COLUMNS = [f"{name}_{q}_s" for name in ("ttft", "tpot", "e2e") for q in ("p50", "p99")]

#: The serving columns the summary adds after the report schema's (issue 3).
SERVING_COLUMNS = [
    "n_requests",
    "n_finished",
    "n_rejected",
    "n_preempted",
    *LATENCY_COLUMNS,
    "throughput_tok_s",
    "goodput_rps",
    "kv_token_util",
    "input_tok_s",
    "output_tok_s",
    "slo_attainment",
    "kv_token_util_pressure",
    "kv_pressure_share",
    "rejected_by",
]


#: The request table's ``status`` of a finished request (``sim.serving.scheduler.RequestState``'s
#: values are what the column says; the serving columns count these).
FINISHED = "finished"
#: ... of one the server turned away.
REJECTED = "rejected"
#: ... of one admitted and not finished when the run ended.
RUNNING = "running"
#: The columns a run records per request; ``request_frame`` derives the latencies from them.
RECORDED_COLUMNS = [c for c in REQUEST_TABLE_COLUMNS if c not in ("ttft_s", "tpot_s", "e2e_s")]


#: The recorded columns of numbers (``sim.serving.scheduler.Request``'s fields) and their dtypes;
#: the rest, the status and the rejection texts, are strings.
RECORDED_NUMBER_DTYPES = {
    "request_id": np.int64,
    "arrival_s": np.float64,
    "prompt_tokens": np.int64,
    "output_tokens": np.int64,
    "num_generated": np.int64,
    "first_token_s": np.float64,
    "finish_s": np.float64,
    "num_preemptions": np.int64,
    "num_swaps": np.int64,
    "prefix_hit_tokens": np.int64,
}


def request_table(requests: Iterable[Any]) -> pd.DataFrame:
    """One row per request (``sim.serving.scheduler.Request`` objects), latencies derived.

    Built by columns, read with ``attrgetter``: the numbers straight into arrays of their dtype
    (``RECORDED_NUMBER_DTYPES``), which pandas takes as they are, where from a list of Python
    ints it infers the type element by element (2 ms a column for the hour's 19,366 requests,
    0.5 ms this way); a list of row tuples, before that, went through an object array converted
    column by column (about 5x slower). The same dtypes and values, floats exactly
    (``tests/sim/replay/test_serving_metrics.py``).

    The int columns go through ``array("q", ...)``, which refuses a float, None or a string
    (``TypeError`` naming the column), where ``np.fromiter`` would truncate a float to an int
    and parse a string: an error, not a quietly changed table. The float columns go through
    ``np.fromiter``, faster, whose conversions are pandas' own for a list of numbers (an int
    becomes its float, None NaN)."""
    requests = list(requests)
    if not requests:  # the row frame's dtypes (object) for no rows
        return request_frame(pd.DataFrame([], columns=RECORDED_COLUMNS))
    num_requests = len(requests)
    columns: dict[str, Any] = {}
    for name in RECORDED_COLUMNS:
        dtype = RECORDED_NUMBER_DTYPES.get(name)
        values = map(attrgetter(name), requests)
        if name == "status":
            # a ``RequestState``: an enum member's ``_value_`` is what its ``value`` property
            # returns, read without the property's Python call (nor a Python ``Enum.__hash__``
            # a request, as a dict of the members took)
            columns[name] = list(map(attrgetter("_value_"), values))
        elif dtype is None:  # the rejection texts: pandas' string dtype, as it infers it
            columns[name] = list(values)
        else:
            try:
                if dtype is np.int64:
                    # from a list: ``array`` sizes itself once, where from an iterator it
                    # grows as it goes (a fifth slower)
                    columns[name] = np.frombuffer(array("q", list(values)), dtype=np.int64)
                else:
                    columns[name] = np.fromiter(values, dtype, count=num_requests)
            except (TypeError, ValueError) as e:
                kind = "an int" if dtype is np.int64 else "a float"
                raise TypeError(f"request table: a request's {name} is not {kind}: {e}") from None
    return request_frame(pd.DataFrame(columns))


def request_frame(recorded: pd.DataFrame) -> pd.DataFrame:
    """The request table from a frame of ``RECORDED_COLUMNS`` (the simulator's requests, or a real
    engine's served ones): latencies derived, columns in ``REQUEST_TABLE_COLUMNS`` order."""
    missing = [c for c in RECORDED_COLUMNS if c not in recorded.columns]
    if missing:
        raise ValueError(f"a request table needs the columns {missing}")
    return add_latencies(recorded.copy())[REQUEST_TABLE_COLUMNS]


def add_latencies(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` (``arrival_s``, ``first_token_s``, ``finish_s``, ``output_tokens``: simulated or a
    real engine's served requests) with ``ttft_s``, ``e2e_s`` and ``tpot_s`` added in place."""
    df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
    df["e2e_s"] = df["finish_s"] - df["arrival_s"]
    decode_steps = (df["output_tokens"] - 1).where(df["output_tokens"] > 1)
    df["tpot_s"] = (df["e2e_s"] - df["ttft_s"]) / decode_steps
    return df


def latency_percentiles(table: pd.DataFrame) -> dict[str, float]:
    """p50 and p99 of TTFT, TPOT and e2e over a table with ``add_latencies``' columns
    (``ttft_p50_s``, ...; NaNs, requests never served, left out)."""
    return {
        **_percentiles(table["ttft_s"], "ttft"),
        **_percentiles(table["tpot_s"], "tpot"),
        **_percentiles(table["e2e_s"], "e2e"),
    }


def _percentiles(values: pd.Series, name: str) -> dict[str, float]:
    a = values.to_numpy(np.float64)
    a = a[np.isfinite(a)]
    if a.size == 0:
        return {f"{name}_p50_s": math.nan, f"{name}_p99_s": math.nan}
    p50, p99 = np.percentile(a, [50, 99])
    return {f"{name}_p50_s": float(p50), f"{name}_p99_s": float(p99)}


def rejected_by(table: pd.DataFrame) -> str:
    """``"kind: count, ..."`` over the rejected requests of a request table, most first; "" when
    none."""
    kinds = table.loc[table["status"] == REJECTED, "reject_kind"]
    return ", ".join(f"{kind}: {n}" for kind, n in kinds.value_counts().items())


def prefix_hit_rates(
    *, lookup_tokens: int, hit_tokens: int, first_lookup_tokens: int, first_hit_tokens: int
) -> dict[str, float]:
    """The prefix cache's two hit rates (0 when nothing was looked up), counted by the KV manager
    at each admission (``sim.serving.kv.PagedKV.admit``) over the prompt tokens in whole cacheable
    blocks:

    - ``prefix_hit_rate``: hit tokens / looked-up tokens over *every* admission, a preempted
      request's re-admissions included, where it finds the blocks its own earlier run cached (at
      small KV budgets most of its hits; what makes recompute preemption cheap).
    - ``prefix_first_hit_rate``: the same over first admissions only, where every hit is on a
      block another request cached: the reuse the traffic itself offers.
    """
    return {
        "prefix_hit_rate": hit_tokens / lookup_tokens if lookup_tokens else 0.0,
        "prefix_first_hit_rate": first_hit_tokens / first_lookup_tokens
        if first_lookup_tokens
        else 0.0,
    }


def serving_summary(
    table: pd.DataFrame,
    *,
    duration_s: float,
    num_preemptions: int,
    kv_token_util: float,
    kv_token_util_pressure: float = math.nan,
    kv_pressure_s: float = 0.0,
    busy_s: float = 0.0,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    slo_e2e_s: float | None = None,
) -> dict[str, Any]:
    """The ``SERVING_COLUMNS`` of one run from its request table (definitions: module docstring)."""
    done = table[table["status"] == FINISHED]
    ok = np.ones(len(done), dtype=bool)
    for col, slo in (("ttft_s", slo_ttft_s), ("tpot_s", slo_tpot_s), ("e2e_s", slo_e2e_s)):
        if slo is not None:
            v = done[col].to_numpy(np.float64)
            ok &= ~(v > slo)  # a NaN TPOT (one-token output) cannot miss its SLO
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    has_slo = any(slo is not None for slo in (slo_ttft_s, slo_tpot_s, slo_e2e_s))
    num_good = float(ok.sum()) if has_slo else math.nan
    output_tok_s = float(done["output_tokens"].sum()) * per_s
    return {
        "n_requests": len(table),
        "n_finished": len(done),
        "n_rejected": int((table["status"] == REJECTED).sum()),
        "n_preempted": num_preemptions,
        **_percentiles(done["ttft_s"], "ttft"),
        **_percentiles(done["tpot_s"], "tpot"),
        **_percentiles(done["e2e_s"], "e2e"),
        "throughput_tok_s": output_tok_s,
        "goodput_rps": num_good * per_s,
        "kv_token_util": kv_token_util,
        "input_tok_s": float(done["prompt_tokens"].sum()) * per_s,
        "output_tok_s": output_tok_s,
        "slo_attainment": num_good / len(table) if len(table) else math.nan,
        "kv_token_util_pressure": kv_token_util_pressure,
        "kv_pressure_share": kv_pressure_s / busy_s if busy_s > 0 else 0.0,
        "rejected_by": rejected_by(table),
    }
