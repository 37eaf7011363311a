"""Session 16 (t4), issue 31: why the synthetic 10 s runs "step faster" -- the engine's slow
stretches, run by run (analysis of the 17 H200 recordings; prints Markdown).

    cd REPO && PYTHONPATH=. python benchmarks/results/s16_t4/step_noise.py [HELD_OUT.md]

HELD_OUT.md: bench_calibration.py's output for the session-15 command (default: the copy beside
this file); its held-out rows are read back to relate each pair's error to the two runs' noise.

* the floor: a 10th-percentile (quantile) regression of the duration of every decode-only step of
  <= 25 sequences under 40k KV tokens, pooled over the 17 runs: floor_ms = a + b seqs + c kKV;
  a step's excess = its duration / the floor at its composition.
* per run: median excess, share of steps > 15 % over the floor, lag-1 autocorrelation of log
  excess (stretches), GC collections while serving (the gc.csv beside the session-13/14 profiles).
* within runs: correlation of log excess with the run's state at the step (demeaned per run).
* GPU-bound steps: decode steps of 100-150 sequences over 150-260k KV tokens (60 s runs).
* pairs: log(excess of the fit's run / the judged run's) against log(1 + error) per figure.
"""

from __future__ import annotations

import glob
import os
import re
import sys

import numpy as np
import pandas as pd
from scipy.optimize import linprog

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.dirname(HERE)
SHARED = "/work/shared/data/engine"


def runs() -> dict[str, tuple[str, str]]:
    out = {}
    for d in ("engine", "engine_s13", "engine_s14"):
        for f in sorted(glob.glob(f"{RESULTS}/{d}/*_steps.csv")):
            n = os.path.basename(f)[len("transformers_cb_") : -len("_steps.csv")]
            if "best-fit" not in n and "torch-caching" not in n:
                out[n] = (d, f)
    for f in sorted(glob.glob(f"{SHARED}/*_steps.csv")):
        out[os.path.basename(f)[len("transformers_cb_") : -len("_steps.csv")]] = ("shared", f)
    return out


def quantile_fit(x: np.ndarray, y: np.ndarray, q: float) -> np.ndarray:
    """Linear quantile regression (min sum of the pinball loss) as a linear program."""
    n, p = x.shape
    c = np.r_[np.zeros(p), q * np.ones(n), (1 - q) * np.ones(n)]
    res = linprog(
        c,
        A_eq=np.c_[x, np.eye(n), -np.eye(n)],
        b_eq=y,
        bounds=[(None, None)] * p + [(0, None)] * (2 * n),
        method="highs",
    )
    return res.x[:p]


def held_out_rows(path: str) -> pd.DataFrame:
    rows = []
    for line in open(path, encoding="utf-8"):
        if not line.startswith("| calibrate steps"):
            continue
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if c[2] != "held out":
            continue
        errs = [float(x.split()[0]) for x in c[3:9]]
        rows.append((c[0].split()[-1], c[1], *errs, sum("✗" in x for x in c[3:9])))
    cols = ["fit", "judged", "ttft50", "ttft99", "tpot50", "tpot99", "e2e50", "e2e99", "misses"]
    return pd.DataFrame(rows, columns=cols)


