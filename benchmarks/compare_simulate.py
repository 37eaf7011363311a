"""`simulate` in two trees, side by side: identical untimed results, CPU time and instructions.

    python benchmarks/compare_simulate.py BEFORE_TREE TRACE -p paged -p best-fit [--repeat 3]
    python benchmarks/compare_simulate.py BEFORE_TREE TRACE -p paged --callgrind
    python benchmarks/compare_simulate.py BEFORE_TREE SHORT_TRACE -p paged --rate-scale 2

Each cell (tree, policy) runs ``build_serving`` + ``Server.run`` + ``serving_result`` (Llama-3-8B
on an H200, ``simulate``'s defaults) in a fresh interpreter whose ``PYTHONPATH`` is that tree
(``PYTHONHASHSEED=0``), this tree being the one this script lies in. The summary's untimed
columns, the request table and the time series must be equal, floats exactly (the timing columns
are left out by ``tests/sim/serving/test_step_fast_path.py``'s ``TIMING`` filter); exit status 1
when they are not. Printed: the CPU time of the run (best of ``--repeat``, trees alternating) and
the ratio after / before; with ``--callgrind``, the instructions of one warm run under
``valgrind --tool=callgrind`` (the count of a process running it twice minus one running it once,
which a loaded machine does not change) per simulated request, and their ratio. ``--rate-scale``
runs the trace at that many times its request rate (``RequestTrace.scale_rate``, as ``simulate
--rate-scale``), ``--option KNOB=VALUE`` sets a simulator option (``build_serving``'s keywords:
``kv_capacity_bytes`` for a KV budget small enough to preempt), in both trees; a bad knob stops
the child with the simulator's error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.sim.serving.test_step_fast_path import TIMING  # noqa: E402

CHILD = r"""
import json, pickle, sys, time
from sim.serving.simulate import build_serving, serving_result
from traces.request_readers import read_request_trace
trace_path, spec, out, num_runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rate_scale, options = float(sys.argv[5]), json.loads(sys.argv[6])
trace = read_request_trace(trace_path)
if rate_scale != 1:
    trace = trace.scale_rate(rate_scale)
for _ in range(num_runs):
    setup = build_serving(trace, spec, model="Llama-3-8B", gpu="H200", **options)
    c0 = time.process_time()
    end_s = setup.server.run()
    r = serving_result(setup, end_s=end_s, wall_s=0.0)
    cpu_s = time.process_time() - c0
if out != "-":
    with open(out, "wb") as f:
        pickle.dump((dict(r.summary), r.requests, r.timeseries, cpu_s, len(trace)), f)
"""


def _env(tree: Path) -> dict[str, str]:
    # the caller's other paths (the H200 image's simpy under a --target folder) come after the tree;
    # a path that is this repository is dropped: a module the tree lacks is not taken from it
    kept = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != REPO
    ]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *kept]), "PYTHONHASHSEED": "0"}


def run_cell(
    tree: Path, trace: str, spec: str, out: Path, rate_scale: float = 1.0, options: str = "{}"
) -> tuple:
    """One run in ``tree``: ``(summary, requests, timeseries, cpu_s, num_requests)``."""
    subprocess.run(
        [sys.executable, "-c", CHILD, trace, spec, str(out), "1", repr(rate_scale), options],
        cwd=tree,
        env=_env(tree),
        check=True,
    )
    with open(out, "rb") as f:
        return pickle.load(f)


def instructions(
    tree: Path, trace: str, spec: str, tmp: Path, rate_scale: float = 1.0, options: str = "{}"
) -> int:
    """Instructions of one warm run in ``tree``: callgrind's count of two runs minus one."""
    counts = []
    for n in (1, 2):
        log = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={tmp / f'cg.{n}.out'}",
                sys.executable,
                "-c",
                CHILD,
                trace,
                spec,
                "-",
                str(n),
                repr(rate_scale),
                options,
            ],
            cwd=tree,
            env=_env(tree),
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        counts.append(int(re.search(r"Collected : (\d+)", log).group(1)))
    return counts[1] - counts[0]


