"""Per-tag caps and statistics (policies/tag_limits.py)."""

from __future__ import annotations

import pandas as pd
import pytest

import policies
from policies.errors import PolicyError
from policies.tag_limits import TagLimits, format_limits, parse_limits
from policies.testing import check_invariants

KiB = 1 << 10
MiB = 1 << 20


def limited(limits="kv=1MiB,activations=256KiB", **kw):
    return TagLimits(base="best-fit:segment_bytes=4MiB", limits=limits, **kw)


# ---------------------------------------------------------------------------- the knob
def test_limits_parse_sizes_per_tag():
    assert parse_limits("kv=40GiB, activations=2MiB,") == {"kv": 40 << 30, "activations": 2 * MiB}
    assert parse_limits("") == {}


@pytest.mark.parametrize(
    "text, named",
    [
        ("kv", "'kv' is not tag=size"),
        ("=1MiB", "not tag=size"),
        ("kv=1MiB,kv=2MiB", "given twice"),
        ("kv=lots", "'kv'"),
        (5, "must be a string"),
    ],
)
def test_bad_limits_raise_policy_error_naming_the_item(text, named):
    with pytest.raises(PolicyError, match=named):
        TagLimits(limits=text)


def test_format_limits_round_trips():
    limits = {"kv": 3 * MiB, "weights": 7}
    assert parse_limits(format_limits(limits)) == limits


def test_spec_round_trips_with_a_bracketed_list():
    p = policies.create("tag-limits:base=[first-fit],limits=[kv=40GiB,activations=2GiB]")
    assert p.limits == "kv=40GiB,activations=2GiB"
    assert policies.create(p.spec).get_params() == p.get_params()


# ---------------------------------------------------------------------------- caps
def test_a_request_over_its_tags_limit_fails_before_the_base_sees_it():
    p = limited()
    p.allocate(768 * KiB, tag="kv")
    before = p.base_policy.stats()
    assert p.allocate(512 * KiB, tag="kv") is None
    assert p.base_policy.stats() == before
    s = p.tag_stats()["kv"]
    assert (s.num_failures, s.num_limit_failures, p.num_limit_failures, p.stats().num_failures) == (
        1,
        1,
        1,
        1,
    )


def test_the_limit_is_inclusive():
    p = limited()
    assert p.allocate(MiB, tag="kv") is not None


def test_freeing_makes_room_under_the_limit_again():
    p = limited()
    a = p.allocate(MiB, tag="kv")
    p.free(a)
    assert p.allocate(MiB, tag="kv") is not None


def test_other_tags_and_untagged_requests_are_not_capped():
    p = limited()
    assert p.allocate(2 * MiB, tag="weights") is not None and p.allocate(2 * MiB) is not None
    assert p.num_limit_failures == 0


def test_limits_count_requested_bytes_and_report_rounded_ones():
    p = limited(limits="kv=1000")
    a = p.allocate(1000, tag="kv")
    s = p.tag_stats()["kv"]
    assert (s.live_bytes, s.allocated_bytes) == (1000, a.size_bytes) and a.size_bytes > 1000


def test_a_base_refusal_counts_for_the_tag_but_not_as_a_limit_failure():
    p = limited(limits="kv=64MiB", capacity_bytes=4 * MiB)
    assert p.allocate(8 * MiB, tag="kv") is None
    s = p.tag_stats()["kv"]
    assert (s.num_failures, s.num_limit_failures) == (1, 0)


# ---------------------------------------------------------------------------- statistics
def test_tag_stats_break_the_pool_down():
    p = limited(limits="")
    kv = [p.allocate(100 * KiB, tag="kv") for _ in range(3)]
    w = p.allocate(MiB, tag="weights")
    p.free(kv[0])
    t = p.tag_stats()
    assert (t["kv"].live_bytes, t["kv"].num_live, t["kv"].num_allocs, t["kv"].num_frees) == (
        200 * KiB,
        2,
        3,
        1,
    )
    assert t["kv"].peak_live_bytes == 300 * KiB and t["weights"].limit_bytes is None
    assert sum(s.allocated_bytes for s in t.values()) == p.stats().allocated_bytes
    check_invariants(p, kv[1:] + [w])


def test_capped_tags_are_listed_before_their_first_request():
    assert set(limited().tag_stats()) == {"kv", "activations"}


def test_tag_stats_are_copies():
    p = limited()
    p.tag_stats()["kv"].live_bytes = 123
    assert p.tag_stats()["kv"].live_bytes == 0


def test_tag_rows_make_a_table():
    p = limited()
    p.allocate(KiB, tag="kv")
    df = pd.DataFrame(p.tag_rows())
    assert list(df["tag"]) == ["kv", "activations"] and {"live_bytes", "num_limit_failures"} <= set(
        df.columns
    )


def test_reset_clears_the_counts_and_keeps_the_limits():
    p = limited()
    p.allocate(KiB, tag="kv")
    p.allocate(2 * MiB, tag="kv")
    p.reset()
    s = p.tag_stats()["kv"]
    assert (s.live_bytes, s.num_failures, s.limit_bytes, p.num_limit_failures) == (0, 0, MiB, 0)


def test_handles_follow_a_compacting_base():
    p = policies.create(
        "tag-limits:base=[compacting:base=[best-fit:segment_bytes=1MiB],min_free_bytes=0]"
    )
    allocs = [p.allocate(64 * KiB, tag="kv") for _ in range(4)]
    p.free(allocs[0])
    p.free(allocs[2])
    p.base_policy.compact(force=True)
    check_invariants(p, [allocs[1], allocs[3]])
    assert allocs[1].offset == p.segments()[0].offset


def test_limits_are_bounded_like_any_spec():
    with pytest.raises(PolicyError, match="limits 'kv=1,kv=1,kv=1.*characters long; at most 4,096"):
        parse_limits("kv=1," * 1000)
    with pytest.raises(PolicyError, match="nests \\[...\\] 40 levels deep"):
        parse_limits("[" * 40 + "kv=1" + "]" * 40)


def test_a_size_of_400_digits_is_refused_not_an_overflow():
    """It used to raise OverflowError (float infinity to int): a traceback on the command line."""
    with pytest.raises(PolicyError, match="tag 'kv'.*400 digits.*too large"):
        parse_limits("kv=" + "9" * 400)
