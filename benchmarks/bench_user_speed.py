"""The waits users feel (issue 33), before and after, side by side in one run.

    PYTHONPATH=. python benchmarks/bench_user_speed.py --before DIR [--rows replay,validate]
        [--million SNAPSHOT] [--repeat N]

``DIR`` is a checkout of the code to compare with (``git archive <commit> | tar -x -C DIR``).
Each row runs one command as a user would (``python -m poollab ...``, a fresh process,
``--no-progress`` where the tree has it) under both trees, alternately (before, after, before,
after, ... ``--repeat`` times; the best time of each kept, so that a machine shared with other jobs
hits both alike), and reports its wall time and its peak memory (the largest resident set of the
process and its workers: ``getrusage(RUSAGE_CHILDREN)`` of a child that runs just that command), and
checks that both trees' ``summary.csv`` agree in every column that is no measured time.

Both trees' packages are compiled to bytecode first (``python -m compileall``), as ``pip
install`` does: a checkout where no ``.pyc`` can be written (the H200 image sets
``PYTHONDONTWRITEBYTECODE=1``) would otherwise compile every module in every run, a cost no
installed user pays (``--no-compile`` keeps the trees as they are).

Rows:

- ``replay``: ``poollab replay`` of a million-event snapshot under best-fit, paged,
  torch-caching, expandable, vmm-stitch (target: at most 1/3 of before's time, 500 MB).
  ``--million`` names the snapshot; made by ``make_million_snapshot.py`` when missing.
- ``validate``: ``poollab gpu replay <bundled slice> -p paged -p best-fit --backend host --sim``,
  with and without ``--validate`` (target: validated at most 10x the unvalidated run).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLICE = REPO / "traces" / "data" / "llama1b_generate_slice.pickle.gz"
FIVE = ["best-fit", "paged", "torch-caching", "expandable", "vmm-stitch"]
MILLION = Path("/tmp/llama1b_generate_1m.pickle.gz")

_MEASURE = """
import resource, subprocess, sys, time
t0 = time.perf_counter()
rc = subprocess.call(sys.argv[1:])
wall = time.perf_counter() - t0
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(rc, wall, use.ru_utime + use.ru_stime, use.ru_maxrss)
"""


def measure(tree: Path, argv: list[str]) -> tuple[float, float, float]:
    """``(wall_s, peak_mb, cpu_s)`` of ``python -m poollab argv`` run from ``tree`` (its own process
    tree; ``cpu_s`` is user + system time of it and its workers: the work, which other jobs on
    the machine do not inflate as they do the wall time)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", _MEASURE, sys.executable, "-m", "poollab", *argv]
    out = subprocess.run(
        cmd, cwd=tree, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    rc, wall_s, cpu_s, peak_kb = int(out[-4]), float(out[-3]), float(out[-2]), int(out[-1])
    if rc != 0:
        raise SystemExit(f"{tree}: poollab {' '.join(argv)} exited {rc}")
    return wall_s, peak_kb / 1024, cpu_s


def same_summaries(a: Path, b: Path, *, measured_ns: bool = False) -> str:
    """Whether two summaries agree in every untimed column (``measured_ns``: the ``*_ns*`` columns
    are measured too, as a real device's driver time is, and are left out)."""
    import pandas as pd

    x, y = pd.read_csv(a), pd.read_csv(b)
    timing = [c for c in x.columns if c.endswith(("_us", "_s")) or (measured_ns and "_ns" in c)]
    cols = [c for c in x.columns if c not in timing and c in y.columns]
    try:
        pd.testing.assert_frame_equal(x[cols], y[cols], check_exact=False, rtol=1e-12)
    except AssertionError as exc:
        return f"DIFFER: {str(exc).splitlines()[0]}"
    return f"identical ({len(cols)} untimed columns)"


PACKAGES = ("policies", "traces", "sim", "realgpu", "poollab")


def compile_tree(tree: Path) -> None:
    """Write the ``.pyc`` of ``tree``'s packages (``py_compile`` writes them whatever
    ``PYTHONDONTWRITEBYTECODE`` says; an import then reads them)."""
    dirs = [str(tree / p) for p in PACKAGES if (tree / p).is_dir()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *dirs], check=True)


