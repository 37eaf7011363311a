"""Step times of a Llama-3-8B-shaped forward pass over a grid, for validating sim.serving.steptime.

    OUT=/some/folder python benchmarks/steptime/measure_grid.py      # on the GPU; writes
    $OUT/steptime_grid.csv

The same model and kernels (``llama8b.py``) as ``measure.py`` (the calibration of
``sim/data/calibration_default.json``): random bf16 weights, 32 layers, cuBLAS matmuls; decode steps
replayed as CUDA graphs (attention as plain matmul + softmax over a dense [batch, kv_heads, context,
head_dim] cache); prefill chunks eager with SDPA (flash) attention, causal to the chunk and open to
the cached context before it (``causal_lower_right``). Every point is the median of CUDA-event-timed
repeats.

Grid (points whose KV would pass ``MAX_KV_TOKENS`` are skipped and listed as skipped):

- decode: batch 1, 4, 16, 64, 128, 256 x context per sequence 128, 512, 2k, 8k, 32k;
- prefill: one sequence, chunk 256, 1k, 2k, 4k, 8k tokens x cached context 0, 2k, 8k, 24k.

Runtime stays under 4 minutes on an H200 (``BUDGET_S``, or ``STEPTIME_BUDGET_S`` seconds from
the environment, stops the grid early, keeping every point already written). One CSV row per
point (``COLUMNS``), flushed as it is measured, so an interrupted run still leaves its points.
``validate.py`` reads the CSV.
"""

import csv
import os
import sys
import time

import torch
import torch.nn.functional as F
from llama8b import D, H, HD, KV, L, V, decode_step, dev, dt, graphed, make_model, mlp, timeit

COLUMNS = [
    "kind",
    "batch",
    "context_tokens",
    "prefill_tokens",
    "measured_s",
    "repeats",
    "gpu",
    "torch",
]
DECODE_BATCHES = (1, 4, 16, 64, 128, 256)
DECODE_CONTEXTS = (128, 512, 2048, 8192, 32768)
PREFILL_CHUNKS = (256, 1024, 2048, 4096, 8192)
PREFILL_CONTEXTS = (0, 2048, 8192, 24576)
MAX_KV_TOKENS = (
    1 << 19
)  # 512k cached tokens: 64 GiB of bf16 KV for this shape, beside 16 GB of weights
BUDGET_S = float(os.environ.get("STEPTIME_BUDGET_S", 210.0))  # a shorter smoke run: the env


def main():
    t0 = time.perf_counter()
    torch.manual_seed(0)
    out_dir = os.environ.get("OUT", ".")
    path = os.path.join(out_dir, "steptime_grid.csv")
    model = make_model()
    layers, emb, head, nf = model
    from torch.nn.attention.bias import causal_lower_right

    def attend(q, k, v, mask):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        except (TypeError, RuntimeError):  # a torch whose CausalBias does not take enable_gqa
            rep = H // KV
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask
            )

    def prefill(tok, kc, vc, C):
        # kc/vc per layer [1, KV, C + N, HD]: C cached tokens, then this chunk's N written in place.
        N = tok.shape[0]
        x = emb[tok]
        mask = causal_lower_right(N, C + N) if C else None
        for i, l in enumerate(layers):
            qkv = F.linear(F.rms_norm(x, (D,), l["n1"]), l["qkv"])
            q, k, v = qkv.split([H * HD, KV * HD, KV * HD], -1)
            q = q.view(1, N, H, HD).transpose(1, 2)
            kc[i][:, :, C:] = k.view(1, N, KV, HD).transpose(1, 2)
            vc[i][:, :, C:] = v.view(1, N, KV, HD).transpose(1, 2)
            a = attend(q, kc[i], vc[i], mask)
            x = x + F.linear(a.transpose(1, 2).reshape(N, H * HD), l["o"])
            x = x + mlp(l, x)
        return F.linear(F.rms_norm(x[-1:], (D,), nf), head).float().argmax(-1)

    gpu, tv = torch.cuda.get_device_name(), torch.__version__
    skipped = []
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(COLUMNS)

        def record(kind, batch, context, prefill_tokens, seconds, repeats):
            out.writerow([kind, batch, context, prefill_tokens, f"{seconds:.6e}", repeats, gpu, tv])
            fh.flush()
            print(
                f"{kind:8s} batch {batch:4d} context {context:6d} prefill {prefill_tokens:5d}: "
                f"{seconds * 1e3:9.3f} ms  [{time.perf_counter() - t0:6.1f} s]",
                flush=True,
            )

        for C in PREFILL_CONTEXTS:
            for N in PREFILL_CHUNKS:
                if time.perf_counter() - t0 > BUDGET_S:
                    skipped.append(("prefill", 1, C, N, "time budget"))
                    continue
                try:
                    kc = [torch.zeros(1, KV, C + N, HD, device=dev, dtype=dt) for _ in range(L)]
                    vc = [torch.zeros(1, KV, C + N, HD, device=dev, dtype=dt) for _ in range(L)]
                    tok = torch.randint(0, V, (N,), device=dev)
                    reps = 5 if N * (C + N) > 1 << 26 else 8
                    with torch.no_grad():
                        record(
                            "prefill",
                            1,
                            C,
                            N,
                            timeit(lambda: prefill(tok, kc, vc, C), reps, 2),
                            reps,
                        )
                    del kc, vc
                except torch.OutOfMemoryError as exc:
                    skipped.append(("prefill", 1, C, N, repr(exc)[:80]))
                torch.cuda.empty_cache()
        for B in DECODE_BATCHES:
            for C in DECODE_CONTEXTS:
                if B * C > MAX_KV_TOKENS:
                    skipped.append(("decode", B, C, 0, f"{B * C:,} KV tokens > {MAX_KV_TOKENS:,}"))
                    continue
                if time.perf_counter() - t0 > BUDGET_S:
                    skipped.append(("decode", B, C, 0, "time budget"))
                    continue
                try:
                    kc = [torch.zeros(B, KV, C + 1, HD, device=dev, dtype=dt) for _ in range(L)]
                    vc = [torch.zeros(B, KV, C + 1, HD, device=dev, dtype=dt) for _ in range(L)]
                    tok = torch.randint(0, V, (B,), device=dev)
                    with torch.no_grad():
                        graph = graphed(lambda: decode_step(model, tok, kc, vc, C))
                        record("decode", B, C, 0, timeit(graph.replay, 15, 3), 15)
                    del kc, vc, graph
                except torch.OutOfMemoryError as exc:
                    skipped.append(("decode", B, C, 0, repr(exc)[:80]))
                torch.cuda.empty_cache()
    for kind, b, c, n, why in skipped:
        print(f"skipped {kind} batch {b} context {c} prefill {n}: {why}")
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("measure_grid.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main())
