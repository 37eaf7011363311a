import copy
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.replay.hardware import load_gpu
from sim.replay.models import load_model
from sim.serving.steptime import (
    DEFAULT_CALIBRATION_PATH,
    Calibration,
    StepTimeModel,
    default_calibration,
    load_calibration,
)


@pytest.fixture(scope="module")
def llama_h200():
    return StepTimeModel(load_model("Llama-3-8B"), load_gpu("H200"))


def test_decode_batch_1_short_context_takes_4_to_6_ms(llama_h200):
    # About 15-16 GB of weights at 4.8 TB/s x efficiency, plus the step overhead.
    assert 4e-3 < llama_h200.step_time_s(0, 1, 128) < 6e-3


def test_prefill_of_2048_tokens_takes_tens_of_ms(llama_h200):
    assert 20e-3 < llama_h200.step_time_s(2048, 0, 0) < 100e-3


@pytest.mark.parametrize("batch, context", [(1, 128), (32, 32 * 1000), (128, 128 * 2000)])
def test_decode_is_memory_bound(llama_h200, batch, context):
    assert llama_h200.step_cost(0, batch, context).bound == "memory"


@pytest.mark.parametrize("tokens", [512, 2048, 8192])
def test_prefill_is_compute_bound(llama_h200, tokens):
    assert llama_h200.step_cost(tokens, 0, 0).bound == "compute"


def test_prefill_flops_count_the_lm_head_once_per_sequence(llama_h200):
    m = llama_h200.model
    cost = llama_h200.step_cost(100, 0, 0)
    body = m.flops_per_token - m.logits_flops_per_token
    assert cost.flops == 100 * body + m.logits_flops_per_token + m.attention_flops(
        1, 100 * 101 // 2
    )


def test_decode_bytes_read_weights_once_and_every_context_token(llama_h200):
    m = llama_h200.model
    cost = llama_h200.step_cost(0, 4, 4000)
    expected = (
        m.weight_read_bytes
        + m.kv_bytes_per_token * (4000 + 4)
        + 4 * (m.activation_traffic_bytes_per_token + m.logits_bytes_per_sampled_token)
    )
    assert cost.hbm_bytes == expected


def test_longer_context_costs_more_decode_time(llama_h200):
    assert llama_h200.step_time_s(0, 64, 64 * 4000) > llama_h200.step_time_s(0, 64, 64 * 1000)


def test_cached_prefix_makes_a_chunk_dearer(llama_h200):
    assert llama_h200.step_time_s(512, 0, 0, 8192) > llama_h200.step_time_s(512, 0, 0, 0)


def test_splitting_prefill_among_more_sequences_has_fewer_causal_pairs(llama_h200):
    one = llama_h200.step_cost(4096, 0, 0, 0, 1)
    many = llama_h200.step_cost(4096, 0, 0, 0, 8)
    assert many.flops < one.flops


counts = st.integers(min_value=0, max_value=20_000)


@settings(max_examples=200, deadline=None)
@given(p=counts, d=st.integers(0, 512), c=counts, pc=counts, extra=st.integers(1, 4096))
def test_step_time_is_monotone_in_every_count(llama_h200, p, d, c, pc, extra):
    c = c if d else 0
    pc = pc if p else 0
    base = llama_h200.step_time_s(p, d, c, pc)
    assert llama_h200.step_time_s(p + extra, d, c, pc if p + extra else 0) >= base
    assert llama_h200.step_time_s(p, d + extra, c, pc) >= base
    if d:
        assert llama_h200.step_time_s(p, d, c + extra, pc) >= base
    if p:
        assert llama_h200.step_time_s(p, d, c, pc + extra) >= base


@settings(max_examples=100, deadline=None)
@given(p=counts, d=st.integers(0, 512), c=counts)
def test_step_cost_agrees_with_step_time(llama_h200, p, d, c):
    c = c if d else 0
    assert math.isclose(llama_h200.step_cost(p, d, c).total_s, llama_h200.step_time_s(p, d, c))


def test_empty_step_takes_no_time(llama_h200):
    assert llama_h200.step_time_s(0, 0, 0) == 0.0


