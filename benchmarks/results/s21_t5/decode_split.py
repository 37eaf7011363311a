"""Step level, held out: does a decode query x KV term of its own (apart from prefill's) price
the other runs' decode steps better? Each run's law fitted (sim.serving.step_fit._fit, its own
tail count) with the query x KV column as one ((p + d) x kv, shipped) or split (p x kv, d x kv);
each other run's decode steps (no prefill token) priced; mean |error| and summed bias, %."""
import glob, re, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, ".")
import sim.serving.step_fit as sf
from sim.replay.hardware import DEFAULT_GPU, load_gpu
from sim.replay.models import DEFAULT_MODEL, load_model
from sim.serving.steptime import StepTimeModel, default_calibration
from traces.engine_profile import read_step_profile
model, gpu = load_model(DEFAULT_MODEL), load_gpu(DEFAULT_GPU)
files = sorted(glob.glob("benchmarks/results/engine*/transformers_cb_*_steps.csv"))
files = [f for f in files if "best-fit" not in f and "torch-caching" not in f]
files += ["/work/shared/data/engine/transformers_cb_azure_code_60s_steps.csv", "/work/shared/data/engine/transformers_cb_synth_mixed_60s_steps.csv"]
runs = {re.sub(r".*transformers_cb_(.*)_steps.csv", r"\1", f): read_step_profile(Path(f)) for f in files}
roof = StepTimeModel(model, gpu, calibration=default_calibration())
def cols(s, hidden, split):
    x = sf.profile_features(s, hidden)
    if not split:
        return x
    p = s.num_prefill_tokens.to_numpy(float); d = s.num_decode_seqs.to_numpy(float)
    kv = (s.prefill_context_tokens + s.decode_context_tokens).to_numpy(float)
    x = x.copy(); x[:, 5] = p * kv
    return np.column_stack([x, d * kv])
fits = {}
for n, s in runs.items():
    shipped = sf.fit_step_profile(s, model, gpu)
    hidden = shipped.terms.num_hidden_kv_tokens
    tail = shipped.terms.per_exposed_kv_token_s > 0 or hidden > 0
    y, floor = s.duration_s.to_numpy(), sf.roofline_s(s, roof)
    for split in (False, True):
        x = cols(s, hidden, split)
        active = [j for j in range(x.shape[1]) if tail or j != 6]
        coef, _ = sf._fit(x, y, floor, active)
        fits[n, split] = (coef, hidden)
    print(f"{n:26s} d x kv split off: prefill q x kv {fits[n, True][0][5]*1e12:7.1f} ps, decode q x kv {fits[n, True][0][7]*1e12:7.1f} ps (one column: {fits[n, False][0][5]*1e12:7.1f} ps)")
res = {False: [], True: []}
for fn in runs:
    for jn, s in runs.items():
        if jn == fn:
            continue
        y, floor = s.duration_s.to_numpy(), sf.roofline_s(s, roof)
        m = s.num_prefill_tokens.to_numpy() == 0; m[0] = False
        for split in (False, True):
            coef, hidden = fits[fn, split]
            pred = np.maximum(cols(s, hidden, split) @ coef, floor)
            res[split].append((np.mean(np.abs(pred[m] / y[m] - 1)), pred[m].sum() / y[m].sum() - 1))
for split in (False, True):
    a = np.array(res[split])
    print(f"{'split' if split else 'one column (shipped)':22s}: held-out decode steps, mean |error| {100*a[:,0].mean():.2f} % (median over pairs {100*np.median(a[:,0]):.2f}), |summed bias| mean {100*np.abs(a[:,1]).mean():.2f} %")
