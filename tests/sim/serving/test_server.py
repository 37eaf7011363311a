import math

import pytest

from sim.replay.costs import CostModel
from sim.replay.hardware import load_gpu
from sim.replay.models import load_model
from sim.serving.config import ServerConfig
from sim.serving.simulate import simulate
from sim.serving.steptime import StepTimeModel
from traces.requests import RequestTrace, make_requests

MODEL, GPU = "Llama-3.2-1B", "H200"
FREE = CostModel(
    {
        "malloc_us": {"nbytes": [1], "us": [1e-6]},
        "free_us": {"nbytes": [1], "us": [1e-6]},
        "d2d_bytes_per_s": 1e30,
        "h2d_bytes_per_s": 1e30,
        "d2h_bytes_per_s": 1e30,
    }
)


def trace(rows):
    """rows: (arrival_s, prompt, output)."""
    t, p, o = zip(*rows)
    return RequestTrace(make_requests(t, p, o), name="t")


@pytest.fixture(scope="module")
def steps():
    return StepTimeModel(load_model(MODEL), load_gpu(GPU))


def test_a_lone_request_takes_one_prefill_then_one_decode_step_per_token(steps):
    r = simulate(trace([(0.0, 100, 5)]), "paged", model=MODEL, gpu=GPU, costs=FREE).requests.iloc[0]
    assert r.ttft_s == pytest.approx(steps.step_time_s(100, 0, 0, 0, 1))
    decode = sum(steps.step_time_s(0, 1, ctx) for ctx in range(100, 104))
    assert r.e2e_s - r.ttft_s == pytest.approx(decode)
    assert r.tpot_s == pytest.approx(decode / 4)


def test_driver_time_lands_on_the_steps_that_allocated():
    t = trace([(0.0, 100, 5)])
    free = simulate(t, "paged", model=MODEL, gpu=GPU, costs=FREE)
    costed = simulate(t, "paged", model=MODEL, gpu=GPU)
    stall = costed.summary["alloc_stall_s"]
    assert stall > 0 and free.summary["alloc_stall_s"] == 0
    assert costed.requests.iloc[0].ttft_s > free.requests.iloc[0].ttft_s
    assert costed.requests.iloc[0].e2e_s == pytest.approx(free.requests.iloc[0].e2e_s + stall)


def test_an_idle_server_waits_for_the_next_arrival():
    res = simulate(
        trace([(0.0, 100, 5), (50.0, 100, 5)]), "paged", model=MODEL, gpu=GPU, costs=FREE
    )
    a, b = res.requests.itertuples()
    assert b.first_token_s - b.arrival_s == pytest.approx(a.ttft_s)
    assert res.summary["sim_time_s"] == pytest.approx(b.finish_s)


def test_batched_requests_share_steps():
    res = simulate(trace([(0.0, 100, 20)] * 4), "paged", model=MODEL, gpu=GPU, costs=FREE)
    assert res.summary["n_steps"] == 20  # one prefill step for all four, then 19 decode steps
    assert res.requests["first_token_s"].nunique() == 1


def test_horizon_stops_the_clock_and_leaves_requests_unfinished():
    res = simulate(
        trace([(0.0, 100, 5), (0.5, 100, 5000)]), "paged", model=MODEL, gpu=GPU, horizon_s=1.0
    )
    assert res.summary["sim_time_s"] == pytest.approx(1.0)
    assert res.summary["n_finished"] == 1
    assert list(res.requests["status"]) == ["finished", "running"]
    assert math.isnan(res.requests.iloc[1].finish_s)


def test_time_series_is_sampled_at_the_given_interval():
    res = simulate(
        trace([(0.01 * i, 100, 200) for i in range(20)]),
        "paged",
        model=MODEL,
        gpu=GPU,
        sample_every_s=0.01,
    )
    t = res.timeseries["time_us"].to_numpy()
    assert (t[1:] >= t[:-1]).all()
    assert len(t) >= 20
    assert res.timeseries["running"].max() >= 2


@pytest.mark.parametrize(
    "name, value",
    [
        ("kv_strategy", "lucky"),
        ("preemption", "pause"),
        ("watermark", 1.5),
        ("max_num_seqs", 0),
        ("pool_layout", "mixed"),
        ("horizon_s", -1.0),
    ],
)
def test_bad_knobs_are_named(name, value):
    with pytest.raises(ValueError, match=name):
        ServerConfig(**{name: value})


def test_unknown_option_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown simulator option 'max_batch'.*max_num_seqs"):
        ServerConfig.from_kwargs(max_batch=3)


def test_a_request_rejected_after_preempting_the_others_does_not_stall_them():
    # pow2 holds the old and the doubled copy at once: 128 + 256 tokens do not fit in 300
    t = trace([(0.0, 100, 150), (0.0, 20, 100)])
    res = simulate(
        t,
        "best-fit:segment_bytes=2MiB",
        model=MODEL,
        gpu=GPU,
        kv_strategy="pow2",
        kv_capacity_bytes=300 * 32768,
    )
    assert list(res.requests["status"]) == ["rejected", "finished"]
    assert (
        res.requests.loc[1, "num_preemptions"] == 1
        and "alone" in res.requests.loc[0, "reject_reason"]
    )


def test_a_run_freezes_the_collector_while_it_runs_and_leaves_it_as_found(monkeypatch):
    import gc

    from sim.serving.server import Server

    seen = []
    run_steps = Server._run_steps

    def watched(self):
        seen.append(gc.get_freeze_count())
        return run_steps(self)

    monkeypatch.setattr(Server, "_run_steps", watched)
    t = trace([(0.0, 100, 5), (0.01, 50, 3)])
    assert gc.get_freeze_count() == 0
    simulate(t, "paged", model=MODEL, gpu=GPU, costs=FREE)
    assert seen and min(seen) > 0  # the objects made before the run: not walked during it
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    # a caller's frozen objects stay frozen: the run neither freezes more nor unfreezes them
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        seen.clear()
        simulate(t, "paged", model=MODEL, gpu=GPU, costs=FREE)
        # (frozen objects that die leave the count: it only falls)
        assert seen and max(seen) <= frozen
        assert frozen // 2 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
