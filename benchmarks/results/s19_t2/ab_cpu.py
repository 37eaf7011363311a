"""CPU seconds of one in-process replay (best of 3): ``ab_cpu.py TRACE SPEC``."""

import sys
import time

from sim.replay.trace_replay import replay, trace_events
from traces.detect import read_alloc_trace

trace = read_alloc_trace(sys.argv[1])
events = trace_events(trace)
best_s = float("inf")
for _ in range(3):
    t = time.process_time()
    replay(trace, sys.argv[2], events=events)
    best_s = min(best_s, time.process_time() - t)
print(sys.argv[2], f"{best_s:.3f}")
