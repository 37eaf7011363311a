"""The pool controls of issue 8, measured: one table per control.

    python benchmarks/bench_controls.py [--only compaction freeze pregrow tags] [--snapshot PATH]

1. **Compaction helps**: replay of a fragmenting trace (seeded, built here: rounds of 1-6 MiB
   tensors, a third kept for six rounds, then a 24-64 MiB working buffer) under a capacity
   just above its peak live bytes; then the Azure code slice through the simulated server with
   a contiguous KV cache (pow2 reservations, best fit) squeezed into a small KV budget.
2. **Compaction costs more than it gives**: the same server run compacting between steps, and
   replays with no capacity limit (the synthetic LLM trace, the PyTorch snapshot), where there is
   no failure to avoid and the moves only shave a little peak memory.
3. **Growth freeze**: the PyTorch snapshot (six ``generate`` calls) replayed with the pool frozen
   after its first K allocations, as CUDA Graph capture after a warm-up would; then the server
   frozen after its first N steps.
4. **Demand prediction vs reactive growth**: the server with an elastic KV pool that grows only
   on failure (``high=1.0``), on its watermark (``high=0.85``), or before each admitting step by
   the predicted KV bytes x safety (``pregrow_safety``).
5. **Per-tag limits**: the synthetic LLM trace (weights, KV, activations, workspace in one pool)
   replayed under a capacity with and without a cap on the KV tag, broken down by tag.
6. ``--only gpu`` (needs CuPy and a GPU): compaction on a real pool: bytes moved by device
   copies, measured against the modelled time, with the data checked by validation mode.

Copy time is modelled with the bundled H200 cost model (``CostModel.copy_ns``: d2d 1.9e12 B/s),
driver time likewise; the simulator's figures are simulated seconds. Everything is seeded.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import policies  # noqa: E402
from sim.replay.hardware import DEFAULT_GPU  # noqa: E402
from sim.replay.models import DEFAULT_MODEL  # noqa: E402
from sim.replay.trace_replay import replay  # noqa: E402
from sim.serving.simulate import simulate  # noqa: E402
from traces.bundled import bundled_path  # noqa: E402
from traces.detect import read_alloc_trace  # noqa: E402
from traces.events import AllocTrace, make_events  # noqa: E402
from traces.info import describe_alloc_trace  # noqa: E402
from traces.request_readers import read_request_trace  # noqa: E402
from traces.synth_alloc import generate_alloc_trace  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
MIXED_SNAPSHOT = REPO.parent / "shared" / "data" / "traces" / "llama1b_generate_mixed.pickle.gz"
MODEL, GPU = DEFAULT_MODEL, DEFAULT_GPU


# ---------------------------------------------------------------------------- traces
def fragmenting_trace(
    seed: int = 0, rounds: int = 40, per_round: int = 48, keep_rounds: int = 6
) -> AllocTrace:
    """Rounds of 1-6 MiB tensors, a third of each kept ``keep_rounds`` rounds, then a 24-64 MiB
    working buffer that needs one contiguous range: the mixed lifetimes that strand free space."""
    rng = np.random.default_rng(seed)
    t, op, ids, size = [], [], [], []
    kept: list[list[tuple[int, int]]] = []
    nid = 0

    def event(kind: str, aid: int, nbytes: int) -> None:
        t.append(10 * len(t))
        op.append(kind)
        ids.append(aid)
        size.append(nbytes)

    for _ in range(rounds):
        born = []
        for _ in range(per_round):
            n = int(rng.integers(MiB, 6 * MiB))
            event("alloc", nid, n)
            born.append((nid, n))
            nid += 1
        rng.shuffle(born)
        for aid, n in born[per_round // 3 :]:
            event("free", aid, n)
        kept.append(born[: per_round // 3])
        big = int(rng.integers(24 * MiB, 64 * MiB))
        event("alloc", nid, big)
        event("free", nid, big)
        nid += 1
        if len(kept) > keep_rounds:
            for aid, n in kept.pop(0):
                event("free", aid, n)
    for group in kept:
        for aid, n in group:
            event("free", aid, n)
    return AllocTrace(make_events(t, op, ids, size), name=f"fragmenting-s{seed}")


def llm_trace() -> AllocTrace:
    """The synthetic LLM allocation trace (Llama-3.2-1B shape, 96 requests, KV in 256-token
    chunks)."""
    return generate_alloc_trace(
        num_requests=96,
        max_batch=32,
        kv_chunk_tokens=256,
        prompt_tokens=(256, 2048),
        output_tokens=(64, 512),
        arrival_rate_per_s=40,
        seed=2,
    )


def snapshot_trace(path: str | None) -> AllocTrace:
    p = Path(path) if path else MIXED_SNAPSHOT
    return read_alloc_trace(p if p.is_file() else bundled_path("llama1b_generate_slice.pickle.gz"))


def azure(scale: float = 1.0):
    t = read_request_trace(bundled_path("azure_code_slice.csv"))
    return t.scale_rate(scale) if scale != 1 else t


# ---------------------------------------------------------------------------- printing
def table(title: str, header: list[str], rows: list[list], note: str = "") -> None:
    print(f"\n### {title}\n")
    cells = [[_cell(v) for v in row] for row in rows]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in cells:
        print("| " + " | ".join(row) + " |")
    if note:
        print(f"\n{note}")
    sys.stdout.flush()


def _cell(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def comp_stats(policy) -> dict:
    return policy.compaction_stats()  # declared on every policy: empty where nothing compacts


def frag_before_after(policy) -> tuple[float, float]:
    from policies.compacting import Compacting

    rows = next(
        (
            layer.compactions
            for layer in policies.wrapper.layers(policy)
            if isinstance(layer, Compacting)
        ),
        [],
    )
    if not rows:
        return float("nan"), float("nan")
    return float(np.mean([r.frag_before for r in rows])), float(
        np.mean([r.frag_after for r in rows])
    )


# ---------------------------------------------------------------------------- 1 + 2: compaction
def bench_compaction() -> None:
    trace = fragmenting_trace()
    peak = describe_alloc_trace(trace)["peak_live_bytes"]
    rows = []
    for factor in (1.05, 1.10, 1.15):
        cap = int(peak * factor)
        for spec in (
            "best-fit",
            "first-fit",
            "worst-fit",
            "compacting:base=[best-fit],check_every=0",
            "compacting:base=[best-fit]",
        ):
            r = replay(trace, spec, capacity_bytes=cap)
            s, c = r.summary, comp_stats(r.policy)
            fb, fa = frag_before_after(r.policy)
            rows.append(
                [
                    f"{factor:.2f}x",
                    spec,
                    s["n_failed"],
                    s["peak_reserved_bytes"] / MiB,
                    s["frag_ext_mean"],
                    c.get("num_compactions", 0),
                    c.get("num_rescues", 0),
                    c.get("moved_bytes", 0) / MiB,
                    c.get("time_ns", 0) / 1e6,
                    fb,
                    fa,
                ]
            )
    table(
        f"Compaction turns failures into successes: replay of `{trace.name}` "
        f"({len(trace):,} events, peak live {peak / MiB:,.0f} MiB) "
        "under capacity = factor x peak live",
        [
            "capacity",
            "policy",
            "failed",
            "peak reserved MiB",
            "frag mean",
            "passes",
            "rescues",
            "moved MiB",
            "copy ms",
            "frag before",
            "frag after",
        ],
        rows,
        "`check_every=0`: compaction only on a failure (the cheapest segment slide first); "
        "default: also every 64 frees when fragmentation > 0.5 and >= 16 MiB are free.",
    )

    t = azure(4)
    rows = []
    for cap in (6 * GiB, 12 * GiB):
        for spec, kw in (
            ("best-fit", {}),
            ("compacting:base=[best-fit],check_every=0", {}),
            ("compacting:base=[best-fit],idle_only=true", {"compact_between_steps": True}),
        ):
            s = simulate(t, spec, model=MODEL, gpu=GPU, kv_capacity_bytes=cap, **kw).summary
            label = spec + (" + compact_between_steps" if kw else "")
            rows.append(
                [
                    f"{cap // GiB} GiB",
                    label,
                    s["n_failed"],
                    s["n_preempted"],
                    s["n_compactions"],
                    s["n_compaction_rescues"],
                    s["compaction_moved_bytes"] / GiB,
                    s["compaction_s"] * 1e3,
                    s["n_hot_grows"],
                    s["alloc_stall_s"] * 1e3,
                    s["ttft_p99_s"],
                    s["e2e_p99_s"],
                    s["throughput_tok_s"],
                ]
            )
    table(
        f"Compaction in the server: Azure code slice x4 rate ({len(t):,} requests), "
        f"{MODEL} on {GPU}, contiguous KV (pow2), KV budget as given",
        [
            "KV budget",
            "policy",
            "failed allocs",
            "preempted",
            "passes",
            "rescues",
            "moved GiB",
            "copy ms",
            "hot grows",
            "stall ms",
            "TTFT p99 s",
            "e2e p99 s",
            "tok/s",
        ],
        rows,
        "Rescued allocations spare preemptions; passes between steps move more and rescue nothing. "
        "Released segments are re-grown later (hot grows), so driver stall rises with compaction.",
    )

    rows = []
    for name, trace in (("synthetic LLM", llm_trace()), ("PyTorch snapshot", snapshot_trace(None))):
        for spec in (
            "best-fit",
            "compacting:base=[best-fit]",
            "compacting:base=[best-fit],check_every=0",
        ):
            t0 = time.perf_counter()
            r = replay(trace, spec)
            wall = time.perf_counter() - t0
            s, c = r.summary, comp_stats(r.policy)
            rows.append(
                [
                    name,
                    spec,
                    s["n_failed"],
                    s["peak_reserved_bytes"] / MiB,
                    s["frag_ext_mean"],
                    c.get("num_compactions", 0),
                    c.get("moved_bytes", 0) / MiB,
                    c.get("time_ns", 0) / 1e6,
                    wall,
                ]
            )
    table(
        "Compaction costing more than it gives: replays with no capacity limit (nothing to rescue)",
        [
            "trace",
            "policy",
            "failed",
            "peak reserved MiB",
            "frag mean",
            "passes",
            "moved MiB",
            "copy ms",
            "replay wall s",
        ],
        rows,
        "The threshold passes buy a few MiB of peak reserved memory "
        "(or none) for tens of GiB of copies, and planning them takes 3-4x the replay's CPU time; "
        "compacting only on failures moves nothing here "
        "(the wrapper alone adds about half to the replay's time).",
    )


# ---------------------------------------------------------------------------- 3: freeze
def bench_freeze(snapshot: str | None) -> None:
    trace = snapshot_trace(snapshot)
    n_allocs = int((trace.events["op"] == "alloc").sum())
    rows = []
    unfrozen = {}
    for spec in ("best-fit", "first-fit", "size-class", "tlsf", "torch-caching", "paged"):
        unfrozen[spec] = replay(trace, spec).summary["peak_reserved_bytes"]
        for frac in (0.01, 0.025, 0.1, 0.5):
            k = max(1, int(n_allocs * frac))
            p = policies.create(spec)
            seen = {"n": 0, "reserved": 0}

            def freeze_after(a, p=p, k=k, seen=seen):
                seen["n"] += 1
                if seen["n"] == k:
                    p.freeze()
                    seen["reserved"] = p.stats().reserved_bytes

            s = replay(trace, p, on_alloc=freeze_after).summary
            rows.append(
                [
                    spec,
                    f"{frac:.1%}",
                    k,
                    seen["reserved"] / MiB,
                    unfrozen[spec] / MiB,
                    p.stats().num_frozen_failures,
                    s["failure_rate"],
                ]
            )
    table(
        "Growth freeze after a warm-up: "
        f"`{trace.name}` ({n_allocs:,} allocations) frozen after its first k",
        [
            "policy",
            "warm-up",
            "k allocs",
            "reserved at freeze MiB",
            "unfrozen peak MiB",
            "frozen failures",
            "failure rate",
        ],
        rows,
    )

    t = azure(4)
    rows = []
    for spec in ("paged", "best-fit"):
        for n in (None, 100, 300, 1000):
            s = simulate(t, spec, model=MODEL, gpu=GPU, freeze_after_steps=n).summary
            rows.append(
                [
                    spec,
                    "-" if n is None else n,
                    s["frozen_at_s"] if s["frozen_at_s"] is not None else "-",
                    s["n_frozen_failures"],
                    s["n_preempted"],
                    s["n_finished"],
                    s["peak_reserved_bytes"] / GiB,
                    s["ttft_p99_s"],
                    s["throughput_tok_s"],
                ]
            )
    table(
        f"Growth freeze in the server: Azure code slice x4 rate, {MODEL} on {GPU}, full KV budget",
        [
            "KV policy",
            "freeze after steps",
            "frozen at s",
            "frozen failures",
            "preempted",
            "finished",
            "peak reserved GiB",
            "TTFT p99 s",
            "tok/s",
        ],
        rows,
    )


# ---------------------------------------------------------------------------- 4: pre-growth
def bench_pregrow() -> None:
    rows = []
    for scale in (1, 4):
        t = azure(scale)
        for base in ("paged", "best-fit"):
            for label, extra, kw in (
                ("reactive (high=1.0)", ",high=1.0", {}),
                ("watermark (high=0.85)", "", {}),
                ("predicted x1.0", ",high=1.0", {"pregrow_safety": 1.0}),
                ("predicted x1.5", ",high=1.0", {"pregrow_safety": 1.5}),
                ("watermark + predicted x1.2", "", {"pregrow_safety": 1.2}),
            ):
                s = simulate(t, f"elastic:base=[{base}]{extra}", model=MODEL, gpu=GPU, **kw).summary
                rows.append(
                    [
                        f"x{scale}",
                        base,
                        label,
                        s["n_hot_grows"],
                        s["n_pregrows"],
                        s["alloc_stall_s"] * 1e3,
                        s["pregrow_driver_s"] * 1e3,
                        s["ttft_p50_s"] * 1e3,
                        s["ttft_p99_s"],
                        s["kv_idle_bytes_mean"] / GiB,
                        s["peak_reserved_bytes"] / GiB,
                        s["n_shrink"],
                    ]
                )
    table(
        f"Demand prediction vs reactive growth: Azure code slice, {MODEL} on {GPU}, "
        "elastic KV pool",
        [
            "rate",
            "base",
            "growth",
            "hot-path grows",
            "pre-grows",
            "stall ms",
            "pre-grow driver ms",
            "TTFT p50 ms",
            "TTFT p99 s",
            "idle KV GiB (mean)",
            "peak reserved GiB",
            "trims",
        ],
        rows,
        "Hot-path grows are segment grows inside a step (their driver time is in the step: stall). "
        "Pre-grows happen before an admitting step; "
        "their driver time is taken to overlap the previous step. "
        "Idle KV: reserved minus allocated KV bytes, averaged over busy time.",
    )


# ---------------------------------------------------------------------------- 5: tag limits
def bench_tags() -> None:
    trace = llm_trace()
    weights = trace.meta["weights_bytes"]
    cap = weights + GiB
    rows = []
    for label, limits in (
        ("no cap", ""),
        ("kv <= 700 MiB", f"kv={700 * MiB}"),
        ("kv <= 900 MiB", f"kv={900 * MiB}"),
    ):
        r = replay(
            trace,
            f"tag-limits:base=[best-fit],limits=[{limits}]"
            if limits
            else "tag-limits:base=[best-fit]",
            capacity_bytes=cap,
        )
        for row in r.policy.tag_rows():
            rows.append(
                [
                    label,
                    row["tag"],
                    "-" if row["limit_bytes"] is None else row["limit_bytes"] / MiB,
                    row["num_allocs"],
                    row["num_failures"],
                    row["num_limit_failures"],
                    row["peak_live_bytes"] / MiB,
                    row["peak_allocated_bytes"] / MiB,
                ]
            )
    table(
        f"Per-tag limits: `{trace.name}` "
        f"({len(trace):,} events) in one best-fit pool of weights + 1 GiB ({cap / MiB:,.0f} MiB)",
        [
            "cap",
            "tag",
            "limit MiB",
            "allocs",
            "failed",
            "by limit",
            "peak live MiB",
            "peak allocated MiB",
        ],
        rows,
        "Without a cap the KV cache fills the pool and activations and workspace fail with it; "
        "with one, only KV requests are refused "
        "(a replay goes on past a failure: the trace does not react to it).",
    )


# ---------------------------------------------------------------------------- 6: on the GPU
def bench_gpu_compaction() -> None:
    from realgpu.compaction import attach, compact
    from realgpu.pool import GpuPool
    from sim.replay.costs import CostModel

    costs = CostModel.load()
    sizes = [int(n) for n in np.random.default_rng(0).integers(8 * MiB, 64 * MiB, 96)]
    spec = "compacting:base=[best-fit:segment_bytes=256MiB],min_free_bytes=0,check_every=0"

    def fragmented(validate: bool, verify: bool, capacity: int):
        pool = GpuPool(spec, backend="cuda", capacity_bytes=capacity, validate=validate)
        mover = attach(pool, verify=verify)
        live = [pool.allocate(n) for n in sizes]
        for a in live[::2]:
            pool.free(a)
        return pool, mover, live[1::2]

    warm, _, _ = fragmented(
        True, True, 8 * GiB
    )  # CuPy compiles its kernels on first use: not measured
    compact(warm, force=True)
    warm.close()
    rows = []
    for validate, verify in ((True, True), (False, True), (False, False)):
        pool, mover, live = fragmented(validate, verify, 8 * GiB)
        before = pool.stats()
        result = compact(pool, force=True)
        rec = result.record
        for a in live:
            pool.free(a)  # validation mode checks every pattern and guard here, after the moves
        pool.close()
        # the same fragmentation with no room to grow: a request only a compaction can place
        rows.append(
            [
                "explicit pass",
                "on" if validate else "off",
                "on" if verify else "off",
                rec.num_moves,
                rec.moved_bytes / GiB,
                result.copy_ns / 1e6,
                result.wall_ns / 1e6,
                result.bytes_per_s / 1e9,
                costs.copy_ns(rec.moved_bytes) / 1e6,
                before.frag_ext,
                rec.frag_after,
                rec.released_bytes / MiB,
            ]
        )
        probe = GpuPool(spec, backend="cuda", capacity_bytes=8 * GiB)
        for n in sizes:
            probe.allocate(n)
        full = probe.stats().reserved_bytes
        probe.close()
        pool, mover, live = fragmented(validate, verify, full)
        need = pool.stats().largest_free_bytes + MiB
        t0 = time.perf_counter_ns()
        a = pool.allocate(
            need
        )  # fails in the base; the compaction on the allocation path places it
        alloc_ns = time.perf_counter_ns() - t0
        rec = pool.policy.compactions[-1]
        for b in live + [a]:
            pool.free(b)
        pool.close()
        rows.append(
            [
                "failure rescue",
                "on" if validate else "off",
                "on" if verify else "off",
                rec.num_moves,
                rec.moved_bytes / GiB,
                mover.copy_ns / 1e6,
                alloc_ns / 1e6,
                rec.moved_bytes / (mover.copy_ns * 1e-9) / 1e9 if mover.copy_ns else float("nan"),
                costs.copy_ns(rec.moved_bytes) / 1e6,
                rec.frag_before,
                rec.frag_after,
                rec.released_bytes / MiB,
            ]
        )
    table(
        "Compaction on the GPU: 96 tensors of 8-64 MiB in 256 MiB segments, every other one freed",
        [
            "pass",
            "validation",
            "verify copies",
            "moves",
            "moved GiB",
            "copy ms",
            "pass / allocate ms",
            "GB/s",
            "modelled ms",
            "frag before",
            "frag after",
            "released MiB",
        ],
        rows,
        "Explicit pass: compact(pool, force=True). Failure rescue: "
        "capacity = what the 96 tensors reserved, "
        "so a request one MiB above the largest hole fails in the base and a compaction places it "
        "(the allocate time includes it). "
        "Validation mode filled every allocation with a pattern and checked it "
        "(and its guards) at its free, after the moves. "
        "Modelled: the bundled cost model's copy_ns (1.9e12 B/s).",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--only",
        nargs="+",
        choices=["compaction", "freeze", "pregrow", "tags", "gpu"],
        default=["compaction", "freeze", "pregrow", "tags"],
    )
    ap.add_argument(
        "--snapshot",
        default=None,
        help="PyTorch snapshot for the freeze table "
        "(default: shared/data's mixed snapshot, else the bundled slice)",
    )
    args = ap.parse_args(argv)
    print(
        f"bench_controls: Python {platform.python_version()} on {platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    t0 = time.perf_counter()
    if "compaction" in args.only:
        bench_compaction()
    if "freeze" in args.only:
        bench_freeze(args.snapshot)
    if "pregrow" in args.only:
        bench_pregrow()
    if "tags" in args.only:
        bench_tags()
    if "gpu" in args.only:
        bench_gpu_compaction()
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
