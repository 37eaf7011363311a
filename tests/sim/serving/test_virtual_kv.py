"""``kv_strategy=virtual`` (vAttention): pages mapped into per-request virtual ranges."""

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from sim.serving.config import ServerConfig
from sim.replay.costs import CostModel, costed_page_mapped_device
from sim.serving.kv import VirtualKV
from sim.serving.pools import TimedPool
from sim.serving.simulate import simulate
from traces.requests import RequestTrace, make_requests

KiB, MiB = 1 << 10, 1 << 20
TENSORS = 4  # two layers, K and V
BPT = TENSORS * 1024  # 1 KiB per token per tensor: a 64 KiB page holds 64 tokens
TPP = 64
GROUP = TENSORS * 64 * KiB  # one page of tokens on the device, every tensor


def virtual(
    budget_bytes=64 * GROUP, map_cache=True, max_num_seqs=8, max_model_len=4096, page=64 * KiB
):
    device = costed_page_mapped_device(
        CostModel.load(), granularity_bytes=page, limit_bytes=budget_bytes
    )
    pool = TimedPool(policies.create("best-fit", device=device))
    cfg = ServerConfig(
        kv_strategy="virtual",
        virtual_page_bytes=page,
        map_cache=map_cache,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    return VirtualKV(
        pool, cfg, bytes_per_token=BPT, budget_bytes=budget_bytes, num_kv_tensors=TENSORS
    )


def test_a_page_of_tokens_is_one_page_in_every_kv_tensor():
    kv = virtual()
    assert (kv.tokens_per_page, kv.group_bytes) == (TPP, GROUP)
    calls = dict(kv.device.num_calls)
    h = kv.new_handle(100, 10)
    assert kv.admit(h, 100)  # two pages of tokens
    made = {c: kv.device.num_calls[c] - calls[c] for c in ("create", "map", "set_access")}
    assert made == {"create": 2 * TENSORS, "map": 2 * TENSORS, "set_access": TENSORS}
    assert h.capacity_tokens == 2 * TPP and kv.device.physical_bytes == 2 * GROUP
    assert kv.take_map_ns() > 0 and kv.take_map_ns() == 0  # taken once
    assert kv.grow(h, 128)  # within its pages: no call
    assert kv.device.num_calls["map"] == calls["map"] + 2 * TENSORS


def test_the_virtual_ranges_are_reserved_at_start_up_and_cost_no_step():
    kv = virtual(max_num_seqs=8, max_model_len=4096)
    assert kv.device.peak_virtual_bytes >= 8 * TENSORS * 4096 * 1024
    assert kv.device.physical_bytes == 0 and kv.take_map_ns() == 0


def test_a_finished_requests_pages_are_reused_without_a_driver_call():
    kv = virtual()
    a = kv.new_handle(300, 10)
    kv.admit(a, 300)
    kv.free(a)
    assert kv.device.physical_bytes == 5 * GROUP and kv.cached_bytes == 5 * GROUP
    kv.take_map_ns()
    maps = kv.device.num_calls["map"]
    b = kv.new_handle(250, 10)
    assert kv.admit(b, 250)
    assert kv.device.num_calls["map"] == maps and kv.take_map_ns() == 0
    assert kv.num_reused_pages == 4
    assert kv.cached_bytes == GROUP  # the fifth page stays cached past b's tokens


def test_without_the_cache_a_finished_request_is_unmapped_at_once():
    kv = virtual(map_cache=False)
    a = kv.new_handle(300, 10)
    kv.admit(a, 300)
    kv.free(a)
    assert kv.device.physical_bytes == 0 and kv.device.num_calls["unmap"] == 5 * TENSORS
    assert kv.take_map_ns() > 0


def test_cached_pages_are_given_back_when_a_grow_needs_them():
    kv = virtual(budget_bytes=8 * GROUP)
    a = kv.new_handle(8 * TPP, 1)
    kv.admit(a, 8 * TPP)
    kv.free(a)  # the whole budget is cached in a's slot
    b, c = kv.new_handle(3 * TPP, 1), kv.new_handle(5 * TPP, 1)
    assert kv.admit(b, 3 * TPP)  # takes a's slot: five pages stay cached past its tokens
    assert (kv.mapped_pages(b), kv.cached_bytes) == (8, 5 * GROUP)
    assert kv.admit(c, 5 * TPP)  # b's five cached pages are unmapped and mapped again for c
    assert (kv.mapped_pages(b), kv.mapped_pages(c), kv.cached_bytes) == (3, 5, 0)
    assert kv.device.physical_bytes == 8 * GROUP


def test_a_grow_past_the_budget_fails_and_changes_nothing():
    kv = virtual(budget_bytes=8 * GROUP)
    a, b = kv.new_handle(6 * TPP, 1), kv.new_handle(3 * TPP, 1)
    assert kv.admit(a, 6 * TPP)
    before = (kv.device.physical_bytes, kv.allocated_bytes, kv.cached_bytes, kv.live_bytes)
    assert not kv.admit(b, 3 * TPP)
    assert (b.slot, b.capacity_tokens) == (-1, 0)
    assert (kv.device.physical_bytes, kv.allocated_bytes, kv.cached_bytes, kv.live_bytes) == before
    assert not kv.grow(a, 9 * TPP)
    assert a.capacity_tokens == 6 * TPP and kv.num_failures == 2


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "free"]), st.integers(0, 7), st.integers(1, 900)
        ),
        max_size=60,
    ),
    st.booleans(),
)
def test_pages_mapped_follow_the_tokens_of_every_live_request(ops, map_cache):
    """Held pages = ceil(tokens / page) per live request; mapped pages only add the reuse cache;
    the device holds exactly what the manager counts, never past the budget."""
    kv = virtual(budget_bytes=24 * GROUP, map_cache=map_cache)
    live: dict[int, tuple] = {}  # request index -> (handle, tokens asked)
    for op, i, n in ops:
        if op == "admit" and i not in live and len(live) < kv.num_slots:
            h = kv.new_handle(n, 1)
            if kv.admit(h, n):
                live[i] = (h, n)
        elif op == "grow" and i in live:
            h, t = live[i]
            if kv.grow(h, t + n):
                live[i] = (h, t + n)
        elif op == "free" and i in live:
            kv.free(live.pop(i)[0])
        need = {i: math.ceil(t / TPP) for i, (h, t) in live.items()}
        assert kv.held_bytes == sum(need.values()) * GROUP <= kv.budget_bytes
        for i, (h, t) in live.items():
            assert h.capacity_tokens == need[i] * TPP
            assert kv.mapped_pages(h) == need[i] if not map_cache else kv.mapped_pages(h) >= need[i]
        assert (
            kv.device.physical_bytes
            == kv.allocated_bytes
            == kv.held_bytes + kv.cached_bytes
            <= kv.budget_bytes
        )
        assert kv.live_bytes == sum(t for _, t in live.values()) * BPT
        if not map_cache:
            assert kv.cached_bytes == 0


