"""The shared wrapper base (policies/wrapper.py): stacks, capability lookup and moves that
propagate."""

from __future__ import annotations

import policies
from policies.testing import check_invariants
import pytest

from policies.errors import PolicyError
from policies.wrapper import layers

KiB = 1 << 10


STACK = (
    "tag-limits:base=[elastic:base=[compacting:base=[best-fit:segment_bytes=1MiB],min_free_bytes=0,"
    "check_every=0],high=1.0]"
)


def test_layers_walk_the_stack_outside_in():
    p = policies.create(STACK)
    assert [layer.name for layer in layers(p)] == [
        "tag-limits",
        "elastic",
        "compacting",
        "best-fit",
    ]


def test_capabilities_are_declared_and_forwarded_from_any_depth():
    p = policies.create(STACK)
    assert p.can_reserve and p.can_compact and p.moves_allocations and p.moves_while_allocating
    plain = policies.create("best-fit")
    assert not (
        plain.can_reserve or plain.can_compact or plain.moves_allocations or plain.can_seed_segments
    )
    assert (
        plain.compaction_stats() == {}
        and plain.take_compaction_ns() == 0
        and plain.shared_extents() == []
    )
    with pytest.raises(PolicyError, match="cannot compact"):
        plain.compact()
    with pytest.raises(PolicyError, match="cannot reserve"):
        plain.reserve(1)
    assert not policies.create("compacting:idle_only=true").moves_while_allocating
    assert policies.create("torch-caching").can_seed_segments
    assert policies.create("elastic:base=[paged:page_bytes=64KiB]").page_size_bytes == 64 * KiB


def test_a_forwarded_reserve_and_compact_act_on_the_layer_that_offers_them():
    p = policies.create(STACK)
    assert p.reserve(8 << 20) and p.reserved_bytes == p.base_policy.reserved_bytes >= 8 << 20
    allocs = [p.allocate(64 * KiB) for _ in range(4)]
    p.free(allocs[0])
    p.free(allocs[2])
    assert p.compact(force=True) is not None
    assert p.compaction_stats()["num_compactions"] == 1
    check_invariants(p, [allocs[1], allocs[3]])


def test_moves_reach_every_layer_with_that_layers_handle():
    p = policies.create(STACK)
    seen = {layer.name: [] for layer in layers(p) if layer.moves_allocations}
    for layer in layers(p):
        if layer.moves_allocations:
            layer.on_move = lambda a, old, new, n, name=layer.name: seen[name].append(
                (a, old, new, n)
            )
    allocs = [p.allocate(64 * KiB) for _ in range(4)]
    p.free(allocs[0])
    p.free(allocs[2])
    p.compact(force=True)
    assert [m[0] for m in seen["tag-limits"]] == [allocs[1], allocs[3]]
    assert (
        [m[1:] for m in seen["tag-limits"]]
        == [m[1:] for m in seen["elastic"]]
        == [m[1:] for m in seen["compacting"]]
    )
    check_invariants(p, [allocs[1], allocs[3]])


def test_only_wrappers_over_a_mover_keep_a_handle_map():
    assert policies.create("elastic")._outer_of is None
    assert policies.create("elastic:base=[compacting]")._outer_of == {}
    assert policies.create("elastic:base=[compacting]").moves_allocations


def test_wrapper_stats_count_the_callers_failures():
    p = policies.create(
        "compacting:base=[best-fit:segment_bytes=1MiB],min_free_bytes=0", capacity_bytes=1 << 20
    )
    allocs = [p.allocate(128 * KiB) for _ in range(8)]
    for a in allocs[::2]:
        p.free(a)
    assert p.allocate(256 * KiB) is not None  # the base failed once, the caller saw a success
    assert p.stats().num_failures == 0 and p.base_policy.stats().num_failures == 1
