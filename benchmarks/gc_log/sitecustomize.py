"""Log every Python garbage collection of a process (issue 31: are the engine's 0.5-0.7 s pauses
GC?).

Put this folder first on ``PYTHONPATH`` and set ``POOLLAB_GC_LOG_DIR``: each Python process started
then (``gpu serve``'s engine child included, which inherits both) appends one CSV row per collection
(of the young generation only those of 1 ms or more) to ``DIR/gc_<pid>.csv``: ``t_s``
(``time.perf_counter()`` at the start: CLOCK_MONOTONIC, one clock for every process of the machine:
``t_s`` less ``gpu serve``'s summary column ``t0_perf_counter_s`` is the step profile's ``start_s``
clock), ``wall_s`` (``time.time()``), ``generation``, ``duration_s``, ``collected``. A collection
stops every thread (it holds the GIL), so one during a step lengthens that step. Without the
variable nothing happens.

Another ``sitecustomize`` further along the path (a distribution's own) is still run.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("POOLLAB_GC_LOG_DIR")


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one shadows, if any (it would have run without us)."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _install(folder: str) -> None:
    import gc
    import time

    os.makedirs(folder, exist_ok=True)
    out = open(os.path.join(folder, f"gc_{os.getpid()}.csv"), "a", buffering=1)  # noqa: SIM115
    out.write("t_s,wall_s,generation,duration_s,collected\n")
    started = [0.0, 0.0]

    def on_gc(phase: str, info: dict) -> None:
        # nothing costly here: the callback runs inside the pause it measures
        if phase == "start":
            started[:] = [time.perf_counter(), time.time()]
        else:
            t, wall = started
            d = time.perf_counter() - t
            if info["generation"] == 0 and d < 1e-3:
                return  # the many short young collections: leave them out (the file stays small)
            out.write(
                f"{t:.6f},{wall:.6f},{info['generation']},{d:.6f},{info.get('collected', 0)}\n"
            )

    gc.callbacks.append(on_gc)


try:
    _chain_next_sitecustomize()
finally:
    if _DIR:
        _install(_DIR)
