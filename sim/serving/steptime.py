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

**Fitted engines** (``StepTerms``, written by ``poollab calibrate``, ``sim.serving.step_fit``): an
engine that is not a CUDA-graph, vLLM-class one (transformers' continuous batching steps in ~100 ms
even at batch 2) is described by linear terms over the step's counts, with the roofline as the
floor no engine beats::

    step_s = max(roofline_s, fixed_s + per_seq_s (k + d) + per_token_s (p + d)
                             + per_kv_token_s kv + per_pair_s pairs + per_query_kv_s (p + d) kv
                             + per_exposed_kv_token_s max(kv - num_hidden_kv_tokens, 0))

where ``kv`` is every KV token the step's attention reads (cached plus new, all sequences),
``pairs`` the causal query/key pairs inside each sequence (what a varlen/paged kernel computes)
and ``(p + d) kv`` the whole step's queries times its keys (what one masked attention over the
packed batch computes, as transformers' ``paged|sdpa`` does), and the last the KV tokens past
what the step's kernel launches hide (``StepTerms``). All terms 0 (the default, and an
old calibration file) is the roofline alone, unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from sim.replay.hardware import GpuSpec
from sim.replay.models import DATA_DIR, ModelSpec, _read_json_object
from sim.serving.fit_range import FittedRange, RangeCount
from traces.errors import shown
from traces.knobs import check_int, is_finite_number

__all__ = [
    "Calibration",
    "StepCost",
    "StepTimeModel",
    "StepTerms",
    "StepCalibration",
    "default_calibration",
    "load_calibration",
    "load_step_calibration",
    "STEP_CALIBRATION_FORMAT",
    "STEP_TERM_NAMES",
    "DEFAULT_CALIBRATION_PATH",
    "step_pairs",
    "term_features",
]

DEFAULT_CALIBRATION_PATH = DATA_DIR / "calibration_default.json"

