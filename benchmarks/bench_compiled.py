"""Pure Python against the Cython build of ``policies`` from the same source, side by side (issue
16).

    python benchmarks/bench_compiled.py [TRACE] [-p SPEC ...] [--rounds 4] [--repeat 5] [--test]
    [--keep DIR]

Builds a compiled copy of this tree in a temporary folder (``policies.testing.compiled``: the
same build as ``POOLLAB_COMPILE=1 pip install -e .``, the modules declared by a ``.pxd``
compiled with Cython in pure-Python mode, everything else interpreted), checks that they really
import as extension modules, with ``--test`` runs ``tests/policies`` (the conformance battery
included) against them, and runs ``benchmarks/bench_replay.py`` in both trees, alternating
``--rounds`` times so that a busy machine hits both alike. Printed: the best ns per event of
each row in each build (best over rounds x repeats), its ratio to the inline-dict floor of the
same build, and pure / compiled.

Needs Cython (``pip install cython``; in the dev extra) and a C compiler.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from policies.testing.compiled import (
    build_compiled_copy,
    build_description,
    run_in,  # noqa: E402
    unavailable_reason,
)

#: the policies issue 16 sets compiled targets for (bench_replay adds the floor rows itself)
DEFAULT_POLICIES = ["paged", "size-class", "best-fit", "first-fit"]
INLINE, NOTHING = "(inline dict)", "(do-nothing)"


def bench_rows(
    tree: Path, trace: str, specs: list[str], repeat: int, clock: str, out: Path
) -> dict[str, float]:
    """ns per event of the bare loop of every row, from one ``bench_replay --bare-only`` run in
    ``tree``."""
    cmd = [
        sys.executable,
        "benchmarks/bench_replay.py",
        trace,
        "--repeat",
        str(repeat),
        "--clock",
        clock,
        "--bare-only",
        "--out",
        str(out),
    ]
    for spec in specs:
        cmd += ["-p", spec]
    run_in(tree, cmd, stdout=subprocess.DEVNULL)
    with open(out, newline="") as f:
        return {r["row"]: float(r["bare_ns"]) for r in csv.DictReader(f)}


def export_ref(ref: str, dest: Path) -> None:
    """The tree of git ``ref`` in ``dest`` (for the pure rows before a change)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", ref], cwd=REPO, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def main(argv=None) -> int:
    from traces import bundled_path, read_alloc_trace

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "trace", nargs="?", default=str(bundled_path("llama1b_generate_slice.pickle.gz"))
    )
    ap.add_argument("-p", "--policy", action="append", dest="specs", help="a policy spec (repeat)")
    ap.add_argument(
        "--rounds", type=int, default=4, help="bench_replay runs per build, alternating"
    )
    ap.add_argument("--repeat", type=int, default=5, help="bench_replay's --repeat in each run")
    ap.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="bench_replay's --clock"
    )
    ap.add_argument(
        "--test", action="store_true", help="run tests/policies against the compiled modules first"
    )
    ap.add_argument(
        "--keep",
        default=None,
        help="build the compiled copy here and keep it (default: a temp folder)",
    )
    ap.add_argument(
        "--pure-ref",
        default=None,
        metavar="REF",
        help="also time the pure tree of git REF (e.g. a merge base): before/after a change",
    )
    args = ap.parse_args(argv)
    specs = args.specs or DEFAULT_POLICIES
    read_alloc_trace(
        args.trace
    )  # a malformed trace fails here, in one line, not in every bench_replay run after a build
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_compiled needs Cython and a C compiler: {reason}", file=sys.stderr)
        return 2
    if any((REPO / "policies").glob("*.so")):
        print(
            f"{REPO}/policies holds compiled modules (an opt-in install): "
            "the pure rows would not be pure; remove policies/*.so first",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="poollab-compiled-") as tmp:
        compiled = Path(args.keep) if args.keep else Path(tmp) / "tree"
        build_compiled_copy(compiled)
        if args.test:
            run_in(
                compiled,
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-x",
                    "tests/policies",
                    "--ignore=tests/policies/test_compiled.py",
                ],
            )
        builds = {"pure": REPO, "cython": compiled}
        if args.pure_ref:
            export_ref(args.pure_ref, Path(tmp) / "ref")
            builds = {f"pure@{args.pure_ref[:9]}": Path(tmp) / "ref", **builds}
        best: dict[str, dict[str, float]] = {build: {} for build in builds}
        for i in range(args.rounds):
            for build, tree in builds.items():
                rows = bench_rows(
                    tree, args.trace, specs, args.repeat, args.clock, Path(tmp) / f"{i}{build}.csv"
                )
                for row, ns in rows.items():
                    best[build][row] = min(best[build].get(row, float("inf")), ns)
    pure, comp = best["pure"], best["cython"]
    print(
        f"# bench_compiled {datetime.datetime.now().isoformat(timespec='seconds')} · python "
        f"{platform.python_version()} · {os.cpu_count()} cores · load "
        f"average {os.getloadavg()[0]:.2f}"
    )
    print(f"# interpreter and build: {build_description()}")
    print(
        "# command: python benchmarks/bench_compiled.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    print(
        f"# bare-loop ns per event ({args.clock} clock), "
        f"best of {args.rounds} rounds x {args.repeat} repeats, builds alternating; "
        "x_dict: over the inline-dict floor of the same build"
    )
    header = f"{'row':<24}" + "".join(f" {build + '_ns':>16} {'x_dict':>7}" for build in builds)
    print(header + f" {'pure/cython':>11}")
    for row in pure:
        cells = "".join(
            f" {best[b][row]:>16.0f} {best[b][row] / best[b][INLINE]:>6.2f}x" for b in builds
        )
        print(f"{row:<24}{cells} {pure[row] / comp[row]:>10.2f}x")
    print(
        "# the contract (do-nothing: an interpreted Policy subclass) "
        f"compiled is {pure[NOTHING] / comp[NOTHING]:.2f}x as fast as pure Python (issue 16: >= 2x)"
    )
    return 0


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
