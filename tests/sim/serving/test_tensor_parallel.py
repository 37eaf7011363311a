"""Tensor parallelism: the per-GPU shard, the per-GPU memory plan, the all-reduce step term."""

import pytest

from sim.replay.hardware import load_gpu
from sim.replay.models import load_model
from sim.serving.pools import plan_memory
from sim.serving.simulate import simulate
from sim.serving.steptime import StepTimeModel
from traces.requests import RequestTrace, make_requests

H200 = load_gpu("H200")
L70 = load_model("Llama-3-70B")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_shard_holds_its_share_of_weights_and_kv_heads(tp):
    s = L70.shard(tp)
    assert (
        s.kv_bytes_per_token * tp == L70.kv_bytes_per_token
    )  # 8 KV heads split evenly up to 8 GPUs
    assert s.weight_bytes * tp == pytest.approx(L70.weight_bytes, rel=1e-6)
    assert s.flops_per_token * tp == pytest.approx(L70.flops_per_token, rel=1e-6)
    assert (
        s.hidden_size == L70.hidden_size
        and s.max_position_embeddings == L70.max_position_embeddings
    )


def test_kv_heads_are_replicated_past_their_count():
    s = load_model("Llama-3-8B").shard(16)  # 8 KV heads over 16 GPUs: one each, as vLLM
    assert s.num_kv_heads == 1 and s.num_heads == 2
    assert s.kv_bytes_per_token == load_model("Llama-3-8B").kv_bytes_per_token // 8


def test_shard_one_is_the_model_and_uneven_splits_are_refused():
    assert L70.shard(1) is L70
    with pytest.raises(ValueError, match="tensor parallelism 3 must divide num_heads"):
        L70.shard(3)


def test_70b_fits_on_4_and_8_h200s_but_not_on_one():
    with pytest.raises(ValueError, match="no memory left"):
        plan_memory(L70, H200, gpu_memory_utilization=0.9, max_num_batched_tokens=8192)
    plans = {
        tp: plan_memory(
            L70, H200, gpu_memory_utilization=0.9, max_num_batched_tokens=8192, tensor_parallel=tp
        )
        for tp in (4, 8)
    }
    for tp, plan in plans.items():
        assert plan.tensor_parallel == tp
        assert plan.weight_bytes == L70.shard(tp).weight_bytes
        assert plan.kv_budget_bytes == (
            plan.usable_bytes
            - plan.weight_bytes
            - plan.activation_reserve_bytes
            - plan.workspace_bytes
        )
    assert (
        plans[8].kv_budget_bytes > plans[4].kv_budget_bytes
    )  # less weight per GPU, more room for KV


def test_allreduce_term_follows_the_ring_formula():
    m = StepTimeModel(L70, H200, tensor_parallel=4)
    tokens = 1000
    per_allreduce = (
        H200.interconnect_latency_s + 2 * 3 / 4 * tokens * 8192 * 2 / H200.link_bytes_per_s
    )
    assert m.allreduce_time_s(tokens) == pytest.approx(2 * 80 * per_allreduce)
    assert StepTimeModel(L70, H200).allreduce_time_s(tokens) == 0.0
    cost = m.step_cost(tokens, 0, 0)
    assert cost.total_s == pytest.approx(m.step_time_s(tokens, 0, 0))
    assert (
        cost.overhead_s
        > StepTimeModel(load_model("Llama-3-8B"), H200).step_cost(tokens, 0, 0).overhead_s
    )


def test_more_gpus_make_steps_faster_but_not_linearly():
    t = {
        tp: StepTimeModel(L70, H200, tensor_parallel=tp).step_time_s(0, 64, 64 * 2000)
        for tp in (2, 4, 8)
    }
    assert t[2] > t[4] > t[8] > t[2] / 4  # the all-reduces and fixed overheads do not shrink


def test_a_slow_link_costs_more():
    from dataclasses import replace

    slow = replace(H200, interconnect_bandwidth_bytes_per_s=25e9)
    fast_s = StepTimeModel(L70, H200, tensor_parallel=8).allreduce_time_s(4096)
    assert StepTimeModel(L70, slow, tensor_parallel=8).allreduce_time_s(4096) > 5 * fast_s


def test_simulate_70b_over_8_h200s():
    trace = RequestTrace(make_requests([0.0, 0.1, 0.2], [2000, 3000, 500], [50, 20, 80]), name="t")
    res = simulate(trace, "paged", model="Llama-3-70B", gpu="H200", tensor_parallel=8)
    s = res.summary
    assert s["n_finished"] == 3 and s["tensor_parallel"] == 8
    assert (
        s["kv_budget_bytes"]
        == plan_memory(
            L70, H200, gpu_memory_utilization=0.9, max_num_batched_tokens=8192, tensor_parallel=8
        ).kv_budget_bytes
    )
    one = simulate(trace, "paged", model="Llama-3-70B", gpu="H200", tensor_parallel=4).summary
    assert s["e2e_p99_s"] < one["e2e_p99_s"]