# ---------------------------------------------------------------------- the simulator
MODEL, GPU = "Llama-3.2-1B", "H200"  # 16 layers: 32 KV tensors of 1 KiB per token
MODEL_BPT = 32768


def synth(n=60, rate=50.0, seed=0, prompt=(50, 400), output=(20, 200), hash_ids=None):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return RequestTrace(
        make_requests(t, rng.integers(*prompt, n), rng.integers(*output, n), hash_ids=hash_ids),
        name=f"synth{seed}",
    )


def sim(trace=None, spec="best-fit", **kw):
    kw.setdefault("kv_strategy", "virtual")
    return simulate(trace if trace is not None else synth(), spec, model=MODEL, gpu=GPU, **kw)


@pytest.mark.parametrize("page, budget_tokens", [(64 * KiB, 3000), (2 * MiB, 3 * 2048)])
def test_every_token_is_generated_under_pressure_and_the_device_is_the_one_reported(
    page, budget_tokens
):
    # 2 MiB pages hold 2,048 tokens of one tensor here: the budget is three pages of tokens
    trace = synth(prompt=(50, 2500), output=(20, 400))
    res = sim(
        trace, kv_capacity_bytes=budget_tokens * MODEL_BPT, virtual_page_bytes=page, max_num_seqs=16
    )
    s, r = res.summary, res.requests
    assert s["kv_strategy"] == "virtual" and s["n_preempted"] > 0
    assert s["n_finished"] == 60 and (r.status == "finished").all()
    assert (r.num_generated == r.output_tokens).all()
    device = res.policy.device
    assert (s["n_map"], s["n_unmap"], s["mapped_bytes"]) == (
        device.num_calls["map"],
        device.num_calls["unmap"],
        device.mapped_bytes_total,
    )
    assert s["n_map"] > 0 and s["peak_reserved_bytes"] <= budget_tokens * MODEL_BPT
    assert s["kv_driver_s"] == pytest.approx(
        sum(s[f"driver_ns_{c}"] for c in ("create", "map", "set_access", "unmap", "release")) * 1e-9
    )
    assert s["kv_page_bytes"] == page and s["frag_ext_mean"] == 0


