"""The bundled Mooncake slice's ``hash_ids`` reach the simulator's prefix cache as shared
512-token prompt blocks, and the eviction sweep of ``benchmarks/RESULTS.md`` is the grid it says."""

from pathlib import Path

import pytest

import traces
from sim.serving.config import ServerConfig
from sim.serving.simulate import simulate
from sim.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parents[3]
SLICE = ROOT / "traces" / "data" / "mooncake_conversation_slice.jsonl"


@pytest.fixture(scope="module")
def mooncake():
    return traces.read_request_trace(SLICE)


def test_hash_ids_name_one_512_token_block_each(mooncake):
    df = mooncake.requests
    assert mooncake.format == "mooncake" and mooncake.meta["hash_block_tokens"] == 512
    assert all(len(h) == -(-p // 512) for h, p in zip(df["hash_ids"], df["prompt_tokens"]))
    shared = mooncake.describe()["hash_block_reuse_frac"]
    assert 0.2 < shared < 0.4  # 28 % of the slice's prompt blocks repeat an earlier one


def test_the_prefix_cache_hits_the_shared_blocks_and_only_them(mooncake):
    head = mooncake.head(120)
    on = simulate(head, "paged", model="Llama-3.1-8B", gpu="H200", config=ServerConfig())
    off = simulate(
        head, "paged", model="Llama-3.1-8B", gpu="H200", config=ServerConfig(prefix_caching=False)
    )
    hits = on.requests["prefix_hit_tokens"]
    assert hits.sum() > 0 and off.requests["prefix_hit_tokens"].sum() == 0
    assert on.summary["prefix_block_tokens"] == 512 and (hits % 512 == 0).all()
    # a request never preempted hits no more than the prefix its prompt shares with earlier ones
    # (one admitted again after a preemption also hits its own blocks: counted, issue 15)
    seen: set[int] = set()
    for h, hit, n in zip(head.requests["hash_ids"], hits, on.requests["num_preemptions"]):
        if n:
            seen.update(h)
            continue
        shared = 0
        for block in h:
            if block not in seen:
                break
            shared += 1
        assert hit <= shared * 512
        assert (
            shared <= 1 or hit > 0
        )  # a shared prefix of two blocks or more is hit (the cache holds it here)
        seen.update(h)
    assert on.requests["ttft_s"].mean() < off.requests["ttft_s"].mean()  # hits skip prefill


def test_the_eviction_sweep_is_three_orders_on_the_bundled_slice():
    spec = load_sweep(ROOT / "benchmarks" / "mooncake_eviction.yaml")
    assert {c.trace.path for c in spec.cells} == {str(SLICE)}
    grid = {
        (
            dict(c.options)["prefix_eviction"],
            dict(c.options)["prefix_caching"],
            c.capacity_bytes,
            c.rate_scale,
        )
        for c in spec.cells
    }
    assert (
        len(grid) == len(spec.cells) == 48
    )  # every order, with prefix caching on and off, at 4 budgets and 2 rates
    assert {g[0] for g in grid} == {"lru", "lfu", "cost"} and {g[1] for g in grid} == {True, False}
    assert {c.model for c in spec.cells} == {"Llama-3.1-8B"}
