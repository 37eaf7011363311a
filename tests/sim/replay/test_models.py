import json

import pytest

from sim.replay.models import ModelSpec, available_models, load_model

REQUIRED = ["Llama-3-8B", "Llama-3-70B", "Llama-2-13B", "Qwen2.5-7B", "Mistral-7B", "OPT-13B"]


def _fields(**overrides):
    fields = load_model("llama-3-8b").to_dict()
    fields.update(overrides)
    return fields


def test_required_presets_are_available():
    assert set(REQUIRED) <= set(available_models())


@pytest.mark.parametrize(
    "name, expected",
    [
        ("Llama-3-8B", 131_072),  # 2 x 32 x 8 x 128 x 2 (field notes)
        ("Llama-3-70B", 327_680),  # 2 x 80 x 8 x 128 x 2
        ("OPT-13B", 819_200),  # MHA: 2 x 40 x 40 x 128 x 2
        ("Qwen2.5-7B", 57_344),  # 2 x 28 x 4 x 128 x 2
    ],
)
def test_kv_bytes_per_token(name, expected):
    assert load_model(name).kv_bytes_per_token == expected


def test_opt_13b_is_multi_head_with_5120_hidden():
    m = load_model("OPT-13B")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads) == (40, 5120, 40, 40)


@pytest.mark.parametrize("name", available_models())
def test_param_count_agrees_with_shape(name):
    # Linear weights of every layer plus the embedding table(s): biases, norms and OPT's
    # positional table are the only parts left out, well under 1 %.
    m = load_model(name)
    if any(g.kind == "mamba" for g in m.kv_groups):
        pytest.skip(
            "Mamba layers have no attention/MLP shape "
            "(tests/sim/serving/test_kv_groups.py checks Bamba's count)"
        )
    attention = 2 * m.hidden_size * m.q_size + 2 * m.hidden_size * m.kv_size
    mlp = (3 if m.gated_mlp else 2) * m.hidden_size * m.intermediate_size
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tied_embeddings else 2)
    estimate = m.num_layers * (attention + mlp) + embeddings
    assert abs(m.param_count - estimate) / m.param_count < 0.01


def test_weight_bytes_of_llama_3_8b_bf16():
    m = load_model("Llama-3-8B")
    assert m.dtype_bytes == 2
    assert m.weight_bytes == 8_030_261_248 * 2


def test_flops_per_token_is_about_twice_the_parameters():
    m = load_model("Llama-3-8B")
    assert 1.8 * m.param_count < m.flops_per_token <= 2 * m.param_count


def test_untied_input_embedding_is_not_multiplied():
    m = load_model("Llama-3-8B")
    assert m.matmul_param_count == m.param_count - m.vocab_size * m.hidden_size


def test_tied_embedding_is_the_lm_head():
    m = load_model("Llama-3.2-1B")
    assert m.tied_embeddings and m.matmul_param_count == m.param_count


def test_attention_flops_formula():
    m = load_model("Llama-3-8B")
    assert m.attention_flops(3, 1000) == 4 * 32 * 32 * 128 * 3 * 1000


def test_activation_bytes_of_llama_3_8b():
    m = load_model("Llama-3-8B")
    # MLP phase: residual 4096 + gate/up 2 x 14336 + activation 14336 elements, bf16.
    per_token = (4096 + 2 * 14336 + 14336) * 2
    logits = 128_256 * (2 + 4)
    assert m.activation_bytes(1000, 1) == 1000 * per_token + logits
    assert m.activation_bytes(8) == 8 * (per_token + logits)


def test_activation_bytes_of_a_plain_mlp_model():
    m = load_model("OPT-13B")
    per_token = (5120 + 20480 + 20480) * 2  # residual, fc1 output, activation output
    assert m.activation_bytes(10, 0) == 10 * per_token


def test_activation_bytes_grow_with_tokens():
    m = load_model("Qwen2.5-7B")
    assert m.activation_bytes(1) < m.activation_bytes(2) < m.activation_bytes(2048)


@pytest.mark.parametrize(
    "spelling", ["llama-3-8b", "LLAMA-3-8B", " Llama-3-8B ", "meta-llama/Meta-Llama-3-8B"]
)
def test_names_are_case_insensitive_and_hf_ids_work(spelling):
    assert load_model(spelling).name == "Llama-3-8B"


def test_load_model_passes_a_spec_through():
    m = load_model("Mistral-7B")
    assert load_model(m) is m


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown model 'llama-5'.*Llama-3-8B.*OPT-13B"):
        load_model("llama-5")


def test_custom_model_from_json_file(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(
        json.dumps(
            {
                k: v
                for k, v in _fields(num_layers=2, param_count=1_100_000_000).items()
                if k != "name"
            }
        )
    )
    m = load_model(str(path))
    assert m.name == "tiny" and m.num_layers == 2
    assert m.kv_bytes_per_token == 2 * 2 * 8 * 128 * 2


def test_custom_model_round_trips_through_to_dict(tmp_path):
    m = load_model("OPT-13B")
    path = tmp_path / "opt.json"
    path.write_text(json.dumps(m.to_dict()))
    assert load_model(path) == m


def test_custom_model_accepts_integral_floats_and_hf_dtype_names(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_fields(param_count=8.030261248e9, dtype="bfloat16")))
    m = load_model(path)
    assert m.param_count == 8_030_261_248 and m.dtype == "bf16"


def test_bad_field_names_file_and_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_fields(num_layers=-3)))
    with pytest.raises(ValueError, match=r"bad\.json.*num_layers\(=-3\) must be an integer >= 1"):
        load_model(path)


def test_missing_field_names_file_and_field(tmp_path):
    fields = _fields()
    del fields["head_dim"]
    path = tmp_path / "missing.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=r"missing\.json.*missing field.*head_dim"):
        load_model(path)


def test_unknown_field_names_file_and_field(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(_fields(num_layer=32)))
    with pytest.raises(ValueError, match=r"typo\.json.*unknown field.*num_layer"):
        load_model(path)


def test_bad_dtype_names_the_field(tmp_path):
    path = tmp_path / "dt.json"
    path.write_text(json.dumps(_fields(dtype="int3")))
    with pytest.raises(ValueError, match=r"dt\.json.*'dtype'.*int3"):
        load_model(path)


def test_param_count_in_billions_is_rejected(tmp_path):
    path = tmp_path / "billions.json"
    path.write_text(json.dumps(_fields(param_count=8)))
    with pytest.raises(ValueError, match=r"billions\.json.*'param_count'"):
        load_model(path)


def test_kv_heads_must_divide_heads():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelSpec(**_fields(num_kv_heads=5))


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json.*not valid JSON"):
        load_model(path)


def test_json_nested_too_deep_names_the_file(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)  # past the parser's recursion limit
    with pytest.raises(ValueError, match=r"deep\.json: JSON nested too deep"):
        load_model(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"nowhere\.json.*does not exist"):
        load_model(tmp_path / "nowhere.json")
