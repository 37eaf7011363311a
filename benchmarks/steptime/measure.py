"""Measure a Llama-3-8B-shaped forward pass on this GPU to calibrate sim.serving.steptime (results:
sim/data/calibration_default.json)."""

import json, os
import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = "cuda"
dt = torch.bfloat16
L, H, KV, HD, D, I, V = 32, 32, 8, 128, 4096, 14336, 128256
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
OUT = os.environ.get("OUT", ".")


def timeit(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return times[len(times) // 2]


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
def w(*shape):
    return torch.randn(*shape, device=dev, dtype=dt) * 0.02


layers = [
    dict(
        qkv=w((H + 2 * KV) * HD, D),
        o=w(D, H * HD),
        gu=w(2 * I, D),
        down=w(D, I),
        n1=torch.ones(D, device=dev, dtype=dt),
        n2=torch.ones(D, device=dev, dtype=dt),
    )
    for _ in range(L)
]
emb = w(V, D)
head = w(V, D)
nf = torch.ones(D, device=dev, dtype=dt)
print(
    "weights GB",
    sum(t.numel() * 2 for l in layers for t in l.values()) / 1e9 + 2 * V * D * 2 / 1e9,
    flush=True,
)


def mlp(l, x):
    gu = F.linear(F.rms_norm(x, (D,), l["n2"]), l["gu"])
    g_, u = gu.chunk(2, -1)
    return F.linear(F.silu(g_) * u, l["down"])


def decode_step(tok, kc, vc, C):
    # tok [B]; kc/vc per layer [B, KV, C+1, HD]; attends to C cached + itself (slot C written).
    x = emb[tok]
    B = x.shape[0]
    for i, l in enumerate(layers):
        qkv = F.linear(F.rms_norm(x, (D,), l["n1"]), l["qkv"])
        q, k, v = qkv.split([H * HD, KV * HD, KV * HD], -1)
        kc[i][:, :, C] = k.view(B, KV, HD)
        vc[i][:, :, C] = v.view(B, KV, HD)
        qg = q.view(B, KV, H // KV, HD)
        s = torch.matmul(qg, kc[i].transpose(-1, -2)) * (HD**-0.5)  # [B, KV, G, C+1]
        p = torch.softmax(s.float(), -1).to(dt)
        a = torch.matmul(p, vc[i]).reshape(B, H * HD)
        x = x + F.linear(a, l["o"])
        x = x + mlp(l, x)
    return F.linear(F.rms_norm(x, (D,), nf), head).float().argmax(-1)


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
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    decode_step(tok, kc, vc, C)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode_step(tok, kc, vc, C)
            t_graph = timeit(graph.replay, iters=20)
            t_eager = timeit(lambda: decode_step(tok, kc, vc, C), iters=5, warm=1)
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
