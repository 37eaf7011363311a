"""``ServerConfig``: every setting of the simulated server, in one place.

Each field carries a ``Knob`` (help text, unit, choices, range, command-line name) in its
metadata. That one declaration is where the setting is documented, validated (once, when the
config is built) and turned into a ``poollab simulate`` option and a sweep ``options`` key; the
built config is then passed down whole (to the server, scheduler, KV manager and pools, as
nano-vllm passes its ``Config``), and none of them checks it again.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from typing import Any

from policies.eviction import EVICTION_ORDERS
from sim.serving.choices import (
    DEFAULT_WORKSPACE_BYTES,
    HYBRID_LAYOUTS,
    POOL_LAYOUTS,
    PREEMPTION_MODES,
    STRATEGIES,
    VIRTUAL,
)

__all__ = ["Knob", "ServerConfig", "knobs"]


@dataclass(frozen=True)
class Knob:
    """What a ``ServerConfig`` field means and which values it takes.

    Attributes:
        help: one sentence for ``--help`` and docs.
        unit: ``"bytes"`` (the command line then takes sizes such as ``8GiB``), ``"s"``,
            ``"tokens"``, ... ; "" for a plain number, string or flag.
        choices: the only values a string knob takes.
        low, high: bounds of a number (None: unbounded); ``low_open``/``high_open`` exclude them.
        none: what None means (the field takes None only when its type says ``| None``).
        pow2: an integer must be a power of two (page sizes).
        cli: the option's name on the command line without ``--`` (default: the field name
            with dashes).
        type: the value's type (bool, int, float or str), filled from the field's annotation.
    """

    help: str
    unit: str = ""
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    none: str = ""
    pow2: bool = False
    cli: str = ""
    type: type = object
    nullable: bool = False

    def describe(self) -> str:
        """What a valid value is, in words: ``"an integer >= 1 or None"``."""
        if self.type is bool:
            what = "true or false"
        elif self.choices:
            what = f"one of {', '.join(self.choices)}"
        elif self.type is str:
            what = "a string"
        else:
            what = "an integer" if self.type is int else "a finite number"
            if self.pow2:
                what = "a power of two"
            if self.low is not None and self.high is not None:
                what += (
                    f" in {'(' if self.low_open else '['}{self.low:g}, "
                    f"{self.high:g}{')' if self.high_open else ']'}"
                )
            elif self.low is not None:
                what += f" {'>' if self.low_open else '>='} {self.low:g}"
        return what + (" or None" if self.nullable else "")

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.type is bool or isinstance(value, bool):
            return self.type is bool and isinstance(value, bool)
        if self.type is str:
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if not isinstance(value, int if self.type is int else (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.pow2 and (value <= 0 or value & (value - 1)):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


def _knob(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"knob": Knob(help, **meta)})


@dataclass(frozen=True)
class ServerConfig:
    """Every knob of the simulated server (defaults follow vLLM's); see each field's ``Knob``.

    Built once (by ``poollab simulate``, a sweep cell or ``sim.serving.simulate.simulate``),
    validated here, and read by whoever needs a knob. ``simulate`` resolves the None defaults that
    depend on the model or trace (``max_model_len``, ``prefix_block_tokens``, ``sample_every_s``)
    with ``dataclasses.replace`` before handing the config down.
    """

    # memory
    gpu_memory_utilization: float = _knob(
        0.9, "Share of GPU memory the server may use.", low=0, low_open=True, high=1
    )
    kv_capacity_bytes: int | None = _knob(
        None,
        "KV budget.",
        unit="bytes",
        low=1,
        cli="kv-capacity",
        none="GPU memory x utilisation - weights - activations - workspace",
    )
    workspace_bytes: int = _knob(
        DEFAULT_WORKSPACE_BYTES,
        "Memory kept outside the KV cache for library workspaces (cuBLAS, sampler, CUDA graphs).",
        unit="bytes",
        low=0,
        cli="workspace",
    )
    pool_layout: str = _knob(
        "separate",
        "KV cache in a pool of its own, or one pool shared with weights and activations.",
        choices=POOL_LAYOUTS,
    )
    aux_policy: str = _knob(
        "best-fit", "Policy of the weights/activations/workspace pools in the separate layout."
    )
    # KV cache
    kv_strategy: str = _knob(
        "pow2",
        "Reservation of contiguous policies (paged ones grow a page at a time); "
        "'virtual' maps pages into one virtual range per request (vAttention), "
        "whatever the policy.",
        choices=STRATEGIES,
    )
    grow_tokens: int = _knob(512, "Chunk of the 'grow' strategy.", unit="tokens", low=1)
    tokens_per_page: int | None = _knob(
        None, "Page size of paged policies.", unit="tokens", low=1, none="the policy's own"
    )
    virtual_page_bytes: int = _knob(
        2 << 20,
        "Physical page of the 'virtual' strategy, "
        "mapped per KV tensor (2 MiB stock CUDA; 64 KiB-1 MiB need vAttention's driver patch).",
        unit="bytes",
        low=64 << 10,
        high=2 << 20,
        pow2=True,
        cli="virtual-page",
    )
    map_overlap: bool = _knob(
        True,
        "'virtual': map pages in the background, overlapped with the step's compute (vAttention); "
        "off: the step waits for every cuMem call.",
    )
    map_cache: bool = _knob(
        True,
        "'virtual': a finished request's pages stay mapped for the next request "
        "(vAttention's deferred reclamation); off: unmapped at once.",
    )
    prefix_caching: bool = _knob(
        True, "Share prompt blocks by the trace's hash_ids (paged policies)."
    )
    prefix_block_tokens: int | None = _knob(
        None,
        "Tokens per hash_ids block (the prefix cache's hash block).",
        unit="tokens",
        low=1,
        none="the trace's, else 512",
    )
    prefix_eviction: str = _knob(
        "lru",
        "Order in which the prefix cache evicts blocks nobody holds: least recently released, "
        "least frequently used, or cost-aware "
        "(GreedyDual-Size-Frequency on each block's prefill recompute time).",
        choices=EVICTION_ORDERS,
    )
    hybrid_kv_layout: str = _knob(
        "padded",
        "Pages of a hybrid model's layer groups (sliding window, Mamba): "
        "one pool of pages padded to the largest (vLLM), of their LCM, "
        "Jenga's two-level LCM pages, or a static pool per group (sim.serving.kv_groups).",
        choices=HYBRID_LAYOUTS,
    )
    max_model_len: int | None = _knob(
        None,
        "Longest sequence; longer outputs are cut there, 'max' reserves it.",
        unit="tokens",
        low=1,
        none="the model's max_position_embeddings, else 8192",
    )
    # parallelism
    tensor_parallel: int = _knob(
        1,
        "GPUs the model is split over (tensor parallelism): weights and KV heads split, "
        "one KV pool per GPU, all-reduces over the GPU's interconnect.",
        low=1,
        cli="tp",
    )
    # scheduling
    max_num_seqs: int = _knob(256, "Most requests running at once.", low=1)
    max_num_batched_tokens: int = _knob(8192, "Token budget of one step.", unit="tokens", low=1)
    chunked_prefill: bool = _knob(True, "Split long prompts across steps within the token budget.")
    watermark: float = _knob(
        0.01, "Share of the KV budget admission keeps free.", low=0, high=1, high_open=True
    )
    preemption: str = _knob(
        "recompute",
        "What happens to a preempted request's KV: dropped and recomputed, "
        "or swapped to host memory.",
        choices=PREEMPTION_MODES,
    )
    swap_space_bytes: int | None = _knob(
        None, "Host memory for swapped KV.", unit="bytes", low=1, cli="swap-space", none="unlimited"
    )
    # reporting
    slo_ttft_s: float | None = _knob(
        None, "TTFT SLO (goodput).", unit="s", low=0, low_open=True, cli="slo-ttft", none="none"
    )
    slo_tpot_s: float | None = _knob(
        None, "TPOT SLO (goodput).", unit="s", low=0, low_open=True, cli="slo-tpot", none="none"
    )
    slo_e2e_s: float | None = _knob(
        None, "E2E SLO (goodput).", unit="s", low=0, low_open=True, cli="slo-e2e", none="none"
    )
    sample_every_s: float | None = _knob(
        None,
        "Interval of the time series.",
        unit="s",
        low=0,
        low_open=True,
        cli="sample-every",
        none="the trace's duration / 2000",
    )
    horizon_s: float | None = _knob(
        None,
        "Stop the clock here.",
        unit="s",
        low=0,
        low_open=True,
        cli="horizon",
        none="run until every request is done",
    )
    # pool controls
    freeze_after_steps: int | None = _knob(
        None,
        "Freeze the KV pool's growth after this many steps (as CUDA Graph capture needs).",
        low=0,
        none="never",
    )
    pregrow_safety: float | None = _knob(
        None,
        "Before admitting, reserve predicted KV + activation bytes x this factor "
        "(elastic policies).",
        low=0,
        low_open=True,
        none="react to failures only",
    )
    compact_between_steps: bool = _knob(
        False, "Call the KV pool's compact() between steps (compacting policies)."
    )

    def __post_init__(self) -> None:
        for name, k in knobs().items():
            value = getattr(self, name)
            if not k.accepts(value):
                raise ValueError(f"{name}(={value!r}) must be {k.describe()}")

    def check_rules(self, *, kv_policy: Any = None, tenants: bool = False) -> None:
        """The rules that span several knobs, or a knob and what it acts on: the one place they
        live.

        ``__post_init__`` checks each knob alone; these are asked by whoever builds a server
        (``sim.serving.simulate.build_serving``, again with ``kv_policy`` once the KV pool is built)
        and by ``sim.serving.tenants.Colocation`` (``tenants=True``: several servers on one GPU).

        Raises:
            ValueError: naming the knobs that do not go together.
        """
        if tenants:
            if self.kv_capacity_bytes is not None:
                raise ValueError(
                    "kv_capacity_bytes is the tenant layout's to decide; leave it unset"
                )
            if self.pool_layout != "separate":
                raise ValueError(
                    "tenants keep their weights out of the KV pool: "
                    f"pool_layout must be 'separate', not {self.pool_layout!r}"
                )
        if self.kv_strategy == VIRTUAL:
            # its KV bypasses the policy, so the pool controls (which act on the policy) and the
            # shared layout have nothing to act on
            if self.pool_layout != "separate":
                raise ValueError(
                    "kv_strategy=virtual keeps the KV cache in virtual ranges of its own: "
                    "pool_layout must be 'separate'"
                )
            for name in ("freeze_after_steps", "pregrow_safety"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} acts on the KV policy, which holds no KV under kv_strategy=virtual"
                    )
            if self.compact_between_steps:
                raise ValueError(
                    "compact_between_steps acts on the KV policy, "
                    "which holds no KV under kv_strategy=virtual"
                )
        if kv_policy is not None:
            if self.pregrow_safety is not None and not kv_policy.can_reserve:
                raise ValueError(
                    "pregrow_safety needs a KV pool that can reserve (elastic), "
                    f"not {kv_policy.spec!r}"
                )
            if self.compact_between_steps and not kv_policy.can_compact:
                raise ValueError(
                    "compact_between_steps needs a compacting KV pool (e.g. "
                    "compacting:base=[best-fit]), "
                    f"not {kv_policy.spec!r}"
                )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerConfig:
        """Build from keyword options; an unknown name is a ValueError listing the known ones."""
        known = list(knobs())
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise ValueError(
                f"unknown simulator option {unknown[0]!r}; options: {', '.join(known)}"
            )
        return cls(**kwargs)

    def replace(self, **changes: Any) -> ServerConfig:
        """A copy with ``changes`` (validated like any config)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@cache
def knobs(config_cls: type | None = None) -> dict[str, Knob]:
    """``ServerConfig``'s fields (or those of ``config_cls``, a dataclass extending it) in order,
    name to ``Knob``, with ``type``/``nullable``/``cli`` filled in."""
    config_cls = config_cls or ServerConfig
    hints = typing.get_type_hints(config_cls)
    out = {}
    for f in fields(config_cls):
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        base = next(a for a in args if a is not type(None))
        k = f.metadata["knob"]
        out[f.name] = dataclasses.replace(
            k, type=base, nullable=type(None) in args, cli=k.cli or f.name.replace("_", "-")
        )
    return out
