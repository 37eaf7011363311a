"""Pure Python against a Cython build of ``policies`` from the same source, side by side (issue 16).

    python benchmarks/bench_compiled.py [TRACE] [-p SPEC ...] [--rounds 4] [--repeat 5] [--test] [--keep DIR]

Copies this tree to a temporary folder and compiles every module of ``policies`` there (not
``policies/testing``: the battery stays interpreted, it is what checks the compiled modules) with
Cython in pure-Python mode: the unchanged ``.py`` files, annotations ignored
(``annotation_typing=False``) so no type is enforced that Python would not enforce. It then checks
that the copy really imports extension modules (each compiled module's ``__file__`` is a shared
object), with ``--test`` runs ``tests/policies`` (the conformance battery included) against them,
and runs ``benchmarks/bench_replay.py`` in both trees, alternating ``--rounds`` times so that a
busy machine hits both alike. Printed: the best ns per event of each row in each build (best over
rounds x repeats), its ratio to the inline-dict floor of the same build, and pure / compiled.

Needs Cython (``pip install cython``) and a C compiler; neither is a dependency of poollab. The
module list is derived (every ``policies/*.py``), so it follows the package as it changes.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: what a copy of the tree leaves out: environments, VCS data and build outputs
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", ".ci-venv", "venv", ".whl", "build", "__pycache__", "*.so",
                                     "*.c", "*.egg-info", "poollab-out", "poollab-demo", "node_modules")
#: keeps Python's semantics: no annotation becomes a C type or a runtime type check
DIRECTIVES = {"language_level": 3, "annotation_typing": False}
#: the policies issue 16 sets compiled targets for (bench_replay adds the floor rows itself)
DEFAULT_POLICIES = ["paged", "size-class", "best-fit", "first-fit"]
INLINE, NOTHING = "(inline dict)", "(do-nothing)"

BUILD = """
import glob, sys
from setuptools import setup
from Cython.Build import cythonize
modules = sorted(p for p in glob.glob("policies/*.py") if not p.endswith("__init__.py"))
setup(ext_modules=cythonize(modules, compiler_directives={directives!r}, nthreads={jobs}, quiet=True),
      script_name="setup.py", script_args=["build_ext", "--inplace", "-j", "{jobs}"])
"""

CHECK = """
import importlib, pathlib, sys
names = sorted(p.stem for p in pathlib.Path("policies").glob("*.py") if p.stem != "__init__")
plain = [n for n in names if not importlib.import_module("policies." + n).__file__.endswith(".so")]
print(f"{len(names) - len(plain)} of {len(names)} policies modules imported as extension modules")
sys.exit(f"imported as Python, not compiled: {plain}" if plain else 0)
"""


def run(cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``cwd`` with that tree first on the import path (so its ``policies`` is the one used)."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(cmd, cwd=cwd, env=env, check=True, **kw)


def build_compiled_copy(dest: Path) -> None:
    shutil.copytree(REPO, dest, ignore=COPY_IGNORE, dirs_exist_ok=True)  # a kept copy is refreshed in place
    jobs = os.cpu_count() or 1
    print(f"# compiling policies/*.py with Cython in {dest} ({jobs} jobs)", flush=True)
    run([sys.executable, "-c", BUILD.format(directives=DIRECTIVES, jobs=jobs)], dest, stdout=subprocess.DEVNULL)
    run([sys.executable, "-c", CHECK], dest)


def bench_rows(tree: Path, trace: str, specs: list[str], repeat: int, out: Path) -> dict[str, float]:
    """ns per event of the bare loop of every row, from one bench_replay run in ``tree``."""
    cmd = [sys.executable, "benchmarks/bench_replay.py", trace, "--repeat", str(repeat), "--out", str(out)]
    for spec in specs:
        cmd += ["-p", spec]
    run(cmd, tree, stdout=subprocess.DEVNULL)
    with open(out, newline="") as f:
        return {r["row"]: float(r["bare_ns"]) for r in csv.DictReader(f)}


def main(argv=None) -> int:
    sys.path.insert(0, str(REPO))
    from traces import bundled_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=str(bundled_path("llama1b_generate_slice.pickle.gz")))
    ap.add_argument("-p", "--policy", action="append", dest="specs", help="a policy spec (repeat)")
    ap.add_argument("--rounds", type=int, default=4, help="bench_replay runs per build, alternating")
    ap.add_argument("--repeat", type=int, default=5, help="bench_replay's --repeat in each run")
    ap.add_argument("--test", action="store_true", help="run tests/policies against the compiled modules first")
    ap.add_argument("--keep", default=None, help="build the compiled copy here and keep it (default: a temp folder)")
    args = ap.parse_args(argv)
    specs = args.specs or DEFAULT_POLICIES
    if importlib.util.find_spec("Cython") is None or not any(map(shutil.which, ("cc", "gcc", "clang"))):
        print("bench_compiled needs Cython (pip install cython) and a C compiler (cc, gcc or clang) on PATH",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="poollab-compiled-") as tmp:
        compiled = Path(args.keep) if args.keep else Path(tmp) / "tree"
        build_compiled_copy(compiled)
        if args.test:
            run([sys.executable, "-m", "pytest", "-q", "-x", "tests/policies"], compiled)
        best = {"pure": {}, "compiled": {}}
        for i in range(args.rounds):
            for build, tree in (("pure", REPO), ("compiled", compiled)):
                rows = bench_rows(tree, args.trace, specs, args.repeat, Path(tmp) / f"{build}{i}.csv")
                for row, ns in rows.items():
                    best[build][row] = min(best[build].get(row, float("inf")), ns)
    pure, comp = best["pure"], best["compiled"]
    print(f"# bench_compiled {datetime.datetime.now().isoformat(timespec='seconds')} · python "
          f"{platform.python_version()} · {os.cpu_count()} cores · load average {os.getloadavg()[0]:.2f}")
    print(f"# command: python benchmarks/bench_compiled.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# bare-loop ns per event, best of {args.rounds} rounds x {args.repeat} repeats, builds alternating")
    print(f"{'row':<20} {'pure_ns':>8} {'x_dict':>7} {'cython_ns':>9} {'x_dict':>7} {'pure/cython':>11}")
    for row in pure:
        print(f"{row:<20} {pure[row]:>8.0f} {pure[row] / pure[INLINE]:>6.2f}x {comp[row]:>9.0f} "
              f"{comp[row] / comp[INLINE]:>6.2f}x {pure[row] / comp[row]:>10.2f}x")
    print(f"# the contract (do-nothing) compiled is {pure[NOTHING] / comp[NOTHING]:.2f}x as fast as pure Python "
          f"(issue 16: a compiled build is worth keeping at >= 2x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
