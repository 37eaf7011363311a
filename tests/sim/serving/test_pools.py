import pytest

import policies
from sim.serving.config import ServerConfig
from sim.replay.costs import CostedDevice, CostModel
from sim.replay.hardware import load_gpu
from sim.replay.models import load_model
from sim.serving.pools import MemoryPlan, ServerPools, TimedPool, plan_memory
from sim.replay.costed_policy import create_policy

MiB = 1 << 20
GiB = 1 << 30


def test_kv_budget_is_what_is_left_after_weights_activations_and_workspace():
    model, gpu = load_model("Llama-3-8B"), load_gpu("H200")
    plan = plan_memory(
        model,
        gpu,
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=8192,
        workspace_bytes=512 * MiB,
    )
    assert plan.usable_bytes == int(gpu.memory_bytes * 0.9)
    assert plan.weight_bytes == model.weight_bytes
    assert plan.activation_reserve_bytes == model.activation_bytes(8192)
    assert (
        plan.kv_budget_bytes
        == plan.usable_bytes - plan.weight_bytes - plan.activation_reserve_bytes - 512 * MiB
    )


def test_a_given_kv_capacity_wins():
    plan = plan_memory(
        load_model("Llama-3-8B"),
        load_gpu("H200"),
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=8192,
        kv_capacity_bytes=GiB,
    )
    assert plan.kv_budget_bytes == GiB


def test_a_model_that_leaves_no_room_for_kv_is_a_clear_error():
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        plan_memory(
            load_model("Llama-3-70B"),
            load_gpu("A100-40GB"),
            gpu_memory_utilization=0.9,
            max_num_batched_tokens=8192,
        )


def test_timed_pool_puts_driver_time_on_the_call_that_grew():
    costs = CostModel.load()
    pool = TimedPool(policies.create("best-fit:segment_bytes=32MiB", device=CostedDevice(costs)))
    a = pool.allocate(MiB)
    assert pool.alloc_ns[0] >= costs.malloc_ns(32 * MiB)
    assert pool.take_driver_ns() == costs.malloc_ns(32 * MiB)
    # the second fits in the segment: no driver time (not compared with alloc_ns[1], a wall-clock
    # reading that a loaded machine can push past the modelled cudaMalloc)
    pool.allocate(MiB)
    assert len(pool.alloc_ns) == 2
    assert pool.take_driver_ns() == 0
    pool.free(a)
    assert len(pool.free_ns) == 1


def test_create_policy_fills_bytes_per_token_unless_the_spec_sets_it():
    p = create_policy("paged", capacity_bytes=None, costs=None, fill={"bytes_per_token": 4096})
    assert p.page_size_bytes == 16 * 4096
    p = create_policy(
        "paged:bytes_per_token=1024",
        capacity_bytes=None,
        costs=None,
        fill={"bytes_per_token": 4096},
    )
    assert p.page_size_bytes == 16 * 1024
    p = create_policy("best-fit", capacity_bytes=None, costs=None, fill={"bytes_per_token": 4096})
    assert "bytes_per_token" not in p.get_params()


def _plan(weights=10 * MiB, workspace=2 * MiB):
    return MemoryPlan(
        gpu_bytes=GiB,
        usable_bytes=GiB,
        weight_bytes=weights,
        activation_reserve_bytes=4 * MiB,
        workspace_bytes=workspace,
        kv_budget_bytes=512 * MiB,
    )


def test_separate_layout_keeps_weights_out_of_the_kv_pool():
    kv = policies.create("best-fit", device=CostedDevice())
    pools = ServerPools(
        kv, _plan(), ServerConfig(pool_layout="separate"), costs=None, num_weight_tensors=4
    )
    assert kv.allocated_bytes == 0
    assert pools.weights.policy.live_bytes == 10 * MiB
    assert pools.kv_reserved_bytes() == 0


def test_shared_layout_puts_everything_in_one_pool_and_counts_only_kv_as_kv():
    kv = policies.create("best-fit", device=CostedDevice())
    pools = ServerPools(
        kv, _plan(), ServerConfig(pool_layout="shared"), costs=None, num_weight_tensors=4
    )
    assert kv.live_bytes == 12 * MiB
    a = pools.allocate_activations(3 * MiB)
    assert pools.aux_allocated_bytes == kv.allocated_bytes
    assert pools.kv_reserved_bytes() == kv.reserved_bytes - kv.allocated_bytes
    pools.free_activations(a)
    assert pools.aux_allocated_bytes == kv.allocated_bytes


def test_loading_weights_costs_no_step_time():
    pools = ServerPools(
        policies.create("best-fit", device=CostedDevice()),
        _plan(),
        ServerConfig(pool_layout="shared"),
        costs=None,
        num_weight_tensors=4,
    )
    assert pools.take_driver_ns() == 0
    assert len(pools.kv.alloc_ns) == 0  # (set-up calls are no latency samples)


def test_weights_that_do_not_fit_are_a_clear_error():
    kv = policies.create("best-fit", capacity_bytes=64 * MiB, device=CostedDevice())
    with pytest.raises(ValueError, match="weights"):
        ServerPools(
            kv,
            _plan(weights=GiB),
            ServerConfig(pool_layout="shared"),
            costs=None,
            num_weight_tensors=1,
        )


def test_unknown_layout_is_a_clear_error_before_any_pool_exists():
    with pytest.raises(ValueError, match="pool_layout.*separate, shared"):
        ServerConfig(pool_layout="mixed")
