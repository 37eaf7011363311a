"""The Llama-3-8B-shaped forward pass the step-time scripts of this folder time on a GPU.

One place for the shape, the weights, the CUDA-event timer, CUDA-graph capture and the eager
decode step that ``measure.py`` (the calibration of ``sim/data/calibration_default.json``),
``measure2.py`` (decode-side kernels) and ``measure_grid.py`` (the validation grid) share: random
bf16 weights, 32 layers, cuBLAS matmuls, decode attention as plain matmul + softmax over a dense
``[batch, kv_heads, context, head_dim]`` cache. Needs torch with CUDA when called; importing it
needs only torch.
"""

import torch
import torch.nn.functional as F

#: layers, query heads, KV heads, head dim, hidden size, MLP size, vocabulary (Llama-3-8B)
L, H, KV, HD, D, I, V = 32, 32, 8, 128, 4096, 14336, 128256
dev, dt = "cuda", torch.bfloat16


def timeit(fn, iters=20, warm=3):
    """Median seconds of ``iters`` calls of ``fn`` by CUDA events, after ``warm`` untimed calls."""
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


def graphed(fn):
    """``fn`` captured as a CUDA graph (two warm-up calls on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def w(*shape):
    """A random bf16 weight on the GPU, scaled as an initialised layer's."""
    return torch.randn(*shape, device=dev, dtype=dt) * 0.02


def make_model():
    """``(layers, emb, head, nf)``: the layers' weights (dicts), embedding, LM head, final norm."""
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
    return layers, w(V, D), w(V, D), torch.ones(D, device=dev, dtype=dt)


def weight_bytes(model) -> int:
    layers, emb, head, _ = model
    return sum(t.numel() * 2 for l in layers for t in l.values()) + (emb.numel() + head.numel()) * 2


def mlp(l, x):
    gu = F.linear(F.rms_norm(x, (D,), l["n2"]), l["gu"])
    g_, u = gu.chunk(2, -1)
    return F.linear(F.silu(g_) * u, l["down"])


def decode_step(model, tok, kc, vc, C):
    """One eager decode step: ``tok`` [B]; ``kc``/``vc`` per layer [B, KV, C+1, HD]; each sequence
    attends to its C cached tokens and itself (slot C written). Returns the greedy next tokens."""
    layers, emb, head, nf = model
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
