"""Prefix-cache eviction orders: LRU, LFU, cost-aware (GreedyDual-Size-Frequency), and through
``paged``."""

import random
from types import SimpleNamespace

import pytest

from policies.errors import PolicyError
from policies.eviction import EVICTION_ORDERS, make_queue
from policies.paged import Paged

PAGE = 4096


def block(uses=1, cost=1.0, size=PAGE):
    return SimpleNamespace(num_uses=uses, recompute_cost=cost, size_bytes=size)


def drain(q):
    out = []
    while len(q):
        out.append(q.pop()[0])
    return out


def test_lru_evicts_in_release_order():
    q = make_queue("lru")
    for k in "abc":
        q.push(k, block())
    q.remove("b")
    assert drain(q) == ["a", "c"]


def test_lfu_evicts_fewest_uses_first_release_order_among_equals():
    q = make_queue("lfu")
    q.push("popular", block(uses=9))
    q.push("old", block(uses=1))
    q.push("new", block(uses=1))
    q.push("some", block(uses=3))
    assert drain(q) == ["old", "new", "some", "popular"]


def test_cost_aware_keeps_expensive_blocks_and_ages_them_out():
    q = make_queue("cost")
    q.push("cheap", block(cost=1.0))
    q.push("dear", block(cost=10.0))
    assert q.pop()[0] == "cheap"
    assert q.clock == pytest.approx(1.0 / PAGE)  # the clock rises to the evicted priority
    # a cheap block released now starts at the clock: after enough evictions it outranks "dear"
    q.push("cheap2", block(cost=1.0))
    assert q.pop()[0] == "cheap2"
    popped = []
    for i in range(20):  # each cheap block starts at the clock, which rises with every eviction
        q.push(i, block(cost=1.0))
        popped.append(q.pop()[0])
    # "dear" (10/PAGE) is evicted once the clock reaches it (9 evictions later), not kept for ever
    assert popped.index("dear") == 7 and "dear" not in q


def test_a_removed_key_never_comes_back_from_the_heap():
    for order in ("lfu", "cost"):
        q = make_queue(order)
        q.push("a", block(uses=1))
        q.push("b", block(uses=2))
        q.remove("a")
        q.push("a", block(uses=5))  # released again after a hit, with more uses
        assert drain(q) == ["b", "a"]
        with pytest.raises(KeyError):
            q.pop()


def test_unknown_order_is_a_clear_error():
    with pytest.raises(ValueError, match="lru, lfu, cost"):
        make_queue("fifo")


@pytest.mark.parametrize("order", EVICTION_ORDERS)
def test_queue_matches_a_brute_force_model(order):
    """Random push/remove/pop against a list that recomputes the victim by definition."""
    rng = random.Random(order)
    q, model, seq, clock = make_queue(order), {}, 0, 0.0
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            k = rng.randrange(50)
            if k in model:
                continue
            b = block(uses=rng.randrange(1, 5), cost=rng.choice([1.0, 2.0, 5.0]))
            prio = {
                "lru": 0,
                "lfu": b.num_uses,
                "cost": clock + b.num_uses * b.recompute_cost / b.size_bytes,
            }[order]
            model[k] = (prio, seq)
            seq += 1
            q.push(k, b)
        elif op < 0.7 and model:
            k = rng.choice(list(model))
            del model[k]
            q.remove(k)
        elif model:
            want = min(model, key=lambda k: model[k])
            got, _ = q.pop()
            assert got == want
            if order == "cost":
                clock = model[want][0]
            del model[want]
        assert len(q) == len(model)


def _cached(pool, key):
    a = pool.allocate(PAGE)
    pool.cache_block(key, a)
    return a


def test_paged_evicts_in_the_chosen_order_and_counts_hits_as_uses():
    pool = Paged(page_bytes=PAGE)
    pool.set_eviction_order("lfu")
    blocks = {k: _cached(pool, k) for k in "abc"}
    pool.share_block("a")  # a hit: "a" has 2 uses
    pool.release_block("a")
    for k in "abc":
        pool.release_block(k)
    assert pool.evict_block() is blocks["b"] and pool.evict_block() is blocks["c"]
    assert pool.evict_block() is blocks["a"]


def test_paged_cost_order_weighs_the_callers_recompute_cost():
    pool = Paged(page_bytes=PAGE)
    pool.set_eviction_order("cost")
    dear = pool.allocate(PAGE)
    pool.cache_block("dear", dear, recompute_cost=50.0)
    cheap = _cached(pool, "cheap")
    pool.release_block("dear")
    pool.release_block("cheap")
    assert pool.evict_block() is cheap


def test_paged_refuses_a_bad_order_or_a_change_with_blocks_evictable():
    pool = Paged(page_bytes=PAGE)
    with pytest.raises(PolicyError, match="unknown eviction order"):
        pool.set_eviction_order("mru")
    _cached(pool, "a")
    pool.release_block("a")
    with pytest.raises(PolicyError, match="evictable already"):
        pool.set_eviction_order("lfu")
    assert pool.eviction_order == "lru" and pool.evictable_bytes == PAGE
    with pytest.raises(PolicyError, match="recompute_cost"):
        pool.cache_block("b", pool.allocate(PAGE), recompute_cost=0)


def test_the_order_survives_reset():
    pool = Paged(page_bytes=PAGE)
    pool.set_eviction_order("cost")
    pool.reset()
    pool.cache_block("a", pool.allocate(PAGE))
    assert pool.eviction_order == "cost" and type(pool._queues[None]).order == "cost"


@pytest.mark.parametrize("order", EVICTION_ORDERS)
def test_owners_evict_and_count_only_their_own_blocks(order):
    """Colocated instances over one pool: each owner's blocks join its own queue."""
    pool = Paged(page_bytes=PAGE)
    pool.set_eviction_order(order)
    mine = {}
    for owner in (0, 1):
        for k in "ab":
            mine[owner, k] = pool.allocate(PAGE)
            pool.cache_block((owner, k), mine[owner, k], owner=owner)
    for key in [(1, "a"), (0, "a"), (0, "b")]:
        pool.release_block(key)
    assert pool.evictable_bytes_of(0) == 2 * PAGE and pool.evictable_bytes_of(1) == PAGE
    assert pool.evictable_bytes == 3 * PAGE and pool.evictable_bytes_of(None) == 0
    pool.share_block((0, "a"))  # a hit takes it out of owner 0's queue only
    assert pool.evictable_bytes_of(0) == PAGE and pool.evictable_bytes_of(1) == PAGE
    assert pool.evict_block(1) is mine[1, "a"] and pool.evict_block(1) is None  # (1, "b") is held
    assert pool.evict_block(0) is mine[0, "b"] and pool.evict_block(0) is None
    assert pool.evict_block() is None  # nothing of no owner
    assert pool.evictable_bytes == 0
