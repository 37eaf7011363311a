"""Run `python -m poollab ARGS` in a child with timestamps at known points; print the gaps."""
import os, subprocess, sys, time, tempfile, resource
log = tempfile.mktemp(suffix=".log")
PROBE = r'''
import time, os, sys, atexit
_T = time.perf_counter
_LOG = open(os.environ["WALLPROBE_LOG"], "a", buffering=1)
def mark(what): _LOG.write(f"{_T():.6f} {what}\n")
mark("interp up (site done)")
atexit.register(mark, "atexit (last handler)")
import poollab.cli
mark("poollab.cli imported")
import poollab.commands.replay as R
mark("commands.replay imported")
import traces.read_ahead as RA
_sr = RA.start_read
def start_read(*a, **k):
    mark("start_read call"); r = _sr(*a, **k); mark("start_read returned"); return r
R.start_read = start_read
_res = RA.ReadAhead.result
def result(self):
    mark("result() call"); r = _res(self); mark("result() returned"); return r
RA.ReadAhead.result = result
import sim.replay.trace_replay as TR
import sim.replay.schema as S
mark("heavy imported (probe)")
def wrap(mod, name):
    f = getattr(mod, name)
    def g(*a, **k):
        mark(name + " call"); r = f(*a, **k); mark(name + " returned"); return r
    setattr(mod, name, g)
wrap(TR, "replay_tables"); wrap(TR, "trace_events"); wrap(TR, "_replay_in_workers")
wrap(TR, "summary_frame"); wrap(TR, "latency_samples")
wrap(S, "write_results"); wrap(S, "format_table")
import click
_echo = click.echo
R.click.echo = click.echo
sys.argv = ["poollab"] + sys.argv[1:]
from poollab.__main__ import run
try:
    run()
finally:
    mark("run() ended")
    import gc
    if os.environ.get("COLLECT"): gc.collect(); mark("collected")
    if os.environ.get("FREEZE"): gc.freeze(); mark("frozen")
'''
env = {**os.environ, "WALLPROBE_LOG": log}
t0 = time.perf_counter()
rc = subprocess.call([sys.executable, "-c", PROBE, *sys.argv[1:]], env=env, stdout=subprocess.DEVNULL)
t1 = time.perf_counter()
u = resource.getrusage(resource.RUSAGE_CHILDREN)
rows = [(t0, "spawn")] + [(float(l.split(" ", 1)[0]), l.split(" ", 1)[1].strip()) for l in open(log)] + [(t1, "process reaped")]
os.unlink(log)
prev = t0
for t, what in rows:
    print(f"{t - t0:8.3f}  +{t - prev:6.3f}  {what}")
    prev = t
print(f"rc {rc}; wall {t1 - t0:.3f} s; CPU {u.ru_utime + u.ru_stime:.2f} s; maxrss {u.ru_maxrss/1024:.0f} MB")
