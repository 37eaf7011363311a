"""The server's fast path (multi-step decode runs, skipped activation round trips) changes nothing.

Each case is simulated twice from the same setup, with ``Server.fast_path`` on and off, and
every non-timing column of the summary row, the request table and the time series must be
EXACTLY equal (floats included: the fast path performs the same float operations in the same
order, so no tolerance is allowed). Timing columns (measured call latencies, wall time) differ
between any two runs and are left out.
"""

import math
import re
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim.serving.server import _delays_to
from sim.serving.simulate import build_serving, serving_result
from traces.request_readers import read_request_trace
from traces.requests import make_requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_scheduler import log_kv_calls  # noqa: E402

AZURE = Path(__file__).resolve().parents[3] / "traces" / "data" / "azure_code_slice.csv"
MODEL, GPU = "Llama-3-8B", "H200"
#: measured, not simulated: they differ between any two runs
TIMING = re.compile(
    r"(_us$|_ns$|_ns_total$|wall_s|latency|_s_per|elapsed|^ns$|seconds|^t_ns|duration_ns|driver_ns)"
)


@pytest.fixture(scope="module")
def azure():
    return read_request_trace(AZURE)


def run(trace, spec, fast, **options):
    setup = build_serving(trace, spec, model=MODEL, gpu=GPU, **options)
    setup.server.fast_path = fast
    end_s = setup.server.run()
    return setup.server, serving_result(setup, end_s=end_s, wall_s=0.0)


def assert_same_frames(a: pd.DataFrame, b: pd.DataFrame, what: str) -> None:
    keep = [c for c in a.columns if not TIMING.search(str(c))]
    assert list(a.columns) == list(b.columns), what
    pd.testing.assert_frame_equal(a[keep], b[keep], check_exact=True, obj=what)


def assert_same_results(slow, fast):
    for k, v in slow.summary.items():
        if TIMING.search(k):
            continue
        w = fast.summary[k]
        same = (v == w) or (
            isinstance(v, float) and isinstance(w, float) and math.isnan(v) and math.isnan(w)
        )
        assert same, f"summary column {k}: {v!r} (fast path off) != {w!r} (on)"
    assert_same_frames(slow.requests, fast.requests, "requests")
    assert_same_frames(slow.timeseries, fast.timeseries, "timeseries")


CASES = [
    ("paged", {}),
    ("best-fit", {}),
    ("best-fit", {"kv_strategy": "grow", "preemption": "swap", "kv_capacity_bytes": 8 << 30}),
    ("paged", {"kv_capacity_bytes": 2 << 30}),  # under pressure: preemptions between runs
    ("size-class", {"freeze_after_steps": 500}),
    ("best-fit", {"kv_strategy": "virtual"}),
    ("paged", {"aux_policy": "size-class"}),
    ("elastic", {"pregrow_safety": 1.2}),
]


@pytest.mark.parametrize(
    "spec,options", CASES, ids=[f"{s}-{'-'.join(o) or 'default'}" for s, o in CASES]
)
def test_fast_path_gives_identical_results(azure, spec, options):
    slow_server, slow = run(azure, spec, False, **options)
    fast_server, fast = run(azure, spec, True, **options)
    assert (
        slow_server.num_batched_steps == 0 and slow_server.num_skipped_activation_round_trips == 0
    )
    assert fast_server.num_quiet_steps > 0, "the case exercises the fast path"
    assert fast_server.num_steps == slow_server.num_steps
    assert_same_results(slow, fast)


@pytest.mark.parametrize("spec", ["paged", "best-fit"])
def test_quiet_stretches_of_any_length_give_identical_results(azure, spec):
    # the quiet runs take their step times a stretch at a time (at most quiet_stretch_steps, up
    # to the next finish): short stretches cut runs everywhere, and nothing may change
    slow_server, slow = run(azure, spec, False)
    setup = build_serving(azure, spec, model=MODEL, gpu=GPU)
    setup.server.quiet_stretch_steps = 3
    end_s = setup.server.run()
    assert setup.server.num_quiet_steps > 0.5 * setup.server.num_steps
    assert setup.server.num_steps == slow_server.num_steps
    assert_same_results(slow, serving_result(setup, end_s=end_s, wall_s=0.0))


@pytest.mark.parametrize("spec", ["paged", "best-fit"])
def test_quiet_runs_stop_where_a_float_might_not_hold_the_token_bytes(azure, spec, monkeypatch):
    # the quiet loop keeps the token bytes as a float below ``FLOAT_EXACT_INT`` and stops a run
    # at the stretch that could reach it: lowered into the bytes the runs reach, runs stop in
    # their middle, and the engine's own steps from there must give the same results
    import sim.serving.server as server_module

    slow_server, slow = run(azure, spec, False)
    setup = build_serving(azure, spec, model=MODEL, gpu=GPU)
    bytes_per_token = setup.kv.bytes_per_token
    monkeypatch.setattr(server_module, "FLOAT_EXACT_INT", 2_000 * bytes_per_token)
    end_s = setup.server.run()
    fast_server = setup.server
    # (about 90 % of the steps are quiet without the limit: tested to stop runs, not all of them)
    assert 0 < fast_server.num_quiet_steps < 0.6 * fast_server.num_steps
    assert fast_server.num_steps == slow_server.num_steps
    assert_same_results(slow, serving_result(setup, end_s=end_s, wall_s=0.0))


