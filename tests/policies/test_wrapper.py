"""The shared wrapper base (policies/wrapper.py): stacks, capability lookup and moves that propagate."""

from __future__ import annotations

import policies
from policies.testing import check_invariants
from policies.wrapper import find_layer, layers

KiB = 1 << 10


STACK = ("tag-limits:base=[elastic:base=[compacting:base=[best-fit:segment_bytes=1MiB],min_free_bytes=0,"
         "check_every=0],high=1.0]")


def test_layers_walk_the_stack_outside_in():
    p = policies.create(STACK)
    assert [layer.name for layer in layers(p)] == ["tag-limits", "elastic", "compacting", "best-fit"]


def test_find_layer_finds_a_capability_at_any_depth():
    p = policies.create(STACK)
    assert find_layer(p, "reserve").name == "elastic" and find_layer(p, "compact").name == "compacting"
    assert find_layer(policies.create("best-fit"), "compact") is None


def test_moves_reach_every_layer_with_that_layers_handle():
    p = policies.create(STACK)
    seen = {layer.name: [] for layer in layers(p) if hasattr(layer, "on_move")}
    for layer in layers(p):
        if hasattr(layer, "on_move"):
            layer.on_move = lambda a, old, new, n, name=layer.name: seen[name].append((a, old, new, n))
    allocs = [p.allocate(64 * KiB) for _ in range(4)]
    p.free(allocs[0])
    p.free(allocs[2])
    find_layer(p, "compact").compact(force=True)
    assert [m[0] for m in seen["tag-limits"]] == [allocs[1], allocs[3]]
    assert [m[1:] for m in seen["tag-limits"]] == [m[1:] for m in seen["elastic"]] == [m[1:] for m in seen["compacting"]]
    check_invariants(p, [allocs[1], allocs[3]])


def test_only_wrappers_over_a_mover_keep_a_handle_map():
    assert policies.create("elastic")._outer_of is None
    assert policies.create("elastic:base=[compacting]")._outer_of == {}
    assert policies.create("elastic:base=[compacting]").moves_allocations


def test_wrapper_stats_count_the_callers_failures():
    p = policies.create("compacting:base=[best-fit:segment_bytes=1MiB],min_free_bytes=0", capacity_bytes=1 << 20)
    allocs = [p.allocate(128 * KiB) for _ in range(8)]
    for a in allocs[::2]:
        p.free(a)
    assert p.allocate(256 * KiB) is not None  # the base failed once, the caller saw a success
    assert p.stats().num_failures == 0 and p.base_policy.stats().num_failures == 1
