"""Record PyTorch memory snapshots of what inference servers run (issue 14's fixtures).

Run on a CUDA machine with torch: ``python benchmarks/record/record_snapshots.py --out DIR``.
Each scenario runs in its own process (allocator settings are read at CUDA start) and writes
``DIR/<scenario>.pickle.gz`` (``torch.cuda.memory._snapshot()``, recorded with
``_record_memory_history(context=None)`` after the weights are loaded, as the bundled snapshot
was) and ``DIR/<scenario>.json`` (torch's own counters: peak reserved and allocated bytes,
segment counts, the settings, timings) as ground truth for ``poollab fidelity``.

Scenarios (a small Llama-shaped decoder written in torch ops, random bf16 weights):
- ``graphs``: an engine's pattern (vLLM/SGLang): a static KV cache, one CUDA graph of the
  decode step per batch size, captured largest first into ONE shared private pool
  (``torch.cuda.graph_pool_handle()``), then eager prefills of 1-4 requests between replays.
- ``compile``: ``torch.compile(mode="reduce-overhead")`` decode (CUDA-graph trees, their own
  private pool) over several batch sizes, eager prefill between.
- ``expandable``: eager generation with a growing (concatenated) KV cache under
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (records segment_map/segment_unmap).
- ``static_empty_cache``: eager generation with a static cache, then ``torch.cuda.empty_cache()``
  before a graph capture on a side stream (what precedes capture in a server), then replays.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import subprocess
import sys
import time

SCENARIOS = ("graphs", "compile", "expandable", "static_empty_cache")
# model shape: small enough for small snapshots, large enough for 2-20 MiB activations
LAYERS, D, H, KV, HD, FF, VOCAB, MAX_CTX = 6, 1024, 16, 4, 64, 2816, 32000, 1024


def _model(torch):
    F = torch.nn.functional
    dt, dev = torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02

    layers = [
        dict(
            qkv=w((H + 2 * KV) * HD, D),
            o=w(D, H * HD),
            gu=w(2 * FF, D),
            down=w(D, FF),
            n1=torch.ones(D, device=dev, dtype=dt),
            n2=torch.ones(D, device=dev, dtype=dt),
        )
        for _ in range(LAYERS)
    ]
    emb, head, nf = w(VOCAB, D), w(VOCAB, D), torch.ones(D, device=dev, dtype=dt)

    def block(l, x, k_all, v_all, mask):
        # x [B, T, D]; k_all/v_all [B, KV, S, HD]; mask [B or 1, 1, T, S] additive
        B, T, _ = x.shape
        qkv = F.linear(F.rms_norm(x, (D,), l["n1"]), l["qkv"])
        q, k, v = qkv.split([H * HD, KV * HD, KV * HD], -1)
        q = q.view(B, T, H, HD).transpose(1, 2)
        att = F.scaled_dot_product_attention(
            q,
            k_all.repeat_interleave(H // KV, 1),
            v_all.repeat_interleave(H // KV, 1),
            attn_mask=mask,
        )
        x = x + F.linear(att.transpose(1, 2).reshape(B, T, H * HD), l["o"])
        gu = F.linear(F.rms_norm(x, (D,), l["n2"]), l["gu"])
        a, b = gu.chunk(2, -1)
        return (
            x + F.linear(F.silu(a) * b, l["down"]),
            k.view(B, T, KV, HD).transpose(1, 2),
            v.view(B, T, KV, HD).transpose(1, 2),
        )

    def forward_cat(tokens, cache):
        """Eager step with a growing cache (list of (k, v) per layer, concatenated)."""
        x = emb[tokens]
        B, T = tokens.shape
        new = []
        for i, l in enumerate(layers):
            k0, v0 = cache[i] if cache else (None, None)
            # project once to get this step's k, v, then attend over cat(cache, new)
            qkv = F.linear(F.rms_norm(x, (D,), l["n1"]), l["qkv"])
            _, k, v = qkv.split([H * HD, KV * HD, KV * HD], -1)
            k = k.view(B, T, KV, HD).transpose(1, 2)
            v = v.view(B, T, KV, HD).transpose(1, 2)
            k_all = k if k0 is None else torch.cat([k0, k], 2)
            v_all = v if v0 is None else torch.cat([v0, v], 2)
            S = k_all.shape[2]
            mask = torch.full((T, S), float("-inf"), device=x.device, dtype=x.dtype).triu(
                S - T + 1
            )[None, None]
            x, _, _ = block(l, x, k_all, v_all, mask)
            new.append((k_all, v_all))
        return F.linear(F.rms_norm(x[:, -1], (D,), nf), head), new

    def forward_static(tokens, pos, kc, vc):
        """One step with a static cache kc/vc [L][B, KV, MAX_CTX, HD]; tokens [B, T] at positions
        pos [B] onward."""
        x = emb[tokens]
        B, T = tokens.shape
        idx = pos[:, None] + torch.arange(T, device=x.device)[None]  # [B, T]
        cols = torch.arange(MAX_CTX, device=x.device)
        mask = torch.where(cols[None, None, :] <= idx[:, :, None], 0.0, float("-inf")).to(x.dtype)[
            :, None
        ]
        for i, l in enumerate(layers):
            qkv = F.linear(F.rms_norm(x, (D,), l["n1"]), l["qkv"])
            _, k, v = qkv.split([H * HD, KV * HD, KV * HD], -1)
            bi = torch.arange(B, device=x.device)[:, None].expand(B, T)
            kc[i][bi, :, idx] = k.view(B, T, KV, HD)
            vc[i][bi, :, idx] = v.view(B, T, KV, HD)
            x, _, _ = block(l, x, kc[i], vc[i], mask)
        return F.linear(F.rms_norm(x[:, -1], (D,), nf), head)

    return forward_cat, forward_static


def _static_cache(torch, batch):
    shape = (batch, KV, MAX_CTX, HD)
    return (
        [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)],
        [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)],
    )


def run_scenario(name: str, out_dir: str) -> None:
    if name == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    torch.manual_seed(0)
    fwd_cat, fwd_static = _model(torch)
    rng = torch.Generator().manual_seed(1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(context=None, max_entries=2_000_000)
    t0 = time.perf_counter()
    max_batch = 64
    notes: dict = {}
    with torch.no_grad():
        if name in ("graphs", "compile"):
            kc, vc = _static_cache(torch, max_batch)
            tok = torch.zeros(max_batch, 1, dtype=torch.long, device="cuda")
            pos = torch.zeros(max_batch, dtype=torch.long, device="cuda")
            sizes = [64, 48, 32, 16, 8, 4, 2, 1]
            if name == "graphs":
                pool = torch.cuda.graph_pool_handle()
                graphs, outs = {}, {}
                for bs in sizes:  # largest first, one shared pool
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):  # warm-up on a side stream, as vLLM does
                        fwd_static(tok[:bs], pos[:bs], [k[:bs] for k in kc], [v[:bs] for v in vc])
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        outs[bs] = fwd_static(
                            tok[:bs], pos[:bs], [k[:bs] for k in kc], [v[:bs] for v in vc]
                        )
                    graphs[bs] = g
                decode = lambda bs: graphs[bs].replay()
            else:
                # the cache lives in module buffers: cudagraph trees skip graphs whose plain inputs
                # are mutated, but allow mutation of buffers (static inputs), as a served model has
                class Decoder(torch.nn.Module):
                    def __init__(self):
                        super().__init__()
                        for i in range(LAYERS):
                            self.register_buffer(f"k{i}", kc[i])
                            self.register_buffer(f"v{i}", vc[i])

                    def forward(self, t, p):
                        bs = t.shape[0]
                        return fwd_static(
                            t,
                            p,
                            [getattr(self, f"k{i}")[:bs] for i in range(LAYERS)],
                            [getattr(self, f"v{i}")[:bs] for i in range(LAYERS)],
                        )

                step = torch.compile(Decoder(), mode="reduce-overhead", dynamic=False)
                decode = lambda bs: step(tok[:bs], pos[:bs])
            # serve: eager prefill of 1-4 requests, then decode steps at a batch size
            for it in range(12):
                n = int(torch.randint(1, 5, (1,), generator=rng))
                plen = int(torch.randint(32, 400, (1,), generator=rng))
                prompt = torch.randint(0, VOCAB, (n, plen), device="cuda")
                fwd_static(
                    prompt,
                    torch.zeros(n, dtype=torch.long, device="cuda"),
                    [k[:n] for k in kc],
                    [v[:n] for v in vc],
                )
                bs = sizes[int(torch.randint(0, len(sizes), (1,), generator=rng))]
                for _ in range(int(torch.randint(4, 16, (1,), generator=rng))):
                    decode(bs)
                    pos[:bs] += 1
                pos.clamp_(max=MAX_CTX - 1)
            notes["batch_sizes"] = sizes
        elif name == "expandable":
            for it in range(6):
                b = int(torch.randint(1, 9, (1,), generator=rng))
                plen = int(torch.randint(64, 700, (1,), generator=rng))
                tokens = torch.randint(0, VOCAB, (b, plen), device="cuda")
                logits, cache = fwd_cat(tokens, None)
                for _ in range(int(torch.randint(16, 65, (1,), generator=rng))):
                    logits, cache = fwd_cat(logits.argmax(-1, keepdim=True), cache)
                del cache, logits
            notes["generations"] = 6
        elif name == "static_empty_cache":
            for it in range(3):
                b = int(torch.randint(1, 9, (1,), generator=rng))
                kc, vc = _static_cache(torch, b)
                plen = int(torch.randint(64, 500, (1,), generator=rng))
                p = torch.zeros(b, dtype=torch.long, device="cuda")
                logits = fwd_static(torch.randint(0, VOCAB, (b, plen), device="cuda"), p, kc, vc)
                p += plen
                for _ in range(int(torch.randint(16, 48, (1,), generator=rng))):
                    logits = fwd_static(logits.argmax(-1, keepdim=True), p, kc, vc)
                    p += 1
                del kc, vc, logits
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # what a server does before capture
            notes["empty_cache_at_s"] = time.perf_counter() - t0
            b = 8
            kc, vc = _static_cache(torch, b)
            tok = torch.zeros(b, 1, dtype=torch.long, device="cuda")
            p = torch.full((b,), 100, dtype=torch.long, device="cuda")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fwd_static(tok, p, kc, vc)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                _out = fwd_static(
                    tok, p, kc, vc
                )  # the captured output, held while the graph replays
            for _ in range(20):
                g.replay()
                p += 1
        torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    meta = {
        "scenario": name,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
        "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
        "num_segment_allocs": stats.get("segment.all.allocated"),
        "num_segment_frees": stats.get("segment.all.freed"),
        "num_alloc_retries": stats.get("num_alloc_retries"),
        "seconds": time.perf_counter() - t0,
        "trace_entries": sum(len(t) for t in snap["device_traces"]),
        "segment_pool_ids": sorted({str(s.get("segment_pool_id")) for s in snap["segments"]}),
        **notes,
    }
    with gzip.open(os.path.join(out_dir, f"{name}.pickle.gz"), "wb", compresslevel=9) as f:
        pickle.dump(snap, f)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=SCENARIOS, action="append")
    ap.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.scenario:
        run_scenario(args.scenario, args.out)
        return
    failed = []
    for name in args.only or SCENARIOS:
        rc = subprocess.call([sys.executable, __file__, "--out", args.out, "--scenario", name])
        if rc:
            failed.append(name)
            print(f"scenario {name} failed with exit status {rc}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
