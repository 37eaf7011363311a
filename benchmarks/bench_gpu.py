"""Everything issue 4 asks to show, measured on the GPU in one run.

    PYTHONPATH=. python benchmarks/bench_gpu.py --out DIR [--trace PATH ...] [--quick]

1. calibrate the driver's costs (``gpu_costs.json``, the simulator's schema);
2. on each trace: every registered policy replayed on the device and in the simulator (same
   capacity, calibrated costs), then every baseline; the same policies again under a capacity
   below the trace's peak, so that failures happen and must agree too (``gpu_replay_summary.csv``);
3. each policy replayed again in validation mode (every allocation filled, checked before free);
4. allocate+free round trips at 1 MiB and 4 MiB: every policy (``allocate``/``free`` and CuPy's
   ``malloc`` protocol) against the baselines, two rounds each (``gpu_roundtrip.csv``);
5. a CuPy program run on every policy through ``cupy.cuda.using_allocator`` (with and without
   validation) and compared with CuPy's own pool; an out-of-memory message;
6. teardown: the device's used memory after each stage (``memory_trail``), and for each set of
   policy replays, before the first pool against after the last one closed (``pool_teardown``).

Checks and facts go to ``gpu_checks.json``; a short table is printed last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import policies  # noqa: E402
from realgpu.baselines import available_baselines, make_baseline  # noqa: E402
from realgpu.calibrate import calibrate, write_costs  # noqa: E402
from realgpu.nvml import MemoryReader  # noqa: E402
from realgpu.pool import GpuPool  # noqa: E402
from realgpu.replay import baseline_replay, device_name, gpu_replay  # noqa: E402
from realgpu.roundtrip import baseline_roundtrip, pointer_floor_roundtrip, pool_roundtrip  # noqa: E402
from sim.replay.costs import CostModel  # noqa: E402
from sim.replay.trace_replay import replay  # noqa: E402
from sim.replay.schema import summary_frame  # noqa: E402
from traces.detect import read_alloc_trace  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
SHARED = [
    "n_alloc",
    "n_free",
    "n_failed",
    "peak_live_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "frag_ext_mean",
    "frag_ext_max",
    "internal_waste_frac",
    "n_grow",
    "n_shrink",
    "grown_bytes",
    "shrunk_bytes",
]
STAGES = ("calibrate", "replay", "tight", "validation", "roundtrip", "cupy")
DEFAULT_TRACES = [
    REPO / ".devdata" / "llama1b_generate_mixed.pickle.gz",
    REPO / "traces" / "data" / "llama1b_generate_slice.pickle.gz",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def environment() -> dict:
    import cupy

    env = {
        "device": device_name(0),
        "python": platform.python_version(),
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    return env


def cupy_program(seed: int) -> float:
    """A small CuPy workload: matmuls, elementwise temporaries of varying sizes, reductions."""
    import cupy

    rng = cupy.random.default_rng(seed)
    acc = cupy.zeros((), dtype=cupy.float64)
    for i in range(30):
        n = 256 + 64 * (i % 9)
        a = rng.standard_normal((n, n), dtype=cupy.float32)
        b = rng.standard_normal((n, n), dtype=cupy.float32)
        c = (a @ b) * 0.5 + cupy.tanh(a)
        acc += c.astype(cupy.float64).sum() + cupy.sort(c.ravel())[n].astype(cupy.float64)
        del a, b, c
    return float(acc)


def warm_up() -> None:
    """Load every kernel and library handle the run uses, so the teardown check sees only pools."""
    cupy_program(0)
    pool = GpuPool("first-fit", capacity_bytes=256 * MiB, validate=True)
    pool.free(pool.allocate(4096))
    p = pool.malloc(1000)
    del p
    pool.block_table(pool.allocate(100))
    pool.close()
    for name in available_baselines():
        bl = make_baseline(name)
        h = bl.alloc(MiB)
        if bl.drop:
            del h
        else:
            bl.free(h)
        bl.close()
    release_caches()


def release_caches() -> None:
    import cupy

    gc.collect()
    cupy.cuda.Device(0).synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except ImportError:
        pass


class Trail:
    """The device's used memory after each stage (caches emptied first), to place any growth."""

    def __init__(self, reader: MemoryReader):
        self.reader = reader
        self.base_used_bytes = reader.used_bytes()
        self.rows: list[dict] = []

    def mark(self, stage: str) -> int:
        release_caches()
        used = self.reader.used_bytes()
        self.rows.append(
            {"stage": stage, "used_bytes": used, "delta_bytes": used - self.base_used_bytes}
        )
        return used


def agreement(sim_row: dict, gpu_row: dict) -> dict:
    return {k: [sim_row[k], gpu_row[k]] for k in SHARED if sim_row[k] != gpu_row[k]}


