"""The hour's request table and latency percentiles, before and after, side by side.

    PYTHONPATH=. python benchmarks/results/s20_t6/tables_side_by_side.py BEFORE_TREE TRACE POLICY [N]

One run of the trace (Llama-3-8B on H200, simulate's defaults), then the before tree's
``request_table`` and ``latency_percentiles`` (as ``serving_result`` called them there) and this
tree's: identical frames (dtypes, values, floats exactly) and floats, then each timed N times
(``timeit``, one call each, the four interleaved): best and median.
"""
import sys, timeit, importlib.util
import numpy as np, pandas as pd
from sim.serving.simulate import build_serving, _int64_array
from sim.replay import serving_metrics as new_sm, schema as new_schema
from sim.replay.hardware import DEFAULT_GPU
from sim.replay.models import DEFAULT_MODEL
from traces.request_readers import read_request_trace
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old_sm = load(f"{sys.argv[1]}/sim/replay/serving_metrics.py", "old_sm")
old_schema = load(f"{sys.argv[1]}/sim/replay/schema.py", "old_schema")
trace = read_request_trace(sys.argv[2])
setup = build_serving(trace, sys.argv[3], model=DEFAULT_MODEL, gpu=DEFAULT_GPU)
setup.server.run()
reqs = setup.requests; kv = setup.pools.kv
a, b = old_sm.request_table(reqs), new_sm.request_table(reqs)
pd.testing.assert_frame_equal(a, b, check_exact=True)
assert a.dtypes.to_dict() == b.dtypes.to_dict()
wa = [getattr(bl.values, "flags", None) and bl.values.flags.writeable for bl in a._mgr.blocks]
wb = [getattr(bl.values, "flags", None) and bl.values.flags.writeable for bl in b._mgr.blocks]
assert wa == wb, (wa, wb)
print("request tables identical:", b.shape, dict(b.dtypes.value_counts().items()))
def old_lat():
    return {**old_schema.latency_percentiles(np.asarray(kv.alloc_ns, dtype=np.int64), "alloc"), **old_schema.latency_percentiles(np.asarray(kv.free_ns, dtype=np.int64), "free")}
def new_lat():
    return {**new_schema.latency_percentiles(_int64_array(kv.alloc_ns), "alloc"), **new_schema.latency_percentiles(_int64_array(kv.free_ns), "free")}
oa, na = old_lat(), new_lat()
assert oa == na, (oa, na)
print("latency percentiles identical:", na)
n = int(sys.argv[4]) if len(sys.argv) > 4 else 21
res = {k: [] for k in ("old table", "new table", "old latency", "new latency")}
for _ in range(n):
    for k, f in (("old table", lambda: old_sm.request_table(reqs)), ("new table", lambda: new_sm.request_table(reqs)), ("old latency", old_lat), ("new latency", new_lat)):
        res[k].append(timeit.timeit(f, number=1))
for k, v in res.items():
    v.sort(); print(f"{k}: best {v[0]*1e3:.2f} ms, median {v[len(v)//2]*1e3:.2f} ms")
