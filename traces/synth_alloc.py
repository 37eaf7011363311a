"""A seeded synthetic allocation trace of LLM inference, from a model shape and a request mix.

What it allocates, and why it looks like this:

- **weights** (tag ``"weights"``): one tensor per parameter matrix, allocated at time 0 and never
  freed (embedding, per layer q/k/v/o and gate/up/down projections and two norms, final norm,
  LM head unless tied), as a model loader does.
- **KV cache** (tag ``"kv"``): grows by chunks, the scheme of block-based caches (vLLM's KV block
  is 16 tokens): each request holds, per layer, a list of chunks of ``kv_chunk_tokens`` tokens
  (K and V together, ``2 * num_kv_heads * head_dim * dtype_bytes`` bytes per token). The prompt's
  chunks are allocated when the request is admitted; a decode step that needs room for one more
  token allocates one more chunk per layer; all of a request's chunks are freed when it finishes.
  ``kv_chunk_tokens=1`` gives per-token growth.
- **activations** (tag ``"activation"``): each step runs one forward pass over the batch's tokens
  (whole prompts of newly admitted requests plus one token per decoding request): per layer the
  norm, q/k/v, attention output, MLP gate/up and down tensors come and go in the order an eager
  forward pass creates and drops them; logits (float32) for the last token of each request.
- **workspace** (tag ``"workspace"``): per layer the attention's float32 log-sum-exp scratch, and
  a float32 sampling buffer per step, all freed within the step.

Scheduling is continuous batching: requests arrive (all at 0, or Poisson at
``arrival_rate_per_s``), wait FCFS, and at most ``max_batch`` run at once. A step lasts
``step_overhead_us + step_us_per_token * tokens`` and its events are spread evenly over it.
Everything random comes from ``numpy.random.default_rng(seed)``: one seed, one trace.

What it writes, the allocation readers read: token counts are at most ``traces.requests.MAX_TOKENS``
(the request readers' limit), every size and time fits int64, and a trace of more than
``MAX_EVENTS`` events is refused before it is built.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import numpy as np
import pandas as pd

from traces.events import AllocTrace, make_events
from traces.knobs import check_int
from traces.requests import MAX_TOKENS

__all__ = ["generate_alloc_trace", "kv_bytes_per_token", "SYNTH_FORMAT", "MAX_EVENTS"]

SYNTH_FORMAT = "synthetic"
FLOAT32_BYTES = 4
#: Most events one generated trace may have: about 200 B each while it is built (5.9 M events
#: took 1.2 GB and 11 s here), so 20 million is 4 GB and a minute; more is refused before any work.
MAX_EVENTS = 20_000_000
_INT64_MAX = int(np.iinfo(np.int64).max)  # sizes and times are int64 columns, as every reader's
_ALLOCS_PER_LAYER_STEP = 11  # allocations one layer of ``_forward`` makes (each freed in the step)

#: A token-count distribution: a fixed count, an inclusive ``(low, high)`` uniform range, a list
#: of observed counts to draw from, or ``f(rng, n) -> n counts``.
LengthSpec = Union[
    int, tuple[int, int], Sequence[int], np.ndarray, Callable[[np.random.Generator, int], Any]
]


def kv_bytes_per_token(
    *, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2
) -> int:
    """K and V of one token over all layers: ``2 * layers * kv_heads * head_dim * dtype_bytes``."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(slots=True)
class _Request:
    rid: int
    arrival_us: int
    prompt_tokens: int
    output_tokens: int
    generated: int = 0
    kv_tokens: int = 0  # capacity of the chunks held, in tokens
    kv_ids: list[int] = field(default_factory=list)
    start_us: int = -1
    finish_us: int = -1


