"""What the compiled build's declarations (``policies/*.pxd``) must not change in the contract.

Runs in the pure build here and, through ``test_compiled.py``, against the compiled modules:
``Policy`` and ``Allocation`` became ``cdef class`` there, so the places where a ``cdef class``
differs from a Python class by default (no ``abc.ABC``, C-typed fields and locals, no instance
dict) are pinned down.
"""

from __future__ import annotations

import numpy as np
import pytest

import policies
from policies import Allocation, Policy, PolicyError
from policies.base import Segment


class _Minimal(Policy):
    """A third-party-style policy: Python hooks, ``__slots__``, a declared capability."""

    __slots__ = ("_live",)
    name = "minimal"
    can_compact = False

    def _reset_state(self):
        self._live = 0

    def _allocate(self, nbytes, stream, tag):
        self._live += 1
        self.allocated_bytes += nbytes
        return Allocation(nbytes, nbytes, ((0, nbytes),), stream, tag)

    def _free(self, allocation):
        self._live -= 1
        self.allocated_bytes -= allocation.size_bytes

    def _release_free_segments(self, max_bytes):
        return 0

    def _add_segment(self, segment):
        pass


def test_policy_without_its_hooks_cannot_be_instantiated():
    with pytest.raises(TypeError, match="Can't instantiate abstract class Policy"):
        Policy()

    class Partial(Policy):
        def _allocate(self, nbytes, stream, tag):
            return None

    with pytest.raises(
        TypeError, match="abstract class Partial with abstract methods _add_segment, _free"
    ):
        Partial()


def test_python_subclass_with_slots_works_and_counts_exactly():
    pool = _Minimal()
    big = 3 << 40  # counters are 64-bit in the compiled build: far beyond any device
    a = pool.allocate(big, stream=7, tag="kv")
    b = pool.allocate(np.int64(512))  # a size that is not an int goes through _as_size
    assert (pool.live_bytes, pool.peak_live_bytes, pool.num_allocs, pool._live) == (
        big + 512,
        big + 512,
        2,
        2,
    )
    assert type(b.nbytes) is int and (a.stream, a.tag) == (7, "kv")
    pool.free(a)
    pool.free(b)
    assert (pool.live_bytes, pool.num_frees, pool.allocated_bytes) == (0, 2, 0)
    assert not pool.can_compact and pool.name == "minimal"


@pytest.mark.parametrize(
    "bad, message", [(None, "got NoneType"), (object(), "got object"), (3, "got int")]
)
def test_bad_free_names_what_it_got(bad, message):
    pool = policies.create("paged")
    with pytest.raises(PolicyError, match=f"free\\(\\) takes an Allocation, {message}"):
        pool.free(bad)
    assert pool.num_frees == 0


@pytest.mark.parametrize("bad", [1.5, "8", True, -1, 0])
def test_bad_sizes_are_policy_errors(bad):
    pool = policies.create("size-class")
    with pytest.raises(PolicyError, match="nbytes"):
        pool.allocate(bad)
    assert pool.num_allocs == pool.num_failures == 0


def test_allocation_and_segment_keep_their_public_behaviour():
    a = Allocation(nbytes=10, size_bytes=512, extents=((4096, 512),), tag="kv")
    assert repr(a) == (
        "Allocation(nbytes=10, size_bytes=512, extents=((4096, 512),), stream=0, tag='kv', "
        "handle=None, owner=None)"
    )
    assert a.offset == 4096 and not a.live and a != Allocation(10, 512, ((4096, 512),)) and a == a
    with pytest.raises(AttributeError):
        a.color = "red"  # slots: no instance dict
    seg = Segment(offset=4096, nbytes=1024)
    assert (
        seg.end == 5120
        and repr(seg) == "Segment(offset=4096, nbytes=1024, stream=0, num_live=0, handle=None)"
    )
    live = policies.create("paged").allocate(100)
    assert live.live and live.offset == live.extents[0][0]


@pytest.mark.parametrize("spec", ["paged", "size-class"])
def test_a_hook_overridden_after_use_is_called(spec):
    """Compiled, ``allocate`` calls ``_allocate`` through a ``cpdef`` override check that the 3.12
    and 3.13 builds cache behind dict version tags (``build_backend/poollab_build.py``,
    ``c_macros``): a class or an instance that overrides the hook after that check was cached
    must still be called, and the compiled hook again once the override is gone."""
    pool = policies.create(spec, capacity_bytes=1 << 30)
    for _ in range(3):  # the check is cached on the first calls
        pool.free(pool.allocate(4096))
    cls, calls = type(pool), []
    compiled_hook = cls._allocate

    def spy(self, nbytes, stream, tag):
        calls.append(nbytes)
        return compiled_hook(self, nbytes, stream, tag)

    cls._allocate = spy  # a class-level override, after use
    try:
        pool.free(pool.allocate(4096))
    finally:
        del cls._allocate
    pool.free(pool.allocate(4096))
    assert calls == [4096]

    def instance_spy(nbytes, stream, tag):
        calls.append(-nbytes)
        return compiled_hook(pool, nbytes, stream, tag)

    pool._allocate = instance_spy  # an instance-level override
    pool.free(pool.allocate(8192))
    assert calls == [4096, -8192]
