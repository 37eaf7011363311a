"""A compiled copy of this tree, for running the battery (and benchmarks) against ``policies``
built with Cython (docs/guides/compiled-build.md).

``build_compiled_copy(dest)`` copies the source tree to ``dest`` and runs the opt-in build there
(``POOLLAB_COMPILE=1 python setup.py build_ext --inplace``: the same backend, module list and
directives as ``POOLLAB_COMPILE=1 pip install -e .``), then checks that every declared module
imports as an extension module. ``run_in(tree, cmd)`` runs a command with that tree first on
the import path. Used by ``tests/policies/test_compiled.py`` and ``benchmarks/bench_compiled.py``;
needs Cython and a C compiler (``unavailable_reason`` says which is missing), which poollab
itself does not.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

#: the repository root: this file is policies/testing/compiled.py
REPO = Path(__file__).resolve().parents[2]
#: what a copy of the tree leaves out: environments, VCS data and build outputs
COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv*",
    ".ci-venv",
    "venv",
    ".whl",
    "build",
    "__pycache__",
    "*.so",
    "*.c",
    "*.egg-info",
    "poollab-out",
    "poollab-demo",
    "node_modules",
)

CHECK = """
import importlib, sys
sys.path.insert(0, "build_backend")
from poollab_build import compiled_modules
names = [p[:-3].replace("/", ".") for p in compiled_modules()]
plain = [n for n in names if not importlib.import_module(n).__file__.endswith(".so")]
print(f"{len(names) - len(plain)} of {len(names)} declared modules imported as extension modules")
sys.exit(f"imported as Python, not compiled: {plain}" if plain else 0)
"""


def unavailable_reason() -> str | None:
    """Why a compiled copy cannot be built here, or None when it can."""
    if importlib.util.find_spec("Cython") is None:
        return "Cython is not installed (pip install cython, or the dev extra)"
    if (
        importlib.util.find_spec("setuptools") is None
    ):  # the build runs setup.py in this environment
        return (
            "setuptools is not installed "
            "(a Python 3.12+ virtual environment has none: pip install setuptools)"
        )
    if not any(map(shutil.which, ("cc", "gcc", "clang"))):
        return "no C compiler (cc, gcc or clang) on PATH"
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        return "no Python headers (Python.h; a python3-dev package)"
    return None


def build_description() -> str:
    """What decides the compiled build's speed on this interpreter, for a benchmark's header.

    The same generated code runs at different speeds on two machines' Pythons
    (benchmarks/RESULTS.md, "The compiled build on Python 3.12"): the version, whether libpython is
    a shared library (its thread-state reads then go through ``__tls_get_addr`` on 3.12), the C
    flags, Cython, and the macros the build backend adds for this version.
    """
    sys.path.insert(0, str(REPO / "build_backend"))
    try:
        from poollab_build import c_macros
    finally:
        sys.path.remove(str(REPO / "build_backend"))
    cython = importlib.util.find_spec("Cython")
    cython_version = "none"
    if cython is not None:
        import Cython

        cython_version = Cython.__version__
    shared = "shared" if sysconfig.get_config_var("Py_ENABLE_SHARED") else "static"
    macros = " ".join(f"-D{name}={value}" for name, value in c_macros()) or "none"
    return (
        f"{platform.python_implementation()} {platform.python_version()} "
        f"({shared} libpython, CFLAGS {sysconfig.get_config_var('CFLAGS')!r}), "
        f"Cython {cython_version}, backend macros {macros}"
    )


def run_in(tree: Path, cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``tree`` with that tree first on the import path (its ``policies`` is the one
    used)."""
    # the tree first; what the caller's path had (a --target install of dependencies) after it
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    kwargs.setdefault("check", True)
    return subprocess.run(cmd, cwd=tree, env=env, **kwargs)


def build_compiled_copy(dest: Path, *, quiet: bool = True) -> None:
    """Copy this tree to ``dest`` (refreshed in place if it exists) and compile its declared modules
    there.

    Raises ``subprocess.CalledProcessError`` when the build fails or a declared module still
    imports as Python.
    """
    dest = Path(dest)
    shutil.copytree(REPO, dest, ignore=COPY_IGNORE, dirs_exist_ok=True)
    jobs = str(os.cpu_count() or 1)
    out = subprocess.DEVNULL if quiet else None
    env = {**os.environ, "POOLLAB_COMPILE": "1"}
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", jobs],
        cwd=dest,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT if quiet else None,
        check=True,
    )
    run_in(dest, [sys.executable, "-c", CHECK], stdout=out)
