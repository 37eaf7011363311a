"""CPU time of priced_range's one simulation, the fast path on (before) and off (now)."""
import time
from sim.serving import engine_runs
from sim.serving.engine_runs import served_trace, served_setup, fit_from_requests
from sim.serving.fit_range import StepFeatureLog
from traces.engine_profile import read_served_requests

served = read_served_requests("benchmarks/results/engine/transformers_cb_azure_code_60s_x1_a_requests.csv")
t0 = time.process_time()
fit = fit_from_requests(served)
fit_s = time.process_time() - t0
cal = fit.calibration
trace = served_trace(served)
best = {}
for _ in range(5):
    for fast in (True, False):
        setup = served_setup(trace, cal)
        log = StepFeatureLog()
        setup.server.step_model.range_count = log
        setup.server.fast_path = fast
        t = time.process_time()
        setup.server.run()
        dt = time.process_time() - t
        best[fast] = min(best.get(fast, 1e9), dt)
        n = (log.num_steps, setup.server.num_steps)
        rng = log.fitted_range()
        print("fast" if fast else "slow", f"{dt:.3f} s CPU", "logged/run", n, "kv max", rng.max["kv_tokens"], "q99", round(rng.quantile["kv_tokens"]), "min", rng.min["kv_tokens"])
print(f"whole fit_from_requests: {fit_s:.2f} s CPU; best of 5: fast {best[True]:.3f} s, slow {best[False]:.3f} s")
