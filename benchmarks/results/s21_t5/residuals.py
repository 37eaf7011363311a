"""Each run's steps against one reference law (the fit pooled over all 25 recordings): median
measured / law by step class and by fifth of the run; usage: residuals.py [NAME ...]."""
import glob, re, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, ".")
from sim.replay.hardware import DEFAULT_GPU, load_gpu
from sim.replay.models import DEFAULT_MODEL, load_model
from sim.serving.step_fit import fit_step_profile, profile_features, roofline_s
from sim.serving.steptime import STEP_TERM_NAMES, StepTimeModel
from traces.engine_profile import read_step_profile
model, gpu = load_model(DEFAULT_MODEL), load_gpu(DEFAULT_GPU)
files = sorted(glob.glob("benchmarks/results/engine*/transformers_cb_*_steps.csv"))
files = [f for f in files if "best-fit" not in f and "torch-caching" not in f]
files += ["/work/shared/data/engine/transformers_cb_azure_code_60s_steps.csv", "/work/shared/data/engine/transformers_cb_synth_mixed_60s_steps.csv"]
runs = {re.sub(r".*transformers_cb_(.*)_steps.csv", r"\1", f): read_step_profile(Path(f)) for f in files}
ref = fit_step_profile(runs, model, gpu).terms
coef = np.array([getattr(ref, n) for n in STEP_TERM_NAMES])
roof = StepTimeModel(model, gpu)
print("reference (all 25 pooled):", {n: f"{getattr(ref, n):.3g}" for n in STEP_TERM_NAMES}, "hidden", ref.num_hidden_kv_tokens)
print(f"{'run':26s} {'dec<30k':>8s} {'dec>=30k':>8s} {'prefill':>8s} {'mixed':>8s} | fifths of the run (all steps) | share>1.2 | sum ratio")
for name, s in sorted(runs.items()):
    y = s.duration_s.to_numpy()
    pred = np.maximum(profile_features(s, ref.num_hidden_kv_tokens) @ coef, roofline_s(s, roof))
    r = y / pred
    kv = (s.prefill_context_tokens + s.decode_context_tokens).to_numpy()
    dec = s.num_prefill_tokens.to_numpy() == 0
    pre = s.num_decode_seqs.to_numpy() == 0
    cls = [dec & (kv < 30000), dec & (kv >= 30000), pre & ~dec, ~pre & ~dec]
    med = [f"{np.median(r[m]):8.2f}" if m.any() else "       -" for m in cls]
    fifths = " ".join(f"{np.median(p):.2f}" for p in np.array_split(r[1:], 5))
    print(f"{name:26s} {' '.join(med)} | {fifths} | {np.mean(r[1:] > 1.2):.2f} | {y[1:].sum() / pred[1:].sum():.2f}")
print()
print("median excess over the reference law (ms): decode steps under 30k KV | mixed steps | prefill-only; median duration of each (ms)")
for name, s in sorted(runs.items()):
    y = s.duration_s.to_numpy()
    pred = np.maximum(profile_features(s, ref.num_hidden_kv_tokens) @ coef, roofline_s(s, roof))
    kv = (s.prefill_context_tokens + s.decode_context_tokens).to_numpy()
    dec = s.num_prefill_tokens.to_numpy() == 0
    pre = s.num_decode_seqs.to_numpy() == 0
    cells = []
    for m in (dec & (kv < 30000), ~pre & ~dec, pre & ~dec):
        m = m.copy(); m[0] = False
        cells.append(f"{1e3*np.median(y[m]-pred[m]):+6.1f} ({1e3*np.median(y[m]):5.0f}, n={m.sum()})" if m.any() else "-")
    print(f"{name:26s} " + " | ".join(cells))
