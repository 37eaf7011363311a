"""``StepTimeModel.step_time_s`` calls of a calibrated model, under callgrind (RESULTS.md "Session
19 (t5)"): ``python t5_cg_calls.py VARIANT LOOPS`` prices 178 steps (decode batches of 1-119
sequences at 900 KV tokens each, and mixed steps of 512 prefill tokens) LOOPS times, with the
fit on the 10 s synthetic x1_f profile (/tmp/t5o/calibration-10s.json: 53 % of these steps lie
past its range, a few under). VARIANT: ``full`` (the file as written), ``nomin`` (minima taken
out), ``norange`` (range taken out: not checked). The instructions a call costs are
(I(LOOPS) - I(0)) / (LOOPS x 178), per tree (PYTHONPATH) and variant."""

import copy
import sys

from sim.replay.hardware import DEFAULT_GPU, load_gpu
from sim.replay.models import DEFAULT_MODEL, load_model
from sim.serving.steptime import StepTimeModel, load_step_calibration

variant, loops = sys.argv[1], int(sys.argv[2])
cal = load_step_calibration("/tmp/t5o/calibration-10s.json")
fit = copy.deepcopy(dict(cal.fit))
if variant == "nomin":
    for entry in fit["feature_range"]["features"].values():
        entry.pop("min", None)
elif variant == "norange":
    del fit["feature_range"]
cal = type(cal)(**{**cal.__dict__, "fit": fit})
stm = StepTimeModel(load_model(DEFAULT_MODEL), load_gpu(DEFAULT_GPU), calibration=cal)
args = [(0, d, d * 900, 0, None) for d in range(1, 120)] + [
    (512, d, d * 900, 512, 1) for d in range(1, 60)
]
f = stm.step_time_s
for _ in range(loops):
    for p, d, c, pc, k in args:
        f(p, d, c, pc, k)
count = stm.range_count
print(variant, loops, None if count is None else (count.num_steps, count.num_past))
