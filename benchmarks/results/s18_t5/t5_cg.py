import dataclasses, sys
from sim.serving.steptime import load_step_calibration
from sim.serving.engine_runs import simulate_served
from traces.request_readers import read_request_trace

cal = load_step_calibration("/tmp/t5o/calibration-10s.json")
if sys.argv[1] == "old":
    cal = dataclasses.replace(cal, fit={k: v for k, v in cal.fit.items() if k != "feature_range"})
r = simulate_served(read_request_trace("/tmp/t5_slice1k.csv"), cal)  # the default model and GPU
print(r.summary["n_steps"], r.summary["extrapolated_step_frac"])
