"""Fixtures for the real-pool tests: small traces, and skipping ``gpu``-marked tests without CUDA.

Every test marked ``@pytest.mark.gpu`` is skipped, with the reason, where CuPy or a CUDA device is
missing; the CPU backend carries the same behaviours everywhere else.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

import policies
from policies.base import Allocation
from policies.testing import SegmentPerRequest

REPO = Path(__file__).resolve().parents[2]
BUNDLED_SNAPSHOT = REPO / "traces" / "data" / "llama1b_generate_slice.pickle.gz"


@functools.lru_cache(maxsize=1)
def cuda_unavailable_reason() -> str | None:
    from realgpu.cuda import require_cuda
    from realgpu.errors import GpuUnavailableError

    try:
        require_cuda(0)
    except GpuUnavailableError as exc:
        return str(exc)
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and "tests/realgpu" in str(item.fspath).replace("\\", "/"):
            reason = cuda_unavailable_reason()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs a CUDA device: {reason}"))


def open_memfds() -> int:
    """The host page-mapped device's physical pages (``memfd``s) open in this process now."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "memfd:poollab-page" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listing's own descriptor is gone already
    return n


@pytest.fixture(autouse=True)
def no_memfd_left_open():
    """Every test gives back the host pages it made: a memfd is a plain descriptor, which no
    garbage collection closes, so a pool a test abandons unclosed would hold its pages to the end
    of the run and fail a later test that counts them (test_host_vmm's). Failing here names the
    test that leaked, whatever the order."""
    if not os.path.isdir("/proc/self/fd"):
        yield
        return
    before = open_memfds()
    yield
    left = open_memfds() - before
    assert left <= 0, (
        f"{left} host page memfd(s) left open: close every pool (and free what it holds) "
        "the test built"
    )


@pytest.fixture(scope="session")
def bundled_snapshot():
    """The bundled PyTorch snapshot slice, read once (skipped when the file is absent)."""
    if not BUNDLED_SNAPSHOT.is_file():
        pytest.skip(f"bundled snapshot slice not present at {BUNDLED_SNAPSHOT}")
    from traces.detect import read_alloc_trace

    return read_alloc_trace(BUNDLED_SNAPSHOT)


class OverlappingPolicy(SegmentPerRequest):
    """A deliberately broken policy: its second allocation starts ``inside_bytes`` (256) into its
    first."""

    name = "overlapping"
    inside_bytes = 256

    def _allocate(self, nbytes, stream, tag):
        if self.num_allocs == 1 and self._first is not None:
            self.allocated_bytes += nbytes
            return Allocation(
                nbytes,
                nbytes,
                ((self._first.offset + self.inside_bytes, nbytes),),
                stream,
                tag,
                None,
            )
        a = super()._allocate(nbytes + 4096, stream, tag)
        self._first = a
        return a

    def _free(self, allocation):
        if allocation.handle is None:
            self.allocated_bytes -= allocation.size_bytes
            return
        super()._free(allocation)

    def _reset_state(self):
        super()._reset_state()
        self._first = None


@pytest.fixture
def overlapping_policy():
    """Registers ``OverlappingPolicy`` as "overlapping" for the test, then removes it."""
    policies.register("overlapping", OverlappingPolicy, replace=True)
    yield "overlapping"
    policies.registry.unregister("overlapping")
