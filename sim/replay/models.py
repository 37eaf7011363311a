"""Model presets by shape: what a transformer weighs, what its KV cache costs, how much it computes.

A ``ModelSpec`` is the shape of a dense decoder-only transformer (no MoE):
enough to size weights, KV cache and activations and to count FLOPs and bytes for the step-time
model (``sim.serving.steptime``). Hybrid models list their ``layer_groups`` (``LayerGroup``: full
attention, a sliding window of W tokens, or Mamba layers with a fixed state per request); a
model without them is one full-attention group, as before. Presets live in ``sim/data/models.json``
(each with its source); a
user's own model is a JSON file with the same fields::

    {"name": "my-7b", "num_layers": 32, "hidden_size": 4096, "num_heads": 32,
     "num_kv_heads": 8, "head_dim": 128, "intermediate_size": 14336,
     "vocab_size": 32000, "param_count": 7241732096, "dtype": "bf16"}

``load_model("llama-3-8b")`` or ``load_model("path/to/my-7b.json")``. Names are
case-insensitive; presets also answer to their Hugging Face ids (``meta-llama/Meta-Llama-3-8B``).

This module also holds the small preset-file machinery ``sim.replay.hardware`` reuses for GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, TypeVar

from traces.knobs import check_flag, check_int
from traces.source import read_settings_bytes

__all__ = [
    "ModelSpec",
    "LayerGroup",
    "LAYER_KINDS",
    "DTYPE_BYTES",
    "DEFAULT_MODEL",
    "load_model",
    "available_models",
]

#: The model every command, sweep and library call serves when none is named (a preset).
DEFAULT_MODEL = "Llama-3-8B"

DATA_DIR = Path(__file__).resolve().parents[1] / "data"

#: Bytes per element of the dtypes a model may be served in.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}

#: Logits are computed in the model dtype, then cast to fp32 for sampling (vLLM's sampler works in
#: fp32); both copies are live at once.
LOGITS_FP32_BYTES = 4

#: Keys a preset file may carry besides the dataclass fields; they are documentation only.
_METADATA_KEYS = frozenset({"source", "notes", "aliases"})


#: Kinds of layer group: what a layer keeps per request (``LayerGroup``).
LAYER_KINDS = ("full", "sliding", "mamba")


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers of one model that keep the same kind of per-request state.

    Attributes:
        kind: ``"full"`` (K and V of every token), ``"sliding"`` (K and V of the last
            ``sliding_window`` tokens) or ``"mamba"`` (a fixed state per request: the SSM state
            and the causal-convolution tail, whatever the length).
        num_layers: layers of this kind.
        sliding_window: tokens a sliding layer attends to (the Hugging Face ``sliding_window``).
        num_kv_heads, head_dim: attention shape; None takes the model's.
        mamba_d_inner, mamba_d_state, mamba_d_conv, mamba_n_groups: Mamba shape (``expand x
            hidden``, ``d_state``, ``d_conv``, ``n_groups``; ``n_groups`` 0 for Mamba-1, whose
            convolution covers ``d_inner`` only). The state of one layer is, as vLLM sizes it,
            ``(d_conv - 1) x (d_inner + 2 n_groups d_state)`` convolution elements plus
            ``d_inner x d_state`` SSM elements.
    """

    kind: str
    num_layers: int
    sliding_window: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mamba_d_inner: int | None = None
    mamba_d_state: int | None = None
    mamba_d_conv: int | None = None
    mamba_n_groups: int = 0

    def __post_init__(self) -> None:
        where = f"layer group {self.kind!r}"
        if self.kind not in LAYER_KINDS:
            raise ValueError(
                f"layer group: field 'kind' must be one of {', '.join(LAYER_KINDS)}, "
                f"got {self.kind!r}"
            )
        _check_positive_int(self.num_layers, "num_layers", where)
        need = {
            "full": (),
            "sliding": ("sliding_window",),
            "mamba": ("mamba_d_inner", "mamba_d_state", "mamba_d_conv"),
        }[self.kind]
        for f in (
            "sliding_window",
            "num_kv_heads",
            "head_dim",
            "mamba_d_inner",
            "mamba_d_state",
            "mamba_d_conv",
        ):
            value = getattr(self, f)
            if f in need or value is not None:
                _check_positive_int(value, f, where)
        check_int("mamba_n_groups", self.mamba_n_groups, low=0, where=f"{where}: ")

    @property
    def is_attention(self) -> bool:
        return self.kind != "mamba"

    def token_bytes(self, dtype_bytes: int) -> int:
        """K and V bytes of one token in every layer of the group (0 for Mamba)."""
        if not self.is_attention:
            return 0
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def state_bytes(self, dtype_bytes: int) -> int:
        """Fixed per-request state of every layer of the group (0 for attention)."""
        if self.is_attention:
            return 0
        conv = (self.mamba_d_conv - 1) * (
            self.mamba_d_inner + 2 * self.mamba_n_groups * self.mamba_d_state
        )
        return self.num_layers * (conv + self.mamba_d_inner * self.mamba_d_state) * dtype_bytes

    def state_update_flops_per_token(self) -> int:
        """FLOPs one token's state update takes in every layer of the group (0 for attention),
        past its projections (those are weights, counted with the model's): the causal
        convolution, ``2 x d_conv`` per channel, and the SSM recurrence, a decay, an outer-product
        add and a contraction of the ``d_inner x d_state`` state, ``6`` per element (Mamba-2's
        recurrent form; its chunked prefill scan does the same order of work)."""
        if self.is_attention:
            return 0
        conv_channels = self.mamba_d_inner + 2 * self.mamba_n_groups * self.mamba_d_state
        return self.num_layers * (
            2 * self.mamba_d_conv * conv_channels + 6 * self.mamba_d_inner * self.mamba_d_state
        )

    def shard(self, tensor_parallel: int, model_kv_heads: int) -> LayerGroup:
        """One GPU's share: KV heads split as the model's (one kept per GPU past their number),
        Mamba's inner dimension split, its B/C groups split (one kept past their number)."""
        tp = tensor_parallel
        if self.is_attention:
            kv = self.num_kv_heads if self.num_kv_heads is not None else model_kv_heads
            return dataclasses.replace(self, num_kv_heads=max(1, kv // tp))
        if self.mamba_d_inner % tp:
            raise ValueError(
                f"tensor parallelism {tp} must divide mamba_d_inner ({self.mamba_d_inner})"
            )
        groups = max(1, self.mamba_n_groups // tp) if self.mamba_n_groups else 0
        return dataclasses.replace(
            self, mamba_d_inner=self.mamba_d_inner // tp, mamba_n_groups=groups
        )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a dense decoder-only transformer.

    Attributes:
        name: preset or user name (for reports).
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
            vocab_size: the Hugging Face config fields of the same meaning.
        param_count: every parameter, embeddings included (as the model card states it).
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (``"bfloat16"`` etc. are accepted).
        gated_mlp: True for SwiGLU-style MLPs (gate and up projections: Llama, Qwen, Mistral),
            False for a plain two-matrix MLP (OPT).
        tied_embeddings: True when the LM head reuses the input embedding table.
        max_position_embeddings: the longest sequence the model was trained for (the Hugging
            Face field; vLLM's default ``max_model_len``); None when a file does not say.
        layer_groups: the KV geometry of a hybrid model, one ``LayerGroup`` per kind of layer
            (their ``num_layers`` add up to the model's; at least one attention group); None
            for one full-attention group of every layer (``kv_groups`` gives it either way).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    param_count: int
    dtype: str = "bf16"
    gated_mlp: bool = True
    tied_embeddings: bool = False
    max_position_embeddings: int | None = None
    layer_groups: tuple[LayerGroup, ...] | None = None

    def __post_init__(self) -> None:
        where = f"ModelSpec {self.name!r}"
        if self.layer_groups is not None:
            object.__setattr__(self, "layer_groups", _layer_groups(self, where))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(
                f"ModelSpec: field 'name' must be a non-empty string, got {self.name!r}"
            )
        for f in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "param_count",
        ):
            _check_positive_int(getattr(self, f), f, where)
        if self.max_position_embeddings is not None:
            _check_positive_int(self.max_position_embeddings, "max_position_embeddings", where)
        for f in ("gated_mlp", "tied_embeddings"):
            check_flag(f, getattr(self, f), where=f"{where}: ")
        dtype = _DTYPE_ALIASES.get(str(self.dtype).lower(), str(self.dtype).lower())
        if dtype not in DTYPE_BYTES:
            raise ValueError(
                f"{where}: field 'dtype' must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
            )
        object.__setattr__(self, "dtype", dtype)  # normalised spelling; frozen otherwise
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{where}: field 'num_kv_heads' ({self.num_kv_heads}) must divide num_heads "
                f"({self.num_heads})"
            )
        if self.param_count <= self._embedding_table_params():
            raise ValueError(
                f"{where}: field 'param_count' "
                f"({self.param_count:,}) is not larger than its embedding tables "
                f"({self._embedding_table_params():,}); give the full count, not billions"
            )

    # -- sizes -------------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy on the GPU: ``param_count x dtype_bytes``."""
        return self.param_count * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token holds: ``2 (K and V) x layers x kv_heads x head_dim x
        dtype_bytes``.

        For a hybrid model, the attention layers' (sliding ones as if the window were not there;
        Mamba layers hold no per-token KV): ``sim.serving.kv_groups`` keeps the real geometry.
        """
        if self.layer_groups is None:
            return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes
        return sum(g.token_bytes(self.dtype_bytes) for g in self.layer_groups)

    @property
    def kv_groups(self) -> tuple[LayerGroup, ...]:
        """The KV geometry: ``layer_groups``, or one full-attention group of every layer."""
        if self.layer_groups is not None:
            return self.layer_groups
        return (
            LayerGroup(
                "full", self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim
            ),
        )

    @property
    def is_hybrid(self) -> bool:
        """True when some layers keep other than full-attention KV (``sim.serving.kv_groups``
        manages them)."""
        return any(g.kind != "full" for g in self.kv_groups)

    @property
    def q_size(self) -> int:
        """Elements of one token's queries (and of the attention output): ``num_heads x
        head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Elements of one token's keys (or values) in one layer: ``num_kv_heads x head_dim``."""
        return self.num_kv_heads * self.head_dim

    def _embedding_table_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def matmul_param_count(self) -> int:
        """Parameters a token is multiplied by: every layer plus the LM head.

        The input embedding table is only indexed, so an untied model's copy is left out (a
        tied model's single table *is* the LM head and stays in).
        """
        return self.param_count - (
            0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        )

    @property
    def weight_read_bytes(self) -> int:
        """Weight bytes one forward pass reads from HBM (each matmul weight once)."""
        return self.matmul_param_count * self.dtype_bytes

    # -- FLOPs -------------------------------------------------------------------------------
    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token through every layer and the LM head: ``2 x matmul params``.

        About ``2 x param_count``; attention scores are separate (``attention_flops``). A prompt
        token whose logits are not needed skips ``logits_flops_per_token`` of it.
        """
        return 2 * self.matmul_param_count

    @property
    def logits_flops_per_token(self) -> int:
        """The LM head's share of ``flops_per_token``: ``2 x vocab x hidden``."""
        return 2 * self.vocab_size * self.hidden_size

    def attention_flops(self, num_query_tokens: int, context_tokens: int) -> int:
        """FLOPs of ``QK^T`` and ``PV`` for ``num_query_tokens`` queries each attending to
        ``context_tokens`` keys: ``4 x layers x num_heads x head_dim x queries x keys``.

        Causal prefill attends to a growing context; the caller sums query/key pairs (see
        ``sim.serving.steptime``) and passes ``num_query_tokens=1, context_tokens=pairs``.
        """
        return 4 * self.num_layers * self.q_size * num_query_tokens * context_tokens

    # -- activations -------------------------------------------------------------------------
    def _mlp_up_size(self) -> int:
        return (2 if self.gated_mlp else 1) * self.intermediate_size

    def activation_bytes(self, num_tokens: int, num_sampled_tokens: int | None = None) -> int:
        """Peak activation memory of one forward pass over ``num_tokens`` tokens.

        Inference frees each layer's activations before the next layer runs, so the peak is the
        largest set live inside one layer, times tokens, plus the logits::

            per_token = dtype_bytes x max(
                attention: 2 x hidden (residual, normed input) + (q + 2 kv) (fused QKV output)
                           + q (attention output),
                MLP:       hidden (residual) + up x intermediate (gate+up output; up = 2 gated, 1 plain)
                           + max(hidden (normed input, until the up GEMM is done),
                                 intermediate (activation output, after it)))
            total = num_tokens x per_token + num_sampled_tokens x vocab x (dtype_bytes + 4)

        where ``q = num_heads x head_dim`` and ``kv = num_kv_heads x head_dim``. The logits term
        holds the model-dtype logits and their fp32 copy for the sampler. ``num_sampled_tokens``
        (positions whose logits are computed) defaults to ``num_tokens``, the bound a server
        must reserve for when every token may be sampled (vLLM sizes its warm-up this way); a
        prefill of one prompt samples only its last position. The KV cache is not counted.
        Llama-3-8B bf16: 94,208 B per token (MLP phase), plus 769,536 B per sampled token.
        """  # noqa: E501
        if num_sampled_tokens is None:
            num_sampled_tokens = num_tokens
        h = self.hidden_size
        attention = 2 * h + self.q_size + 2 * self.kv_size + self.q_size
        mlp = h + self._mlp_up_size() + max(h, self.intermediate_size)
        per_token = self.dtype_bytes * max(attention, mlp)
        return num_tokens * per_token + num_sampled_tokens * self.logits_bytes_per_sampled_token

    @property
    def logits_bytes_per_sampled_token(self) -> int:
        """Logits of one sampled position: ``vocab x (dtype_bytes + 4)`` (model dtype + fp32
        copy)."""
        return self.vocab_size * (self.dtype_bytes + LOGITS_FP32_BYTES)

    @property
    def activation_traffic_bytes_per_token(self) -> int:
        """HBM bytes one token's activations move per forward pass (reads + writes), KV excluded.

        Per layer, with the fusions serving engines use (fused QKV, fused residual-add + RMSNorm,
        fused SiLU-and-mul), in elements: add+norm ``4 h`` twice; QKV GEMM reads ``h``, writes
        ``q + 2 kv``; rotary rewrites ``q + kv`` in place (``2 (q + kv)``); attention reads ``q``
        and writes ``q``; o-proj reads ``q``, writes ``h``; up GEMM reads ``h``, writes
        ``up x inter``; activation reads ``up x inter``, writes ``inter``; down GEMM reads
        ``inter``, writes ``h``. Total ``12 h + 6 q + 4 kv + (2 up + 2) inter`` per layer. Small
        next to the weights for decode, and next to the FLOPs for prefill, but not zero.
        """
        h, q, kv, inter = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        up = 2 if self.gated_mlp else 1
        per_layer = 12 * h + 6 * q + 4 * kv + (2 * up + 2) * inter
        return self.num_layers * per_layer * self.dtype_bytes

    # -- tensor parallelism -------------------------------------------------------------------
    def shard(self, tensor_parallel: int) -> ModelSpec:
        """What one GPU of ``tensor_parallel`` holds and computes (Megatron-style sharding, as
        vLLM).

        Attention heads, KV heads, the MLP's intermediate dimension and both vocabulary tables
        are split ``tensor_parallel`` ways; the residual stream (``hidden_size``) is whole on
        every GPU. With fewer KV heads than GPUs each GPU keeps one KV head (vLLM replicates
        them), so its KV projections are not split further. Every size, FLOP and byte count of
        the shard is then per GPU; the all-reduces that join the shards are
        ``sim.serving.steptime``'s. ``shard(1)`` is the model itself.

        Raises ValueError when the heads or the intermediate size do not divide evenly.
        """
        tp = tensor_parallel
        _check_positive_int(tp, "tensor_parallel", f"ModelSpec {self.name!r}")
        if tp == 1:
            return self
        kv = self.num_kv_heads
        if self.num_heads % tp or self.intermediate_size % tp or (kv % tp and tp % kv):
            raise ValueError(
                f"{self.name}: tensor parallelism {tp} must divide num_heads "
                f"({self.num_heads}) and intermediate_size ({self.intermediate_size}), "
                f"and divide or be a multiple of num_kv_heads ({kv})"
            )
        kv_shard = max(1, kv // tp)
        tables = self._embedding_table_params()
        vocab_shard = -(-self.vocab_size // tp)
        # layer parameters split evenly, except KV projections replicated past num_kv_heads GPUs
        kv_proj = 2 * self.num_layers * self.hidden_size * self.head_dim
        layer_params = self.param_count - tables - kv_proj * kv
        shard_params = (
            -(-layer_params // tp)
            + kv_proj * kv_shard
            + vocab_shard * self.hidden_size * (1 if self.tied_embeddings else 2)
        )
        groups = (
            None if self.layer_groups is None else tuple(g.shard(tp, kv) for g in self.layer_groups)
        )
        return dataclasses.replace(
            self,
            num_heads=self.num_heads // tp,
            num_kv_heads=kv_shard,
            intermediate_size=self.intermediate_size // tp,
            vocab_size=vocab_shard,
            param_count=shard_params,
            layer_groups=groups,
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields, ready for ``json.dump`` (a custom-model file round-trips through it)."""
        return dataclasses.asdict(self)


def _layer_groups(model: ModelSpec, where: str) -> tuple[LayerGroup, ...]:
    """``model.layer_groups`` as LayerGroups (dicts from a JSON file accepted), attention shape
    filled in from the model, checked against its layer count."""
    raw = model.layer_groups
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(
            f"{where}: field 'layer_groups' must be a non-empty list of groups, got {raw!r}"
        )
    groups = []
    for i, g in enumerate(raw):
        if isinstance(g, Mapping):
            g = _spec_from_mapping(LayerGroup, g, f"{where}: layer_groups[{i}]")
        elif not isinstance(g, LayerGroup):
            raise ValueError(
                f"{where}: layer_groups[{i}] must be an object with a 'kind', got {g!r}"
            )
        if g.is_attention:
            g = dataclasses.replace(
                g,
                num_kv_heads=g.num_kv_heads or model.num_kv_heads,
                head_dim=g.head_dim or model.head_dim,
            )
        groups.append(g)
    total = sum(g.num_layers for g in groups)
    if total != model.num_layers:
        raise ValueError(
            f"{where}: layer_groups hold {total} layers, "
            f"the model has num_layers={model.num_layers}"
        )
    if not any(g.is_attention for g in groups):
        raise ValueError(
            f"{where}: layer_groups need at least one attention group "
            "(pure state-space models are not modelled)"
        )
    return tuple(groups)


def _check_positive_int(value: Any, field: str, where: str) -> None:
    check_int(field, value, where=f"{where}: ")


# -- preset files (shared with sim.replay.hardware) ------------------------------------------------
_Spec = TypeVar("_Spec")


def _read_json_object(path: Path) -> dict[str, Any]:
    """The top-level object of a JSON file; ValueError naming the file otherwise."""
    if path.suffix.lower() in (".yaml", ".yml"):
        raise ValueError(f"{path}: YAML is not supported; write the same fields as JSON")
    try:  # read once, whole: a FIFO or /dev/stdin works, /dev/zero is refused
        raw = read_settings_bytes(path)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}), so not JSON") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    except RecursionError:  # arrays or objects nested thousands deep: no preset or calibration
        raise ValueError(f"{path}: JSON nested too deep to be a preset or calibration") from None
    except ValueError as e:  # an integer literal past Python's 4,300 digits
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: expected a JSON object with the spec's fields, got {type(data).__name__}"
        )
    return data


def _coerce(value: Any, type_name: str, field: str, where: str) -> Any:
    """JSON numbers to the field's type (``8.03e9`` -> int when integral); reject the rest."""
    if type_name == "int" and isinstance(value, float) and not isinstance(value, bool):
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{where}: field {field!r} must be a whole number, got {value!r}")
        return int(value)
    if type_name == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _spec_from_mapping(
    cls: type[_Spec], data: Mapping[str, Any], where: str, *, default_name: str | None = None
) -> _Spec:
    """Build ``cls`` from a preset/file mapping, naming ``where`` and the field in every error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in data if k not in fields and k not in _METADATA_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected {sorted(fields)}")
    values = {k: v for k, v in data.items() if k in fields}
    if "name" not in values and default_name is not None:
        values["name"] = default_name
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [n for n in required if n not in values]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    for name, value in values.items():
        values[name] = _coerce(value, str(fields[name].type).split(" ")[0], name, where)
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


class _PresetTable:
    """Presets of one kind read once from a bundled JSON file, looked up case-insensitively."""

    def __init__(self, cls: type, filename: str, section: str, kind: str):
        self.cls, self.filename, self.section, self.kind = cls, filename, section, kind

    @functools.cached_property
    def _entries(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        path = DATA_DIR / self.filename
        entries = _read_json_object(path).get(self.section)
        assert isinstance(entries, dict), f"{path} lacks its {self.section!r} table"
        index: dict[str, str] = {}
        for name, fields in entries.items():
            for key in [name, *fields.get("aliases", [])]:
                assert key.lower() not in index, f"{path}: {key!r} names two presets"
                index[key.lower()] = name
        return entries, index

    def names(self) -> list[str]:
        return list(self._entries[0])

    @functools.lru_cache(maxsize=None)  # noqa: B019 (one table per kind, lives for the process)
    def _build(self, name: str) -> Any:
        entries, _ = self._entries
        return _spec_from_mapping(
            self.cls, {"name": name, **entries[name]}, f"{DATA_DIR / self.filename} [{name}]"
        )

    def load(self, name_or_path: Any) -> Any:
        if isinstance(name_or_path, self.cls):
            return name_or_path
        if not isinstance(name_or_path, (str, Path)):
            raise ValueError(
                f"{self.kind} must be a preset name or a JSON file path, got {name_or_path!r}"
            )
        key = str(name_or_path).strip().lower()
        canonical = self._entries[1].get(key)
        if canonical is not None:
            return self._build(canonical)
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            raise ValueError(f"{self.kind} file {str(path)!r} is a folder, not a JSON file")
        if path.exists():  # a regular file, or a FIFO or /dev/stdin (read once)
            return _spec_from_mapping(
                self.cls, _read_json_object(path), str(path), default_name=path.stem
            )
        if path.suffix.lower() in (".json", ".yaml", ".yml"):
            raise ValueError(f"{self.kind} file {str(path)!r} does not exist")
        raise ValueError(
            f"unknown {self.kind} {str(name_or_path)!r}; "
            f"known: {', '.join(self.names())} (or a path to a JSON file with the same fields)"
        )


_MODELS = _PresetTable(ModelSpec, "models.json", "models", "model")


def available_models() -> list[str]:
    """Names of the bundled model presets, in file order."""
    return _MODELS.names()


def load_model(name_or_path: str | Path | ModelSpec) -> ModelSpec:
    """A preset by name (case-insensitive, Hugging Face ids too) or a model from a JSON file.

    Raises ValueError listing the known names for an unknown name, or naming the file and the
    field for a bad file. A ``ModelSpec`` is returned as it is.
    """
    return _MODELS.load(name_or_path)
