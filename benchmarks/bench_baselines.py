"""Every registered policy against the lower bound and the offline planner, on a real and a
synthetic trace.

    python benchmarks/bench_baselines.py [--snapshot PATH] [--requests 12] [--seed 0]
                                         [--policy SPEC ...] [--repeat 1] [--out DIR]

Traces: the PyTorch snapshot (default: the full recording in ``shared/data``, else the bundled
slice) and a synthetic inference trace (``traces.generate_alloc_trace``: Llama-3.2-1B shape,
``--requests`` requests arriving at 4/s, continuous batching). For each trace it prints the
lower bound (peak live bytes) and the greedy-by-size planner's peak, then one row per policy:

- ``peak_reserved_MiB``, ``overhead_%`` (peak reserved / peak live - 1), ``failed`` requests;
- ``gap_to_bound_%`` = peak reserved / lower bound - 1 and ``gap_to_planner_%`` = peak reserved /
  planner peak - 1;
- ``Mops/s``: allocate/free calls per second in a lean loop (no sampling, no timers around
  calls), the best of ``--repeat`` runs.

Then the fidelity table of ``torch-caching`` against the snapshot's own segment events, with
recorded and with virtual segment addresses.

    python benchmarks/bench_baselines.py --real OUT_DIR [--snapshot PATH]

(on a machine with CUDA, PyTorch and CuPy) validates the emulations against the real allocators
instead: the snapshot's requests are replayed through PyTorch's caching allocator once per
``REAL_TORCH_CONFIGS`` entry (each in a fresh process with its ``PYTORCH_CUDA_ALLOC_CONF``; the
allocations made before recording first, then ``_record_memory_history`` and the rest), each
new snapshot is written to ``OUT_DIR`` and compared with ``torch-caching`` by
``sim.replay.fidelity``; and the same requests go through CuPy's ``MemoryPool``, whose
``total_bytes()`` after every request is compared with ``cupy-pool``'s reserved bytes.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

import policies  # noqa: E402
from sim.replay.bounds import bounds  # noqa: E402
from sim.replay.fidelity import read_recording, replay_recording  # noqa: E402
from sim.replay.trace_replay import replay  # noqa: E402
from traces import bundled_path, generate_alloc_trace, read_alloc_trace  # noqa: E402

FULL_SNAPSHOT = REPO.parent / "shared" / "data" / "traces" / "llama1b_generate_mixed.pickle.gz"
MiB = 1 << 20
#: name -> (PYTORCH_CUDA_ALLOC_CONF, memory limit in bytes or None) for ``--real``. In the GC run,
#: collection starts above 80 % of the 2300 MiB limit (1840 MiB), below the 2112 MiB the default
#: pool reserves on the snapshot, so it has to act.
REAL_TORCH_CONFIGS = {
    "default": ("", None),
    "split64-div4": ("max_split_size_mb:64,roundup_power2_divisions:4", None),
    "gc80-cap2300MiB": ("garbage_collection_threshold:0.8", 2300 * MiB),
}


def lean_ops_per_s(trace, spec: str, repeat: int) -> float:
    """Events per second of allocate/free alone (best of ``repeat``)."""
    _, is_alloc, ids, sizes, streams = trace.arrays()
    ops = list(zip(is_alloc.tolist(), ids.tolist(), sizes.tolist(), streams.tolist()))
    best = float("inf")
    for _ in range(repeat):
        policy = policies.create(spec)
        allocate, free = policy.allocate, policy.free
        live = {}
        t0 = time.perf_counter()
        for is_alloc_, ident, size, stream in ops:
            if is_alloc_:
                live[ident] = allocate(size, stream=stream)
            else:
                a = live.pop(ident)
                if a is not None:
                    free(a)
        best = min(best, time.perf_counter() - t0)
    return len(ops) / best


def compare(trace, specs: list[str], repeat: int) -> pd.DataFrame:
    b = bounds(trace)
    print(f"\n## {trace.name}: {len(trace):,} events, {b['num_allocations']:,} allocations")
    print(
        f"lower bound (peak live) {b['lower_bound_bytes'] / MiB:,.1f} MiB; planner "
        f"({b['planner']}) {b['planner_peak_bytes'] / MiB:,.1f} MiB "
        f"(+{100 * (b['planner_peak_bytes'] / b['lower_bound_bytes'] - 1):.2f} %, "
        f"{b['planner_s']:.1f} s)"
    )
    rows = []
    for spec in specs:
        s = replay(trace, spec).summary
        rows.append(
            {
                "policy": spec,
                "peak_reserved_MiB": s["peak_reserved_bytes"] / MiB,
                "overhead_%": 100 * s["overhead"],
                "failed": s["n_failed"],
                "gap_to_bound_%": 100 * (s["peak_reserved_bytes"] / b["lower_bound_bytes"] - 1),
                "gap_to_planner_%": 100 * (s["peak_reserved_bytes"] / b["planner_peak_bytes"] - 1),
                "segments": s["n_grow"],
                "Mops/s": lean_ops_per_s(trace, spec, repeat) / 1e6,
            }
        )
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format=lambda v: f"{v:,.2f}"))
    return table.assign(
        trace=trace.name,
        lower_bound_bytes=b["lower_bound_bytes"],
        planner_peak_bytes=b["planner_peak_bytes"],
    )


def _requests(trace):
    """``(is_alloc, alloc_id, nbytes, pre_trace)`` lists of a trace, for the real replays."""
    _, is_alloc, ids, sizes, _ = trace.arrays()
    return (
        is_alloc.tolist(),
        ids.tolist(),
        sizes.tolist(),
        (trace.events["tag"] == "pre-trace").tolist(),
    )


def torch_child(snapshot: str, limit: str, out_path: str) -> None:
    """Replay ``snapshot``'s requests through the real caching allocator and dump a new snapshot."""
    import torch

    if limit != "none":
        torch.cuda.set_per_process_memory_fraction(
            int(limit) / torch.cuda.get_device_properties(0).total_memory
        )
    is_alloc, ids, sizes, pre = _requests(read_alloc_trace(snapshot))
    live = {}
    k = 0
    while k < len(is_alloc) and pre[k]:  # allocated before recording, as in the original run
        live[ids[k]] = torch.empty(sizes[k], dtype=torch.uint8, device="cuda")
        k += 1
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, context=None, stacks="python")
    for a, i, n in zip(is_alloc[k:], ids[k:], sizes[k:]):
        if a:
            live[i] = torch.empty(n, dtype=torch.uint8, device="cuda")
        else:
            del live[i]
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    with gzip.open(out_path, "wb") as f:
        import pickle

        pickle.dump(snap, f)
    print(
        f"  torch {torch.__version__}: "
        f"max reserved {torch.cuda.max_memory_reserved() / MiB:,.1f} MiB, "
        f"max allocated {torch.cuda.max_memory_allocated() / MiB:,.1f} MiB"
    )


