"""Decode steps of 1-16 sequences under 30k KV tokens (launch-bound): duration quantiles (ms)."""
import glob, re, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, ".")
from traces.engine_profile import read_step_profile
files = sorted(glob.glob("benchmarks/results/engine*/transformers_cb_*_steps.csv"))
files = [f for f in files if "best-fit" not in f and "torch-caching" not in f]
files += ["/work/shared/data/engine/transformers_cb_azure_code_60s_steps.csv", "/work/shared/data/engine/transformers_cb_synth_mixed_60s_steps.csv"]
print(f"{'run':26s}    n    min    p5   p10   p25   p50   p90")
for f in files:
    s = read_step_profile(Path(f)).iloc[1:]
    m = (s.num_prefill_tokens == 0) & (s.decode_context_tokens < 30000) & (s.num_decode_seqs <= 16)
    q = 1e3 * s.duration_s[m].to_numpy()
    name = re.sub(r".*transformers_cb_(.*)_steps.csv", r"\1", f)
    print(f"{name:26s} {len(q):4d} " + " ".join(f"{v:5.0f}" for v in [q.min(), *np.percentile(q, [5, 10, 25, 50, 90])]))