def test_fast_path_is_off_in_the_shared_layout_and_results_agree(azure):
    slow_server, slow = run(azure, "best-fit", False, pool_layout="shared")
    fast_server, fast = run(azure, "best-fit", True, pool_layout="shared")
    # the activations share the pool under test there: every round trip is made and timed
    assert fast_server.num_quiet_steps == 0 and fast_server.num_skipped_activation_round_trips == 0
    assert fast_server.num_batched_steps > 0  # steps still run back to back
    assert len(fast.summary) == len(slow.summary)
    assert_same_results(slow, fast)


def test_skipped_round_trips_are_counted(azure):
    server, _ = run(azure, "paged", True)
    # every step either made its activations' round trip or counted it as skipped (no step
    # here is short of activation memory, so there are no retries)
    assert server.num_activation_failures == 0
    made = server.pools.activations.policy.stats().num_allocs
    assert made + server.num_skipped_activation_round_trips == server.num_steps
    assert server.num_quiet_steps <= server.num_skipped_activation_round_trips


@pytest.mark.parametrize(
    "now_s,end_s",
    [
        (0.0, 0.3),
        (0.19552277483712263, 0.46556321754368596),
        (1.5, 2.9),
        (3600.25, 3600.2500001),
        (1e-9, 7.0),
    ],
)
def test_delays_reach_the_exact_float_time_of_a_run(now_s, end_s):
    # rounding to even can put end_s out of one addition's reach (the second pair): two timeouts
    # then
    t = now_s
    for delay in _delays_to(now_s, end_s):
        assert delay > 0
        t = t + delay  # as simpy adds a timeout's delay to its clock
    assert t == end_s


