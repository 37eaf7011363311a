"""``gpu serve --sim``'s comparison, as the command prints it, for a recorded engine run: the
recorded summary stands for the engine's side (``realgpu.serve.ServeRun``), the recorded request
table for its plan; the simulator's side is ``compare_with_engine`` with a step calibration.

    python benchmarks/results/s21_t3/serve_sim_range.py RUN_PREFIX CAL.json

RUN_PREFIX: ``benchmarks/results/engine/transformers_cb_synth_mixed_60s_x1`` (its ``_summary.csv``
and ``_requests.csv``). The engine's KV: 3,060 blocks of 256 tokens (the recordings'), Llama-3-8B's
131,072 bytes a token.
"""

import sys
from pathlib import Path

import pandas as pd

from realgpu.serve import ServeRun, ServeSettings
from sim.serving.engine_compare import compare_with_engine

prefix, cal = sys.argv[1], Path(sys.argv[2])
summary = pd.read_csv(f"{prefix}_summary.csv").iloc[0].to_dict()
summary["kv_bytes"] = 3060 * 256 * 131_072
plan = pd.read_csv(f"{prefix}_requests.csv")
run = ServeRun(spec=summary["policy"], summary=summary, steps=pd.DataFrame(), served=pd.DataFrame())
settings = ServeSettings(max_len_tokens=8192)
tables = compare_with_engine(
    [run], plan, settings, calibration=cal, trace_name=Path(prefix).name, warn=print
)
for spec, table in tables.items():
    print(f"measured against `simulate` ({spec}; error = predicted / measured - 1):")
    print(table.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
