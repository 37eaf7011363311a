"""How long one continuous-batching iteration takes: a roofline over FLOPs and HBM bytes.

One iteration (a "step") runs ``prefill_tokens`` prompt tokens (chunked prefill) and one token
for each of ``decode_seqs`` decoding sequences through the model once::

    compute_s = prefill_flops / (peak x mfu_prefill) + decode_flops / (peak x mfu_decode)
    memory_s  = (weight bytes + KV bytes read and written + activation traffic)
                / (hbm_bandwidth x hbm_efficiency)
    step_s    = max(compute_s, memory_s) + num_layers x layer_overhead_s + step_overhead_s

FLOPs: every token is multiplied by the layer weights (``2 x params`` each); only sampled
positions (each decode sequence, and the last position of each prefill sequence) go through
the LM head; attention adds ``4 x layers x heads x head_dim`` per query/key pair, with causal
pairs inside a prefill chunk. Bytes: the weights once per step, the KV of every context token
read once and the new tokens' KV written once, each token's activations
(``ModelSpec.activation_traffic_bytes_per_token``) and each sampled position's logits.

Hybrid models (``ModelSpec.layer_groups``) cost each layer as its group: a full-attention layer
as above; a sliding-window layer of W tokens attends to, and reads the KV of, at most W tokens
per query (a prefill chunk's causal pairs are counted inside the window; a decode batch's
keys are ``min(context + d, d x W)``, exact when every sequence is below the window or every
one is past it, since the step sees only the batch's summed context); a Mamba layer has no
attention pairs and no per-token KV, but updates a fixed state per token
(``LayerGroup.state_update_flops_per_token``) and reads and writes each scheduled sequence's
state once per step. A model without groups takes the all-full-attention path unchanged.

This gives compute and memory time only. Allocator costs (``cudaMalloc``, defragmentation
copies, swaps) land on the step that caused them: the server adds them, pricing copies and
swaps with ``copy_time_s`` and ``swap_time_s``.

Tensor parallelism over ``N`` GPUs (``tensor_parallel``): each GPU runs the model's shard
(``ModelSpec.shard``: its FLOPs and bytes are one GPU's), and the shards join through two
all-reduces per layer (after the attention output and the MLP down projection), each of the
step's tokens x ``hidden_size`` activations. A ring all-reduce moves ``2 (N-1)/N`` of them over
the GPU's interconnect, plus its fixed latency::

    allreduce_s = 2 x num_layers x (interconnect_latency_s
                                    + 2 (N-1)/N x tokens x hidden x dtype_bytes / link_bandwidth)

added to the step, not overlapped (vLLM runs them between the layer's kernels). The logits
gather of the vocabulary-parallel LM head is left out (one small gather per step).

The efficiency factors come from ``sim/data/calibration_default.json`` (each explained there)
and can be overridden by a calibration JSON file (``load_calibration``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from sim.hardware import GpuSpec
from sim.models import DATA_DIR, ModelSpec, _read_json_object

__all__ = [
    "Calibration", "StepCost", "StepTimeModel", "default_calibration", "load_calibration",
    "DEFAULT_CALIBRATION_PATH",
]

DEFAULT_CALIBRATION_PATH = DATA_DIR / "calibration_default.json"

#: Keys a calibration file may carry besides the factors: documentation only.
_CALIBRATION_METADATA_KEYS = frozenset({"source", "notes", "measured_on", "measured"})
#: Factors that are shares of a peak: in (0, 1].
_FRACTION_FACTORS = ("mfu_prefill", "mfu_decode", "hbm_efficiency", "pcie_efficiency")


@dataclass(frozen=True, slots=True)
class Calibration:
    """Efficiency factors of the step-time model (see ``calibration_default.json`` for sources).

    Attributes:
        mfu_prefill: share of peak dense FLOPs that prompt tokens' work reaches.
        mfu_decode: share of peak that decode tokens' matmuls reach when compute-bound.
        hbm_efficiency: share of peak HBM bandwidth that streaming weights and KV reaches.
        pcie_efficiency: multiplies the GPU's (already achievable) PCIe rate.
        layer_overhead_s: fixed GPU time per layer per iteration (the ramp and tail of a
            layer's dozen small kernels, which neither roof covers; dominant only at batch 1).
        step_overhead_s: fixed CPU-side time per iteration (scheduling, input preparation,
            sampling) that the GPU waits for.
        transfer_latency_s: fixed time per ``copy_time_s`` / ``swap_time_s`` call.
    """

    mfu_prefill: float
    mfu_decode: float
    hbm_efficiency: float
    pcie_efficiency: float
    layer_overhead_s: float
    step_overhead_s: float
    transfer_latency_s: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"calibration: field {f.name!r} must be a number, got {value!r}")
            if f.name in _FRACTION_FACTORS and not 0 < value <= 1:
                raise ValueError(f"calibration: field {f.name!r} must be in (0, 1], got {value!r}")
            if f.name not in _FRACTION_FACTORS and value < 0:
                raise ValueError(f"calibration: field {f.name!r} must be >= 0 seconds, got {value!r}")

    def replace(self, **overrides: float) -> Calibration:
        """A copy with some factors changed (unknown names raise ValueError)."""
        return _calibration_from_mapping(overrides, "overrides", base=self)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _calibration_from_mapping(data: Mapping[str, Any], where: str, *, base: Calibration | None) -> Calibration:
    names = [f.name for f in dataclasses.fields(Calibration)]
    unknown = sorted(k for k in data if k not in names and k not in _CALIBRATION_METADATA_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown calibration factor(s) {unknown}; known: {names}")
    values = {} if base is None else base.to_dict()
    values.update({k: v for k, v in data.items() if k in names})
    missing = [n for n in names if n not in values]
    if missing:
        raise ValueError(f"{where}: missing calibration factor(s) {missing}")
    try:
        return Calibration(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


@functools.lru_cache(maxsize=1)
def default_calibration() -> Calibration:
    """The bundled defaults (``sim/data/calibration_default.json``)."""
    path = DEFAULT_CALIBRATION_PATH
    return _calibration_from_mapping(_read_json_object(path), str(path), base=None)


def load_calibration(path: str | Path) -> Calibration:
    """Factors from a calibration JSON file; factors it leaves out keep their defaults.

    Raises ValueError naming the file and the factor when a value is out of range, a name is
    unknown or the file is no JSON object.
    """
    path = Path(path).expanduser()
    return _calibration_from_mapping(_read_json_object(path), str(path), base=default_calibration())


def _windowed_pairs(num_positions: float, window: int | None) -> float:
    """Causal query/key pairs of positions ``1..num_positions``, each query attending to at most
    ``window`` keys (itself included; None: no window): ``sum over t of min(t, window)``."""
    m = num_positions
    if window is None or m <= window:
        return m * (m + 1) / 2
    return window * (window + 1) / 2 + (m - window) * window


@dataclass(slots=True)
class StepCost:
    """One step's roofline terms, for diagnostics and tests (``StepTimeModel.step_cost``).

    ``overhead_s`` is what neither roof covers: ``step_overhead_s + num_layers x
    layer_overhead_s`` plus, under tensor parallelism, the all-reduces.
    """

    flops: float
    hbm_bytes: float
    compute_s: float
    memory_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def bound(self) -> str:
        """``"compute"`` or ``"memory"``: which roof sets the step's time."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


class StepTimeModel:
    """Time of one serving iteration of ``model`` on ``gpu`` (see the module docstring).

    Args:
        model: the model's shape (``sim.models.load_model``).
        gpu: the accelerator (``sim.hardware.load_gpu``).
        calibration: efficiency factors: a ``Calibration``, a mapping of factor overrides, a
            path to a calibration JSON file, or None for the bundled defaults.
        tensor_parallel: GPUs the model is split over; ``model`` is the whole model (each
            GPU's shard is computed here) and every time is one step of all of them.

    ``step_time_s`` is called once per simulated step, so every per-step constant is folded
    into a few floats in ``_reset_state`` and a call is a handful of multiplications.
    """

    def __init__(self, model: ModelSpec, gpu: GpuSpec, *,
                 calibration: Calibration | Mapping[str, float] | str | Path | None = None,
                 tensor_parallel: int = 1):
        if not isinstance(model, ModelSpec):
            raise ValueError(f"model must be a ModelSpec (use sim.models.load_model), got {model!r}")
        if not isinstance(gpu, GpuSpec):
            raise ValueError(f"gpu must be a GpuSpec (use sim.hardware.load_gpu), got {gpu!r}")
        self.whole_model = model
        self.tensor_parallel = tensor_parallel
        self.model = model.shard(tensor_parallel)  # what one GPU computes
        self.gpu = gpu
        self.calibration = calibration
        self._reset_state()

    def _resolved_calibration(self) -> Calibration:
        cal = self.calibration
        if cal is None:
            return default_calibration()
        if isinstance(cal, Calibration):
            return cal
        if isinstance(cal, (str, Path)):
            return load_calibration(cal)
        if isinstance(cal, Mapping):
            return default_calibration().replace(**cal)
        raise ValueError(f"calibration must be a Calibration, a mapping, a file path or None, got {cal!r}")

    def _reset_state(self) -> None:
        m, cal = self.model, self._resolved_calibration()
        self.factors = cal
        peak = self.gpu.flops_per_s(m.dtype)
        s_per_prefill_flop = 1.0 / (peak * cal.mfu_prefill)
        s_per_decode_flop = 1.0 / (peak * cal.mfu_decode)
        self._s_per_hbm_byte = 1.0 / (self.gpu.hbm_bandwidth_bytes_per_s * cal.hbm_efficiency)
        self._s_per_pcie_byte = 1.0 / (self.gpu.pcie_bandwidth_bytes_per_s * cal.pcie_efficiency)
        # Per-layer kernel floors and the engine's own overhead are added, not overlapped.
        self._fixed_s = cal.step_overhead_s + m.num_layers * cal.layer_overhead_s
        self._transfer_latency_s = cal.transfer_latency_s
        # FLOP counts, kept for step_cost().
        self._body_flops_per_token = m.flops_per_token - m.logits_flops_per_token
        self._logits_flops = m.logits_flops_per_token
        self._attn_flops_per_pair = m.attention_flops(1, 1)
        # The same as seconds, so step_time_s is multiplications only.
        self._prefill_token_s = self._body_flops_per_token * s_per_prefill_flop
        self._prefill_sampled_s = self._logits_flops * s_per_prefill_flop
        self._prefill_pair_s = self._attn_flops_per_pair * s_per_prefill_flop
        self._decode_token_s = m.flops_per_token * s_per_decode_flop
        self._decode_pair_s = self._attn_flops_per_pair * s_per_decode_flop
        # HBM bytes.
        self._weight_bytes = m.weight_read_bytes
        self._kv_bytes_per_token = m.kv_bytes_per_token
        self._act_bytes_per_token = m.activation_traffic_bytes_per_token
        self._logits_bytes = m.logits_bytes_per_sampled_token
        # Tensor-parallel all-reduces: a fixed part and a part per token of the step.
        tp = self.tensor_parallel
        num_allreduces = 2 * m.num_layers if tp > 1 else 0
        self._allreduce_fixed_s = num_allreduces * self.gpu.interconnect_latency_s
        self._allreduce_token_s = (num_allreduces * 2 * (tp - 1) / tp * m.hidden_size * m.dtype_bytes
                                   / self.gpu.link_bytes_per_s)
        # Hybrid models: per attention group (layers, window or None, KV bytes per token); Mamba
        # groups as their state bytes per sequence and state-update FLOPs per token.
        self._hybrid = m.is_hybrid
        groups = m.kv_groups
        self._attention_groups = [(g.num_layers, g.sliding_window if g.kind == "sliding" else None,
                                   g.token_bytes(m.dtype_bytes)) for g in groups if g.is_attention]
        self._layer_pair_flops = 4 * m.q_size  # QK^T and PV of one query/key pair in one layer
        self._state_bytes = sum(g.state_bytes(m.dtype_bytes) for g in groups)
        self._state_flops_per_token = sum(g.state_update_flops_per_token() for g in groups)

    def get_params(self) -> dict[str, Any]:
        """Model, GPU and factors by name, for a report's params column."""
        tp = {"tensor_parallel": self.tensor_parallel} if self.tensor_parallel > 1 else {}
        return {"model": self.model.name, "gpu": self.gpu.name, **tp, **self.factors.to_dict()}

    def allreduce_time_s(self, num_tokens: int) -> float:
        """Seconds a step of ``num_tokens`` tokens spends in tensor-parallel all-reduces (0 on one GPU)."""
        if num_tokens <= 0 or not self._allreduce_fixed_s and not self._allreduce_token_s:
            return 0.0
        return self._allreduce_fixed_s + num_tokens * self._allreduce_token_s

    # -- the hot path ----------------------------------------------------------------------------
    def step_time_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int,
                    prefill_context_tokens: int = 0, num_prefill_seqs: int | None = None) -> float:
        """Seconds one iteration takes (compute/memory roofline plus the fixed overheads).

        Args:
            prefill_tokens: prompt tokens processed this step (all prefilling sequences).
            decode_seqs: sequences generating one token each.
            context_tokens: KV tokens already cached for the decoding sequences, summed over
                them (each decode query attends to its context and itself).
            prefill_context_tokens: KV tokens already cached for the prefilling sequences
                (earlier chunks, prefix-cache hits), summed over them.
            num_prefill_seqs: sequences the prefill tokens belong to (default 1 when there are
                prefill tokens). Each samples one position; the causal attention term assumes
                the tokens and cached context are split evenly among them.

        Returns 0.0 for a step with no tokens. Raises ValueError for negative counts or counts
        that contradict each other.
        """
        p, d, k = prefill_tokens, decode_seqs, num_prefill_seqs
        if k is None:
            k = 1 if p > 0 else 0
        if p < 0 or d < 0 or context_tokens < 0 or prefill_context_tokens < 0 or k < 0 or k > p \
                or (p > 0 and k == 0) or (d == 0 and context_tokens) or (p == 0 and prefill_context_tokens):
            self._check_args(p, d, context_tokens, prefill_context_tokens, k)
        if p == 0 and d == 0:
            return 0.0
        if self._hybrid:
            return self._hybrid_cost(p, d, context_tokens, prefill_context_tokens, k).total_s
        if p:
            # Causal pairs of k sequences of n = p/k new tokens after c = P/k cached ones:
            # k x (n c + n (n + 1) / 2) = p P / k + p (p / k + 1) / 2.
            pairs = p * prefill_context_tokens / k + p * (p / k + 1) / 2
            compute_s = p * self._prefill_token_s + k * self._prefill_sampled_s + pairs * self._prefill_pair_s
        else:
            compute_s = 0.0
        if d:
            compute_s += d * self._decode_token_s + (context_tokens + d) * self._decode_pair_s
        hbm_bytes = (self._weight_bytes
                     + self._kv_bytes_per_token * (context_tokens + prefill_context_tokens + p + d)
                     + self._act_bytes_per_token * (p + d)
                     + self._logits_bytes * (k + d))
        memory_s = hbm_bytes * self._s_per_hbm_byte
        step_s = (compute_s if compute_s > memory_s else memory_s) + self._fixed_s
        if self._allreduce_token_s:
            step_s += self._allreduce_fixed_s + (p + d) * self._allreduce_token_s
        return step_s

    @staticmethod
    def _check_args(p: int, d: int, c: int, pc: int, k: int) -> None:
        for name, value in (("prefill_tokens", p), ("decode_seqs", d), ("context_tokens", c),
                            ("prefill_context_tokens", pc), ("num_prefill_seqs", k)):
            if value < 0:
                raise ValueError(f"{name}={value} must be >= 0")
        if k > p or (p > 0 and k == 0):
            raise ValueError(f"num_prefill_seqs={k} must be between 1 and prefill_tokens={p}")
        if d == 0 and c:
            raise ValueError(f"context_tokens={c} given for decode_seqs=0")
        raise ValueError(f"prefill_context_tokens={pc} given for prefill_tokens=0")

    # -- diagnostics -----------------------------------------------------------------------------
    def step_cost(self, prefill_tokens: int, decode_seqs: int, context_tokens: int,
                  prefill_context_tokens: int = 0, num_prefill_seqs: int | None = None) -> StepCost:
        """The roofline terms behind ``step_time_s`` (same arguments); ``total_s`` equals it."""
        p, d = prefill_tokens, decode_seqs
        k = (1 if p > 0 else 0) if num_prefill_seqs is None else num_prefill_seqs
        total = self.step_time_s(p, d, context_tokens, prefill_context_tokens, k)  # validates
        if total == 0.0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        if self._hybrid:
            return self._hybrid_cost(p, d, context_tokens, prefill_context_tokens, k)
        pairs = p * prefill_context_tokens / k + p * (p / k + 1) / 2 if p else 0.0
        prefill_flops = p * self._body_flops_per_token + k * self._logits_flops + pairs * self._attn_flops_per_pair
        decode_flops = d * (self._body_flops_per_token + self._logits_flops) \
            + (context_tokens + d) * self._attn_flops_per_pair if d else 0.0
        peak = self.gpu.flops_per_s(self.model.dtype)
        compute_s = prefill_flops / (peak * self.factors.mfu_prefill) + decode_flops / (peak * self.factors.mfu_decode)
        hbm_bytes = (self._weight_bytes
                     + self._kv_bytes_per_token * (context_tokens + prefill_context_tokens + p + d)
                     + self._act_bytes_per_token * (p + d) + self._logits_bytes * (k + d))
        cost = StepCost(flops=prefill_flops + decode_flops, hbm_bytes=hbm_bytes, compute_s=compute_s,
                        memory_s=hbm_bytes * self._s_per_hbm_byte,
                        overhead_s=self._fixed_s + self.allreduce_time_s(p + d))
        assert math.isclose(cost.total_s, total, rel_tol=1e-9), (cost, total)
        return cost

    def _hybrid_cost(self, p: int, d: int, c: int, pc: int, k: int) -> StepCost:
        """``step_cost`` of a hybrid model, each layer costed as its group (module docstring);
        arguments validated, at least one token."""
        prefill_pairs = decode_pairs = 0.0  # query/key pairs summed over attention layers
        kv_tokens_bytes = 0.0
        for num_layers, window, token_bytes in self._attention_groups:
            if p:
                n, cached = p / k, pc / k  # per sequence, split evenly as the full-attention path assumes
                pairs = k * (_windowed_pairs(cached + n, window) - _windowed_pairs(cached, window))
                prefill_pairs += num_layers * pairs
                kv_tokens_bytes += token_bytes * ((pc if window is None else k * min(cached, window)) + p)
            if d:
                keys = c + d if window is None else min(c + d, d * window)
                decode_pairs += num_layers * keys
                kv_tokens_bytes += token_bytes * keys
        prefill_flops = (p * (self._body_flops_per_token + self._state_flops_per_token) + k * self._logits_flops
                         + prefill_pairs * self._layer_pair_flops) if p else 0.0
        decode_flops = (d * (self._body_flops_per_token + self._logits_flops + self._state_flops_per_token)
                        + decode_pairs * self._layer_pair_flops) if d else 0.0
        peak = self.gpu.flops_per_s(self.model.dtype)
        compute_s = prefill_flops / (peak * self.factors.mfu_prefill) + decode_flops / (peak * self.factors.mfu_decode)
        hbm_bytes = (self._weight_bytes + kv_tokens_bytes + 2 * self._state_bytes * (k + d)
                     + self._act_bytes_per_token * (p + d) + self._logits_bytes * (k + d))
        return StepCost(flops=prefill_flops + decode_flops, hbm_bytes=hbm_bytes, compute_s=compute_s,
                        memory_s=hbm_bytes * self._s_per_hbm_byte,
                        overhead_s=self._fixed_s + self.allreduce_time_s(p + d))

    # -- transfers -------------------------------------------------------------------------------
    def copy_time_s(self, nbytes: int) -> float:
        """A device-to-device copy of ``nbytes``: read and write at HBM speed, plus the call's latency."""
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"nbytes={nbytes} must be >= 0")
            return 0.0
        return self._transfer_latency_s + 2 * nbytes * self._s_per_hbm_byte

    def swap_time_s(self, nbytes: int) -> float:
        """A host<->device copy of ``nbytes`` over PCIe (one direction), plus the call's latency."""
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"nbytes={nbytes} must be >= 0")
            return 0.0
        return self._transfer_latency_s + nbytes * self._s_per_pcie_byte
