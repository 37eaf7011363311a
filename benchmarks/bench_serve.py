"""Record the engine step profiles and request tables (issue 31) and the start-up snapshot (issue
34) with ``poollab gpu serve``, and time ``gpu serve`` under PyTorch's allocator against policies.

Run on the GPU machine from the repository root::

    python benchmarks/bench_serve.py record NAME... --out DIR [--bundle FILE] [--budget-s S]
    python benchmarks/bench_serve.py list

Each NAME is one ``gpu serve`` run of ``RUNS`` (trace, load, policies, options): its result folder
goes to ``DIR/NAME``; after each run everything under DIR is packed into ``--bundle`` (a .tar.gz),
so a run cut short by a time limit still leaves the earlier ones. With ``--budget-s`` the runs share
that many seconds: each gets its own limit or what is left, whichever is less, and a run with under
30 s left is skipped (named in the output). Settings are those of the shared recordings
(``../shared/data/engine``): Llama-3-8B's shape, random bf16 weights, 256-token blocks,
``max_batch_tokens`` 8192, 1,024 sequences, the KV cache as the engine sizes it.

The higher loads serve the same requests denser: ``--rate-scale 2 --duration 30`` takes the arrivals
of the first 60 s of the trace at twice the rate.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

AZURE = "traces/data/azure_code_slice.csv"
# ../shared/data/engine/synth_mixed_60s.csv, copied into the carried tree
SYNTH = ".data/synth_mixed_60s.csv"

#: name -> (trace, gpu serve options, time limit in seconds); policies: -p options, default pytorch
RUNS: dict[str, tuple[str, list[str], int]] = {
    "azure_code_60s_x1_a": (AZURE, ["--duration", "60", "--snapshot"], 240),
    "azure_code_60s_x1_b": (AZURE, ["--duration", "60"], 240),
    "azure_code_60s_x2": (AZURE, ["--duration", "30", "--rate-scale", "2"], 240),
    # session 13's repeats (issue 31: the engine's run-to-run spread per condition, cold starts),
    # each about 60-75 s with the engine's start, so a 9-minute device call holds seven
    "azure_code_60s_x2_b": (AZURE, ["--duration", "30", "--rate-scale", "2"], 100),
    "azure_code_60s_x2_c": (AZURE, ["--duration", "30", "--rate-scale", "2"], 100),
    # cold: no warm-up before the trace, as the shared recordings started (their first step 1.4-1.6
    # s)
    "azure_code_60s_x1_cold_b": (AZURE, ["--duration", "60", "--no-warmup"], 110),
    "azure_code_60s_x1_cold_c": (AZURE, ["--duration", "60", "--no-warmup"], 110),
    # the synthetic trace's first 10 s (26 requests, outputs up to 503 tokens: about 55 s served);
    # its full 60 s takes 228 s to serve, too long to repeat three times in one call
    "synth_mixed_10s_x1_a": (SYNTH, ["--duration", "10"], 130),
    "synth_mixed_10s_x1_b": (SYNTH, ["--duration", "10"], 130),
    "synth_mixed_10s_x1_c": (SYNTH, ["--duration", "10"], 130),
    # session 16's interleaved repeats (issue 31: are the 10 s runs' steps faster, or the others'
    # slower in stretches? one host, one call, with per-step CPU time and the GPU's clocks beside)
    "synth_mixed_10s_x1_d": (SYNTH, ["--duration", "10"], 130),
    "synth_mixed_10s_x1_e": (SYNTH, ["--duration", "10"], 130),
    "azure_code_60s_x1_d": (AZURE, ["--duration", "60"], 110),
    "azure_code_60s_x1_e": (AZURE, ["--duration", "60"], 110),
    # session 17's (issue 31: more repeats of the same two conditions on one host, for the
    # engine's spread and for fits pooled over a workload's recordings)
    "synth_mixed_10s_x1_f": (SYNTH, ["--duration", "10"], 130),
    "synth_mixed_10s_x1_g": (SYNTH, ["--duration", "10"], 130),
    "azure_code_60s_x1_f": (AZURE, ["--duration", "60"], 110),
    "azure_code_60s_x1_g": (AZURE, ["--duration", "60"], 110),
    "synth_mixed_60s_x1": (SYNTH, ["--duration", "60"], 420),
    "synth_mixed_60s_x2": (SYNTH, ["--duration", "30", "--rate-scale", "2"], 420),
    # session 14's repeats of the two synthetic 60 s conditions (each about 228 s served, so two
    # fill one 9-minute call): the large-batch regime's own run-to-run spread
    "synth_mixed_60s_x1_b": (SYNTH, ["--duration", "60"], 300),
    "synth_mixed_60s_x2_b": (SYNTH, ["--duration", "30", "--rate-scale", "2"], 300),
    # the README's "validate in a real model": PyTorch's allocator and a fast policy, one after the
    # other
    "azure_code_60s_policies": (
        AZURE,
        ["--duration", "60", "-p", "pytorch", "-p", "best-fit:virtual=true", "--sim"],
        420,
    ),
    "azure_code_60s_torch_caching": (
        AZURE,
        ["--duration", "60", "-p", "torch-caching", "--sim"],
        240,
    ),
}


def record(
    names: list[str],
    out: Path,
    bundle: Path | None,
    policies: list[str],
    budget_s: float | None = None,
    dry_run: bool = False,
) -> int:
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    t_start = time.perf_counter()
    for name in names:
        trace, options, limit_s = RUNS[name]
        if budget_s is not None:
            left_s = budget_s - (time.perf_counter() - t_start)
            if left_s < 30:
                print(f"== {name}: skipped, {left_s:.0f} s of the budget left", flush=True)
                status = status or 124
                continue
            limit_s = min(limit_s, left_s)
        specs = [] if "-p" in options else [a for p in policies for a in ("-p", p)]
        cmd = [
            sys.executable,
            "-m",
            "poollab",
            "gpu",
            "serve",
            trace,
            *specs,
            "--out",
            str(out / name),
            *options,
        ]
        env = dict(os.environ)
        if env.get("POOLLAB_GC_LOG_DIR"):  # benchmarks/gc_log: each run's collections in its folder
            env["POOLLAB_GC_LOG_DIR"] = str(out / name / "gc")
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        if dry_run:  # the plumbing only: a Python child that collects, in place of gpu serve
            (out / name).mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-c", "import gc; gc.collect()"]
        t = time.perf_counter()
        proc = subprocess.Popen(
            cmd, start_new_session=True, env=env
        )  # its own group: a timeout ends the engine child too
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        print(f"== {name}: exit {rc} after {time.perf_counter() - t:,.0f} s", flush=True)
        status = status or rc
        if bundle is not None:
            with tarfile.open(bundle, "w:gz") as tar:
                tar.add(out, arcname=out.name)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record", help="run the named recordings")
    rec.add_argument("names", nargs="+", choices=sorted(RUNS))
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--bundle", type=Path, default=None)
    rec.add_argument(
        "--dry-run", action="store_true", help="run a stand-in child instead of gpu serve"
    )
    rec.add_argument(
        "--budget-s", type=float, default=None, help="seconds all the runs share (default: none)"
    )
    rec.add_argument(
        "-p",
        "--policy",
        dest="policies",
        action="append",
        default=None,
        help="gpu serve -p, repeatable (default: pytorch)",
    )
    sub.add_parser("list", help="the recordings and their options")
    args = ap.parse_args(argv)
    if args.what == "list":
        for name, (trace, options, limit_s) in RUNS.items():
            print(f"{name}: {trace} {' '.join(options)} (limit {limit_s} s)")
        return 0
    return record(
        args.names, args.out, args.bundle, args.policies or ["pytorch"], args.budget_s, args.dry_run
    )


if __name__ == "__main__":
    sys.exit(main())