def test_fast_path_with_a_prefix_cache_gives_identical_results():
    # shared prompt blocks (hash_ids, 64-token blocks), cached blocks evicted under a small budget
    import numpy as np

    from traces.requests import RequestTrace, make_requests

    rng = np.random.default_rng(7)
    n = 300
    groups = rng.integers(0, 8, n)
    prompts = (rng.integers(4, 9, n) * 64 + rng.integers(0, 64, n)).tolist()
    hash_ids = [tuple(1000 * int(g) + b for b in range(p // 64)) for g, p in zip(groups, prompts)]
    t = RequestTrace(
        make_requests(
            np.cumsum(rng.exponential(0.05, n)),
            prompts,
            rng.integers(5, 300, n).tolist(),
            hash_ids=hash_ids,
        ),
        name="prefix",
        meta={"hash_block_tokens": 64},
    )
    for options in ({}, {"kv_capacity_bytes": 256 << 20}):
        slow_server, slow = run(t, "paged", False, **options)
        fast_server, fast = run(t, "paged", True, **options)
        assert fast_server.num_quiet_steps > 0
        assert fast.summary["prefix_hit_rate"] > 0
        assert_same_results(slow, fast)


@pytest.mark.parametrize(
    "spec,options", [("paged", {}), ("best-fit", {}), ("paged", {"kv_capacity_bytes": 2 << 30})]
)
def test_the_kv_policy_sees_every_call_of_the_step_by_step_path(azure, spec, options):
    # the closed form takes pages and frees requests through the policy as the engine's own steps
    # do: the same calls, sizes and addresses, in the same order
    logs = []
    for fast in (False, True):
        setup = build_serving(azure, spec, model=MODEL, gpu=GPU, **options)
        setup.server.fast_path = fast
        logs.append(log_kv_calls(setup.pools.kv))
        setup.server.run()
    assert len(logs[0]) > 1000 and logs[0] == logs[1]


def test_quiet_runs_go_through_finishes_arrivals_and_samples(azure):
    # a quiet run ends only where the batch changes shape by an admission (or memory runs out):
    # finishing requests, the step an arrival falls in and time-series samples stay in closed form
    server, result = run(azure, "paged", True)
    num_prefill_steps = sum(
        1 for r in server.requests if r.status.value == "finished"
    )  # one prompt step each
    assert server.num_steps - server.num_quiet_steps <= 1.5 * num_prefill_steps
    assert server.num_quiet_steps > 0.9 * server.num_steps


def _round_trips(spec, trace, **options):
    """The activation round trips a fast run makes: (size, segment changes of the pool before
    it)."""
    setup = build_serving(trace, spec, model=MODEL, gpu=GPU, **options)
    pools, trips = setup.pools, []
    allocate = pools.allocate_activations

    def logged(nbytes):
        acts = pools.activations.policy
        trips.append((nbytes, acts.num_grows + acts.num_shrinks))
        return allocate(nbytes)

    pools.allocate_activations = logged
    setup.server.run()
    return trips


def test_a_coalescing_activation_pool_skips_every_size_it_has_seen(azure):
    # best-fit coalesces: with nothing live its state is its segments, so each activation size
    # makes one round trip per change of its segments, the others are skipped
    trips = _round_trips("paged", azure)
    assert len(trips) > 50 and len(set(trips)) == len(trips)
    # a size-class pool does not coalesce: only a repeat of the last size is skipped
    trips = _round_trips("paged", azure, aux_policy="size-class")
    assert len(set(trips)) < len(trips)
    assert all(a != b for a, b in zip(trips, trips[1:]))


@pytest.mark.parametrize("spec", ["paged", "best-fit"])
def test_a_step_the_engine_yields_for_is_one_event(azure, spec, monkeypatch):
    # a step that ends at or after the next arrival, begun after steps run back to back: the
    # engine's clock moves to its end in one timeout (two only where ``_delays_to`` needs two),
    # not one to its start and one for it; on a clock of its own the engine is driven by
    # ``Server.run`` (``_OwnClock``: no simpy event loop, no arrival process, no wake-up event)
    import simpy

    from sim.serving import server as server_module

    setup = build_serving(azure, spec, model=MODEL, gpu=GPU)
    server, timeout = setup.server, server_module._OwnClock.timeout
    by_process: dict[str, int] = {}

    def counted(delay):
        name = sys._getframe(1).f_code.co_name
        by_process[name] = by_process.get(name, 0) + 1
        return timeout(delay)

    monkeypatch.setattr(server_module._OwnClock, "timeout", staticmethod(counted))
    # the simpy environment is not run: any event, timeout or process made in it would fail
    for name in ("timeout", "event", "process", "run"):
        monkeypatch.setattr(server.env, name, None)
    take = server._take_arrivals
    num_idle = []  # the engine's waits for work (up to the next arrival: one or two timeouts)

    def counted_take(now_s):
        num_idle.append(sys._getframe(1).f_code.co_name == "_engine")
        return take(now_s)

    server._take_arrivals = counted_take
    end_s = server.run()
    yielded = server.num_steps - server.num_batched_steps  # steps the engine yielded for
    assert yielded > 100 and server.num_batched_steps > yielded
    # the engine takes the arrivals itself; the clock's timeouts are the engine's alone
    assert set(by_process) == {"_engine"}
    # (the tree before made one more timeout for nearly every yielded step: 965 for 572 here)
    assert yielded <= by_process["_engine"] <= 1.01 * yielded + 2 * sum(num_idle)
    # the server's environment afterwards is a simpy one at the time reached
    assert type(server.env) is simpy.Environment and server.env.now == end_s


def test_a_server_on_its_own_clock_reaches_the_times_of_the_event_loop(azure):
    # the same run on its own clock (``_OwnClock``, driven by ``Server.run``) and through simpy's
    # event loop (``start`` and ``env.run``, the engine's timeouts simpy events): every result
    # equal, the end time to the bit (the clock adds each delay as simpy adds a timeout's)
    own = build_serving(azure, "paged", model=MODEL, gpu=GPU)
    end_own = own.server.run()
    loop = build_serving(azure, "paged", model=MODEL, gpu=GPU)
    loop.server.env.run(until=loop.server.start())  # what ``run`` does on a shared clock
    end_loop = loop.server.finish()
    assert end_own == end_loop and end_own > 0
    assert own.server.num_steps == loop.server.num_steps
    assert own.server.num_batched_steps == loop.server.num_batched_steps > 0
    assert_same_results(
        serving_result(loop, end_s=end_loop, wall_s=0.0),
        serving_result(own, end_s=end_own, wall_s=0.0),
    )


def test_arrivals_at_a_step_end_come_as_their_events_would(azure):
    # requests added at the exact float time a step ends (one, and two at once): simpy runs the
    # arrival's timeout, scheduled first, before the engine's; the engine that takes its
    # arrivals itself must add them before it ends the step, as the step-by-step path does
    from traces.requests import RequestTrace

    setup = build_serving(azure, "paged", model=MODEL, gpu=GPU)
    ends = []
    end_step = setup.server._end_step
    setup.server._end_step = lambda *a: (ends.append(a[-1]), end_step(*a))
    setup.server.fast_path = False
    setup.server.run()
    df = azure.requests
    for end_s, copies in ((ends[len(ends) // 3], 1), (ends[2 * len(ends) // 3], 2)):
        assert end_s not in set(df["arrival_s"])
        extra = df.iloc[[5] * copies].assign(arrival_s=end_s)
        rows = pd.concat([df, extra]).sort_values("arrival_s", kind="stable")
        t = RequestTrace(
            make_requests(
                rows["arrival_s"].to_numpy(), rows["prompt_tokens"], rows["output_tokens"]
            ),
            name="tie",
        )
        assert end_s in set(t.requests["arrival_s"])
        slow_server, slow = run(t, "paged", False)
        fast_server, fast = run(t, "paged", True)
        assert fast_server.num_quiet_steps > 0
        assert_same_results(slow, fast)
