"""Measure a Llama-3-8B-shaped forward pass on this GPU to calibrate sim.serving.steptime (results:
sim/data/calibration_default.json)."""

import json, os
import torch
import torch.nn.functional as F

from llama8b import (
    D,
    H,
    HD,
    KV,
    L,
    V,
    decode_step,
    dev,
    dt,
    graphed,
    make_model,
    mlp,
    timeit,
    weight_bytes,
)

torch.manual_seed(0)
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
OUT = os.environ.get("OUT", ".")


# 1. ceilings
a = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
b = torch.empty_like(a)
t = timeit(lambda: b.copy_(a))
res["d2d_copy_TBps_rw"] = 2 * a.numel() / t / 1e12
del a, b
x = torch.randn(8192, 8192, device=dev, dtype=dt)
y = torch.randn(8192, 8192, device=dev, dtype=dt)
t = timeit(lambda: x @ y, iters=10)
res["gemm_8192_TFLOPs"] = 2 * 8192**3 / t / 1e12
del x, y
h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
g = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
res["h2d_GBps"] = (1 << 30) / timeit(lambda: g.copy_(h, non_blocking=True), iters=10) / 1e9
res["d2h_GBps"] = (1 << 30) / timeit(lambda: h.copy_(g, non_blocking=True), iters=10) / 1e9
del h, g
print(res, flush=True)


# 2. model
model = make_model()
layers, emb, head, nf = model
print("weights GB", weight_bytes(model) / 1e9, flush=True)


def prefill(tok, P=0):
    N = tok.shape[0]
    x = emb[tok]
    for l in layers:
        qkv = F.linear(F.rms_norm(x, (D,), l["n1"]), l["qkv"])
        q, k, v = qkv.split([H * HD, KV * HD, KV * HD], -1)
        q = q.view(1, N, H, HD).transpose(1, 2)
        k = k.view(1, N, KV, HD).transpose(1, 2)
        v = v.view(1, N, KV, HD).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(a.transpose(1, 2).reshape(N, H * HD), l["o"])
        x = x + mlp(l, x)
    return F.linear(F.rms_norm(x[-1:], (D,), nf), head).float().argmax(-1)


pre = {}
for N in (128, 512, 2048, 8192):
    tok = torch.randint(0, V, (N,), device=dev)
    with torch.no_grad():
        pre[N] = timeit(lambda: prefill(tok), iters=8, warm=2)
    print("prefill", N, pre[N] * 1e3, "ms", flush=True)
res["prefill_s"] = pre

dec = {}
for B, C in (
    (1, 128),
    (1, 4096),
    (8, 1024),
    (32, 1024),
    (64, 2048),
    (128, 1024),
    (256, 512),
    (256, 2048),
    (512, 128),
    (1024, 128),
):
    try:
        kc = [torch.zeros(B, KV, C + 1, HD, device=dev, dtype=dt) for _ in range(L)]
        vc = [torch.zeros(B, KV, C + 1, HD, device=dev, dtype=dt) for _ in range(L)]
        tok = torch.randint(0, V, (B,), device=dev)
        with torch.no_grad():
            graph = graphed(lambda: decode_step(model, tok, kc, vc, C))
            t_graph = timeit(graph.replay, iters=20)
            t_eager = timeit(lambda: decode_step(model, tok, kc, vc, C), iters=5, warm=1)
        dec[f"{B}x{C}"] = {"graph_s": t_graph, "eager_s": t_eager}
        print("decode", B, C, t_graph * 1e3, "ms graph", t_eager * 1e3, "ms eager", flush=True)
        del kc, vc, graph
        torch.cuda.empty_cache()
    except Exception as e:  # keep the other points
        print("decode", B, C, "failed", repr(e)[:200], flush=True)
        torch.cuda.empty_cache()
res["decode"] = dec
json.dump(res, open(os.path.join(OUT, "calib.json"), "w"), indent=1)
print(json.dumps(res), flush=True)
