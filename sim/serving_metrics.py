"""What users feel: per-request latencies and the serving columns of the summary.

Definitions follow vLLM's serving benchmark (field notes):

- TTFT: first token time - arrival.
- TPOT: ``(e2e - TTFT) / (output tokens - 1)``; undefined (NaN) for one-token outputs.
- e2e: finish time - arrival.
- throughput_tok_s: output tokens of finished requests / duration.
- goodput_rps: finished requests meeting every SLO that is set / duration.

``duration_s`` is the simulated time from the first arrival to the end of the run.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import pandas as pd

__all__ = ["REQUEST_TABLE_COLUMNS", "SERVING_COLUMNS", "request_table", "serving_summary"]

REQUEST_TABLE_COLUMNS = [
    "request_id", "arrival_s", "prompt_tokens", "output_tokens", "num_generated", "first_token_s", "finish_s",
    "ttft_s", "tpot_s", "e2e_s", "num_preemptions", "num_swaps", "prefix_hit_tokens", "status", "reject_reason",
]

#: The serving columns the summary adds after the report schema's (issue 3).
SERVING_COLUMNS = [
    "n_requests", "n_finished", "n_rejected", "n_preempted", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
    "tpot_p99_s", "e2e_p50_s", "e2e_p99_s", "throughput_tok_s", "goodput_rps", "kv_token_util",
]


def request_table(requests: Iterable[Any]) -> pd.DataFrame:
    """One row per request (``sim.scheduler.Request`` objects), latencies derived."""
    rows = [(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.num_generated, r.first_token_s,
             r.finish_s, r.num_preemptions, r.num_swaps, r.prefix_hit_tokens, r.status.value, r.reject_reason)
            for r in requests]
    df = pd.DataFrame(rows, columns=["request_id", "arrival_s", "prompt_tokens", "output_tokens", "num_generated",
                                     "first_token_s", "finish_s", "num_preemptions", "num_swaps",
                                     "prefix_hit_tokens", "status", "reject_reason"])
    df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
    df["e2e_s"] = df["finish_s"] - df["arrival_s"]
    decode_steps = (df["output_tokens"] - 1).where(df["output_tokens"] > 1)
    df["tpot_s"] = (df["e2e_s"] - df["ttft_s"]) / decode_steps
    return df[REQUEST_TABLE_COLUMNS]


def _percentiles(values: pd.Series, name: str) -> dict[str, float]:
    a = values.to_numpy(np.float64)
    a = a[np.isfinite(a)]
    if a.size == 0:
        return {f"{name}_p50_s": math.nan, f"{name}_p99_s": math.nan}
    p50, p99 = np.percentile(a, [50, 99])
    return {f"{name}_p50_s": float(p50), f"{name}_p99_s": float(p99)}


def serving_summary(table: pd.DataFrame, *, duration_s: float, num_preemptions: int, kv_token_util: float,
                    slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                    slo_e2e_s: float | None = None) -> dict[str, Any]:
    """The ``SERVING_COLUMNS`` of one run from its request table."""
    done = table[table["status"] == "finished"]
    ok = np.ones(len(done), dtype=bool)
    for col, slo in (("ttft_s", slo_ttft_s), ("tpot_s", slo_tpot_s), ("e2e_s", slo_e2e_s)):
        if slo is not None:
            v = done[col].to_numpy(np.float64)
            ok &= ~(v > slo)  # a NaN TPOT (one-token output) cannot miss its SLO
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    return {
        "n_requests": len(table),
        "n_finished": len(done),
        "n_rejected": int((table["status"] == "rejected").sum()),
        "n_preempted": num_preemptions,
        **_percentiles(done["ttft_s"], "ttft"),
        **_percentiles(done["tpot_s"], "tpot"),
        **_percentiles(done["e2e_s"], "e2e"),
        "throughput_tok_s": float(done["output_tokens"].sum()) * per_s,
        "goodput_rps": float(ok.sum()) * per_s,
        "kv_token_util": kv_token_util,
    }
