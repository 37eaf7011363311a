"""Why step fits do not carry between small and large decode batches (issue 31, session 13): an
analysis.

    python benchmarks/steptime/decode_regimes.py [STEPS.csv ...]

Over the decode-only steps of each engine step profile (default: every recording in
``benchmarks/results/engine*`` and ``../shared/data/engine``, the allocator comparisons left out),
fits ``fixed + per_seq * n + per_kv * kv + per_query_kv * g(n) * kv`` (``n`` decoding sequences,
``kv`` their context tokens) by NNLS on relative error, once with ``g(n) = n`` (the shipped
model's query x KV cross term, ``sim.serving.step_fit``), once with ``g(n) = min(n, N0)`` (an
attention cost per query that stops growing once the batch fills the GPU), and once with the
cross term replaced by ``max(kv - K0, 0)`` (``per_exposed_kv_token_s``: KV tokens past those the
kernel launches hide, ``K0`` chosen per run among its KV counts' quantiles), and prints each fit's
per-run terms and its error on every other run (median over steps of predicted / measured - 1).
Prints Markdown; nothing here feeds the simulator.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import nnls

REPO = Path(__file__).resolve().parents[2]
LEFT_OUT = ("best-fit", "torch-caching")  # another allocator, not a repeat of the engine's own


def decode_steps(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, kv, duration_s) of the decode-only steps, the first step (a possible warm-up) left
    out."""
    d = pd.read_csv(path)
    d = d[(d.num_prefill_seqs == 0) & (d.num_decode_seqs > 0)].iloc[1:]
    return (
        d.num_decode_seqs.to_numpy(float),
        d.decode_context_tokens.to_numpy(float),
        d.duration_s.to_numpy(),
    )


def features(
    n: np.ndarray, kv: np.ndarray, n0: float | None, k0: float | None = None
) -> np.ndarray:
    """The four columns; with ``k0`` the last is the exposed KV, ``max(kv - k0, 0)``."""
    if k0 is not None:
        cross = np.maximum(kv - k0, 0)
    else:
        cross = kv * (n if n0 is None else np.minimum(n, n0))
    return np.column_stack([np.ones_like(n), n, kv, cross])


def fit_exposed(n: np.ndarray, kv: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """``(coefficients, K0)``: the fit of the exposed-KV model whose K0 misses least."""
    best = None
    for k0 in np.unique(np.round(np.quantile(kv, np.linspace(0.05, 0.9, 18)))):
        c = fit(n, kv, y, None, k0)
        rel = features(n, kv, None, k0) @ c / y - 1
        loss = float(np.sum(np.minimum(rel**2, 0.25)))
        if best is None or loss < best[0]:
            best = (loss, c, float(k0))
    return best[1], best[2]


def fit(
    n: np.ndarray, kv: np.ndarray, y: np.ndarray, n0: float | None, k0: float | None = None
) -> np.ndarray:
    """NNLS on relative error, then once more without the steps 50 % off (pauses)."""
    x = features(n, kv, n0, k0)
    a = x / y[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1
    keep = np.ones(len(y), bool)
    for _ in range(2):
        coef, _ = nnls(a[keep] / scale, np.ones(keep.sum()))
        coef = coef / scale
        keep = np.abs(x @ coef / y - 1) < 0.5
    return coef


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or [
        p
        for p in sorted(REPO.glob("benchmarks/results/engine*/*_steps.csv"))
        + sorted((REPO.parent / "shared" / "data" / "engine").glob("*_steps.csv"))
        if not any(t in p.name for t in LEFT_OUT)
    ]
    runs = {p.name.removeprefix("transformers_cb_").removesuffix("_steps.csv"): p for p in paths}
    data = {name: decode_steps(p) for name, p in runs.items()}
    for n0 in (None, 32, "exposed"):
        exposed = n0 == "exposed"
        label = (
            "max(kv - K0, 0) in place of the cross term"
            if exposed
            else ("g(n) = n" if n0 is None else f"g(n) = min(n, {n0})")
        )
        last = "per exposed KV token ns | K0" if exposed else "per query x KV ps"
        print(
            f"\n{label}\n\n| fitted on | batch | fixed ms | per seq ms | "
            f"per KV token ns | {last} | error on the other runs (median per run) |\n"
            "|---|---|---|---|---|---|---|" + ("---|" if exposed else "")
        )
        held = []
        for name, (n, kv, y) in data.items():
            if exposed:
                c, k0 = fit_exposed(n, kv, y)
                cols = lambda m, k, k0=k0: features(m, k, None, k0)  # noqa: E731
            else:
                c = fit(n, kv, y, n0)
                cols = lambda m, k, n0=n0: features(m, k, n0)  # noqa: E731
            errs = {
                other: float(np.median(cols(*data[other][:2]) @ c / data[other][2] - 1))
                for other in data
                if other != name
            }
            held += [abs(e) for e in errs.values()]
            worst = max(errs, key=lambda k: abs(errs[k]))
            print(
                f"| {name} | {int(n.min())}-{int(n.max())} | {c[0] * 1e3:.1f} | {c[1] * 1e3:.2f} "
                f"| {c[2] * 1e9:.0f} | "
                + (f"{c[3] * 1e9:.0f} | {k0:,.0f}" if exposed else f"{c[3] * 1e12:.1f}")
                + f" | median {100 * np.median(list(map(abs, errs.values()))):.0f} %, "
                f"worst {worst} {100 * errs[worst]:+.0f} % |"
            )
        print(
            f"\nall pairs: median {100 * np.median(held):.1f} %, "
            f"p90 {100 * np.quantile(held, 0.9):.1f} %, max {100 * max(held):.1f} %"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