@pytest.mark.parametrize(
    "args, name",
    [
        ((-1, 0, 0), "prefill_tokens"),
        ((0, -1, 0), "decode_seqs"),
        ((0, 1, -5), "context_tokens"),
        ((0, 0, 10), "context_tokens"),
        ((0, 1, 0, 10), "prefill_context_tokens"),
        ((10, 0, 0, 0, 11), "num_prefill_seqs"),
        ((10, 0, 0, 0, 0), "num_prefill_seqs"),
    ],
)
def test_bad_counts_name_the_argument(llama_h200, args, name):
    with pytest.raises(ValueError, match=name):
        llama_h200.step_time_s(*args)


def test_decode_memory_time_scales_with_hbm_bandwidth():
    m = load_model("Llama-3-8B")
    h200 = StepTimeModel(m, load_gpu("H200")).step_cost(0, 16, 16_000)
    a100 = StepTimeModel(m, load_gpu("A100-80GB")).step_cost(0, 16, 16_000)
    assert a100.memory_s / h200.memory_s == pytest.approx(4.8 / 2.039)
    assert a100.total_s > h200.total_s


def test_copy_reads_and_writes_at_hbm_speed(llama_h200):
    cal = llama_h200.factors
    expected = cal.transfer_latency_s + 2 * (1 << 30) / (4.8e12 * cal.hbm_efficiency)
    assert llama_h200.copy_time_s(1 << 30) == pytest.approx(expected)


def test_swap_goes_at_pcie_speed(llama_h200):
    cal = llama_h200.factors
    expected = cal.transfer_latency_s + (1 << 30) / (
        llama_h200.gpu.pcie_bandwidth_bytes_per_s * cal.pcie_efficiency
    )
    assert llama_h200.swap_time_s(1 << 30) == pytest.approx(expected)


def test_empty_transfers_take_no_time(llama_h200):
    assert llama_h200.copy_time_s(0) == 0.0 and llama_h200.swap_time_s(0) == 0.0


def test_defaults_are_the_bundled_file():
    cal = default_calibration()
    assert 0.3 <= cal.mfu_prefill <= 0.8 and 0.6 <= cal.hbm_efficiency <= 0.95
    assert 0 < cal.step_overhead_s < 5e-3


def test_every_default_is_explained():
    raw = json.loads(DEFAULT_CALIBRATION_PATH.read_text())
    assert set(raw["notes"]) == set(default_calibration().to_dict())


def test_calibration_file_overrides_a_factor(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"hbm_efficiency": 0.5, "source": "measured"}))
    cal = load_calibration(path)
    assert cal.hbm_efficiency == 0.5
    assert cal.mfu_prefill == default_calibration().mfu_prefill
    m, g = load_model("Llama-3-8B"), load_gpu("H200")
    slow = StepTimeModel(m, g, calibration=str(path)).step_time_s(0, 1, 128)
    assert slow > StepTimeModel(m, g).step_time_s(0, 1, 128) * 1.4


def test_layer_overhead_is_paid_once_per_layer():
    cal = {"layer_overhead_s": 1e-3, "step_overhead_s": 0.0}
    small = StepTimeModel(load_model("Llama-3.2-1B"), load_gpu("H200"), calibration=cal)
    assert small.step_cost(0, 1, 10).overhead_s == pytest.approx(16e-3)


def test_defaults_reproduce_the_h200_measurements():
    # The bundled defaults were fitted to step times measured on an H200 (recorded in the file).
    raw = json.loads(DEFAULT_CALIBRATION_PATH.read_text())
    decode, prefill = raw["measured"].values()
    model = StepTimeModel(
        load_model("Llama-3-8B"), load_gpu("H200"), calibration={"step_overhead_s": 0.0}
    )
    for shape, (measured_ms, _) in decode.items():
        batch, context = map(int, shape.split("x"))
        assert model.step_time_s(0, batch, batch * context) * 1e3 == pytest.approx(
            measured_ms, rel=0.15
        ), shape
    for tokens, (measured_ms, _) in prefill.items():
        assert model.step_time_s(int(tokens), 0, 0) * 1e3 == pytest.approx(measured_ms, rel=0.15), (
            tokens
        )


def test_calibration_mapping_overrides_a_factor():
    m, g = load_model("Llama-3-8B"), load_gpu("H200")
    model = StepTimeModel(m, g, calibration={"step_overhead_s": 0.0})
    assert model.factors.step_overhead_s == 0.0
    assert model.calibration == {"step_overhead_s": 0.0}  # stored as given