class _Recorder:
    """Column lists of the event table; ids are dense, so sizes live in a list indexed by id."""

    __slots__ = ("is_alloc", "ids", "tags", "size_of", "steps")

    def __init__(self) -> None:
        self.is_alloc: list[bool] = []
        self.ids: list[int] = []
        self.tags: list[str] = []
        self.size_of: list[int] = []
        self.steps: list[tuple[int, int, int]] = []  # (first event index, start_us, duration_us)

    def alloc(self, nbytes: int, tag: str) -> int:
        aid = len(self.size_of)
        self.size_of.append(nbytes)
        self.is_alloc.append(True)
        self.ids.append(aid)
        self.tags.append(tag)
        return aid

    def free(self, aid: int) -> None:
        self.is_alloc.append(False)
        self.ids.append(aid)
        self.tags.append("")

    def begin_step(self, start_us: int, duration_us: int) -> None:
        self.steps.append((len(self.ids), start_us, duration_us))

    def times(self) -> np.ndarray:
        out = np.zeros(len(self.ids), np.int64)
        bounds = [s[0] for s in self.steps[1:]] + [len(self.ids)]
        for (first, start_us, dur_us), end in zip(self.steps, bounds):
            n = end - first
            out[first:end] = start_us + (np.arange(n, dtype=np.int64) * dur_us) // max(n, 1)
        return out


