"""Record the engine step profiles and request tables (issue 31) and the start-up snapshot (issue 34)
with ``poollab gpu serve``, and time ``gpu serve`` under PyTorch's allocator against policies.

Run on the GPU machine from the repository root::

    python benchmarks/bench_serve.py record NAME... --out DIR [--bundle FILE]
    python benchmarks/bench_serve.py list

Each NAME is one ``gpu serve`` run of ``RUNS`` (trace, load, policies, options): its result folder goes
to ``DIR/NAME``; after each run everything under DIR is packed into ``--bundle`` (a .tar.gz), so a run
cut short by a time limit still leaves the earlier ones. Settings are those of the shared recordings
(``../shared/data/engine``): Llama-3-8B's shape, random bf16 weights, 256-token blocks,
``max_batch_tokens`` 8192, 1,024 sequences, the KV cache as the engine sizes it.

The higher loads serve the same requests denser: ``--rate-scale 2 --duration 30`` takes the arrivals of
the first 60 s of the trace at twice the rate.
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
SYNTH = ".data/synth_mixed_60s.csv"  # ../shared/data/engine/synth_mixed_60s.csv, copied into the carried tree

#: name -> (trace, gpu serve options, time limit in seconds); policies: -p options, default pytorch
RUNS: dict[str, tuple[str, list[str], int]] = {
    "azure_code_60s_x1_a": (AZURE, ["--duration", "60", "--snapshot"], 240),
    "azure_code_60s_x1_b": (AZURE, ["--duration", "60"], 240),
    "azure_code_60s_x2": (AZURE, ["--duration", "30", "--rate-scale", "2"], 240),
    "synth_mixed_60s_x1": (SYNTH, ["--duration", "60"], 420),
    "synth_mixed_60s_x2": (SYNTH, ["--duration", "30", "--rate-scale", "2"], 420),
    # the README's "validate in a real model": PyTorch's allocator and a fast policy, one after the other
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


def record(names: list[str], out: Path, bundle: Path | None, policies: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    for name in names:
        trace, options, limit_s = RUNS[name]
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
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t = time.perf_counter()
        proc = subprocess.Popen(
            cmd, start_new_session=True
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record", help="run the named recordings")
    rec.add_argument("names", nargs="+", choices=sorted(RUNS))
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--bundle", type=Path, default=None)
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
    return record(args.names, args.out, args.bundle, args.policies or ["pytorch"])


if __name__ == "__main__":
    sys.exit(main())