def test_results_are_deterministic():
    a, b = sim(kv_capacity_bytes=3000 * MODEL_BPT), sim(kv_capacity_bytes=3000 * MODEL_BPT)
    pd.testing.assert_series_equal(
        pd.Series(a.summary).drop("wall_s"), pd.Series(b.summary).drop("wall_s")
    )
    assert a.summary["n_map"] > 0
    pd.testing.assert_frame_equal(a.requests, b.requests)


def test_overlapped_mapping_is_never_slower_than_synchronous():
    # a closed batch with room for all: both runs schedule the same steps, so only the stalls differ
    trace = synth(n=40, rate=1e9, prompt=(500, 3000), output=(50, 300))
    kw = dict(virtual_page_bytes=64 * KiB, kv_capacity_bytes=40 * 3300 * MODEL_BPT)
    sync, over = sim(trace, map_overlap=False, **kw), sim(trace, map_overlap=True, **kw)
    assert sync.summary["n_steps"] == over.summary["n_steps"]
    assert over.summary["kv_driver_s"] == pytest.approx(sync.summary["kv_driver_s"])
    assert sync.summary["kv_driver_step_s"] == pytest.approx(sync.summary["kv_driver_s"])
    assert sync.summary["kv_driver_s"] > 0
    assert over.summary["kv_driver_step_s"] < sync.summary["kv_driver_step_s"]
    assert (over.requests.finish_s <= sync.requests.finish_s + 1e-12).all()
    assert (over.requests.ttft_s <= sync.requests.ttft_s + 1e-12).all()


def test_a_request_longer_than_the_budget_is_rejected_with_a_reason():
    trace = RequestTrace(make_requests([0.0, 0.1], [3000, 100], [100, 10]), name="long")
    res = sim(trace, kv_capacity_bytes=2048 * MODEL_BPT, virtual_page_bytes=64 * KiB)
    r = res.requests.set_index("request_id")
    assert r.loc[0, "status"] == "rejected" and "whole budget" in r.loc[0, "reject_reason"]
    assert r.loc[1, "status"] == "finished"


def test_prefix_caching_is_off_with_a_note_not_silently():
    trace = synth(n=20, hash_ids=[[1, 2, 3]] * 20)
    s = sim(trace, prefix_caching=True).summary
    assert s["prefix_caching"] is False and s["prefix_hit_rate"] == 0
    assert "prefix caching off" in s["kv_note"]
    assert sim(trace, prefix_caching=False).summary["kv_note"].count("prefix") == 0
    assert sim(trace, kv_strategy="pow2").summary["kv_note"] == ""


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(pool_layout="shared"), "pool_layout"),
        (dict(freeze_after_steps=3), "freeze_after_steps"),
        (dict(virtual_page_bytes=96 * KiB), "power of two"),
        (dict(virtual_page_bytes=4 * MiB), "virtual_page_bytes"),
    ],
)
def test_what_virtual_does_not_model_is_refused_by_name(options, words):
    with pytest.raises(ValueError, match=words):
        sim(**options)