def generate_alloc_trace(
    *,
    num_layers: int = 16,
    hidden_size: int = 2048,
    num_heads: int | None = None,
    num_kv_heads: int = 8,
    head_dim: int = 64,
    intermediate_size: int | None = None,
    vocab_size: int = 128_256,
    param_count: int | None = None,
    dtype_bytes: int = 2,
    tie_word_embeddings: bool = True,
    num_requests: int = 32,
    prompt_tokens: LengthSpec = (64, 1024),
    output_tokens: LengthSpec = (16, 256),
    arrival_rate_per_s: float | None = None,
    max_batch: int = 8,
    kv_chunk_tokens: int = 16,
    step_overhead_us: int = 6_000,
    step_us_per_token: float = 2.0,
    seed: int = 0,
) -> AllocTrace:
    """Generate an allocation trace of LLM inference (see the module docstring for the scheme).

    Args:
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, vocab_size: the model shape
            (``num_heads`` defaults to ``hidden_size // head_dim``); defaults are Llama-3.2-1B's.
        intermediate_size: MLP width; default ``4 * hidden_size`` (Llama-3.2-1B's 8192), or
            derived from ``param_count`` when that is given (give one of the two).
        param_count: total parameters; sets the MLP width so the weights add up to it.
        dtype_bytes: bytes per weight/activation/KV element (2 for bf16).
        tie_word_embeddings: the LM head shares the embedding's tensor.
        num_requests: how many requests.
        prompt_tokens, output_tokens: token-count distributions (``LengthSpec``).
        arrival_rate_per_s: Poisson arrivals at this rate; None: all arrive at time 0.
        max_batch: most requests running at once.
        kv_chunk_tokens: tokens per KV chunk (per layer, per request).
        step_overhead_us, step_us_per_token: step duration model.
        seed: the seed; the same arguments and seed give the same trace.

    Returns:
        An AllocTrace with tags weights / kv / activation / workspace; ``meta`` holds the model
        shape, ``kv_bytes_per_token``, ``weights_bytes``, ``num_steps`` and ``requests`` (a table
        of arrival, start and finish times per request).
    """
    for name, value in (
        ("num_layers", num_layers),
        ("hidden_size", hidden_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("vocab_size", vocab_size),
        ("dtype_bytes", dtype_bytes),
        ("num_requests", num_requests),
        ("max_batch", max_batch),
        ("kv_chunk_tokens", kv_chunk_tokens),
    ):
        _check_positive_int(name, value)
    num_heads = hidden_size // head_dim if num_heads is None else num_heads
    _check_positive_int("num_heads", num_heads)
    if not (0 <= step_overhead_us < math.inf and 0 <= step_us_per_token < math.inf):
        raise ValueError(
            f"step_overhead_us(={step_overhead_us}) and step_us_per_token(={step_us_per_token}) "
            "must be finite numbers >= 0"
        )
    if arrival_rate_per_s is not None and not arrival_rate_per_s > 0:
        raise ValueError(f"arrival_rate_per_s(={arrival_rate_per_s}) must be > 0 or None")
    # every request holds at least one KV chunk per layer and takes a share of a step
    _check_num_events(num_layers, max_batch, num_requests, num_requests, num_requests)
    intermediate_size = _mlp_width(
        num_layers,
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        tie_word_embeddings,
        intermediate_size,
        param_count,
    )

    rng = np.random.default_rng(seed)
    prompts = _sample("prompt_tokens", prompt_tokens, rng, num_requests)
    outputs = _sample("output_tokens", output_tokens, rng, num_requests)
    _check_num_events(
        num_layers,
        max_batch,
        num_requests,
        int((-(-prompts // kv_chunk_tokens)).sum()),
        int(outputs.sum()),
    )
    if arrival_rate_per_s is None:
        arrivals = np.zeros(num_requests, np.int64)
    else:
        arrivals_us = np.cumsum(rng.exponential(1e6 / arrival_rate_per_s, num_requests))
        if (
            arrivals_us.size and not arrivals_us[-1] <= _INT64_MAX
        ):  # astype would wrap it to a negative time
            raise ValueError(
                f"arrival_rate_per_s(={arrival_rate_per_s}) "
                f"puts the last arrival at {arrivals_us[-1]:.3g} us, past what an int64 time holds"
            )
        arrivals = arrivals_us.astype(np.int64)
    requests = [
        _Request(i, int(a), int(p), int(o))
        for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))
    ]

    rec = _Recorder()
    rec.begin_step(0, 0)
    weights_bytes = _load_weights(
        rec,
        num_layers,
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        vocab_size,
        dtype_bytes,
        tie_word_embeddings,
    )
    chunk_bytes = kv_chunk_tokens * kv_bytes_per_token(
        num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes
    )
    shape = (
        num_layers,
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        vocab_size,
        dtype_bytes,
    )

    pending = deque(requests)  # by arrival time: arrivals are sorted
    running: list[_Request] = []
    now_us, num_steps = 0, 0
    while pending or running:
        if not running and pending[0].arrival_us > now_us:
            now_us = pending[0].arrival_us  # idle until the next request arrives
        admitted = []
        while (
            pending and len(running) + len(admitted) < max_batch and pending[0].arrival_us <= now_us
        ):
            admitted.append(pending.popleft())
        decoding = running
        num_tokens = sum(r.prompt_tokens for r in admitted) + len(decoding)
        duration_us = int(step_overhead_us + step_us_per_token * num_tokens)
        rec.begin_step(now_us, duration_us)
        for r in admitted:
            r.start_us = now_us
            _grow_kv(rec, r, r.prompt_tokens, num_layers, kv_chunk_tokens, chunk_bytes)
        for r in decoding:
            _grow_kv(
                rec, r, r.prompt_tokens + r.generated, num_layers, kv_chunk_tokens, chunk_bytes
            )
        _forward(rec, num_tokens, len(admitted) + len(decoding), shape)
        running = decoding + admitted
        now_us += duration_us
        still = []
        for r in running:
            r.generated += 1
            if r.generated >= r.output_tokens:
                r.finish_us = now_us
                for aid in r.kv_ids:
                    rec.free(aid)
                r.kv_ids.clear()
            else:
                still.append(r)
        running = still
        num_steps += 1

    largest = max(rec.size_of)
    if largest > _INT64_MAX:  # one pass over a list: cheaper than checking every allocation
        raise ValueError(
            f"this model shape allocates a tensor of {largest:,} bytes, "
            "more than an int64 size holds"
        )
    if now_us > _INT64_MAX:
        raise ValueError(
            f"the trace lasts more than {_INT64_MAX:,} us, what an int64 time holds; "
            f"lower step_us_per_token(={step_us_per_token}) "
            f"or step_overhead_us(={step_overhead_us})"
        )
    ids = np.asarray(rec.ids, np.int64)
    sizes = np.asarray(rec.size_of, np.int64)
    events = make_events(
        rec.times(), np.where(rec.is_alloc, "alloc", "free"), ids, sizes[ids], None, rec.tags
    )
    meta = {
        "model": {
            "num_layers": num_layers,
            "hidden_size": hidden_size,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "intermediate_size": intermediate_size,
            "vocab_size": vocab_size,
            "dtype_bytes": dtype_bytes,
            "tie_word_embeddings": tie_word_embeddings,
        },
        "kv_bytes_per_token": kv_bytes_per_token(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype_bytes=dtype_bytes,
        ),
        "kv_chunk_tokens": kv_chunk_tokens,
        "weights_bytes": weights_bytes,
        "num_steps": num_steps,
        "max_batch": max_batch,
        "seed": seed,
        "requests": pd.DataFrame(
            {
                "request_id": [r.rid for r in requests],
                "arrival_us": [r.arrival_us for r in requests],
                "start_us": [r.start_us for r in requests],
                "finish_us": [r.finish_us for r in requests],
                "prompt_tokens": [r.prompt_tokens for r in requests],
                "output_tokens": [r.output_tokens for r in requests],
            }
        ),
    }
    name = f"synth-L{num_layers}-h{hidden_size}-r{num_requests}-s{seed}"
    return AllocTrace(events, name=name, source="", format=SYNTH_FORMAT, meta=meta)


def _load_weights(
    rec: _Recorder,
    num_layers: int,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    inter: int,
    vocab: int,
    dtype_bytes: int,
    tied: bool,
) -> int:
    tensors = [vocab * hidden]
    per_layer = [
        hidden * num_heads * head_dim,
        hidden * num_kv_heads * head_dim,
        hidden * num_kv_heads * head_dim,
        num_heads * head_dim * hidden,
        hidden * inter,
        hidden * inter,
        inter * hidden,
        hidden,
        hidden,
    ]
    tensors += per_layer * num_layers + [hidden] + ([] if tied else [vocab * hidden])
    for numel in tensors:
        rec.alloc(numel * dtype_bytes, "weights")
    return sum(tensors) * dtype_bytes


def _grow_kv(
    rec: _Recorder,
    r: _Request,
    need_tokens: int,
    num_layers: int,
    chunk_tokens: int,
    chunk_bytes: int,
) -> None:
    while r.kv_tokens < need_tokens:
        for _ in range(num_layers):
            r.kv_ids.append(rec.alloc(chunk_bytes, "kv"))
        r.kv_tokens += chunk_tokens


def _forward(rec: _Recorder, num_tokens: int, batch: int, shape: tuple) -> None:
    """One eager forward pass: tensors appear and go in the order the layers create and drop
    them."""
    num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab, dtype_bytes = shape
    t, act = num_tokens, "activation"
    h_bytes = t * hidden * dtype_bytes
    x = rec.alloc(h_bytes, act)  # embedding output
    for _ in range(num_layers):
        norm = rec.alloc(h_bytes, act)
        qkv = rec.alloc(t * (num_heads + 2 * num_kv_heads) * head_dim * dtype_bytes, act)
        rec.free(norm)
        lse = rec.alloc(t * num_heads * FLOAT32_BYTES, "workspace")
        attn = rec.alloc(t * num_heads * head_dim * dtype_bytes, act)
        rec.free(lse)
        rec.free(qkv)
        o = rec.alloc(h_bytes, act)
        rec.free(attn)
        x2 = rec.alloc(h_bytes, act)  # residual add
        rec.free(x)
        rec.free(o)
        norm = rec.alloc(h_bytes, act)
        gate_up = rec.alloc(2 * t * inter * dtype_bytes, act)
        rec.free(norm)
        mlp = rec.alloc(t * inter * dtype_bytes, act)
        rec.free(gate_up)
        down = rec.alloc(h_bytes, act)
        rec.free(mlp)
        x = rec.alloc(h_bytes, act)  # residual add
        rec.free(x2)
        rec.free(down)
    norm = rec.alloc(batch * hidden * dtype_bytes, act)  # final norm, last token of each request
    rec.free(x)
    logits = rec.alloc(batch * vocab * FLOAT32_BYTES, act)
    rec.free(norm)
    probs = rec.alloc(batch * vocab * FLOAT32_BYTES, "workspace")  # sampling
    rec.free(logits)
    rec.free(probs)


def _mlp_width(
    num_layers: int,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab: int,
    tied: bool,
    intermediate_size: int | None,
    param_count: int | None,
) -> int:
    if param_count is None:
        if intermediate_size is None:
            return 4 * hidden
        _check_positive_int("intermediate_size", intermediate_size)
        return intermediate_size
    if intermediate_size is not None:
        raise ValueError(
            "give intermediate_size or param_count, not both (param_count sets the MLP width)"
        )
    _check_positive_int("param_count", param_count)
    fixed = (
        vocab * hidden * (1 if tied else 2)
        + hidden
        + num_layers
        * (2 * hidden * num_heads * head_dim + 2 * hidden * num_kv_heads * head_dim + 2 * hidden)
    )
    inter = (param_count - fixed) // (3 * hidden * num_layers)
    if inter < 1:
        raise ValueError(
            f"param_count(={param_count:,}) is too small for this shape: "
            f"embeddings and attention alone hold {fixed:,} parameters"
        )
    return int(inter)


def _sample(name: str, spec: LengthSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    if isinstance(spec, (bool, np.bool_)):
        raise ValueError(f"{name}(={spec!r}) is not a token count")
    if isinstance(spec, (int, np.integer)):
        if not 1 <= spec <= MAX_TOKENS:
            raise ValueError(f"{name}(={spec!r}) must be a token count from 1 to {MAX_TOKENS:,}")
        out = np.full(n, int(spec), np.int64)
    elif isinstance(spec, tuple):
        if (
            len(spec) != 2
            or not all(
                isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
                for v in spec
            )
            or not 1 <= spec[0] <= spec[1] <= MAX_TOKENS
        ):
            raise ValueError(
                f"{name}(={spec!r}) must be an inclusive range "
                f"(low, high) with 1 <= low <= high <= {MAX_TOKENS:,}"
            )
        out = rng.integers(spec[0], spec[1] + 1, n)
    elif callable(spec):
        out = np.asarray(spec(rng, n))
        if out.shape != (n,):
            raise ValueError(f"{name}: the sampler returned shape {out.shape}, expected ({n},)")
    elif isinstance(spec, (list, np.ndarray)) and len(spec):
        out = rng.choice(np.asarray(spec), n)
    else:
        raise ValueError(
            f"{name}(={spec!r}) must be an int, a (low, high) tuple, a list of counts or f(rng, n)"
        )
    if out.dtype.kind not in "iuf" or (out.dtype.kind == "f" and not np.all(out == np.floor(out))):
        raise ValueError(f"{name}: token counts must be integers, got {out[:5]!r}")
    if out.size and not out.max() <= MAX_TOKENS:  # compared before the int64 cast, which could wrap
        raise ValueError(f"{name}: token counts must be at most {MAX_TOKENS:,}, got {out.max()!r}")
    out = out.astype(np.int64)
    if out.size and out.min() < 1:
        raise ValueError(f"{name}: token counts must be >= 1, got {int(out.min())}")
    return out


def _check_num_events(
    num_layers: int,
    max_batch: int,
    num_requests: int,
    num_prompt_chunks: int,
    num_output_tokens: int,
) -> None:
    """Refuse a trace that would hold more than ``MAX_EVENTS`` events, from a lower bound on its
    size.

    Each prompt chunk is allocated and freed once per layer; each step generates at most
    ``max_batch`` tokens and allocates and frees ``11 * layers + 4`` tensors; the weights add
    ``9 * layers + 3``. The bound never refuses a trace that would fit.
    """
    num_steps = -(-num_output_tokens // max_batch)
    at_least = (
        2 * num_layers * num_prompt_chunks
        + 2 * (_ALLOCS_PER_LAYER_STEP * num_layers + 4) * num_steps
        + 9 * num_layers
        + 3
    )
    if at_least > MAX_EVENTS:
        raise ValueError(
            f"{num_requests:,} requests of this shape make at least {at_least:,} events, "
            f"more than {MAX_EVENTS:,}; generate fewer or shorter requests"
        )


def _check_positive_int(name: str, value: Any) -> None:
    check_int(name, value)
