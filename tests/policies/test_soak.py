"""The randomized soak (``policies.testing.soak``): every registered policy, invariants after every
operation. A short seeded run here; ``POOLLAB_SOAK_OPS`` sets the op count of the slow one."""

from __future__ import annotations

import functools
import os

import pytest

import policies
from policies.arena import Arena
from policies.testing import SegmentPerRequest
from policies.testing.soak import BOUNDARY_SIZES, soak, soak_specs

SPECS = soak_specs()


def _soak(spec: str, num_ops: int, seed: int = 0, episode_ops: int = 20_000):
    factory = (
        SegmentPerRequest
        if spec == SegmentPerRequest.name
        else functools.partial(policies.create, spec)
    )
    report = soak(factory, num_ops, seed=seed, spec=spec, episode_ops=episode_ops)
    assert report.num_ops == num_ops
    assert report.num_violations == 0, "\n".join(report.violations)
    return report


@pytest.mark.parametrize("spec", [*SPECS, SegmentPerRequest.name])  # and a third-party policy
def test_a_short_soak_finds_no_violation(spec):
    report = _soak(spec, 500, seed=1, episode_ops=100)  # five pools, each with a capacity drawn
    assert report.num_failures > 0 and report.num_episodes == 5  # the capacities did force failures


@pytest.mark.slow
@pytest.mark.skipif(
    "POOLLAB_SOAK_OPS" not in os.environ,
    reason="set POOLLAB_SOAK_OPS (e.g. 1000000) to run the long soak; "
    "benchmarks/soak.py runs it in parallel",
)
@pytest.mark.parametrize("spec", [*SPECS, SegmentPerRequest.name])
def test_a_long_soak_finds_no_violation(spec):
    _soak(spec, int(os.environ.get("POOLLAB_SOAK_OPS", "0")), seed=1)


class _ArenaKeepsReleasedCurrent(Arena):
    """Releases an empty current arena but goes on bumping in it (issue 11's arena bug, another way
    in)."""

    def _release_free_segments(self, max_bytes):
        current = dict(self._current)
        released = super()._release_free_segments(max_bytes)
        self._current.update(current)
        return released


def test_the_soak_finds_an_arena_that_serves_from_a_released_segment():
    report = soak(_ArenaKeepsReleasedCurrent, 3000, seed=0, episode_ops=400)
    assert report.num_violations > 0 and "seed 0, episode" in report.violations[0]
    assert len(report.violations) <= 5 and report.num_ops == 3000  # counted, and the run went on


def test_a_soak_is_replayed_exactly_by_its_seed():
    factory = functools.partial(policies.create, "best-fit")
    a, b = soak(factory, 500, seed=3), soak(factory, 500, seed=3)
    assert (a.num_failures, a.num_episodes) == (b.num_failures, b.num_episodes)
    assert a.as_dict().keys() >= {"spec", "num_ops", "num_violations", "num_failures", "seconds"}


def test_boundary_sizes_straddle_powers_of_two_and_the_thresholds():
    assert {(1 << 20) - 1, 1 << 20, (1 << 20) + 1, 131_072_000, 20 * (1 << 20) + 1} <= set(
        BOUNDARY_SIZES
    )
