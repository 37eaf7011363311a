"""``sim.serving.engines``: engine behaviour presets as data; transformers' KV sizing rule."""

import pytest

from sim.serving.engines import available_engines, load_engine, transformers_kv_blocks
from sim.replay.hardware import load_gpu
from sim.replay.models import load_model
from sim.serving.config import ServerConfig


@pytest.fixture(scope="module")
def llama_h200():
    return load_model("Llama-3-8B"), load_gpu("H200")


def test_the_transformers_rule_gives_the_blocks_the_shared_recordings_logged(llama_h200):
    # shared/data/README.md: KV cache 3,038 blocks of 256 tokens on the H200
    preset = load_engine("transformers")
    blocks = transformers_kv_blocks(*llama_h200, reserved_bytes=preset.reserved_at_sizing_bytes)
    assert blocks == 3038
    # the rule alone (nothing reserved beside the weights) is within 2 %
    assert transformers_kv_blocks(*llama_h200) == pytest.approx(3038, rel=0.02)


def test_a_larger_step_budget_leaves_fewer_blocks(llama_h200):
    # the [M, N + M] attention mask grows with M: transformers trades KV for batch tokens
    assert transformers_kv_blocks(*llama_h200, max_batch_tokens=16384) < transformers_kv_blocks(
        *llama_h200
    )


def test_the_transformers_preset_schedules_as_its_fifo_scheduler(llama_h200):
    opts = load_engine("transformers").server_options(*llama_h200)
    cfg = ServerConfig(**opts)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.tokens_per_page) == (1024, 8192, 256)
    assert cfg.chunked_prefill and cfg.watermark == 0.15
    assert cfg.kv_capacity_bytes == 3038 * 256 * llama_h200[0].kv_bytes_per_token


def test_options_the_user_gives_win_over_the_preset(llama_h200):
    opts = load_engine("hf").server_options(
        *llama_h200, explicit={"max_num_seqs": 8, "kv_capacity_bytes": 1 << 30}
    )
    assert opts["max_num_seqs"] == 8 and opts["kv_capacity_bytes"] == 1 << 30
    assert opts["tokens_per_page"] == 256


def test_the_vllm_preset_is_the_simulators_defaults(llama_h200):
    assert load_engine("vllm").server_options(*llama_h200) == {}
    assert available_engines()[:2] == ["vllm", "transformers"]


def test_an_unknown_engine_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown engine 'sglang-9'; engines: vllm, transformers"):
        load_engine("sglang-9")
