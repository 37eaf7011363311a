"""One calibrated simulate (the callgrind driver of RESULTS.md "Session 19 (t5)"): the first 1,000
requests of the Azure conversation hour priced by a fit on the 10 s synthetic x1_f profile.
``full``: the file as written; ``nomin``: its minima taken out (not checked below); ``norange``:
its range taken out (not checked). Run it with PYTHONPATH at the tree to measure."""

import copy
import sys

from sim.serving.engine_runs import simulate_served
from sim.serving.steptime import load_step_calibration
from traces.request_readers import read_request_trace

cal = load_step_calibration("/tmp/t5o/calibration-10s.json")
fit = copy.deepcopy(dict(cal.fit))
if sys.argv[1] == "nomin":
    for entry in fit["feature_range"]["features"].values():
        entry.pop("min", None)
elif sys.argv[1] == "norange":
    del fit["feature_range"]
cal = type(cal)(**{**cal.__dict__, "fit": fit})
r = simulate_served(read_request_trace("/tmp/t5_slice1k.csv"), cal)  # the default model and GPU
s = r.summary
print(s["n_steps"], s["extrapolated_step_frac"], s.get("extrapolation_ratio"),
      s.get("below_range_step_frac"), s["tpot_p50_s"], s["ttft_p99_s"])
