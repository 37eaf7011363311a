"""Alignment and granularity, the rounding knobs every block policy takes (policies/_blocks.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

import policies
from policies import PolicyError
from policies._blocks import ContiguousPolicy
from policies.best_fit import BestFit
from policies.device import VirtualDevice

KiB = 1 << 10
MiB = 1 << 20
BLOCK_POLICIES = ["first-fit", "best-fit", "worst-fit"]


@pytest.mark.parametrize("name", BLOCK_POLICIES)
def test_default_alignment_is_256_bytes(name):
    p = policies.create(name)
    assert p.alignment_bytes == 256 and p.granularity_bytes is None
    assert p.allocate(1).size_bytes == 256 and p.allocate(257).size_bytes == 512


@pytest.mark.parametrize("name", BLOCK_POLICIES)
@pytest.mark.parametrize(
    "granularity, nbytes, expected",
    [
        (4096, 1, 4096),
        (4096, 4097, 8192),
        (3072, 1, 3072),
        (3072, 3073, 6144),
        (2 * MiB, 5 * MiB + 1, 6 * MiB),
    ],
)
def test_granularity_rounds_requests_up_to_its_multiple(name, granularity, nbytes, expected):
    p = policies.create(f"{name}:alignment_bytes=1024,granularity_bytes={granularity}")
    a = p.allocate(nbytes)
    assert a.size_bytes == expected and p.rounded_size(nbytes) == expected
    assert p.stats().live_bytes == nbytes  # the rest is internal waste


@pytest.mark.parametrize(
    "knobs, named",
    [
        ({"granularity_bytes": 1000}, "multiple of alignment_bytes"),
        ({"granularity_bytes": 0}, "granularity_bytes"),
        ({"granularity_bytes": True}, "granularity_bytes"),
    ],
)
def test_bad_granularity_raises_policy_error_naming_it(knobs, named):
    with pytest.raises(PolicyError, match=named):
        BestFit(**knobs)


def test_coarse_granularity_lets_a_freed_block_fit_the_next_request_exactly():
    p = BestFit(segment_bytes=MiB, granularity_bytes=64 * KiB)
    a = p.allocate(40 * KiB)
    p.allocate(4 * KiB)
    p.free(a)
    b = p.allocate(60 * KiB)  # a different size, the same rounded size: the hole is reused whole
    assert b.offset == a.offset and len(p.free_extents()) == 1


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300 * KiB), min_size=1, max_size=40),
    alignment=st.sampled_from([256, 512, 4096]),
    factor=st.sampled_from([None, 1, 3, 8]),
    name=st.sampled_from(BLOCK_POLICIES),
)
def test_every_allocation_is_aligned_and_a_whole_number_of_granules(sizes, alignment, factor, name):
    granularity = None if factor is None else alignment * factor
    p = policies.create(
        name, alignment_bytes=alignment, granularity_bytes=granularity, segment_bytes=MiB
    )
    live = []
    for i, n in enumerate(sizes):
        a = p.allocate(n)
        live.append(a)
        if i % 3 == 2:
            p.free(live.pop(0))
        assert a.offset % alignment == 0
        # the default split threshold (the alignment) splits off every remainder: nothing joins
        assert a.size_bytes == p.rounded_size(n) and a.size_bytes % (granularity or alignment) == 0
    p.check_invariants()


def test_a_subclass_that_fixes_a_block_knob_does_not_list_it():
    class Fixed(BestFit):
        name = "fixed-alignment"

        def __init__(self, *, capacity_bytes=None, device=None):
            super().__init__(alignment_bytes=4096, capacity_bytes=capacity_bytes, device=device)

    p = Fixed()
    assert p.get_params() == {"capacity_bytes": None}
    assert type(p)(**p.get_params(), device=VirtualDevice()).alignment_bytes == 4096


def test_a_subclass_passing_keywords_through_keeps_every_knob():
    class Passing(BestFit):
        name = "passing"

        def __init__(self, **kw):
            super().__init__(**kw)

    assert "granularity_bytes" in Passing().get_params()
    assert issubclass(Passing, ContiguousPolicy)
