import dataclasses, time
from sim.serving.steptime import load_step_calibration
from sim.serving.engine_runs import simulate_served
from traces.request_readers import read_request_trace

cal = load_step_calibration("/tmp/t5o/calibration-10s.json")
old = dataclasses.replace(cal, fit={k: v for k, v in cal.fit.items() if k != "feature_range"})
trace = read_request_trace("/tmp/t5_slice1k.csv")
best = {"range": 1e9, "no range": 1e9}
res = {}
for _ in range(6):
    for name, c in (
        (("range", cal), ("no range", old)) if _ % 2 else (("no range", old), ("range", cal))
    ):
        t = time.process_time()
        r = simulate_served(trace, c)  # the default model and GPU
        dt = time.process_time() - t
        best[name] = min(best[name], dt)
        res[name] = r
a, b = res["range"].summary, res["no range"].summary
diff = [
    k
    for k in a
    if k not in ("wall_s", "extrapolated_step_frac", "range_warning")
    and a[k] != b[k]
    and not (a[k] != a[k] and b[k] != b[k])
]
print(
    "steps",
    a["n_steps"],
    "extrapolated_step_frac",
    round(a["extrapolated_step_frac"], 4),
    "differing columns:",
    diff,
)
print(
    {k: f"{v:.2f} s CPU" for k, v in best.items()}, f"ratio {best['range'] / best['no range']:.3f}"
)
print(a["range_warning"])