def test_calibration_unknown_factor_names_file_and_factor(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"mfu_prefil": 0.6}))
    with pytest.raises(ValueError, match=r"typo\.json.*mfu_prefil"):
        load_calibration(path)


def test_calibration_out_of_range_names_file_and_factor(tmp_path):
    path = tmp_path / "range.json"
    path.write_text(json.dumps({"mfu_decode": 1.5}))
    with pytest.raises(ValueError, match=r"range\.json.*'mfu_decode'.*1.5"):
        load_calibration(path)


def test_negative_overhead_is_rejected():
    with pytest.raises(ValueError, match="step_overhead_s"):
        default_calibration().replace(step_overhead_s=-1e-3)


def test_calibration_object_is_used_as_given():
    cal = default_calibration().replace(mfu_prefill=0.25)
    model = StepTimeModel(load_model("Llama-3-8B"), load_gpu("H200"), calibration=cal)
    assert model.factors is cal
    assert isinstance(cal, Calibration)


def test_model_must_be_a_spec():
    with pytest.raises(ValueError, match="load_model"):
        StepTimeModel("llama-3-8b", load_gpu("H200"))


def test_get_params_names_model_gpu_and_factors(llama_h200):
    params = llama_h200.get_params()
    assert params["model"] == "Llama-3-8B" and params["gpu"] == "H200"
    assert params["hbm_efficiency"] == llama_h200.factors.hbm_efficiency


# -- hybrid models: each layer costed as its group -------------------------------------------------
def _with_all_full(name):
    import dataclasses

    model = load_model(name)
    return StepTimeModel(model, load_gpu("H200")), StepTimeModel(
        dataclasses.replace(model, layer_groups=None), load_gpu("H200")
    )


@pytest.mark.parametrize(
    "args",
    [
        (0, 64, 64 * 1000),
        (0, 1, 4000),
        (2048, 0, 0, 0),
        (1024, 0, 0, 2048),
        (512, 8, 8 * 3000, 1024, 2),
    ],
)
def test_sliding_window_costs_what_full_attention_does_below_the_window(args):
    gemma, all_full = _with_all_full("Gemma-2-9B")  # window 4096
    assert gemma.step_time_s(*args) == pytest.approx(all_full.step_time_s(*args), rel=1e-12)
    assert gemma.step_cost(*args).flops == pytest.approx(all_full.step_cost(*args).flops, rel=1e-12)
    assert gemma.step_cost(*args).hbm_bytes == pytest.approx(
        all_full.step_cost(*args).hbm_bytes, rel=1e-12
    )


def test_sliding_window_decode_past_the_window_reads_only_the_window():
    gemma, all_full = _with_all_full("Gemma-2-9B")
    m = gemma.model
    d, context = 64, 64 * 30_000
    saved = all_full.step_cost(0, d, context).hbm_bytes - gemma.step_cost(0, d, context).hbm_bytes
    sliding = next(g for g in m.kv_groups if g.kind == "sliding")
    # the sliding layers read W keys per sequence instead of its whole context
    assert saved == pytest.approx(
        sliding.token_bytes(m.dtype_bytes) * (context + d - d * sliding.sliding_window)
    )
    assert gemma.step_time_s(0, d, context) < 0.7 * all_full.step_time_s(0, d, context)


def test_sliding_window_prefill_past_the_window_counts_pairs_inside_it():
    gemma, all_full = _with_all_full("Gemma-2-9B")
    w = 4096
    # one sequence, 8192 new tokens: full layers 8192*8193/2 pairs, sliding ones w(w+1)/2 + (8192-w)
    # w
    full_pairs, sliding_pairs = 8192 * 8193 / 2, w * (w + 1) / 2 + (8192 - w) * w
    saved = all_full.step_cost(8192, 0, 0).flops - gemma.step_cost(8192, 0, 0).flops
    assert saved == pytest.approx(21 * 4 * gemma.model.q_size * (full_pairs - sliding_pairs))
    assert gemma.step_time_s(512, 0, 0, 16_000) < all_full.step_time_s(512, 0, 0, 16_000)