#: Keys a calibration file may carry besides the factors: documentation only.
_CALIBRATION_METADATA_KEYS = frozenset({"source", "notes", "measured_on", "measured"})
#: ``format`` of a fitted calibration file (``StepCalibration``); a file without it holds factors
#: only.
STEP_CALIBRATION_FORMAT = "poollab-step-time/2"
#: Keys of a fitted calibration file; ``fit`` and ``source`` are what the fit measured,
#: documentation only.
_STEP_CALIBRATION_KEYS = frozenset(
    {"format", "engine", "model", "gpu", "tp", "terms", "warmup_s", "factors", "fit", "source"}
)
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
            if not is_finite_number(value):
                raise ValueError(
                    f"calibration: field {f.name!r} must be a finite number, got {shown(value)}"
                )
            if f.name in _FRACTION_FACTORS and not 0 < value <= 1:
                raise ValueError(f"calibration: field {f.name!r} must be in (0, 1], got {value!r}")
            if f.name not in _FRACTION_FACTORS and value < 0:
                raise ValueError(
                    f"calibration: field {f.name!r} must be >= 0 seconds, got {value!r}"
                )

    def replace(self, **overrides: float) -> Calibration:
        """A copy with some factors changed (unknown names raise ValueError)."""
        return _calibration_from_mapping(overrides, "overrides", base=self)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _calibration_from_mapping(
    data: Mapping[str, Any], where: str, *, base: Calibration | None
) -> Calibration:
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
    unknown or the file is no JSON object. A fitted file (``load_step_calibration``) gives its
    roofline factors.
    """
    return load_step_calibration(path).factors


@dataclass(frozen=True, slots=True)
class StepTerms:
    """Linear step-time terms of a fitted engine (module docstring), all >= 0: seconds, but for
    ``num_hidden_kv_tokens``, the one count (where ``per_exposed_kv_token_s`` starts).

    Attributes:
        fixed_s: every step (scheduling, input preparation, kernel launches without CUDA graphs).
        per_seq_s: each scheduled sequence (sampling, bookkeeping, per-request tensors).
        per_token_s: each query token (prefill and decode) through the layers.
        per_kv_token_s: each KV token the step's attention reads (cached plus new).
        per_pair_s: each causal query/key pair inside one sequence.
        per_query_kv_s: each (query token, KV token) pair of the whole step, masked or not.
        per_exposed_kv_token_s: each KV token a step reads past ``num_hidden_kv_tokens``. Without
            CUDA graphs an engine's step is bound by the CPU launching its kernels, and the GPU's
            attention work runs under those launches until the step reads about that many KV
            tokens; past it the GPU is the bound and each further KV token adds its time. Why this
            term (issue 31, session 13): it is the one that carries between small and large
            decode batches (``benchmarks/RESULTS.md``), where ``per_query_kv_s`` fitted on small
            batches overshoots large ones.
        num_hidden_kv_tokens: KV tokens a step reads under the launch time (a count, not seconds).
    """

    fixed_s: float = 0.0
    per_seq_s: float = 0.0
    per_token_s: float = 0.0
    per_kv_token_s: float = 0.0
    per_pair_s: float = 0.0
    per_query_kv_s: float = 0.0
    per_exposed_kv_token_s: float = 0.0
    num_hidden_kv_tokens: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not is_finite_number(value) or value < 0:
                unit = "tokens" if f.name.startswith("num_") else "seconds"
                raise ValueError(
                    f"term {f.name!r} must be a finite number >= 0 {unit}, got {shown(value)}"
                )

    @property
    def is_zero(self) -> bool:
        """No cost at all (``num_hidden_kv_tokens`` is where a cost starts, not one)."""
        return not any(getattr(self, name) for name in STEP_TERM_NAMES)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def linear_s(self, p: float, d: float, k: float, kv: float, pairs: float) -> float:
        """The terms' sum for a step of ``p`` prefill tokens in ``k`` sequences, ``d`` decode
        sequences, ``kv`` KV tokens read and ``pairs`` causal pairs (``term_features``)."""
        features = term_features(p, d, k, kv, pairs, self.num_hidden_kv_tokens)
        return sum(getattr(self, name) * x for name, x in zip(STEP_TERM_NAMES, features))


def term_features(
    p: Any, d: Any, k: Any, kv: Any, pairs: Any, num_hidden_kv_tokens: float = 0.0
) -> tuple[Any, ...]:
    """What each ``StepTerms`` cost term multiplies, in ``STEP_TERM_NAMES`` order (numbers or
    numpy arrays alike); ``num_hidden_kv_tokens`` is where the exposed-KV term starts."""
    exposed = np.maximum(kv - num_hidden_kv_tokens, 0)
    return (p * 0 + 1, k + d, p + d, kv, pairs, (p + d) * kv, exposed)


def step_pairs(p: Any, k: Any, prefill_cached: Any, decode_kv: Any) -> Any:
    """Causal query/key pairs inside each sequence of a step: ``k`` prefilling sequences share
    ``p`` new tokens after ``prefill_cached`` cached ones (split evenly, as the roofline
    assumes), and each decode query meets its ``decode_kv`` keys (numbers or numpy arrays)."""
    per_seq = np.maximum(k, 1)
    return p * prefill_cached / per_seq + p * (p / per_seq + 1) / 2 + decode_kv


#: The cost terms' names, in ``StepTerms`` order (the fit's columns); ``num_hidden_kv_tokens``
#: is no column: the fit chooses it (``sim.serving.step_fit``).
STEP_TERM_NAMES = tuple(
    f.name for f in dataclasses.fields(StepTerms) if f.name != "num_hidden_kv_tokens"
)
#: Every key of a calibration file's ``terms``.
_STEP_TERM_KEYS = (*STEP_TERM_NAMES, "num_hidden_kv_tokens")


@dataclass(frozen=True)
class StepCalibration:
    """A calibration file's whole content: roofline factors, fitted terms and what they were fitted
    for.

    ``model``, ``gpu`` and ``tp`` are None in an old (factors-only) file; ``fit`` holds what the
    fit measured (errors by step kind; ``fitted_range``: the step features it covered, None in a
    file written before it was recorded), ``path`` the file read (None when built in memory).
    ``warmup_s`` is what the engine's first step takes beyond its terms (a cold start: kernel
    selection, allocator growth); the server adds it to its first step.
    """

    factors: Calibration
    terms: StepTerms = StepTerms()
    warmup_s: float = 0.0
    engine: str | None = None
    model: str | None = None
    gpu: str | None = None
    tp: int | None = None
    fit: Mapping[str, Any] | None = None
    source: str = ""
    path: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The file's content (``load_step_calibration`` reads it back)."""
        return {
            "format": STEP_CALIBRATION_FORMAT,
            "source": self.source,
            "engine": self.engine,
            "model": self.model,
            "gpu": self.gpu,
            "tp": self.tp,
            "terms": self.terms.to_dict(),
            "warmup_s": self.warmup_s,
            "factors": self.factors.to_dict(),
            "fit": dict(self.fit or {}),
        }

    @property
    def fitted_range(self) -> FittedRange | None:
        """The step features the fit's steps covered (``fit.feature_range``), or None: no fitted
        terms, or a file without a range (not checked)."""
        data = (self.fit or {}).get("feature_range")
        if data is None or self.terms.is_zero:
            return None
        return FittedRange.from_json(data, self.path or "calibration")

    def check_matches(self, model: str, gpu: str, tp: int) -> None:
        """ValueError when the file was fitted for another model, GPU or tensor parallelism."""
        theirs, ours = (self.model, self.gpu, self.tp), (model, gpu, tp)
        for what, a, b in zip(("model", "GPU", "tensor parallelism"), theirs, ours):
            if a is not None and a != b:
                raise ValueError(
                    f"{self.path or 'calibration'}: fitted for {self.model} on {self.gpu} "
                    f"(tp {self.tp}); this run's {what} is {b} "
                    "(fit a calibration for it: poollab calibrate steps)"
                )

    def describe(self) -> str:
        """A few words for a settings line: the file and what it describes."""
        where = self.path or "in-memory calibration"
        if self.terms.is_zero:
            return f"step time: roofline with factors from {where}"
        return f"step time: fitted from {where}" + (
            f" ({self.engine} engine, fixed {self.terms.fixed_s * 1e3:.1f} ms a step)"
            if self.engine
            else f" (fixed {self.terms.fixed_s * 1e3:.1f} ms a step)"
        )