def differences(a: tuple, b: tuple) -> list[str]:
    """What differs between two cells' untimed results (empty: identical)."""
    out = []
    for k, v in a[0].items():
        if TIMING.search(k):
            continue
        w = b[0].get(k)
        nan = isinstance(v, float) and isinstance(w, float) and math.isnan(v) and math.isnan(w)
        if v != w and not nan:
            out.append(f"summary column {k}: {v!r} != {w!r}")
    for what, x, y in (("requests", a[1], b[1]), ("timeseries", a[2], b[2])):
        if list(x.columns) != list(y.columns):
            out.append(f"{what}: other columns")
            continue
        keep = [c for c in x.columns if not TIMING.search(str(c))]
        try:
            pd.testing.assert_frame_equal(x[keep], y[keep], check_exact=True, obj=what)
        except AssertionError as exc:
            out.append(str(exc).splitlines()[0])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", help="the other tree (e.g. `git archive main | tar -x -C DIR`)")
    ap.add_argument("trace")
    ap.add_argument("--policy", "-p", action="append", dest="policies", required=True)
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell; the fastest counts")
    ap.add_argument("--callgrind", action="store_true", help="also count instructions")
    ap.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="the trace at this many times its request rate (2: arrivals twice as dense)",
    )
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="a simulator option for both trees (a ServerConfig knob, the value a JSON number, "
        "true/false or else a string), e.g. kv_capacity_bytes=4294967296 (preemptions)",
    )
    args = ap.parse_args(argv)
    before, trace = Path(args.before).resolve(), str(Path(args.trace).resolve())
    if not (before / "sim" / "serving" / "simulate.py").is_file():
        print(f"compare_simulate: {before} is not a poollab tree", file=sys.stderr)
        return 2
    if not 0 < args.rate_scale < math.inf:
        print(f"compare_simulate: --rate-scale {args.rate_scale:g} must be > 0", file=sys.stderr)
        return 2
    options = {}
    for item in args.option:
        knob, eq, text = item.partition("=")
        if not eq or not knob:
            print(f"compare_simulate: --option {item!r} is not KNOB=VALUE", file=sys.stderr)
            return 2
        try:
            options[knob] = json.loads(text)
        except ValueError:
            options[knob] = text
    options_json = json.dumps(options)
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for spec in args.policies:
            cells: dict[str, tuple] = {}
            cpu = {"before": math.inf, "after": math.inf}
            for _ in range(max(1, args.repeat)):
                for name, tree in (("before", before), ("after", REPO)):
                    try:
                        cells[name] = run_cell(
                            tree, trace, spec, tmp / f"{name}.pkl", args.rate_scale, options_json
                        )
                    except subprocess.CalledProcessError as exc:
                        print(
                            f"compare_simulate: {spec} in {tree} failed (exit status "
                            f"{exc.returncode}; its error above)",
                            file=sys.stderr,
                        )
                        return 2
                    cpu[name] = min(cpu[name], cells[name][3])
            diff = differences(cells["before"], cells["after"])
            same &= not diff
            n = cells["after"][4]
            line = (
                f"{spec}: {'identical' if not diff else 'DIFFERENT'} untimed results "
                f"({n:,} requests"
                + (f", rate x{args.rate_scale:g}" if args.rate_scale != 1 else "")
                + "".join(f", {k}={v}" for k, v in options.items())
                + f"); CPU s before {cpu['before']:.2f}, after {cpu['after']:.2f}, "
                f"after/before {cpu['after'] / cpu['before']:.3f}"
            )
            if args.callgrind:
                ins = {
                    k: instructions(t, trace, spec, tmp, args.rate_scale, options_json)
                    for k, t in (("before", before), ("after", REPO))
                }
                line += (
                    f"; instructions/request before {ins['before'] / n:,.0f}, after "
                    f"{ins['after'] / n:,.0f}, after/before {ins['after'] / ins['before']:.3f}"
                )
            print(line, flush=True)
            for d in diff[:10]:
                print(f"  {d}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