def test_mamba_layers_cost_the_same_at_any_context():
    bamba, all_full = _with_all_full("Bamba-9B")
    m = bamba.model
    short, long = bamba.step_cost(0, 16, 16 * 1000), bamba.step_cost(0, 16, 16 * 100_000)
    attention = sum(g.token_bytes(m.dtype_bytes) for g in m.kv_groups if g.is_attention)
    # only the 3 attention layers' KV grows with context
    assert long.hbm_bytes - short.hbm_bytes == pytest.approx(attention * 16 * 99_000)
    assert bamba.step_time_s(0, 16, 16 * 100_000) < 0.5 * all_full.step_time_s(0, 16, 16 * 100_000)
    # each scheduled sequence's states are read and written once per step
    state = sum(g.state_bytes(m.dtype_bytes) for g in m.kv_groups)
    one, two = bamba.step_cost(0, 1, 1000), bamba.step_cost(0, 2, 2000)
    assert two.hbm_bytes - one.hbm_bytes == pytest.approx(
        2 * state
        + attention * 1001
        + m.activation_traffic_bytes_per_token
        + m.logits_bytes_per_sampled_token
    )
    assert bamba.step_cost(100, 0, 0).flops > 100 * (m.flops_per_token - m.logits_flops_per_token)


# -- fitted engines (StepTerms, poollab calibrate) -------------------------------------------------
from sim.serving.steptime import StepCalibration, StepTerms, load_step_calibration  # noqa: E402

FITTED = StepTerms(
    fixed_s=0.07,
    per_seq_s=1e-4,
    per_token_s=2e-5,
    per_kv_token_s=1e-6,
    per_pair_s=2e-9,
    per_query_kv_s=1.5e-9,
)


def _fitted_file(tmp_path, **changes):
    cal = StepCalibration(
        default_calibration(),
        terms=FITTED,
        warmup_s=1.5,
        engine="transformers",
        model="Llama-3-8B",
        gpu="H200",
        tp=1,
    )
    data = {**cal.to_json(), **changes}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    return path


def test_the_uncalibrated_default_is_the_roofline_alone(llama_h200):
    # a CUDA-graph engine: batch-1 decode ~5 ms, no fitted terms in play
    assert llama_h200.terms.is_zero and llama_h200.warmup_s == 0
    assert 0.004 < llama_h200.step_time_s(0, 1, 128) < 0.006


def test_an_old_factor_file_still_loads_as_factors_only(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"mfu_prefill": 0.4, "source": "an old file"}))
    cal = load_step_calibration(path)
    assert cal.factors.mfu_prefill == 0.4 and cal.terms.is_zero and cal.model is None
    assert load_calibration(path).mfu_prefill == 0.4
    stm = StepTimeModel(load_model("Llama-3-8B"), load_gpu("H200"), calibration=path)
    assert stm.step_time_s(2048, 0, 0) == StepTimeModel(
        load_model("Llama-3-8B"), load_gpu("H200"), calibration={"mfu_prefill": 0.4}
    ).step_time_s(2048, 0, 0)


def test_a_fitted_file_prices_steps_with_its_terms_over_the_roofline_floor(tmp_path, llama_h200):
    stm = StepTimeModel(
        load_model("Llama-3-8B"), load_gpu("H200"), calibration=_fitted_file(tmp_path)
    )
    assert stm.warmup_s == 1.5
    # batch-2 decode: the fixed 70 ms, not the roofline's 5 ms
    linear = FITTED.linear_s(0, 2, 0, 1002, 1002)
    assert stm.step_time_s(0, 2, 1000) == pytest.approx(linear)
    assert stm.step_time_s(0, 2, 1000) > 10 * llama_h200.step_time_s(0, 2, 1000)
    # the whole step's queries x keys: a prefill beside long decodes costs their product
    cost = stm.step_cost(8000, 20, 40000, 0, 2)
    assert cost.total_s == stm.step_time_s(8000, 20, 40000, 0, 2) == cost.fitted_s
    assert cost.fitted_s > FITTED.per_query_kv_s * 8020 * 48020


def test_the_roofline_is_the_floor_of_a_fitted_engine(tmp_path, llama_h200):
    tiny = StepCalibration(default_calibration(), terms=StepTerms(fixed_s=1e-6))
    stm = StepTimeModel(load_model("Llama-3-8B"), load_gpu("H200"), calibration=tiny)
    assert stm.step_time_s(4096, 0, 0) == pytest.approx(
        llama_h200.step_time_s(4096, 0, 0), rel=1e-12
    )


