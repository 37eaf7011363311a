"""One replay job as a worker runs it, under a collector setting (run under callgrind):
``cg_job.py SPEC default|freeze|tuned TRACE [THRESHOLDS] [noreplay]`` (``tuned``: ``gc.freeze()``
and ``gc.set_threshold(*THRESHOLDS)``, e.g. ``50000,20,20``; ``noreplay``: the setup only)."""

import gc
import sys

import poollab.cli  # noqa: F401  (the command's module state)
import poollab.commands.replay  # noqa: F401
from sim.replay.schema import format_table, write_results  # noqa: F401
from sim.replay.trace_replay import replay, trace_events
from traces.detect import read_alloc_trace

spec, mode, path = sys.argv[1], sys.argv[2], sys.argv[3]
trace = read_alloc_trace(path)
events = trace_events(trace)
if mode == "freeze":
    gc.freeze()
elif mode == "tuned":
    gc.freeze()
    gc.set_threshold(*[int(x) for x in sys.argv[4].split(",")])
if "noreplay" not in sys.argv:
    result = replay(trace, spec, events=events)
    print(result.summary["peak_reserved_bytes"], len(gc.get_objects()))