def main() -> None:
    held = held_out_rows(sys.argv[1] if len(sys.argv) > 1 else f"{HERE}/held_out_s16_unchanged.md")
    steps = {}
    for n, (d, f) in runs().items():
        s = pd.read_csv(f)
        s["run"], s["session"], s["i"] = n, d, np.arange(len(s))
        r = pd.read_csv(f.replace("_steps.csv", "_requests.csv"))
        fin, arr = np.sort(r.finish_s.to_numpy()), np.sort(r.arrival_s.to_numpy())
        s["finished"] = np.searchsorted(fin, s.start_s.to_numpy())
        s["arrived"] = np.searchsorted(arr, s.start_s.to_numpy())
        big_end = (s.start_s + s.duration_s).where(s.num_prefill_tokens >= 2048)
        s["since_prefill_s"] = (s.start_s - big_end.ffill().shift(1)).fillna(300).clip(upper=300)
        s["run_share"] = s.start_s / s.start_s.max()
        steps[n] = s
    every = pd.concat(steps.values(), ignore_index=True)
    small = every[
        (every.num_prefill_tokens == 0)
        & (every.decode_context_tokens < 40_000)
        & (every.num_decode_seqs <= 25)
    ].copy()
    x = np.c_[np.ones(len(small)), small.num_decode_seqs, small.decode_context_tokens / 1e3]
    y = small.duration_s.to_numpy() * 1e3
    b = quantile_fit(x, y, 0.1)
    small["excess"] = y / (x @ b)
    small["log_excess"] = np.log(small.excess)
    print(
        f"floor (10th percentile, {len(small)} decode-only steps of <= 25 sequences under 40k KV "
        f"tokens, 17 runs): {b[0]:.1f} ms + {b[1]:.3f} ms a sequence + {b[2]:.3f} ms per 1k KV "
        "tokens\n"
    )

    print(
        "| run | session | small decode steps | p5 ms (1-8 seqs, < 12k KV) | median ms (same) "
        "| median excess | > 15 % over the floor | lag-1 autocorr. | GC while serving: count, "
        "longest ms | decode 9-16 seqs, 10-20k KV: median ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    per_run = {}
    for n, g in small.groupby("run", sort=False):
        d = g.session.iloc[0]
        s = steps[n]
        lo = s[
            (s.num_prefill_tokens == 0)
            & s.num_decode_seqs.between(1, 8)
            & (s.decode_context_tokens < 12_000)
        ].duration_s
        mid = s[
            (s.num_prefill_tokens == 0)
            & s.num_decode_seqs.between(9, 16)
            & s.decode_context_tokens.between(10_000, 20_000)
        ].duration_s
        gc_file = f"{RESULTS}/{d}/transformers_cb_{n}_gc.csv"
        gc_cell = "-"
        if os.path.exists(gc_file):
            t0 = pd.read_csv(gc_file.replace("_gc.csv", "_summary.csv")).t0_perf_counter_s.iloc[0]
            end = s.start_s.iloc[-1] + s.duration_s.iloc[-1]
            gc = pd.read_csv(gc_file)
            gc = gc[(gc.t_s - t0 >= 0) & (gc.t_s - t0 <= end)]
            gens = ",".join(str(int(v)) for v in sorted(gc.generation.unique()))
            gc_cell = f"{len(gc)} (gen {gens}), {1e3 * gc.duration_s.max():.1f}"
        per_run[n] = g.excess.median()
        mid_cell = f"{1e3 * mid.median():.0f}" if len(mid) else "-"
        print(
            f"| {n} | {d} | {len(g)} | {1e3 * lo.quantile(0.05):.0f} | {1e3 * lo.median():.0f} "
            f"| {g.excess.median():.2f} | {100 * (g.excess > 1.15).mean():.0f} % "
            f"| {g.log_excess.autocorr(1):.2f} | {gc_cell} | {mid_cell} |"
        )

    cols = ["since_prefill_s", "finished", "arrived", "run_share", "i", "num_decode_seqs",
            "decode_context_tokens"]  # fmt: skip
    pooled = small[cols + ["log_excess"]].corr()["log_excess"]
    within = small[cols + ["log_excess"]] - small.groupby("run")[cols + ["log_excess"]].transform(
        "mean"
    )
    within = within.corr()["log_excess"]
    print("\n| state at the step | corr. with log excess, pooled | within runs (demeaned) |")
    print("|---|---|---|")
    for c in cols:
        print(f"| {c} | {pooled[c]:+.2f} | {within[c]:+.2f} |")

    print(
        "\n| 60 s run | median excess of its small steps | GPU-bound decode steps "
        "(100-150 seqs, 150-260k KV) | median ms | median KV | us per KV token |"
    )
    print("|---|---|---|---|---|---|")
    for n, s in steps.items():
        if not re.match(r"synth_mixed_60s", n):
            continue
        m = (
            (s.num_prefill_tokens == 0)
            & s.num_decode_seqs.between(100, 150)
            & s.decode_context_tokens.between(150e3, 260e3)
        )
        g = s[m]
        print(
            f"| {n} | {per_run[n]:.2f} | {len(g)} | {1e3 * g.duration_s.median():.0f} "
            f"| {g.decode_context_tokens.median() / 1e3:.0f}k "
            f"| {1e6 * np.median(g.duration_s / g.decode_context_tokens):.2f} |"
        )

    held["log_ratio"] = np.log(held.fit.map(per_run) / held.judged.map(per_run))
    print(
        "\n| judged runs | pairs | corr(log excess ratio fit / judged, log(1 + error)): "
        "TTFT p50 | TPOT p50 | TPOT p99 | e2e p50 | e2e p99 |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, sel in (
        ("synthetic 10 s", held.judged.str.contains("_10s_")),
        ("Azure code", held.judged.str.startswith("azure")),
        ("synthetic 60 s", held.judged.str.contains("synth_mixed_60s")),
    ):
        h = held[sel]
        cells = " | ".join(
            f"{np.corrcoef(h.log_ratio, np.log1p(h[c] / 100))[0, 1]:+.2f}"
            for c in ("ttft50", "tpot50", "tpot99", "e2e50", "e2e99")
        )
        print(f"| {label} | {len(h)} | {cells} |")

    ten = held[held.judged.str.contains("_10s_") & ~held.fit.str.contains("_10s_")]
    print(
        "\n| fit (Azure or 60 s) | its median excess | misses on the three 10 s runs (of 18) "
        "| mean TPOT p50 error | mean e2e p50 error |"
    )
    print("|---|---|---|---|---|")
    t = ten.groupby("fit").agg(
        misses=("misses", "sum"), tpot=("tpot50", "mean"), e2e=("e2e50", "mean")
    )
    t["excess"] = t.index.map(per_run)
    for n, r in t.sort_values("excess").iterrows():
        print(f"| {n} | {r.excess:.2f} | {r.misses:.0f} | {r.tpot:+.0f} % | {r.e2e:+.0f} % |")
    tens = ", ".join(f"{n[-1]} {per_run[n]:.2f}" for n in per_run if "_10s_" in n)
    print(f"\n(the 10 s runs' own median excess: {tens})")


if __name__ == "__main__":
    main()