def test_a_fitted_file_for_another_model_is_refused(tmp_path):
    path = _fitted_file(tmp_path)
    with pytest.raises(ValueError, match="fitted for Llama-3-8B on H200"):
        StepTimeModel(load_model("Llama-3.2-1B"), load_gpu("H200"), calibration=path)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"terms": {"fixed_s": -1}}, "fixed_s"),
        ({"terms": {"per_banana_s": 1}}, "terms"),
        ({"format": "poollab-step-time/9"}, "unknown calibration format"),
        ({"warmup_s": "soon"}, "warmup_s"),
        ({"colour": "red"}, "unknown key"),
    ],
)
def test_a_bad_fitted_file_names_file_and_field(tmp_path, changes, words):
    path = _fitted_file(tmp_path, **changes)
    with pytest.raises(ValueError, match=words) as info:
        load_step_calibration(path)
    assert str(path) in str(info.value)


def test_a_fitted_file_round_trips(tmp_path):
    cal = load_step_calibration(_fitted_file(tmp_path))
    assert (
        cal.terms == FITTED
        and cal.engine == "transformers"
        and (cal.model, cal.gpu, cal.tp) == ("Llama-3-8B", "H200", 1)
    )
    assert "fitted from" in cal.describe() and "70.0 ms" in cal.describe()


def _ranged_file(tmp_path, max_kv=10_000, max_d=8):
    """``_fitted_file`` with a recorded range: KV tokens and decode sequences up to the maxima,
    prefills up to 4,096 tokens."""
    from sim.serving.fit_range import RANGE_FEATURES

    top = {
        "num_prefill_tokens": 4096,
        "prefill_context_tokens": 4096,
        "num_decode_seqs": max_d,
        "decode_context_tokens": max_kv,
        "kv_tokens": max_kv,
    }
    feature_range = {
        "quantile": 0.99,
        "features": {k: {"max": top[k], "quantile": top[k]} for k in RANGE_FEATURES},
    }
    return _fitted_file(tmp_path, fit={"feature_range": feature_range})


def test_a_fitted_file_without_a_range_loads_and_is_not_checked(tmp_path):
    path = _fitted_file(tmp_path)  # written before the range was recorded: no fit.feature_range
    cal = load_step_calibration(path)
    assert cal.fitted_range is None
    stm = StepTimeModel(load_model("Llama-3-8B"), load_gpu("H200"), calibration=path)
    assert stm.range_count is None
    assert stm.step_time_s(0, 2, 1000) == pytest.approx(FITTED.linear_s(0, 2, 0, 1002, 1002))


def test_a_fitted_range_counts_the_steps_priced_past_it_and_prices_them_alike(tmp_path):
    path = _ranged_file(tmp_path)
    stm = StepTimeModel(load_model("Llama-3-8B"), load_gpu("H200"), calibration=path)
    (tmp_path / "plain").mkdir()
    plain = StepTimeModel(
        load_model("Llama-3-8B"), load_gpu("H200"), calibration=_fitted_file(tmp_path / "plain")
    )
    assert stm.step_time_s(0, 4, 5000) == plain.step_time_s(0, 4, 5000)  # inside
    assert stm.step_time_s(0, 4, 20_000) == plain.step_time_s(0, 4, 20_000)  # more KV
    stm.step_time_s(0, 0, 0)  # no step at all: not priced
    stm.step_cost(0, 16, 1000)  # a diagnostic, not a simulated step
    assert (stm.range_count.num_steps, stm.range_count.num_past) == (2, 1)
    # a quiet decode stretch: one priced step each, past once its KV passes 10k
    stm.decode_step_times_s(4, 9_990, 5)  # 9,994 .. 10,010 KV tokens (4 new): 2 inside
    assert (stm.range_count.num_steps, stm.range_count.num_past) == (7, 4)
    assert "read more KV tokens than the calibration saw, up to 2.0x its largest (max 10k;" in (
        stm.range_count.warning()
    )


def test_a_bad_fitted_range_names_the_file(tmp_path):
    path = _fitted_file(tmp_path, fit={"feature_range": {"features": {"kv_tokens": {}}}})
    with pytest.raises(ValueError, match=r"feature_range.features: missing \['num_") as info:
        load_step_calibration(path)
    assert str(path) in str(info.value)


