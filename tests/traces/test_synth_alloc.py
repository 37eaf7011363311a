import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.events import validate_events
from traces.info import live_bytes
from traces.synth_alloc import generate_alloc_trace, kv_bytes_per_token

SMALL = dict(
    num_layers=2,
    hidden_size=256,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=1000,
    num_requests=6,
    prompt_tokens=(8, 60),
    output_tokens=(1, 12),
    max_batch=3,
)


def _gen(**kw):
    return generate_alloc_trace(**{**SMALL, **kw})


def _allocs(trace, tag):
    ev = trace.events
    return ev[(ev["op"] == "alloc") & (ev["tag"] == tag)]


def test_same_seed_same_trace():
    pd.testing.assert_frame_equal(_gen(seed=7).events, _gen(seed=7).events)


def test_different_seed_different_trace():
    assert not _gen(seed=7).events.equals(_gen(seed=8).events)


def test_trace_is_a_valid_event_table():
    validate_events(_gen(seed=1).events, "synth")


def test_all_four_tags_appear():
    ev = _gen(seed=1).events
    assert set(ev.loc[ev["op"] == "alloc", "tag"]) == {"weights", "kv", "activation", "workspace"}


def test_weights_come_first_at_time_zero_and_stay():
    trace = _gen(seed=1)
    weights = _allocs(trace, "weights")
    assert (weights["time_us"] == 0).all()
    assert list(weights.index) == list(range(len(weights)))
    assert (
        not trace.events.loc[trace.events["op"] == "free", "alloc_id"]
        .isin(weights["alloc_id"])
        .any()
    )
    assert weights["nbytes"].sum() == trace.meta["weights_bytes"]


def test_only_weights_are_live_at_the_end():
    trace = _gen(seed=2)
    assert live_bytes(trace)[-1] == trace.meta["weights_bytes"]


def test_weights_per_layer_tensor_count():
    # embedding + 9 tensors per layer + final norm (tied LM head)
    assert len(_allocs(_gen(num_layers=3), "weights")) == 1 + 9 * 3 + 1
    assert len(_allocs(_gen(num_layers=3, tie_word_embeddings=False), "weights")) == 1 + 9 * 3 + 2


def test_param_count_sets_the_weights_size():
    trace = _gen(param_count=50_000_000)
    assert abs(trace.meta["weights_bytes"] - 2 * 50_000_000) / (2 * 50_000_000) < 0.01


def test_kv_bytes_cover_prompt_and_generated_tokens_in_chunks():
    trace = _gen(seed=4, kv_chunk_tokens=16)
    req = trace.meta["requests"]
    chunk_bytes = 16 * kv_bytes_per_token(num_layers=1, num_kv_heads=2, head_dim=32)
    # the last generated token is never fed back, so the cache holds prompt + output - 1 tokens
    chunks = np.ceil((req["prompt_tokens"] + req["output_tokens"] - 1) / 16).astype(int).sum() * 2
    kv = _allocs(trace, "kv")
    assert len(kv) == chunks and (kv["nbytes"] == chunk_bytes).all()


def test_chunk_of_one_token_grows_per_token():
    trace = _gen(seed=4, kv_chunk_tokens=1)
    req = trace.meta["requests"]
    assert (
        len(_allocs(trace, "kv"))
        == int((req["prompt_tokens"] + req["output_tokens"] - 1).sum()) * 2
    )


def test_no_more_than_max_batch_requests_run_at_once():
    req = _gen(seed=5, num_requests=12, max_batch=3).meta["requests"]
    starts = np.sort(req["start_us"].to_numpy())
    running = [((req["start_us"] <= t) & (req["finish_us"] > t)).sum() for t in starts]
    assert max(running) == 3


def test_requests_start_after_they_arrive():
    req = _gen(seed=6, arrival_rate_per_s=50.0).meta["requests"]
    assert (req["start_us"] >= req["arrival_us"]).all()
    assert req["arrival_us"].is_monotonic_increasing and req["arrival_us"].iloc[-1] > 0


def test_activations_and_workspace_do_not_outlive_their_step():
    trace = _gen(seed=3)
    ev = trace.events
    freed_at = ev[ev["op"] == "free"].set_index("alloc_id")["time_us"]
    for tag in ("activation", "workspace"):
        a = _allocs(trace, tag).set_index("alloc_id")["time_us"]
        lifetime = freed_at.reindex(a.index) - a
        step_us = 6_000 + 2.0 * 3 * 60  # longest possible step for SMALL: overhead + tokens
        assert lifetime.notna().all() and (lifetime <= step_us).all()


