"""Dependencies point one way: ``policies`` imports no simpy, CuPy or pandas, and ``traces``
imports no policy. Each check runs in a fresh interpreter with the forbidden packages blocked
by a meta path finder, so an import anywhere (even a lazy one at module level) fails loudly."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_BLOCKER = textwrap.dedent("""
    import importlib, pkgutil, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked for this test")
            return None

    sys.meta_path.insert(0, Blocker())
    for name in BLOCKED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"the blocker let {name} through")

    def import_package(package):
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__, package + "."):
            importlib.import_module(info.name)
""")


def _run(blocked: str, body: str) -> subprocess.CompletedProcess:
    code = _BLOCKER + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code, blocked],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )


def test_policies_and_every_builtin_import_without_simpy_cupy_or_pandas():
    result = _run(
        "simpy,cupy,pandas",
        """
        import policies
        from policies.registry import BUILTIN_POLICIES
        import_package("policies")
        for name in BUILTIN_POLICIES:
            cls = policies.get(name)
            cls().allocate(4096)
        print("ok", len(BUILTIN_POLICIES))
    """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_traces_import_without_policies():
    result = _run(
        "policies",
        """
        import_package("traces")
        print("ok")
    """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_blocked_import_is_reported():
    result = _run(
        "pandas",
        """
        import pandas
    """,
    )
    assert result.returncode != 0
    assert "pandas is blocked for this test" in result.stderr
