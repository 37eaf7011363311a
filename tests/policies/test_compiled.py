"""The compiled build of ``policies`` (Cython, from the same source) passes what the pure one does.

Builds a compiled copy of the tree (``policies.testing.compiled``, the same build as
``POOLLAB_COMPILE=1 pip install -e .``), checks its declared modules are extension modules, and
runs ``tests/policies`` (the conformance battery over every registered policy included), the
host-backed ``GpuPool.malloc`` tests and the PyTorch allocator's CPU tests (``realgpu.malloc_path``
is compiled too) against it in a subprocess. Skips, saying why, without Cython or a C compiler.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from policies.testing import compiled


def test_policies_tests_pass_against_the_compiled_modules(tmp_path):
    reason = compiled.unavailable_reason()
    if reason is not None:
        pytest.skip(f"compiled build not possible here: {reason}")
    tree = tmp_path / "tree"
    try:
        compiled.build_compiled_copy(tree)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"compiled build failed: {exc}")
    here = "tests/policies/test_compiled.py"  # not again inside the copy
    proc = compiled.run_in(
        tree,
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "tests/policies",
            f"--ignore={here}",
            "tests/realgpu/test_malloc_path.py",
            "tests/realgpu/test_live_map.py",  # PyTorch's live pointer map, C keys compiled
            # the trampoline built without torch, calling the C entries by address
            "tests/realgpu/test_torch_shim_without_torch.py",
            "tests/realgpu/test_pool.py",
            # PyTorch's hot path: the direct calls into Policy (and, with torch, the trampoline's
            # calls of its C functions by address)
            "tests/realgpu/test_torch_allocator.py",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, (
        "tests/policies and the malloc tests against the compiled modules:\n"
        f"{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
    )


def test_pure_install_needs_no_cython():
    """Without Cython installed, ``policies`` imports its no-op shim and works as before."""
    script = """
import sys
sys.modules["cython"] = None  # what an install without Cython looks like: import cython fails
import policies
from policies import base, paged, size_class
from realgpu import malloc_path  # compiled in the opt-in build too
assert base.cython.__class__.__name__ == "SimpleNamespace", base.cython
assert malloc_path.extents_are_one_range(((0, 8), (8, 8)), [0])
for spec in ("paged", "size-class", "best-fit", "first-fit"):
    pool = policies.create(spec)
    a = pool.allocate(1000, stream=0, tag="kv")
    pool.free(a)
    assert pool.num_allocs == pool.num_frees == 1 and pool.live_bytes == 0
try:
    pool.free(object())
except policies.PolicyError as exc:
    assert "free() takes an Allocation" in str(exc), exc
else:
    raise AssertionError("a bad free was accepted")
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
        cwd=compiled.REPO,
        env={**os.environ, "PYTHONPATH": str(compiled.REPO)},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
