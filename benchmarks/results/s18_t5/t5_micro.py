import time, dataclasses
from sim.replay.models import DEFAULT_MODEL, load_model
from sim.replay.hardware import DEFAULT_GPU, load_gpu
from sim.serving.steptime import StepTimeModel, load_step_calibration

cal = load_step_calibration("/tmp/t5o/calibration-10s.json")
old = dataclasses.replace(cal, fit={k: v for k, v in cal.fit.items() if k != "feature_range"})
m, g = load_model(DEFAULT_MODEL), load_gpu(DEFAULT_GPU)
a, b = StepTimeModel(m, g, calibration=cal), StepTimeModel(m, g, calibration=old)
assert a.range_count is not None and b.range_count is None
args = [(0, d, d * 900, 0, None) for d in range(1, 120)] + [
    (512, d, d * 900, 512, 1) for d in range(1, 60)
]


def run(stm):
    t = time.process_time()
    for _ in range(300):
        for p, d, c, pc, k in args:
            stm.step_time_s(p, d, c, pc, k)
    return time.process_time() - t


best = {"range": 1e9, "no range": 1e9}
for _ in range(7):
    best["range"] = min(best["range"], run(a))
    best["no range"] = min(best["no range"], run(b))
n = 300 * len(args)
print(
    {k: f"{v / n * 1e6:.2f} us a step" for k, v in best.items()},
    f"ratio {best['range'] / best['no range']:.3f}",
)