def cupy_child(snapshot: str) -> None:
    """Replay through CuPy's MemoryPool and compare ``total_bytes()`` with ``cupy-pool`` request by
    request."""
    import cupy

    pool = cupy.cuda.MemoryPool()
    emulation = policies.create("cupy-pool")
    is_alloc, ids, sizes, _ = _requests(read_alloc_trace(snapshot))
    live, emulated = {}, {}
    num_differ = first_differ = peak_real = peak_emulated = 0
    first_differ = -1
    for k, (a, i, n) in enumerate(zip(is_alloc, ids, sizes)):
        if a:
            live[i] = pool.malloc(n)
            emulated[i] = emulation.allocate(n)
        else:
            del live[i]
            emulation.free(emulated.pop(i))
        real, emu = pool.total_bytes(), emulation.reserved_bytes
        peak_real, peak_emulated = max(peak_real, real), max(peak_emulated, emu)
        if real != emu:
            num_differ += 1
            first_differ = k if first_differ < 0 else first_differ
    print(
        f"  cupy {cupy.__version__} MemoryPool vs cupy-pool over {len(is_alloc):,} requests: "
        f"peak total_bytes {peak_real / MiB:,.2f} vs {peak_emulated / MiB:,.2f} MiB; "
        f"requests after which they differ: {num_differ:,} (first: {first_differ})"
    )


def real(snapshot: str, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"## the real allocators on {Path(snapshot).name}")
    for name, (conf, limit) in REAL_TORCH_CONFIGS.items():
        path = out_dir / f"torch_{name}.pickle.gz"
        print(f"\n### PyTorch, PYTORCH_CUDA_ALLOC_CONF={conf!r}, limit {limit}")
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        subprocess.run(
            [sys.executable, __file__, "--_torch-child", snapshot, str(limit or "none"), str(path)],
            env=env,
            check=True,
        )
        result = replay_recording(read_recording(path), capacity_bytes=limit)
        print(result.format())
    print("\n### CuPy")
    subprocess.run([sys.executable, __file__, "--_cupy-child", snapshot], check=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_torch-child"]:
        torch_child(*argv[1:4])
        return 0
    if argv[:1] == ["--_cupy-child"]:
        cupy_child(argv[1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_snapshot = (
        FULL_SNAPSHOT
        if FULL_SNAPSHOT.exists()
        else bundled_path("llama1b_generate_slice.pickle.gz")
    )
    ap.add_argument("--snapshot", default=str(default_snapshot))
    ap.add_argument("--requests", type=int, default=12, help="requests in the synthetic trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--policy", action="append", dest="specs", help="policy spec, repeatable (default: all)"
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--out", type=Path, default=None, help="write baselines.csv and fidelity.csv here"
    )
    ap.add_argument(
        "--real",
        type=Path,
        default=None,
        metavar="OUT_DIR",
        help="validate against the real allocators on this machine's GPU instead (see above)",
    )
    args = ap.parse_args(argv)
    if args.real is not None:
        real(args.snapshot, args.real)
        return 0
    specs = args.specs or policies.available()
    print(
        f"# bench_baselines {datetime.date.today()}: "
        f"python {platform.python_version()} on {platform.machine()}"
    )
    print(f"command: {' '.join(['python', 'benchmarks/bench_baselines.py', *argv])}")
    snapshot = read_alloc_trace(args.snapshot)
    synthetic = generate_alloc_trace(
        num_requests=args.requests, arrival_rate_per_s=4.0, seed=args.seed
    )
    synthetic.name = f"synthetic-{args.requests}req-seed{args.seed}"
    tables = [compare(snapshot, specs, args.repeat), compare(synthetic, specs, args.repeat)]

    print(f"\n## fidelity of torch-caching on {Path(args.snapshot).name}")
    rec = read_recording(args.snapshot)
    fidelity_tables = []
    for mode in ("recorded", "virtual"):
        result = replay_recording(rec, addresses=mode)
        print(result.format())
        fidelity_tables.append(result.table.assign(addresses=mode))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        pd.concat(tables).to_csv(args.out / "baselines.csv", index=False)
        pd.concat(fidelity_tables).to_csv(args.out / "fidelity.csv", index=False)
        print(f"\nwrote {args.out}/baselines.csv, {args.out}/fidelity.csv")
    return 0


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
