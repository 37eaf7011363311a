"""KV geometry per layer group: presets, the four page layouts, the hybrid manager."""

import json

import pytest

from sim.serving.config import ServerConfig
from sim.replay.costs import CostModel
from sim.serving.kv_groups import HybridKV, plan_layout
from sim.replay.models import LayerGroup, load_model
from sim.serving.pools import TimedPool
from sim.replay.costed_policy import create_policy
from sim.serving.simulate import simulate
from traces.requests import RequestTrace, make_requests

GIB = 1 << 30


def _kv(model, layout, budget_bytes=2 * GIB, max_model_len=8192):
    lay = plan_layout(
        load_model(model),
        layout,
        tokens_per_page=16,
        budget_bytes=budget_bytes,
        max_model_len=max_model_len,
    )
    policy = create_policy(
        "paged",
        capacity_bytes=budget_bytes,
        costs=CostModel.load(),
        fill={"page_bytes": lay.granule_bytes},
    )
    cfg = ServerConfig(hybrid_kv_layout=layout)
    return HybridKV(
        TimedPool(policy),
        cfg,
        layout=lay,
        bytes_per_token=load_model(model).kv_bytes_per_token,
        budget_bytes=budget_bytes,
    )


def _group(kv, kind):
    return next(g for g, p in enumerate(kv.groups) if p.kind == kind)


# -- presets ----------------------------------------------------------------------------------
def test_existing_presets_are_one_full_attention_group():
    m = load_model("Llama-3-8B")
    assert m.layer_groups is None and not m.is_hybrid
    (g,) = m.kv_groups
    assert g.kind == "full" and g.token_bytes(m.dtype_bytes) == m.kv_bytes_per_token == 131072


def test_gemma_2_alternates_sliding_and_full_layers():
    m = load_model("google/gemma-2-9b")
    assert [(g.kind, g.num_layers, g.sliding_window) for g in m.kv_groups] == [
        ("sliding", 21, 4096),
        ("full", 21, None),
    ]
    assert m.kv_bytes_per_token == 2 * 42 * 8 * 256 * 2


def test_bamba_mamba_state_as_vllm_sizes_it():
    m = load_model("Bamba-9B")
    mamba = m.kv_groups[1]
    conv = 3 * (8192 + 2 * 128)
    assert mamba.state_bytes(2) == 29 * (conv + 8192 * 128) * 2
    assert m.kv_bytes_per_token == 2 * 3 * 8 * 128 * 2  # attention layers only


def test_bamba_param_count_agrees_with_its_shape():
    m = load_model("Bamba-9B")
    h, d_inner, n, heads = 4096, 8192, 128, 128
    attention = 2 * h * h + 2 * h * 1024
    mamba = (
        h * (2 * d_inner + 2 * n + heads)
        + (d_inner + 2 * n) * 5
        + 3 * heads
        + d_inner
        + d_inner * h
    )
    mlp = 3 * h * 14336
    estimate = 3 * attention + 29 * mamba + 32 * mlp + 2 * m.vocab_size * h
    assert abs(m.param_count - estimate) / m.param_count < 0.001


def test_layer_groups_must_add_up_to_the_layers(tmp_path):
    fields = load_model("Llama-3-8B").to_dict() | {"name": "bad"}
    fields["layer_groups"] = [{"kind": "full", "num_layers": 30}]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=r"bad\.json.*30 layers.*num_layers=32"):
        load_model(path)


def test_a_sliding_group_needs_its_window():
    with pytest.raises(ValueError, match="sliding_window"):
        LayerGroup("sliding", 4)


def test_custom_hybrid_model_round_trips_through_to_dict(tmp_path):
    m = load_model("Bamba-9B")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(m.to_dict()))
    assert load_model(path) == m


def test_tensor_parallel_shard_splits_groups():
    shard = load_model("Bamba-9B").shard(2)
    assert shard.kv_groups[0].num_kv_heads == 4 and shard.kv_groups[1].mamba_d_inner == 4096


