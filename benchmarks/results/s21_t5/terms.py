import sys, glob, re
from pathlib import Path
import numpy as np
sys.path.insert(0, ".")
from sim.replay.hardware import DEFAULT_GPU, load_gpu
from sim.replay.models import DEFAULT_MODEL, load_model
from sim.serving.step_fit import fit_step_profile
from traces.engine_profile import read_step_profile
model, gpu = load_model(DEFAULT_MODEL), load_gpu(DEFAULT_GPU)
files = sorted(glob.glob("benchmarks/results/engine*/transformers_cb_*_steps.csv"))
files = [f for f in files if "best-fit" not in f and "torch-caching" not in f]
files += ["/work/shared/data/engine/transformers_cb_azure_code_60s_steps.csv", "/work/shared/data/engine/transformers_cb_synth_mixed_60s_steps.csv"]
sel = sys.argv[1:] 
for f in files:
    name = re.sub(r".*transformers_cb_(.*)_steps.csv", r"\1", f)
    if sel and not any(s == name for s in sel): continue
    steps = read_step_profile(Path(f))
    fit = fit_step_profile(steps, model, gpu)
    t = fit.terms
    kv = (steps.prefill_context_tokens + steps.decode_context_tokens)
    print(f"{name:28s} n={fit.num_steps} out={fit.num_outliers} dw={fit.num_downweighted} fixed={t.fixed_s*1e3:.1f}ms seq={t.per_seq_s*1e6:.0f}us tok={t.per_token_s*1e6:.1f}us kv={t.per_kv_token_s*1e9:.0f}ns pair={t.per_pair_s*1e12:.2f}ps qkv={t.per_query_kv_s*1e12:.3f}ps exp={t.per_exposed_kv_token_s*1e9:.0f}ns hid={t.num_hidden_kv_tokens:.0f} maxkv={kv.max()}")
