"""What a simulation's headline stands on: context limits, rejection kinds, pressure utilisation,
eviction orders through the simulator, empty traces."""

import numpy as np
import pytest

from sim.replay.models import available_models, load_model
from sim.serving.simulate import simulate
from traces.requests import RequestTrace, make_requests

#: Hugging Face config.json max_position_embeddings of each preset (checked by hand, see
#: models.json)
CONTEXT = {
    "Llama-3-8B": 8192,
    "Llama-3.1-8B": 131072,
    "Llama-3-70B": 8192,
    "Llama-3.1-70B": 131072,
    "Llama-2-7B": 4096,
    "Llama-2-13B": 4096,
    "Llama-3.2-1B": 131072,
    "Llama-3.2-3B": 131072,
    "Qwen2.5-7B": 131072,
    "Qwen2.5-7B-Instruct": 32768,
    "Mistral-7B": 32768,
    "OPT-13B": 2048,
    "Gemma-2-9B": 8192,
    "Bamba-9B": 262144,
}


def test_every_preset_carries_its_context_limit():
    assert {m: load_model(m).max_position_embeddings for m in available_models()} == CONTEXT


def test_llama_3_1_ids_reach_the_131k_preset():
    for name in ("Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct"):
        assert load_model(name).max_position_embeddings == 131072
    assert load_model("meta-llama/Meta-Llama-3-8B").max_position_embeddings == 8192


def test_a_bad_context_limit_in_a_file_names_the_field(tmp_path):
    spec = load_model("Llama-3-8B").to_dict() | {"max_position_embeddings": 0}
    p = tmp_path / "m.json"
    import json

    p.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_model(p)


def trace(prompts, outputs=None, hash_ids=None, rate=20.0):
    n = len(prompts)
    t = np.arange(n) / rate
    return RequestTrace(
        make_requests(t, prompts, outputs or [20] * n, hash_ids=hash_ids),
        name="t",
        meta={"hash_block_tokens": 64},
    )


def test_max_model_len_defaults_to_the_models_context():
    t = trace([9000, 100])
    short = simulate(t, "paged", model="Llama-3-8B", gpu="H200")
    long = simulate(t, "paged", model="Llama-3.1-8B", gpu="H200")
    assert (short.summary["n_rejected"], short.summary["max_model_len"]) == (1, 8192)
    assert short.summary["rejected_by"] == "prompt>=max_model_len: 1"
    assert (long.summary["n_rejected"], long.summary["max_model_len"]) == (0, 131072)
    assert short.requests.loc[0, "reject_kind"] == "prompt>=max_model_len"


def test_an_empty_trace_is_an_error():
    with pytest.raises(ValueError, match="no requests"):
        simulate(trace([]), "paged", model="Llama-3.2-1B", gpu="H200")


def test_pressure_utilisation_is_taken_over_blocked_steps_only():
    t = trace([400] * 120, [200] * 120, rate=400.0)
    tight = simulate(
        t, "best-fit", model="Llama-3.2-1B", gpu="H200", kv_capacity_bytes=3000 * 32768
    ).summary
    roomy = simulate(t, "best-fit", model="Llama-3.2-1B", gpu="H200").summary
    assert 0 < tight["kv_pressure_share"] <= 1 and 0 < tight["kv_token_util_pressure"] <= 1
    assert roomy["kv_pressure_share"] == 0 and np.isnan(roomy["kv_token_util_pressure"])


@pytest.mark.parametrize("order", ["lru", "lfu", "cost"])
def test_every_eviction_order_serves_a_shared_prefix_trace(order):
    rng = np.random.default_rng(0)
    n = 150
    groups = rng.integers(0, 12, n)
    hash_ids = [tuple(1000 * g + b for b in range(6)) + (10**6 + i,) for i, g in enumerate(groups)]
    t = trace([7 * 64 + 10] * n, [30] * n, hash_ids=hash_ids, rate=100.0)
    s = simulate(
        t,
        "paged",
        model="Llama-3.2-1B",
        gpu="H200",
        kv_capacity_bytes=2500 * 32768,
        prefix_eviction=order,
    ).summary
    assert s["n_finished"] == n and s["prefix_eviction"] == order
    assert s["prefix_hit_rate"] > 0 and s["n_prefix_evictions"] > 0


def test_the_hash_block_size_is_a_knob():
    hash_ids = [(1, 2, 3, 4)] * 20
    t = trace([300] * 20, hash_ids=hash_ids)
    s = simulate(t, "paged", model="Llama-3.2-1B", gpu="H200", prefix_block_tokens=32).summary
    assert s["prefix_block_tokens"] == 32 and s["prefix_hit_rate"] > 0
