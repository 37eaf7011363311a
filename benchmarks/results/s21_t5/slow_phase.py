"""The recordings with a cpu_s column (sessions 16-17): decode steps under 30k KV tokens, per
fifth of the run: median duration (ms), median batch, median cpu_s / duration_s."""
import glob, re, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, ".")
from traces.engine_profile import read_step_profile
for f in sorted(glob.glob("benchmarks/results/engine_s1[67]/transformers_cb_*_steps.csv")):
    s = read_step_profile(Path(f))
    name = re.sub(r".*transformers_cb_(.*)_steps.csv", r"\1", f)
    s = s.iloc[1:]
    kv = s.prefill_context_tokens + s.decode_context_tokens
    parts = np.array_split(np.arange(len(s)), 5)
    out = []
    for p in parts:
        q = s.iloc[p]
        m = (q.num_prefill_tokens == 0) & ((q.prefill_context_tokens + q.decode_context_tokens) < 30000)
        q = q[m]
        if len(q) == 0:
            out.append("   -   "); continue
        out.append(f"{1e3*q.duration_s.median():5.0f}ms b{q.num_decode_seqs.median():3.0f} c{(q.cpu_s/q.duration_s).median():.2f} n{len(q)}")
    print(f"{name:26s} " + " | ".join(out))