def has_option(tree: Path, command: list[str], option: str) -> bool:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    text = subprocess.run(
        [sys.executable, "-m", "poollab", *command, "--help"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    return option in text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the code before")
    ap.add_argument("--rows", default="replay,validate")
    ap.add_argument("--million", type=Path, default=MILLION)
    ap.add_argument(
        "--repeat", type=int, default=1, help="alternating runs of each row; the best time is kept"
    )
    ap.add_argument(
        "--no-compile", action="store_true", help="do not compile the trees to bytecode first"
    )
    args = ap.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": REPO}
    print(
        f"# bench_user_speed {datetime.datetime.now().isoformat(timespec='seconds')} · python "
        f"{platform.python_version()} · {os.cpu_count()} cores "
        f"(affinity {len(os.sched_getaffinity(0))}) · load average {os.getloadavg()[0]:.2f}"
    )
    print(
        "# command: python benchmarks/bench_user_speed.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    if not args.no_compile:
        for tree in trees.values():
            compile_tree(tree)
        print(
            "# bytecode: both trees' packages compiled first (python -m compileall, as an install)"
        )
    rows = args.rows.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if "replay" in rows:
            if not args.million.exists():
                subprocess.run(
                    [
                        sys.executable,
                        str(REPO / "benchmarks" / "make_million_snapshot.py"),
                        str(args.million),
                    ],
                    check=True,
                )
            got = {}
            for _ in range(args.repeat):
                for name, tree in trees.items():
                    out = Path(tmp) / f"replay-{name}"
                    quiet = (
                        ["--no-progress"] if has_option(tree, ["replay"], "--no-progress") else []
                    )
                    run = measure(
                        tree,
                        [
                            "replay",
                            str(args.million),
                            *[a for p in FIVE for a in ("-p", p)],
                            "--out",
                            str(out),
                            *quiet,
                        ],
                    )
                    print(
                        f"replay 1M x5 policies  {name:>6}: "
                        f"{run[0]:7.1f} s  {run[1]:7.0f} MB peak  {run[2]:7.1f} s CPU  "
                        f"(load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
                    got[name] = min(got.get(name, run), run)
            b, a = got["before"], got["after"]
            print(
                f"replay 1M x5 policies  best of {args.repeat}: before {b[0]:.1f} s, "
                f"after {a[0]:.1f} s; CPU of those runs: before {b[2]:.1f} s, after {a[2]:.1f} s"
            )
            print(
                "replay 1M x5 policies  after/before: "
                f"CPU time {a[2] / b[2]:.2f} (the work: what more cores cannot cut)"
            )
            print(
                f"replay 1M x5 policies  after/before: time {a[0] / b[0]:.2f} (target <= 0.33), "
                f"peak {a[1]:.0f} MB (target <= 500); summaries "
                f"{same_summaries(Path(tmp) / 'replay-before' / 'summary.csv', Path(tmp) / 'replay-after' / 'summary.csv')}",  # noqa: E501
                flush=True,
            )
        if "validate" in rows:
            got = {}
            for _ in range(args.repeat):
                for name, tree in trees.items():
                    for validate in (False, True):
                        out = Path(tmp) / f"gpu-{name}-{validate}"
                        argv_ = [
                            "gpu",
                            "replay",
                            str(SLICE),
                            "-p",
                            "paged",
                            "-p",
                            "best-fit",
                            "--backend",
                            "host",
                            "--sim",
                            "--out",
                            str(out),
                            "--no-progress",
                            *(["--validate"] if validate else []),
                        ]
                        run = measure(tree, argv_)
                        print(
                            f"gpu replay slice {'--validate' if validate else 'plain':>10} "
                            f"{name:>6}: "
                            f"{run[0]:7.1f} s  {run[1]:7.0f} MB peak  {run[2]:7.1f} s CPU",
                            flush=True,
                        )
                        got[name, validate] = min(got.get((name, validate), run), run)
            for name in trees:
                print(
                    f"gpu replay --validate over plain, {name}: "
                    f"{got[name, True][0] / got[name, False][0]:.1f}x (target <= 10x)"
                )
            print(
                f"validated summaries before/after: "
                f"{same_summaries(Path(tmp) / 'gpu-before-True' / 'summary.csv', Path(tmp) / 'gpu-after-True' / 'summary.csv', measured_ns=True)}"  # noqa: E501
            )
    print(f"# load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