# -- a quiet decode run's step times in one call (the server's closed form) -----------------------
@pytest.mark.parametrize(
    "model,tp", [("Llama-3-8B", 1), ("Llama-3-70B", 4), ("Llama-3.2-1B", 1)], ids=str
)
@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 512), c=st.integers(0, 4_000_000), n=st.integers(0, 40))
def test_decode_step_times_are_step_time_s_bit_for_bit(model, tp, d, c, n):
    stm = _stm(model, tp)
    got = stm.decode_step_times_s(d, c, n)
    assert got == [stm.step_time_s(0, d, c + s * d) for s in range(n)]  # exact, no tolerance


@settings(max_examples=30, deadline=None)
@given(d=st.integers(1, 512), c=st.integers(0, 4_000_000), n=st.integers(1, 40))
def test_decode_step_times_past_exact_float_bytes_are_step_time_s(d, c, n):
    """A memory-bound stretch whose byte counts could pass ``FLOAT_EXACT_INT`` (lowered here
    under every step's) keeps them as integers: still ``step_time_s``'s floats."""
    import sim.serving.steptime as steptime

    stm = _stm("Llama-3-8B", 1)
    limit = steptime.FLOAT_EXACT_INT
    steptime.FLOAT_EXACT_INT = stm._weight_bytes  # (a hypothesis test: no monkeypatch fixture)
    try:
        got = stm.decode_step_times_s(d, c, n)
    finally:
        steptime.FLOAT_EXACT_INT = limit
    assert got == [stm.step_time_s(0, d, c + s * d) for s in range(n)]


_STMS: dict = {}


def _stm(model: str, tp: int) -> StepTimeModel:
    key = (model, tp)
    if key not in _STMS:
        _STMS[key] = StepTimeModel(load_model(model), load_gpu("H200"), tensor_parallel=tp)
    return _STMS[key]


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 512), c=st.integers(0, 4_000_000), n=st.integers(0, 40))
def test_decode_step_times_with_fractional_byte_counts_are_step_time_s(d, c, n):
    """Byte counts that are not integers (a sum whose order matters) take the step loop's
    general form: still ``step_time_s``'s floats, bit for bit."""
    stm = copy.copy(_stm("Llama-3-8B", 1))
    stm._weight_bytes += 0.3  # non-integers: the constant terms cannot be summed ahead
    stm._kv_bytes_per_token += 0.1
    got = stm.decode_step_times_s(d, c, n)
    assert got == [stm.step_time_s(0, d, c + s * d) for s in range(n)]


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 64), offset=st.integers(-3_000, 3_000), n=st.integers(1, 40))
def test_decode_step_times_across_the_compute_memory_crossover_are_step_time_s(d, offset, n):
    """A stretch that starts, ends or crosses where the compute side overtakes the memory side
    (the attention pairs priced at twice the KV bytes' rate, so compute grows faster with the
    context and crosses near 122k tokens) is computed side by side, not the memory side's
    closed form (``_memory_bound`` at both ends): still ``step_time_s``'s floats, bit for bit."""
    stm = copy.copy(_stm("Llama-3-8B", 1))
    per_byte, kv = stm._s_per_hbm_byte, stm._kv_bytes_per_token
    stm._decode_pair_s = 2 * kv * per_byte
    base = stm._weight_bytes + (stm._act_bytes_per_token + stm._logits_bytes) * d
    token_s = d * stm._decode_token_s
    crossover = int((base * per_byte - token_s) / (stm._decode_pair_s - kv * per_byte))
    c = max(0, crossover + offset)
    got = stm.decode_step_times_s(d, c, n)
    want = [stm.step_time_s(0, d, c + s * d) for s in range(n)]
    assert got == want  # exact, no tolerance

    def compute_bound(ctx):  # the step over ``ctx`` context tokens (``ctx + d`` attended)
        return token_s + (ctx + d) * stm._decode_pair_s > (base + kv * (ctx + d)) * per_byte

    # the stretch's ends on the sides of the crossover the offset puts them on
    if offset > 100:
        assert compute_bound(c)
    if offset + n * d < -100:
        assert not compute_bound(c + (n - 1) * d)