def replay_trace(
    trace, specs, baselines, costs, checks, rows, trail, capacity=None, label=""
) -> None:
    before = trail.mark(f"{trace.name}{label}: before the policy pools")
    for spec in specs:
        try:
            g = gpu_replay(trace, spec, capacity_bytes=capacity)
        except Exception as exc:  # a broken policy must not stop the others
            checks["errors"].append(
                {
                    "trace": trace.name,
                    "policy": spec,
                    "stage": f"replay{label}",
                    "error": repr(exc),
                    "traceback": traceback.format_exc(limit=3),
                }
            )
            log(f"  {spec}: FAILED {exc!r}")
            continue
        s = replay(trace, spec, capacity_bytes=g.summary["capacity_bytes"], costs=costs)
        for r in (g, s):
            rows.append(
                {
                    **r.summary,
                    "kind": r.summary.get("kind", "policy"),
                    "run": f"{trace.name}{label}",
                }
            )
        diff = agreement(s.summary, g.summary)
        lat = {
            "alloc_p50_ratio": s.summary["alloc_p50_us"] / g.summary["alloc_p50_us"],
            "free_p50_ratio": s.summary["free_p50_us"] / g.summary["free_p50_us"],
            "alloc_mean_us_sim": float(s.alloc_ns.mean()) / 1e3,
            "alloc_mean_us_gpu": float(g.alloc_ns.mean()) / 1e3,
            "free_mean_us_sim": float(s.free_ns.mean()) / 1e3 if s.free_ns.size else None,
            "free_mean_us_gpu": float(g.free_ns.mean()) / 1e3 if g.free_ns.size else None,
            "driver_ms_sim": s.summary["driver_ns_total"] / 1e6,
            "driver_ms_gpu": g.summary["driver_ns_total"] / 1e6,
        }
        checks["agreement"].append(
            {
                "trace": trace.name,
                "run": label or "default",
                "policy": spec,
                "capacity_bytes": g.summary["capacity_bytes"],
                "exact": not diff,
                "differences": diff,
                **lat,
            }
        )
        log(
            f"  {spec:<16} peak reserved {g.summary['peak_reserved_bytes'] / MiB:9.1f} MiB  failed "
            f"{g.summary['n_failed']:>5}  alloc p50 {g.summary['alloc_p50_us']:.2f} us "
            f"(sim {s.summary['alloc_p50_us']:.2f})  agree={'yes' if not diff else diff}"
        )
    after = trail.mark(f"{trace.name}{label}: after the policy pools closed")
    checks["pool_teardown"].append(
        {
            "trace": trace.name,
            "run": label or "default",
            "before_used_bytes": before,
            "after_used_bytes": after,
            "delta_bytes": after - before,
            "within_2MiB": abs(after - before) <= 2 * MiB,
        }
    )
    for name in baselines:
        try:
            b = baseline_replay(trace, name)
        except Exception as exc:
            checks["errors"].append(
                {
                    "trace": trace.name,
                    "policy": name,
                    "stage": "baseline",
                    "error": repr(exc),
                    "traceback": traceback.format_exc(limit=3),
                }
            )
            log(f"  {name}: FAILED {exc!r}")
            continue
        rows.append({**b.summary, "run": f"{trace.name}{label}"})
        log(
            f"  {name:<16} peak reserved {b.summary['peak_reserved_bytes'] / MiB:9.1f} MiB  alloc "
            f"p50 {b.summary['alloc_p50_us']:.2f} us  free p50 {b.summary['free_p50_us']:.2f} us"
        )
        trail.mark(f"{trace.name}{label}: after baseline {name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--trace", type=Path, action="append", default=None)
    ap.add_argument("--quick", action="store_true", help="smaller sweeps (smoke test)")
    ap.add_argument("--iterations", type=int, default=20000, help="round trips per pool")
    ap.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}"
    )
    ap.add_argument(
        "--policy",
        action="append",
        default=None,
        help="restrict to these policy specs (repeatable)",
    )
    args = ap.parse_args(argv)
    stages = set(args.stages.split(","))
    unknown = stages - set(STAGES)
    if unknown:
        ap.error(f"unknown stage(s) {sorted(unknown)}; choose from {','.join(STAGES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    import cupy

    t_start = time.perf_counter()
    specs = args.policy or policies.available()
    baselines = available_baselines()
    traces = [
        read_alloc_trace(p) for p in (args.trace or [p for p in DEFAULT_TRACES if p.is_file()])
    ]
    checks: dict = {
        "environment": environment(),
        "stages": sorted(stages),
        "policies": specs,
        "baselines": baselines,
        "traces": [],
        "agreement": [],
        "validation": [],
        "cupy_program": [],
        "pool_teardown": [],
        "errors": [],
    }
    log(f"{checks['environment']}")
    log(f"policies {specs}; baselines {baselines}; traces {[t.name for t in traces]}")

    warm_up()
    reader = MemoryReader(device_id=0)
    base = reader.read()
    trail = Trail(reader)
    checks["memory_before"] = {
        "used_bytes": base.used_bytes,
        "total_bytes": base.total_bytes,
        "source": base.source,
    }
    log(
        "device memory before the first pool: "
        f"used {base.used_bytes / MiB:,.0f} MiB of {base.total_bytes / MiB:,.0f} ({base.source})"
    )

    # 1. calibration
    costs = None
    if "calibrate" in stages:
        t0 = time.perf_counter()
        sizes = (4096, MiB, 64 * MiB, GiB) if args.quick else None
        table = calibrate(**({"sizes": sizes} if sizes else {}), progress=log)
        costs_path = write_costs(table, args.out / "gpu_costs.json")
        costs = CostModel.load(costs_path)
        checks["calibrate_s"] = time.perf_counter() - t0
        log(
            f"calibrated in {checks['calibrate_s']:.1f} s: "
            f"d2d {table['d2d_bytes_per_s'] / 1e9:,.0f} GB/s, "
            f"h2d {table['h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"d2h {table['d2h_bytes_per_s'] / 1e9:.1f} GB/s"
        )
        trail.mark("after calibration")

    # 2. replays
    rows: list[dict] = []
    for trace in traces:
        checks["traces"].append(
            {
                "name": trace.name,
                "source": trace.source,
                "events": len(trace),
                "recorded_peak_reserved_bytes": trace.meta.get("recorded_peak_reserved_bytes"),
            }
        )
        if "replay" in stages:
            log(f"== {trace.name}: {len(trace):,} events")
            replay_trace(trace, specs, baselines, costs, checks, rows, trail)
    if traces and not args.quick and "tight" in stages:
        tight = (
            1900 * MiB
        )  # below the full trace's peak live (about 1,983 MiB): failures must happen and agree
        log(f"== {traces[0].name} under capacity {tight / MiB:,.0f} MiB")
        replay_trace(
            traces[0], specs, [], costs, checks, rows, trail, capacity=tight, label="@1900MiB"
        )

    # 3. validation
    for trace in traces[:1] if "validation" in stages else []:
        log(f"== validation on {trace.name}")
        for spec in specs:
            t0 = time.perf_counter()
            try:
                v = gpu_replay(trace, spec, validate=True)
                entry = {
                    "trace": trace.name,
                    "policy": spec,
                    "corruption": None,
                    "allocations_checked": v.summary["n_alloc"] - v.summary["n_failed"],
                }
            except Exception as exc:
                entry = {"trace": trace.name, "policy": spec, "corruption": repr(exc)}
            entry["wall_s"] = time.perf_counter() - t0
            checks["validation"].append(entry)
            log(f"  {spec:<16} corruption={entry['corruption']}  ({entry['wall_s']:.1f} s)")
        trail.mark(f"{trace.name}: after the validated replays")

    # 4. round trips at 1 MiB
    iterations = 2000 if args.quick else args.iterations
    rt_rows = []
    for nbytes in (MiB, 4 * MiB) if "roundtrip" in stages else ():
        for rnd in (1, 2):
            for spec in specs:
                pool = GpuPool(spec, capacity_bytes=4 * GiB)
                for path in ("allocate", "malloc"):
                    try:
                        rt_rows.append(
                            {
                                **pool_roundtrip(pool, nbytes, path=path, iterations=iterations),
                                "kind": "policy",
                                "round": rnd,
                            }
                        )
                    except (
                        Exception
                    ) as exc:  # paged: a malloc over two discontiguous pages is refused
                        checks["errors"].append(
                            {
                                "policy": spec,
                                "stage": f"roundtrip-{path}-{nbytes}",
                                "error": repr(exc),
                            }
                        )
                pool.close()
            for name in baselines:
                bl = make_baseline(name)
                n = min(iterations, 1000) if name == "cudaMalloc" else iterations
                rt_rows.append(
                    {
                        **baseline_roundtrip(bl, nbytes, iterations=n),
                        "kind": "baseline",
                        "round": rnd,
                    }
                )
                bl.close()
            for finalizer in (False, True):  # what GpuPool.malloc pays before its policy runs
                rt_rows.append(
                    {
                        **pointer_floor_roundtrip(
                            nbytes, iterations=iterations, finalizer=finalizer
                        ),
                        "kind": "floor",
                        "round": rnd,
                    }
                )
            release_caches()
    if rt_rows:
        roundtrip = pd.DataFrame(rt_rows)
        roundtrip.to_csv(args.out / "gpu_roundtrip.csv", index=False)
        trail.mark("after the round trips")
        log("round trips (p50 us; sizes x two rounds):")
        log(
            "\n"
            + roundtrip.pivot_table(
                index=["allocator", "path"], columns=["nbytes", "round"], values="p50_us"
            )
            .round(3)
            .to_string()
        )

    # 5. a CuPy program on every policy, and an out-of-memory message
    expected = cupy_program(1)
    release_caches()
    # paged pools serve CuPy only with requests that fit one page (or pages that happen to be
    # contiguous): the 8 MiB-page variant holds every request of this program in one page
    for spec in (specs + ["paged:page_bytes=8MiB"]) if "cupy" in stages else []:
        for validate in (False, True):
            pool = GpuPool(spec, capacity_bytes=8 * GiB, validate=validate)
            t0 = time.perf_counter()
            try:
                with cupy.cuda.using_allocator(pool.malloc):
                    got = cupy_program(1)
                gc.collect()
                # cuBLAS may pick another kernel for other pointer alignments: equal to rounding
                entry = {
                    "policy": spec,
                    "validate": validate,
                    "equal": abs(got - expected) <= 1e-9 * abs(expected),
                    "bitwise_equal": got == expected,
                    "result": got,
                    "expected": expected,
                    "live_after": pool.policy.num_live,
                    "allocs": pool.policy.num_allocs,
                    "lease_errors": [repr(e) for e in pool.lease_errors],
                }
            except Exception as exc:  # paged: discontiguous pages; compacting: may move pointers
                entry = {"policy": spec, "validate": validate, "refused": repr(exc)}
            finally:
                gc.collect()
                pool.close()
            entry["wall_s"] = time.perf_counter() - t0
            checks["cupy_program"].append(entry)
    log(
        "CuPy program on every policy: "
        f"{sum(e.get('equal', False) for e in checks['cupy_program'])}"
        f"/{len(checks['cupy_program'])} runs equal to CuPy's own pool; refused: "
        f"{sorted({e['policy'] for e in checks['cupy_program'] if 'refused' in e})}"
    )
    trail.mark("after the CuPy programs")
    pool = GpuPool("best-fit", capacity_bytes=64 * MiB)
    keep = pool.malloc(48 * MiB)
    try:
        pool.malloc(48 * MiB)
    except cupy.cuda.memory.OutOfMemoryError as exc:
        checks["oom"] = {
            "type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
        }
    del keep
    pool.close()

    # 6. teardown
    trail.mark("end")
    end = reader.read()
    checks["memory_after"] = {
        "used_bytes": end.used_bytes,
        "delta_bytes": end.used_bytes - base.used_bytes,
        "within_2MiB": abs(end.used_bytes - base.used_bytes) <= 2 * MiB,
    }
    checks["memory_trail"] = trail.rows
    log(
        f"device memory after teardown: used {end.used_bytes / MiB:,.0f} MiB "
        f"(delta {(end.used_bytes - base.used_bytes) / MiB:+.1f} MiB)"
    )

    summary = summary_frame(rows) if rows else pd.DataFrame()
    if rows:
        summary.to_csv(args.out / "gpu_replay_summary.csv", index=False)
    checks["wall_s"] = time.perf_counter() - t_start
    (args.out / "gpu_checks.json").write_text(
        json.dumps(checks, indent=2, default=_json_default) + "\n"
    )

    if not len(summary):
        print(
            "validation clean: "
            f"{sum(v['corruption'] is None for v in checks['validation'])}/"
            f"{len(checks['validation'])}; "
            f"whole-run delta {checks['memory_after']['delta_bytes'] / MiB:+.1f} MiB; errors "
            f"{len(checks['errors'])}"
        )
        return 0
    view = summary[summary["run"] == summary["run"].iloc[0]]
    cols = [
        "policy",
        "backend",
        "n_failed",
        "peak_reserved_bytes",
        "overhead",
        "alloc_p50_us",
        "alloc_p99_us",
        "free_p50_us",
        "free_p99_us",
        "nvml_peak_used_bytes",
    ]
    table_view = view[cols].copy()
    for c in ("peak_reserved_bytes", "nvml_peak_used_bytes"):
        table_view[c] = table_view[c] / MiB
    print(table_view.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
    print(
        "agreement exact: "
        f"{sum(a['exact'] for a in checks['agreement'])}/{len(checks['agreement'])}; "
        "validation clean: "
        f"{sum(v['corruption'] is None for v in checks['validation'])}/"
        f"{len(checks['validation'])}; "
        "policy pools' teardown within 2 MiB: "
        f"{sum(t['within_2MiB'] for t in checks['pool_teardown'])}"
        f"/{len(checks['pool_teardown'])}; whole-run delta "
        f"{checks['memory_after']['delta_bytes'] / MiB:+.1f} MiB; "
        f"errors {len(checks['errors'])}; "
        f"wall {checks['wall_s']:.0f} s"
    )
    return 0


def _json_default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return str(obj)


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
