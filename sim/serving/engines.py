"""Engine behaviour presets (``sim/data/engines.json``): how a real engine schedules and sizes its
KV cache.

A preset is data: ``ServerConfig`` options (scheduler order, step budget, block size, seats,
admission watermark) and a KV sizing rule, so that a simulated server schedules as the engine
does; its step *time* is the calibration's (``poollab calibrate``), not the preset's. Options a
user sets explicitly win over the preset's (``EnginePreset.server_options``).

KV sizing rules:

* ``plan``: the simulator's own (``sim.serving.pools.plan_memory``, vLLM's: utilisation x memory -
  weights - activations - workspace).
* ``transformers``: ``PagedAttentionMemoryHandler`` of transformers' continuous batching:
  ``max_memory_percent`` of the memory free after the weights, less the activation peaks of a
  ``max_batch_tokens`` batch and its ``[M, N + M]`` attention mask, in whole blocks
  (``transformers_kv_blocks``).

``kv_linked``: buffers the engine sizes by its KV cache besides the cache (``KvLinkedRule``:
``bytes_per_token x KV tokens + fixed_bytes``), which ``poollab plan --engine`` recognises in a
start-up snapshot and grows with the cache.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from sim.replay.models import DATA_DIR, ModelSpec, _read_json_object

__all__ = [
    "EnginePreset",
    "KvLinkedRule",
    "ENGINES_PATH",
    "available_engines",
    "load_engine",
    "transformers_kv_blocks",
]

ENGINES_PATH = DATA_DIR / "engines.json"
_KV_SIZINGS = ("plan", "transformers")
_INT32_BYTES, _INT64_BYTES, _FP32_BYTES = 4, 8, 4


@dataclass(frozen=True)
class KvLinkedRule:
    """A buffer an engine sizes by its KV cache: ``bytes_per_token x kv_tokens + fixed_bytes``
    requested bytes, where ``kv_tokens`` is what the KV tensors hold (padding blocks included)."""

    name: str
    bytes_per_token: int
    fixed_bytes: int = 0

    def nbytes(self, kv_tokens: int) -> int:
        return self.bytes_per_token * kv_tokens + self.fixed_bytes


@dataclass(frozen=True)
class EnginePreset:
    """One engine's behaviour (an ``engines.json`` entry).

    Attributes:
        name: the preset's name (``--engine``).
        description: one paragraph: what the engine does that the preset mimics.
        options: ``ServerConfig`` fields and values.
        kv_sizing: ``"plan"`` or ``"transformers"`` (module docstring).
        max_memory_percent, reserved_at_sizing_bytes: the ``transformers`` rule's inputs.
        typical_terms, typical_warmup_s: a fitted step time of this engine (``StepTerms``
            fields), where ``poollab calibrate requests`` starts its search; empty: none known.
        kv_linked: buffers sized by the KV cache (``KvLinkedRule``), for ``poollab plan --engine``.
    """

    name: str
    description: str
    options: Mapping[str, Any] = field(default_factory=dict)
    kv_sizing: str = "plan"
    max_memory_percent: float = 0.9
    reserved_at_sizing_bytes: int = 0
    typical_terms: Mapping[str, float] = field(default_factory=dict)
    typical_warmup_s: float = 0.0
    kv_linked: tuple[KvLinkedRule, ...] = ()

    def server_options(
        self,
        model: ModelSpec,
        gpu: Any,
        *,
        explicit: Mapping[str, Any] | None = None,
        tensor_parallel: int = 1,
    ) -> dict[str, Any]:
        """The preset's ``ServerConfig`` options for ``model`` on ``gpu`` (the KV budget its rule
        gives included), with ``explicit`` (what the user set) winning."""
        explicit = dict(explicit or {})
        out = dict(self.options)
        if self.kv_sizing == "transformers" and "kv_capacity_bytes" not in explicit:
            block_tokens = int(explicit.get("tokens_per_page", out.get("tokens_per_page", 256)))
            step_tokens = int(
                explicit.get("max_num_batched_tokens", out.get("max_num_batched_tokens", 8192))
            )
            shard = model.shard(tensor_parallel)
            blocks = transformers_kv_blocks(
                shard,
                gpu,
                block_tokens=block_tokens,
                max_batch_tokens=step_tokens,
                max_memory_percent=self.max_memory_percent,
                reserved_bytes=self.reserved_at_sizing_bytes,
            )
            out["kv_capacity_bytes"] = blocks * block_tokens * shard.kv_bytes_per_token
        out.update(explicit)
        return out


def transformers_kv_blocks(
    model: ModelSpec,
    gpu: Any,
    *,
    block_tokens: int = 256,
    max_batch_tokens: int = 8192,
    max_memory_percent: float = 0.9,
    reserved_bytes: int = 0,
) -> int:
    """KV blocks transformers' ``PagedAttentionMemoryHandler`` allocates for ``model`` on ``gpu``
    (5.17, ``infer_max_batch_tokens_and_num_blocks`` with ``max_batch_tokens`` given, SDPA
    attention: one bf16 mask, no fast-decode block table, synchronous batching).

    ``reserved_bytes``: what torch held beside the weights when the cache was sized. Raises
    ValueError when no block fits.
    """
    a = c = model.dtype_bytes
    kv_size, q_size = model.kv_size, model.q_size
    available = int((gpu.memory_bytes - model.weight_bytes - reserved_bytes) * max_memory_percent)
    m = max_batch_tokens
    io_m = (
        7 * _INT32_BYTES + _INT32_BYTES + 2 * _INT64_BYTES
    )  # bulk_input, output_ids, write and read index
    kv_per_page = (
        2 * model.num_layers * kv_size * c + _INT64_BYTES
    )  # the cache, read_index's N part
    mask = a  # [1, 1, M, N + M] in the activation dtype: c_mn = c_mm
    peaks = {  # (c_m, c_n) per activation peak
        "lm_head": (model.hidden_size * a + model.vocab_size * _FP32_BYTES + io_m, kv_per_page),
        "attention": (
            a * (model.hidden_size + q_size + 2 * kv_size) + io_m,
            2 * kv_size * a + kv_per_page,
        ),
    }
    pages = min(
        math.floor((available - cm * m - mask * m * m) / (cn + mask * m))
        for cm, cn in peaks.values()
    )
    blocks = pages // block_tokens
    if blocks <= 0:
        raise ValueError(
            f"transformers KV sizing: no block fits for {model.name} on {gpu.name} "
            f"({available / 2**30:.1f} GiB available at max_memory_percent {max_memory_percent})"
        )
    return blocks


@functools.lru_cache(maxsize=1)
def _presets() -> dict[str, EnginePreset]:
    data = _read_json_object(ENGINES_PATH)["engines"]
    out = {}
    for name, entry in data.items():
        assert entry.get("kv_sizing", "plan") in _KV_SIZINGS, (
            f"{ENGINES_PATH}: {name}: unknown kv_sizing"
        )
        preset = EnginePreset(
            name=name,
            description=entry["description"],
            options=dict(entry.get("options", {})),
            kv_sizing=entry.get("kv_sizing", "plan"),
            max_memory_percent=float(entry.get("max_memory_percent", 0.9)),
            reserved_at_sizing_bytes=int(entry.get("reserved_at_sizing_bytes", 0)),
            typical_terms=dict(entry.get("typical_terms", {})),
            typical_warmup_s=float(entry.get("typical_warmup_s", 0.0)),
            kv_linked=tuple(
                KvLinkedRule(
                    str(r["name"]), int(r["bytes_per_token"]), int(r.get("fixed_bytes", 0))
                )
                for r in entry.get("kv_linked", ())
            ),
        )
        for key in (name, *entry.get("aliases", ())):
            assert key.lower() not in out, f"{ENGINES_PATH}: {key!r} names two presets"
            out[key.lower()] = preset
    return out


def available_engines() -> list[str]:
    """Preset names (no aliases), in file order."""
    return list(dict.fromkeys(p.name for p in _presets().values()))


def load_engine(name: str) -> EnginePreset:
    """The preset called ``name`` (or an alias; any case); ValueError listing the known ones."""
    preset = _presets().get(str(name).lower())
    if preset is None:
        raise ValueError(f"unknown engine {name!r}; engines: {', '.join(available_engines())}")
    return preset