# -- layouts ----------------------------------------------------------------------------------
def test_padded_layout_grows_the_attention_block_until_it_holds_a_state():
    lay = plan_layout(
        load_model("Bamba-9B"),
        "padded",
        tokens_per_page=16,
        budget_bytes=8 * GIB,
        max_model_len=8192,
    )
    full, mamba = lay.groups
    state_per_layer = 2 * (3 * (8192 + 256) + 8192 * 128)
    assert full.tokens_per_page == 16 * -(-state_per_layer // (16 * 4096)) == 528
    assert full.page_bytes // 3 == mamba.page_bytes // 29 == 528 * 4096
    assert mamba.padding_bytes_per_page == 29 * (528 * 4096 - state_per_layer)


def test_per_group_capacity_sums_to_the_budget():
    budget = 8 * GIB + 12345
    lay = plan_layout(
        load_model("Bamba-9B"),
        "per-group",
        tokens_per_page=16,
        budget_bytes=budget,
        max_model_len=8192,
    )
    assert sum(lay.group_budget_bytes) == budget


def test_two_level_large_page_is_a_multiple_of_every_small_page():
    lay = plan_layout(
        load_model("Gemma-2-9B"),
        "two-level",
        tokens_per_page=16,
        budget_bytes=8 * GIB,
        max_model_len=8192,
    )
    assert all(lay.large_page_bytes % g.page_bytes == 0 for g in lay.groups)


def test_unknown_layout_is_named():
    with pytest.raises(ValueError, match="hybrid_kv_layout.*one of"):
        plan_layout(
            load_model("Bamba-9B"),
            "buddy",
            tokens_per_page=16,
            budget_bytes=GIB,
            max_model_len=8192,
        )


# -- the manager ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["padded", "two-level", "per-group"])
def test_sliding_window_memory_is_bounded_by_the_window(layout):
    kv = _kv("Gemma-2-9B", layout, budget_bytes=16 * GIB)
    g, f = _group(kv, "sliding"), _group(kv, "full")
    h = kv.new_handle(100, 20000)
    assert kv.admit(h, 101)
    for n in range(102, 20000, 7):  # decode, a few tokens at a time
        assert kv.grow(h, n, n - 7)
        assert len(h.pages[g]) <= -(-4096 // 16) + 2
    assert len(h.pages[f]) == -(-19998 // 16)


def test_mamba_memory_does_not_depend_on_length():
    kv = _kv("Bamba-9B", "padded")
    m = _group(kv, "mamba")
    short, long = kv.new_handle(10, 10), kv.new_handle(5000, 10)
    assert kv.admit(short, 11) and kv.admit(long, 5001)
    assert len(short.pages[m]) == len(long.pages[m]) == 1
    assert kv.grow(long, 6000, 5001) and len(long.pages[m]) == 1


@pytest.mark.parametrize("layout", ["padded", "lcm", "two-level", "per-group"])
def test_freeing_every_request_returns_every_byte(layout):
    kv = _kv("Bamba-9B", layout, budget_bytes=64 * GIB)
    handles = [kv.new_handle(300 * i + 1, 50) for i in range(1, 8)]
    for h in handles:
        assert kv.admit(h, h.prompt_tokens)
    for h in handles[::2]:
        assert kv.grow(h, h.prompt_tokens + 40, h.prompt_tokens)
    for h in handles:
        kv.free(h)
    assert kv.allocated_bytes == 0 and kv.pool.policy.stats().allocated_bytes == 0
    assert all(s.num_pages == 0 and s.data_bytes == 0 for s in kv._state)


def test_padded_waste_equals_the_computed_padding():
    kv = _kv("Bamba-9B", "padded", budget_bytes=64 * GIB)
    handles = [kv.new_handle(528, 10) for _ in range(5)]  # whole attention pages: no tail
    for h in handles:
        assert kv.admit(h, 528)
    full, mamba = kv.groups
    rows = {r["kind"]: r for r in kv.group_rows()}
    assert rows["mamba"]["peak_padding_bytes"] == 5 * mamba.padding_bytes_per_page
    assert (
        rows["mamba"]["peak_held_bytes"] - rows["mamba"]["peak_data_bytes"]
        == 5 * mamba.padding_bytes_per_page
    )
    assert (
        rows["full"]["peak_held_bytes"]
        == rows["full"]["peak_data_bytes"]
        == 5 * 528 * full.token_bytes
    )


def test_a_refused_grow_changes_nothing():
    kv = _kv("Bamba-9B", "per-group", budget_bytes=GIB)
    m = _group(kv, "mamba")
    while True:  # fill the Mamba pool: one state per request
        before = (kv.allocated_bytes, [s.num_pages for s in kv._state])
        h = kv.new_handle(16, 1)
        if not kv.admit(h, 16):  # its attention page was taken, then given back
            break
    assert h.pages[m] == {} and h.pages[1 - m] == {} and h.capacity_tokens == 0
    assert (kv.allocated_bytes, [s.num_pages for s in kv._state]) == before
    assert kv.free_bytes() > 0  # the attention pool still has room the Mamba group cannot use


# -- the simulator ----------------------------------------------------------------------------
def _trace(n=40):
    reqs = make_requests(
        [0.05 * i for i in range(n)],
        [200 + 300 * (i % 9) for i in range(n)],
        [30 + 7 * (i % 5) for i in range(n)],
    )
    return RequestTrace(requests=reqs, name="toy")


@pytest.mark.parametrize("model", ["Gemma-2-9B", "Bamba-9B"])
@pytest.mark.parametrize("layout", ["padded", "two-level", "per-group"])
def test_hybrid_simulation_conserves_tokens(model, layout):
    trace = _trace()
    r = simulate(
        trace, "paged", model=model, gpu="H200", kv_capacity_bytes=4 * GIB, hybrid_kv_layout=layout
    )
    done = r.requests[r.requests["status"] == "finished"]
    assert len(done) == len(trace.requests)
    assert int(done["output_tokens"].sum()) == int(trace.requests["output_tokens"].sum())
    assert r.summary["hybrid_kv_layout"] == layout
    assert list(r.kv_groups["group"]) == [
        p.name
        for p in plan_layout(
            load_model(model), layout, tokens_per_page=16, budget_bytes=4 * GIB, max_model_len=8192
        ).groups
    ]
    held = r.kv_groups["peak_held_bytes"]
    assert (
        held
        == r.kv_groups["peak_padding_bytes"]
        + r.kv_groups["peak_data_bytes"]
        + r.kv_groups["peak_other_waste_bytes"]
    ).all()


def test_full_attention_models_have_no_group_table():
    r = simulate(_trace(5), "paged", model="Llama-3.2-1B", gpu="H200", kv_capacity_bytes=GIB)
    assert r.kv_groups.empty and "hybrid_kv_layout" not in r.summary


def test_hybrid_model_needs_a_paged_policy():
    with pytest.raises(ValueError, match="layer groups.*paged policy"):
        simulate(_trace(3), "best-fit", model="Bamba-9B", gpu="H200", kv_capacity_bytes=GIB)