def load_step_calibration(path: str | Path) -> StepCalibration:
    """A calibration file of either format: factors only (old), or fitted terms
    (``STEP_CALIBRATION_FORMAT``).

    Raises ValueError naming the file and the field for anything out of range or unknown.
    """
    path = Path(path).expanduser()
    data = _read_json_object(path)
    if "format" not in data:
        factors = _calibration_from_mapping(data, str(path), base=default_calibration())
        return StepCalibration(factors=factors, source=str(data.get("source", "")), path=str(path))
    if data["format"] != STEP_CALIBRATION_FORMAT:
        raise ValueError(
            f"{path}: unknown calibration format {data['format']!r}; "
            f"expected {STEP_CALIBRATION_FORMAT!r}"
        )
    unknown = sorted(set(data) - _STEP_CALIBRATION_KEYS)
    if unknown:
        raise ValueError(
            f"{path}: unknown key(s) {unknown}; "
            f"a fitted calibration has {sorted(_STEP_CALIBRATION_KEYS)}"
        )
    terms_data = data.get("terms") or {}
    if not isinstance(terms_data, dict) or set(terms_data) - set(_STEP_TERM_KEYS):
        raise ValueError(
            f"{path}: 'terms' must be an object with keys among {list(_STEP_TERM_KEYS)}"
        )
    try:
        terms = StepTerms(**terms_data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    factors_data = data.get("factors") or {}
    if not isinstance(factors_data, dict):
        raise ValueError(f"{path}: 'factors' must be an object of roofline factors")
    factors = _calibration_from_mapping(
        factors_data, f"{path}: factors", base=default_calibration()
    )
    tp = data.get("tp")
    # bounded: a tensor-parallel degree past a few hundred GPUs is an edit, not a fit
    check_int("tp", tp, high=1024, none_ok=True, where=f"{path}: ")
    for key in ("engine", "model", "gpu", "source"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ValueError(f"{path}: {key!r} must be a string, got {data[key]!r}")
    fit = data.get("fit")
    if fit is not None and not isinstance(fit, dict):
        raise ValueError(f"{path}: 'fit' must be an object")
    if fit and fit.get("feature_range") is not None:
        FittedRange.from_json(fit["feature_range"], str(path))  # a bad range is named here
    warmup_s = data.get("warmup_s", 0.0)
    if not is_finite_number(warmup_s) or warmup_s < 0:
        raise ValueError(
            f"{path}: 'warmup_s' must be a finite number >= 0 seconds, got {shown(warmup_s)}"
        )
    return StepCalibration(
        factors=factors,
        terms=terms,
        warmup_s=float(warmup_s),
        engine=data.get("engine"),
        model=data.get("model"),
        gpu=data.get("gpu"),
        tp=tp,
        fit=fit,
        source=data.get("source") or "",
        path=str(path),
    )


def _windowed_pairs(num_positions: float, window: int | None) -> float:
    """Causal query/key pairs of positions ``1..num_positions``, each query attending to at most
    ``window`` keys (itself included; None: no window): ``sum over t of min(t, window)``."""
    m = num_positions
    if window is None or m <= window:
        return m * (m + 1) / 2
    return window * (window + 1) / 2 + (m - window) * window


#: Integers below this are floats exactly, and so are the sums of such floats that stay below
#: it: byte counts kept as floats under it are the same numbers (and ``float(x) * y`` is
#: ``x * y``: CPython converts an int so before it multiplies by a float)
FLOAT_EXACT_INT = 2**53

#: how far (relative) a decode step's memory time must lie above its compute time, at both ends
#: of a stretch, for ``decode_step_times_s`` to take the memory side for all of it: each side
#: is a few float roundings (about 1e-16 each) off its exact value, far under this
_MEMORY_BOUND_MARGIN = 1e-9


def _memory_bound(
    token_s: float, pair_s: float, base: int, kv: int, per_byte: float, c0: int, c1: int
) -> bool:
    """Whether the decode steps over ``c0`` and over ``c1`` attended tokens are both
    memory-bound by more than ``_MEMORY_BOUND_MARGIN``: each one's compute side
    (``0.0 + (token_s + c * pair_s)``, non-negative) against its memory side
    (``(base + kv * c) * per_byte``), as ``decode_step_times_s`` forms them. True means true,
    computed, at every context between: the exact sides are linear in the context and the
    margin covers their roundings."""
    x0 = 0.0 + (token_s + c0 * pair_s)
    x1 = 0.0 + (token_s + c1 * pair_s)
    bound = 1.0 + _MEMORY_BOUND_MARGIN
    return (
        x0 >= 0.0
        and x1 >= 0.0
        and (base + kv * c0) * per_byte > x0 * bound
        and (base + kv * c1) * per_byte > x1 * bound
    )


@dataclass(slots=True)
class StepCost:
    """One step's roofline terms, for diagnostics and tests (``StepTimeModel.step_cost``).

    ``overhead_s`` is what neither roof covers: ``step_overhead_s + num_layers x
    layer_overhead_s`` plus, under tensor parallelism, the all-reduces. ``fitted_s`` is a fitted
    engine's linear terms; the step takes the larger of it and the roofline.
    """

    flops: float
    hbm_bytes: float
    compute_s: float
    memory_s: float
    overhead_s: float
    fitted_s: float = 0.0  # the fitted terms' sum (``StepTerms``); 0 without them

    @property
    def roofline_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def total_s(self) -> float:
        return max(self.roofline_s, self.fitted_s)

    @property
    def bound(self) -> str:
        """``"compute"`` or ``"memory"``: which roof sets the step's time."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


class StepTimeModel:
    """Time of one serving iteration of ``model`` on ``gpu`` (see the module docstring).

    Args:
        model: the model's shape (``sim.replay.models.load_model``).
        gpu: the accelerator (``sim.replay.hardware.load_gpu``).
        calibration: a ``Calibration`` (factors), a ``StepCalibration`` (factors and fitted
            terms), a mapping of factor overrides, a path to a calibration JSON file of either
            format (``load_step_calibration``), or None for the bundled defaults.
        tensor_parallel: GPUs the model is split over; ``model`` is the whole model (each
            GPU's shard is computed here) and every time is one step of all of them.

    ``step_time_s`` is called once per simulated step, so every per-step constant is folded
    into a few floats in ``_reset_state`` and a call is a handful of multiplications.
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        *,
        calibration: Calibration | Mapping[str, float] | str | Path | None = None,
        tensor_parallel: int = 1,
    ):
        if not isinstance(model, ModelSpec):
            raise ValueError(
                f"model must be a ModelSpec (use sim.replay.models.load_model), got {model!r}"
            )
        if not isinstance(gpu, GpuSpec):
            raise ValueError(
                f"gpu must be a GpuSpec (use sim.replay.hardware.load_gpu), got {gpu!r}"
            )
        self.whole_model = model
        self.tensor_parallel = tensor_parallel
        self.model = model.shard(tensor_parallel)  # what one GPU computes
        self.gpu = gpu
        self.calibration = calibration
        self._reset_state()

    def _resolved_calibration(self) -> StepCalibration:
        cal = self.calibration
        if cal is None:
            return StepCalibration(default_calibration())
        if isinstance(cal, StepCalibration):
            return cal
        if isinstance(cal, Calibration):
            return StepCalibration(cal)
        if isinstance(cal, (str, Path)):
            return load_step_calibration(cal)
        if isinstance(cal, Mapping):
            return StepCalibration(default_calibration().replace(**cal))
        raise ValueError(
            "calibration must be a Calibration, a StepCalibration, a mapping, a file path or None, "
            f"got {cal!r}"
        )

    def _reset_state(self) -> None:
        step_cal = self._resolved_calibration()
        step_cal.check_matches(self.whole_model.name, self.gpu.name, self.tensor_parallel)
        self.step_calibration = step_cal
        self.terms = step_cal.terms
        self.warmup_s = step_cal.warmup_s  # the server adds it to its first step
        self._terms = (
            None if step_cal.terms.is_zero else step_cal.terms
        )  # None: the roofline alone (hot path)
        fitted_range = step_cal.fitted_range
        #: the fitted steps priced and those past the calibration's range (None: not checked)
        # (a hybrid model's steps are priced by its roofline, not the terms: nothing to check)
        self.range_count = (
            None if fitted_range is None or self.model.is_hybrid else RangeCount(fitted_range)
        )
        m, cal = self.model, step_cal.factors
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
        self._allreduce_token_s = (
            num_allreduces
            * 2
            * (tp - 1)
            / tp
            * m.hidden_size
            * m.dtype_bytes
            / self.gpu.link_bytes_per_s
        )
        # Hybrid models: per attention group (layers, window or None, KV bytes per token); Mamba
        # groups as their state bytes per sequence and state-update FLOPs per token.
        self._hybrid = m.is_hybrid
        groups = m.kv_groups
        self._attention_groups = [
            (
                g.num_layers,
                g.sliding_window if g.kind == "sliding" else None,
                g.token_bytes(m.dtype_bytes),
            )
            for g in groups
            if g.is_attention
        ]
        self._layer_pair_flops = 4 * m.q_size  # QK^T and PV of one query/key pair in one layer
        self._state_bytes = sum(g.state_bytes(m.dtype_bytes) for g in groups)
        self._state_flops_per_token = sum(g.state_update_flops_per_token() for g in groups)

    def get_params(self) -> dict[str, Any]:
        """Model, GPU and factors by name, for a report's params column."""
        tp = {"tensor_parallel": self.tensor_parallel} if self.tensor_parallel > 1 else {}
        terms = self._terms.to_dict() if self._terms is not None else {}
        return {
            "model": self.model.name,
            "gpu": self.gpu.name,
            **tp,
            **self.factors.to_dict(),
            **terms,
        }

    def allreduce_time_s(self, num_tokens: int) -> float:
        """Seconds a step of ``num_tokens`` tokens spends in tensor-parallel all-reduces (0 on one
        GPU)."""
        if num_tokens <= 0 or not self._allreduce_fixed_s and not self._allreduce_token_s:
            return 0.0
        return self._allreduce_fixed_s + num_tokens * self._allreduce_token_s

    # -- the hot path ----------------------------------------------------------------------------
    def step_time_s(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        context_tokens: int,
        prefill_context_tokens: int = 0,
        num_prefill_seqs: int | None = None,
    ) -> float:
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
        if (
            p < 0
            or d < 0
            or context_tokens < 0
            or prefill_context_tokens < 0
            or k < 0
            or k > p
            or (p > 0 and k == 0)
            or (d == 0 and context_tokens)
            or (p == 0 and prefill_context_tokens)
        ):
            self._check_args(p, d, context_tokens, prefill_context_tokens, k)
        if p == 0 and d == 0:
            return 0.0
        if self._hybrid:
            return self._hybrid_cost(p, d, context_tokens, prefill_context_tokens, k).total_s
        if self._terms is not None:
            if self.range_count is not None:  # the fit's range is known: count what passes it
                self.range_count.add(p, d, context_tokens, prefill_context_tokens)
            return self._fitted_cost(p, d, context_tokens, prefill_context_tokens, k).total_s
        if p:
            # Causal pairs of k sequences of n = p/k new tokens after c = P/k cached ones:
            # k x (n c + n (n + 1) / 2) = p P / k + p (p / k + 1) / 2.
            pairs = p * prefill_context_tokens / k + p * (p / k + 1) / 2
            compute_s = (
                p * self._prefill_token_s
                + k * self._prefill_sampled_s
                + pairs * self._prefill_pair_s
            )
        else:
            compute_s = 0.0
        if d:
            compute_s += d * self._decode_token_s + (context_tokens + d) * self._decode_pair_s
        hbm_bytes = (
            self._weight_bytes
            + self._kv_bytes_per_token * (context_tokens + prefill_context_tokens + p + d)
            + self._act_bytes_per_token * (p + d)
            + self._logits_bytes * (k + d)
        )
        memory_s = hbm_bytes * self._s_per_hbm_byte
        step_s = (compute_s if compute_s > memory_s else memory_s) + self._fixed_s
        if self._allreduce_token_s:
            step_s += self._allreduce_fixed_s + (p + d) * self._allreduce_token_s
        return step_s

    def decode_step_times_s(
        self, decode_seqs: int, context_tokens: int, num_steps: int
    ) -> list[float]:
        """``step_time_s(0, decode_seqs, context_tokens + s * decode_seqs)`` for each ``s`` in
        ``range(num_steps)``: the next steps of a batch that decodes one token of each sequence
        per step (each step adds ``decode_seqs`` tokens of context). The same floats as those
        calls, bit for bit: the roofline's decode terms in the same order of operations, with
        what does not depend on the context taken out of the loop (the server's quiet decode
        runs ask for a stretch at a time; ``tests/sim/serving/test_steptime.py``)."""
        d = decode_seqs
        if d <= 0 or context_tokens < 0 or self._hybrid or self._terms is not None:
            f = self.step_time_s
            return [f(0, d, context_tokens + s * d) for s in range(num_steps)]
        token_s, pair_s = d * self._decode_token_s, self._decode_pair_s
        weights, kv = self._weight_bytes, self._kv_bytes_per_token
        act, logits = self._act_bytes_per_token * d, self._logits_bytes * d
        per_byte, fixed = self._s_per_hbm_byte, self._fixed_s
        c0 = c = context_tokens + d  # each decode query attends to its context and itself
        if type(weights) is int and type(kv) is int and type(act) is int and type(logits) is int:
            # integer byte counts: their sum is exact in any order, so the constant terms come
            # first, once (``(weights + kv * c + act + logits)`` is ``base + kv * c``), and the
            # steps are one comprehension over their contexts
            base = weights + act + logits
            if (
                num_steps > 0
                and kv > 0
                and _memory_bound(token_s, pair_s, base, kv, per_byte, c0, c0 + (num_steps - 1) * d)
            ):
                # memory-bound at both ends, by a margin rounding cannot cross: both sides are
                # linear in the context, so at every step between too, and the max is the
                # memory side's; its byte counts are a range of integers (exact), each step
                # one multiply and one add (the same two float operations as below)
                b0, db = base + kv * c0, kv * d
                if b0 + num_steps * db < FLOAT_EXACT_INT:
                    # the byte counts as floats, one exact add a step (integers below 2**53),
                    # in a plain loop (a comprehension is a frame in 3.11): the same products,
                    # ``int * float`` converting its int so
                    b, fdb = float(b0), float(db)
                    out = []
                    append = out.append
                    for _ in range(num_steps):
                        append(b * per_byte + fixed)
                        b += fdb
                    return self._with_allreduce(d, out)
                return self._with_allreduce(
                    d, [b * per_byte + fixed for b in range(b0, b0 + num_steps * db, db)]
                )
            out = [
                (
                    x
                    if (x := 0.0 + (token_s + c * pair_s)) > (y := (base + kv * c) * per_byte)
                    else y
                )
                + fixed
                for c in range(c0, c0 + num_steps * d, d)
            ]
        else:
            out = []
            for _ in range(num_steps):
                compute_s = 0.0 + (token_s + c * pair_s)
                memory_s = (weights + kv * c + act + logits) * per_byte
                out.append((compute_s if compute_s > memory_s else memory_s) + fixed)
                c += d
        return self._with_allreduce(d, out)

    def _with_allreduce(self, decode_seqs: int, out: list[float]) -> list[float]:
        """``decode_step_times_s``'s steps with the all-reduce term added (as ``step_time_s``
        adds it, last), or as they are on one GPU."""
        if self._allreduce_token_s:
            allreduce_s = self._allreduce_fixed_s + decode_seqs * self._allreduce_token_s
            out = [s + allreduce_s for s in out]
        return out

    @staticmethod
    def _check_args(p: int, d: int, c: int, pc: int, k: int) -> None:
        for name, value in (
            ("prefill_tokens", p),
            ("decode_seqs", d),
            ("context_tokens", c),
            ("prefill_context_tokens", pc),
            ("num_prefill_seqs", k),
        ):
            if value < 0:
                raise ValueError(f"{name}={value} must be >= 0")
        if k > p or (p > 0 and k == 0):
            raise ValueError(f"num_prefill_seqs={k} must be between 1 and prefill_tokens={p}")
        if d == 0 and c:
            raise ValueError(f"context_tokens={c} given for decode_seqs=0")
        raise ValueError(f"prefill_context_tokens={pc} given for prefill_tokens=0")

    # -- diagnostics -----------------------------------------------------------------------------
    def step_cost(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        context_tokens: int,
        prefill_context_tokens: int = 0,
        num_prefill_seqs: int | None = None,
    ) -> StepCost:
        """The roofline terms behind ``step_time_s`` (same arguments); ``total_s`` equals it."""
        p, d = prefill_tokens, decode_seqs
        k = (1 if p > 0 else 0) if num_prefill_seqs is None else num_prefill_seqs
        # validates; a diagnostic, not a simulated step: not counted in ``range_count``
        count, self.range_count = self.range_count, None
        try:
            total = self.step_time_s(p, d, context_tokens, prefill_context_tokens, k)
        finally:
            self.range_count = count
        if total == 0.0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        if self._terms is not None:
            return self._fitted_cost(p, d, context_tokens, prefill_context_tokens, k)
        return self._roofline_cost(p, d, context_tokens, prefill_context_tokens, k, total)

    def _fitted_cost(self, p: int, d: int, c: int, pc: int, k: int) -> StepCost:
        """``step_cost`` with the fitted terms (arguments validated, at least one token): the
        roofline's terms, and ``fitted_s`` in the step profile's counts (``kv`` counts new
        tokens)."""
        cost = self._roofline_cost(p, d, c, pc, k, None)
        cost.fitted_s = float(
            self._terms.linear_s(p, d, k, pc + p + c + d, step_pairs(p, k, pc, c + d))
        )
        return cost

    def _roofline_cost(
        self,
        p: int,
        d: int,
        context_tokens: int,
        prefill_context_tokens: int,
        k: int,
        total: float | None,
    ) -> StepCost:
        """The roofline's terms (arguments validated, at least one token); checked against
        ``step_time_s``'s ``total`` when given."""
        if self._hybrid:
            return self._hybrid_cost(p, d, context_tokens, prefill_context_tokens, k)
        pairs = p * prefill_context_tokens / k + p * (p / k + 1) / 2 if p else 0.0
        prefill_flops = (
            p * self._body_flops_per_token
            + k * self._logits_flops
            + pairs * self._attn_flops_per_pair
        )
        decode_flops = (
            d * (self._body_flops_per_token + self._logits_flops)
            + (context_tokens + d) * self._attn_flops_per_pair
            if d
            else 0.0
        )
        peak = self.gpu.flops_per_s(self.model.dtype)
        compute_s = prefill_flops / (peak * self.factors.mfu_prefill) + decode_flops / (
            peak * self.factors.mfu_decode
        )
        hbm_bytes = (
            self._weight_bytes
            + self._kv_bytes_per_token * (context_tokens + prefill_context_tokens + p + d)
            + self._act_bytes_per_token * (p + d)
            + self._logits_bytes * (k + d)
        )
        cost = StepCost(
            flops=prefill_flops + decode_flops,
            hbm_bytes=hbm_bytes,
            compute_s=compute_s,
            memory_s=hbm_bytes * self._s_per_hbm_byte,
            overhead_s=self._fixed_s + self.allreduce_time_s(p + d),
        )
        assert total is None or math.isclose(cost.total_s, total, rel_tol=1e-9), (cost, total)
        return cost

    def _hybrid_cost(self, p: int, d: int, c: int, pc: int, k: int) -> StepCost:
        """``step_cost`` of a hybrid model, each layer costed as its group (module docstring);
        arguments validated, at least one token."""
        prefill_pairs = decode_pairs = 0.0  # query/key pairs summed over attention layers
        kv_tokens_bytes = 0.0
        for num_layers, window, token_bytes in self._attention_groups:
            if p:
                n, cached = (
                    p / k,
                    pc / k,
                )  # per sequence, split evenly as the full-attention path assumes
                pairs = k * (_windowed_pairs(cached + n, window) - _windowed_pairs(cached, window))
                prefill_pairs += num_layers * pairs
                kv_tokens_bytes += token_bytes * (
                    (pc if window is None else k * min(cached, window)) + p
                )
            if d:
                keys = c + d if window is None else min(c + d, d * window)
                decode_pairs += num_layers * keys
                kv_tokens_bytes += token_bytes * keys
        prefill_flops = (
            (
                p * (self._body_flops_per_token + self._state_flops_per_token)
                + k * self._logits_flops
                + prefill_pairs * self._layer_pair_flops
            )
            if p
            else 0.0
        )
        decode_flops = (
            (
                d * (self._body_flops_per_token + self._logits_flops + self._state_flops_per_token)
                + decode_pairs * self._layer_pair_flops
            )
            if d
            else 0.0
        )
        peak = self.gpu.flops_per_s(self.model.dtype)
        compute_s = prefill_flops / (peak * self.factors.mfu_prefill) + decode_flops / (
            peak * self.factors.mfu_decode
        )
        hbm_bytes = (
            self._weight_bytes
            + kv_tokens_bytes
            + 2 * self._state_bytes * (k + d)
            + self._act_bytes_per_token * (p + d)
            + self._logits_bytes * (k + d)
        )
        return StepCost(
            flops=prefill_flops + decode_flops,
            hbm_bytes=hbm_bytes,
            compute_s=compute_s,
            memory_s=hbm_bytes * self._s_per_hbm_byte,
            overhead_s=self._fixed_s + self.allreduce_time_s(p + d),
        )

    # -- transfers -------------------------------------------------------------------------------
    def copy_time_s(self, nbytes: int) -> float:
        """A device-to-device copy of ``nbytes``: read and write at HBM speed, plus the call's
        latency."""
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
