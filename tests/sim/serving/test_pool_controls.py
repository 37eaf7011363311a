"""The pool controls the simulated server drives (sim/serving/server.py): growth freeze after N
steps, phase-aware pre-growth of an elastic pool, and compaction between steps or when idle."""

from __future__ import annotations

import numpy as np
import pytest

from sim.replay.costs import CostModel
from sim.serving.config import ServerConfig
from sim.serving.simulate import simulate
from traces.requests import RequestTrace, make_requests

MODEL, GPU = "Llama-3.2-1B", "H200"
BPT = 32768  # Llama-3.2-1B: KV bytes per token
FREE_COPIES = CostModel(
    {
        "malloc_us": {"nbytes": [1], "us": [50.0]},
        "free_us": {"nbytes": [1], "us": [50.0]},
        "d2d_bytes_per_s": 1e30,
        "h2d_bytes_per_s": 1e30,
        "d2h_bytes_per_s": 1e30,
    }
)


def trace(rows):
    """rows: (arrival_s, prompt, output)."""
    t, p, o = zip(*rows)
    return RequestTrace(make_requests(t, p, o), name="t")


def synth(n=150, rate=200.0, seed=0):
    rng = np.random.default_rng(seed)
    return trace(
        list(
            zip(
                np.cumsum(rng.exponential(1 / rate, n)),
                rng.integers(50, 400, n),
                rng.integers(20, 200, n),
            )
        )
    )


def sim(spec, t, **kw):
    return simulate(t, spec, model=MODEL, gpu=GPU, **kw)


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "kw, named",
    [
        ({"freeze_after_steps": -1}, "freeze_after_steps"),
        ({"freeze_after_steps": 1.5}, "freeze_after_steps"),
        ({"pregrow_safety": 0}, "pregrow_safety"),
        ({"pregrow_safety": float("inf")}, "pregrow_safety"),
        ({"compact_between_steps": 1}, "compact_between_steps"),
    ],
)
def test_bad_control_options_name_themselves(kw, named):
    with pytest.raises(ValueError, match=named):
        ServerConfig(**kw)


def test_pregrowth_needs_a_pool_that_can_reserve():
    with pytest.raises(ValueError, match="pregrow_safety needs .*elastic"):
        sim("paged", trace([(0.0, 100, 5)]), pregrow_safety=1.0)


def test_compaction_needs_a_compacting_pool():
    with pytest.raises(ValueError, match="compact_between_steps needs a compacting"):
        sim("best-fit", trace([(0.0, 100, 5)]), compact_between_steps=True)


def test_controls_off_report_zeros():
    s = sim("paged", trace([(0.0, 100, 5)])).summary
    assert (s["n_frozen_failures"], s["frozen_at_s"], s["n_pregrows"], s["n_compactions"]) == (
        0,
        None,
        0,
        0,
    )
    assert s["n_hot_grows"] == s["n_grow"] > 0


# ---------------------------------------------------------------------------- freeze
def test_freeze_stops_kv_growth_after_n_steps():
    res = sim(
        "best-fit:segment_bytes=8MiB", synth(), kv_capacity_bytes=6000 * BPT, freeze_after_steps=5
    )
    s = res.summary
    assert s["frozen_at_s"] > 0 and s["n_frozen_failures"] > 0
    assert res.policy.frozen
    after = res.timeseries[res.timeseries.time_us > s["frozen_at_s"] * 1e6]
    assert after.reserved_bytes.max() <= after.reserved_bytes.iloc[0]  # never grew again


def test_freeze_before_the_first_step_leaves_no_room_at_all():
    s = sim("paged", trace([(0.0, 100, 5)]), freeze_after_steps=0).summary
    assert (s["n_finished"], s["n_rejected"]) == (0, 1) and s["n_frozen_failures"] == s[
        "n_failed"
    ] > 0


# ---------------------------------------------------------------------------- pre-growth
def test_pregrowth_takes_the_first_prefills_grow_off_the_hot_path():
    t = trace([(0.0, 300, 5)])
    reactive = sim("elastic:base=[paged],high=1.0", t, costs=FREE_COPIES)
    predicted = sim("elastic:base=[paged],high=1.0", t, costs=FREE_COPIES, pregrow_safety=1.0)
    r, p = reactive.summary, predicted.summary
    assert r["n_hot_grows"] >= 1 and r["n_pregrows"] == 0
    assert p["n_hot_grows"] == 0 and p["n_pregrows"] >= 1 and p["pregrow_driver_s"] > 0
    assert p["alloc_stall_s"] < r["alloc_stall_s"]
    assert predicted.requests.ttft_s.iloc[0] < reactive.requests.ttft_s.iloc[0]


def test_pregrowth_reserves_at_least_the_admitted_kv():
    s = sim("elastic:base=[paged],high=1.0", trace([(0.0, 1000, 2)]), pregrow_safety=2.0).summary
    assert s["pregrow_bytes"] >= 2 * 1000 * BPT


# ---------------------------------------------------------------------------- compaction
def test_compaction_between_steps_runs_and_is_charged_to_steps():
    base = "compacting:base=[best-fit:segment_bytes=8MiB],idle_only=true,threshold=0.3"
    s = sim(base, synth(), kv_capacity_bytes=3000 * BPT, compact_between_steps=True).summary
    assert (
        s["n_compactions"] > 0
        and s["compaction_moved_bytes"] > 0
        and s["n_compaction_rescues"] == 0
    )
    assert 0 < s["compaction_s"] <= s["alloc_stall_s"]


def test_idle_only_pool_without_the_option_never_compacts():
    base = "compacting:base=[best-fit:segment_bytes=8MiB],idle_only=true,threshold=0.3"
    s = sim(base, synth(), kv_capacity_bytes=3000 * BPT).summary
    assert s["n_compactions"] == 0


def test_failures_on_the_allocation_path_are_rescued():
    s = sim(
        "compacting:base=[best-fit:segment_bytes=8MiB]", synth(), kv_capacity_bytes=3000 * BPT
    ).summary
    plain = sim("best-fit:segment_bytes=8MiB", synth(), kv_capacity_bytes=3000 * BPT).summary
    assert s["n_compaction_rescues"] > 0 and s["n_failed"] < plain["n_failed"]
