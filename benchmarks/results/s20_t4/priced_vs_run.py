"""Priced vs run steps: the share past the fit's range over priced steps (fast path on) against
over the run's steps (fast path off: every step priced once, as it runs)."""
import sys
from sim.replay.models import DEFAULT_MODEL, load_model
from sim.replay.hardware import DEFAULT_GPU, load_gpu
from sim.serving.engine_runs import served_trace, served_setup
from sim.serving.fit_range import RangeCount
from sim.serving.step_fit import fit_step_profile
from traces.engine_profile import read_step_profile, read_served_requests

E = "benchmarks/results/"
pairs = [
    ("engine_s17/transformers_cb_synth_mixed_10s_x1_f", "engine/transformers_cb_synth_mixed_60s_x1"),
    ("engine/transformers_cb_azure_code_60s_x1_a", "engine/transformers_cb_synth_mixed_60s_x1"),
    ("engine_s17/transformers_cb_synth_mixed_10s_x1_f", "engine/transformers_cb_azure_code_60s_x1_a"),
]
for fit_run, judged in pairs:
    cal = fit_step_profile(read_step_profile(E + fit_run + "_steps.csv"), model=load_model(DEFAULT_MODEL), gpu=load_gpu(DEFAULT_GPU)).calibration
    trace = served_trace(read_served_requests(E + judged + "_requests.csv"))
    out = []
    for fast in (True, False):
        setup = served_setup(trace, cal)
        setup.server.fast_path = fast
        setup.server.run()
        c = setup.server.step_model.range_count
        out.append((c.num_steps, setup.server.num_steps, c.num_past, c.frac, c.num_below, c.below_frac, c.max_kv_tokens))
    print(fit_run.split("/")[-1], "->", judged.split("/")[-1])
    for name, o in zip(("fast (priced)", "slow (run)"), out):
        print(f"  {name}: priced {o[0]} run {o[1]} past {o[2]} ({100*o[3]:.2f} %) below {o[4]} ({100*o[5]:.2f} %) max kv {o[6]}")