def test_list_and_callable_length_specs():
    trace = _gen(prompt_tokens=[10, 20], output_tokens=lambda rng, n: np.full(n, 3))
    req = trace.meta["requests"]
    assert set(req["prompt_tokens"]) <= {10, 20} and (req["output_tokens"] == 3).all()


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"num_layers": 0}, "num_layers"),
        ({"prompt_tokens": (50, 10)}, "prompt_tokens"),
        ({"output_tokens": 0}, "output_tokens"),
        ({"max_batch": 1.5}, "max_batch"),
        ({"param_count": 10, "intermediate_size": 5}, "intermediate_size"),
        ({"param_count": 1000}, "param_count"),
        ({"arrival_rate_per_s": 0}, "arrival_rate_per_s"),
    ],
)
def test_bad_arguments_name_themselves(kw, name):
    with pytest.raises(ValueError, match=name):
        _gen(**kw)


def test_kv_bytes_per_token_matches_field_notes():
    # Llama-3-8B in bf16: 2 x 32 x 8 x 128 x 2 = 128 KiB per token
    assert kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2) == 131_072


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    layers=st.integers(1, 3),
    batch=st.integers(1, 4),
    chunk=st.integers(1, 32),
    requests=st.integers(1, 6),
)
def test_any_configuration_gives_a_valid_trace(seed, layers, batch, chunk, requests):
    trace = _gen(
        seed=seed, num_layers=layers, max_batch=batch, kv_chunk_tokens=chunk, num_requests=requests
    )
    validate_events(trace.events, "synth")
    assert live_bytes(trace)[-1] == trace.meta["weights_bytes"]
    assert (trace.meta["requests"]["finish_us"] > 0).all()


# -- the generator holds the readers' limits (issue 29): refused before the work, not after


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            {"prompt_tokens": 10**12},
            "from 1 to 2,147,483,647",
        ),  # was: killed for memory, building 6e10 KV chunks
        ({"prompt_tokens": (1, 10**20)}, "high <= 2,147,483,647"),
        ({"output_tokens": [10**30]}, "must be integers"),
        ({"output_tokens": [True, False]}, "must be integers"),
        (
            {"num_requests": 100_000_000},
            "100,000,000 requests of this shape make at least .* events, more than 20,000,000",
        ),
        ({"num_requests": 3, "prompt_tokens": 2_000_000_000}, "more than 20,000,000"),
        ({"step_us_per_token": float("inf")}, "finite numbers >= 0"),  # was: OverflowError
    ],
)
def test_specs_beyond_the_limits_are_refused_before_any_work(kw, match):
    with pytest.raises(ValueError, match=match):
        _gen(**kw)


def test_times_past_int64_are_refused_not_wrapped():
    """A tiny arrival rate used to cast 2e304 us to int64: a negative arrival time, written without
    a word."""
    with pytest.raises(ValueError, match="past what an int64 time holds"):
        _gen(arrival_rate_per_s=1e-300)
    with pytest.raises(ValueError, match="more than 9,223,372,036,854,775,807 us"):
        _gen(num_requests=2, step_us_per_token=1e300)


def test_a_tensor_past_int64_is_refused():
    """A model JSON of absurd width used to fail with numpy's OverflowError, a traceback on the
    command line."""
    with pytest.raises(ValueError, match="more than an int64 size holds"):
        _gen(
            num_requests=1,
            hidden_size=4_000_000_000,
            head_dim=4_000_000_000,
            num_heads=1,
            intermediate_size=4_000_000_000,
            output_tokens=1,
            prompt_tokens=1,
        )


def test_the_event_bound_never_refuses_a_trace_that_fits():
    from traces import synth_alloc

    trace = _gen(num_requests=40, prompt_tokens=(100, 400), output_tokens=(5, 40))
    num_events = len(trace.events)
    old = synth_alloc.MAX_EVENTS
    try:
        synth_alloc.MAX_EVENTS = num_events  # exactly its size: allowed
        assert (
            len(_gen(num_requests=40, prompt_tokens=(100, 400), output_tokens=(5, 40)))
            == num_events
        )
    finally:
        synth_alloc.MAX_EVENTS = old
