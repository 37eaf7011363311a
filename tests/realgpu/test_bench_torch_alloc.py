"""``benchmarks/bench_torch_alloc.py``'s summary: paired ratios over ABAB rounds, their spread, and
which targets each policy meets (the GPU figures: benchmarks/RESULTS.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_torch_alloc.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_torch_alloc", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker(name, r, seconds, *, alloc_us=None, free_us=None, sha="t"):
    w = {
        "allocator": name,
        "round": r,
        "build": "compiled",
        "runs": [
            {"shape": shape, "seconds": s, "tokens_sha": sha}
            for shape, s in zip(("8x128", "4x1500"), seconds)
        ],
    }
    if alloc_us is not None:
        w.update(alloc_mean_us=alloc_us, free_mean_us=free_us, summary={"n_alloc": 10})
    return w


def test_rounds_alternate_their_order(bench):
    assert bench.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert bench.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_ratios_are_paired_by_round_with_their_spread_and_the_targets(bench):
    # PyTorch's allocator slow in round 1 (the machine, not the policy): paired, the policy's ratio
    # stays near 1.0; unpaired medians would say 0.7
    workers = [
        _worker("torch", 0, [1.0, 2.0]),
        _worker("torch", 1, [2.0, 4.0]),
        _worker("torch", 2, [1.0, 2.0]),
        _worker("fast", 0, [1.02, 2.04], alloc_us=1.2, free_us=0.9),
        _worker("fast", 1, [2.06, 4.12], alloc_us=1.4, free_us=1.0),
        _worker("fast", 2, [1.0, 2.0], alloc_us=1.3, free_us=0.8),
        _worker("slow", 0, [1.2, 2.4], alloc_us=3.0, free_us=1.0, sha="other"),
        _worker("slow", 1, [2.4, 4.8], alloc_us=3.1, free_us=1.1, sha="other"),
        {"allocator": "slow", "round": 2, "error": "timed out after 45 s"},
    ]
    rows = {(r["allocator"], r["shape"]): r for r in bench.summarise(workers, ["fast", "slow"])}
    fast = rows[("fast", "8x128")]
    assert fast["n_rounds"] == 3 and fast["ratio_to_torch"] == pytest.approx(1.02)
    assert fast["ratio_min"] == pytest.approx(1.0) and fast["ratio_max"] == pytest.approx(1.03)
    assert (
        fast["meets_generate"]
        and fast["meets_call"]
        and fast["alloc_mean_us"] == pytest.approx(1.3)
    )
    assert fast["tokens_equal_torch"] is True
    every = rows[("fast", bench.ALL_SHAPES)]
    assert every["seconds_median"] == pytest.approx(3.06) and every[
        "ratio_to_torch"
    ] == pytest.approx(1.02)
    slow = rows[("slow", "4x1500")]
    assert slow["n_rounds"] == 2 and slow["ratio_to_torch"] == pytest.approx(1.2)
    assert (
        not slow["meets_generate"]
        and not slow["meets_call"]
        and slow["tokens_equal_torch"] is False
    )
    assert (
        rows[("torch", "8x128")]["ratio_to_torch"] == pytest.approx(1.0)
        and not rows[("torch", "8x128")]["meets_generate"]
    )


def test_mempool_runs_summarise_against_pytorch_in_the_same_process(bench):
    mempool = {
        "runs": [
            {"allocator": "torch", "round": 0, "shape": "8x128", "seconds": 1.0, "tokens_sha": "t"},
            {
                "allocator": "best-fit",
                "round": 0,
                "shape": "8x128",
                "seconds": 1.1,
                "tokens_sha": "t",
            },
        ],
        "summaries": [
            {
                "policy": "best-fit",
                "round": 0,
                "alloc_mean_us": 2.0,
                "free_mean_us": 1.0,
                "peak_reserved_bytes": 5,
                "n_alloc": 3,
            }
        ],
    }
    rows = {
        (r["allocator"], r["shape"]): r
        for r in bench.summarise(bench.mempool_as_workers(mempool), ["best-fit"])
    }
    row = rows[("best-fit", "8x128")]
    assert (
        row["ratio_to_torch"] == pytest.approx(1.1)
        and row["peak_reserved_bytes"] == 5
        and row["n_alloc"] == 3
    )


def test_results_are_written_after_every_worker_and_rounds_run_abab(bench, tmp_path, monkeypatch):
    # the H200's run was cut at its time limit two rounds in, and wrote nothing: each worker now
    # leaves the tables as they stand
    import csv
    import sys

    order, seen_rows = [], []

    def spawn(args, extra, timeout_s, tree=bench.REPO):
        name = extra[1]
        order.append(name)
        if (tmp_path / "torch_alloc_summary.csv").is_file():
            with open(tmp_path / "torch_alloc_summary.csv") as f:
                seen_rows.append(len(list(csv.DictReader(f))))
        return _worker(
            name, 0, [1.0, 2.0], **({} if name == "torch" else {"alloc_us": 1.0, "free_us": 1.0})
        )

    monkeypatch.setattr(bench, "spawn", spawn)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_torch_alloc.py",
            "--rounds",
            "2",
            "-p",
            "a",
            "-p",
            "b",
            "--shapes",
            "8x128,4x1500",
            "--out",
            str(tmp_path),
        ],
    )
    assert bench.main() == 0
    assert order == ["torch", "a", "b", "b", "a", "torch"]
    assert (
        seen_rows[0] == 3 and seen_rows[-1] == 9
    )  # torch's rows after the first worker; all three allocators later
    with open(tmp_path / "torch_alloc_runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 12


def test_stitch_bench_take_overs_cut_fresh_ranges_on_pytorchs_own_requests(bench):
    from types import SimpleNamespace

    off, on = bench.stitch_bench(SimpleNamespace(policies=["paged:page_bytes=2MiB"]))
    assert (
        not off["take_over"] and on["take_over"] and off["n_take_overs"] == 0 < on["n_take_overs"]
    )
    assert (
        on["n_fresh_ranges"] < off["n_fresh_ranges"] and on["n_stitch_maps"] < off["n_stitch_maps"]
    )
    assert (
        on["modelled_driver_ms"] < off["modelled_driver_ms"]
        and off["n_errors"] == on["n_errors"] == 0
    )
    # tensors served inside a longer kept range, and fewer access calls than a fresh range each
    # and one per remapped page (one per run of adjacent remapped pages)
    assert off["n_inside_reuses"] == 0 < on["n_inside_reuses"]
    assert off["n_stitch_set_access"] == off["n_fresh_ranges"]
    assert on["n_stitch_set_access"] < on["n_fresh_ranges"] + on["n_pages_remapped"]


def _host_core(spec: str = "best-fit", sample_every: int = 8):
    from realgpu.pool import GpuPool
    from realgpu.torch_allocator import ALIGNMENT_BYTES, AlignedHostDevice, AllocatorCore

    pool = GpuPool(spec, backend=AlignedHostDevice(), guard_bytes=ALIGNMENT_BYTES)
    return AllocatorCore(pool, sample_every=sample_every)


def test_a_traces_requests_replay_through_the_trampoline_with_each_malloc_tagged(bench):
    pytest.importorskip("torch")
    from realgpu.torch_allocator import load_shim
    from traces import bundled_path

    shim = load_shim()
    requests = bench._trace_requests(bundled_path("llama1b_generate_slice.pickle.gz"), 2000)
    n_mallocs = sum(a for a, _, _ in requests)
    core = _host_core()
    shim.bind(core)
    shim.reset()
    try:
        tags = bench._replay_calls(shim, core, requests, None, 0, True)
    finally:
        shim.bind(None)
    # every malloc tagged, in order; the first took a segment; every free went back (none leak)
    assert len(tags) == n_mallocs == shim.counters()["n_calls_malloc"] and tags[0] == "new_segment"
    assert not core.live and core.policy.num_live == 0
    # a sample every 8 calls (mallocs and frees): those that fell on a malloc, less the segment ones
    assert 0 < tags.count("monitor_sample") <= (2 * n_mallocs) // 8
    assert shim.breakdown()["n_calls_without_gil"] == 2 * n_mallocs  # the frees too
    b = bench.malloc_breakdown(shim.samples(0), tags)
    assert sum(b[f"share_{t}"] for t in bench.MALLOC_TAGS) == pytest.approx(1.0)
    assert sum(b[f"time_share_{t}"] for t in bench.MALLOC_TAGS) == pytest.approx(1.0)
    assert b["share_slow_path"] == 0 and b["mean_us_new_segment"] > 0
    core.close()


def test_call_marks_cover_only_the_calls_between_start_and_stop(bench):
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from realgpu.torch_allocator import load_shim

    shim = load_shim()
    core = _host_core(sample_every=4)
    alloc = SimpleNamespace(shim=shim, core=core, pool=core.pool)
    shim.bind(core)
    shim.reset()
    try:
        before = [shim.probe_malloc(1 << 20)[1] for _ in range(5)]  # "the model's build"
        marks = bench._CallMarks(alloc)
        ptrs = [shim.probe_malloc(4096, release_gil=True)[1] for _ in range(30)]
        for p in ptrs:
            shim.call_free(p, 4096)
        marks.stop()
        after = shim.probe_malloc(8192)[1]  # after stop: not counted
    finally:
        shim.bind(None)
    b = marks.breakdown(torch)
    assert b["gen_n_malloc"] == 30 and b["gen_n_free"] == 30
    assert b["gen_share_calls_without_gil"] == 1.0  # every call between the marks came without it
    assert b["gen_malloc_p50_us"] <= b["gen_malloc_p99_us"] and b["gen_malloc_mean_us"] > 0
    assert b["gen_n_slow_mallocs"] == 0 and b["n_streams"] == 1 and b["gen_gc_passes"] >= 0
    assert b["monitor_sample_us"] > 0 and b["monitor_sample_every_calls"] == 4
    assert b["split_python_call_ns"] > 0 and "capture_check_side_stream_ns" not in b  # no CUDA
    assert "generate: malloc mean" in bench.generate_breakdown_text(b)
    for p in before:
        core.free(p, 1 << 20, 0, 0)
    core.free(after, 8192, 0, 0)
    core.close()
    assert core.pool.closed and core.errors == []


# ------------------------------------------------------------ --persistent: paired rounds
def _rec(name, r, seconds, *, sha="t", warmup=False, malloc_us=None, position=0):
    rec = {
        "allocator": name,
        "round": r,
        "position": position,
        "warmup": warmup,
        "runs": [
            {"shape": shape, "seconds": s, "tokens_sha": sha}
            for shape, s in zip(("8x128", "4x1500"), seconds)
        ],
    }
    if malloc_us is not None:
        rec.update(malloc_mean_us=malloc_us, free_mean_us=malloc_us / 2)
    return rec


def test_settle_draws_met_missed_or_not_settled_from_the_medians_interval(bench):
    import random

    rng = random.Random(3)
    tight = [1.00 + rng.uniform(-0.02, 0.02) for _ in range(25)]
    slow = [1.20 + rng.uniform(-0.02, 0.02) for _ in range(25)]
    wide = [rng.uniform(0.7, 1.4) for _ in range(25)]
    assert bench.settle(tight, 1.05)["verdict"] == "met"
    assert bench.settle(slow, 1.05)["verdict"] == "missed"
    spread = bench.settle(wide, 1.05)
    assert spread["verdict"] == "not settled" and spread["lo"] < 1.05 < spread["hi"]
    assert spread["median"] == pytest.approx(sorted(wide)[12])
    # too few rounds: no verdict however clear; the same values, the same interval (seeded)
    assert bench.settle(tight[:4], 1.05)["verdict"] == "not settled"
    assert bench.median_interval(wide) == bench.median_interval(wide)
    assert bench.settle([], 1.05) == {
        "n": 0,
        "median": None,
        "lo": None,
        "hi": None,
        "verdict": "not settled",
    }


def test_paired_ratios_pair_each_round_with_pytorchs_and_skip_warmups(bench):
    # PyTorch's own time doubles in round 1 (the machine): paired, the policy stays at 1.1x
    records = [
        _rec("torch", -1, [9.0, 9.0], warmup=True),
        _rec("p", -1, [1.0, 1.0], warmup=True),
        _rec("torch", 0, [1.0, 1.0]),
        _rec("p", 0, [1.1, 1.1]),
        _rec("torch", 1, [2.0, 2.0]),
        _rec("p", 1, [2.2, 2.2]),
        _rec("p", 2, [1.0, 1.0]),  # PyTorch's worker failed this round: no pair
        {"allocator": "torch", "round": 2, "error": "no answer in 45 s"},
    ]
    assert bench.paired_ratios(records, "p") == pytest.approx([1.1, 1.1])
    assert bench.paired_ratios(records, "p", "4x1500") == pytest.approx([1.1, 1.1])


def test_verdict_rows_count_equal_tokens_and_settle_the_call_means_per_round(bench):
    records = []
    for r in range(8):
        records += [
            _rec("torch", r, [1.0, 1.0]),
            _rec("p", r, [1.0, 1.01], malloc_us=1.2 + 0.01 * r, sha="t" if r < 6 else "x"),
        ]
    run = {
        "records": records,
        "finals": {"p": {"malloc_breakdown": {"gen_malloc_mean_us": 1.3}}},
        "ready": {"p": {"policy_installed": True}},
    }
    (row,) = bench.verdict_rows(run, ["p"])
    assert row["n_rounds"] == 8 and row["generate_verdict"] == "met"
    assert row["ratio_median"] == pytest.approx(1.005)
    assert row["malloc_verdict"] == "met" and row["malloc_us_hi95"] <= 1.5
    assert row["free_us_median"] == pytest.approx((1.2 + 0.035) / 2)
    assert row["n_rounds_tokens_equal_torch"] == 6 and row["gen_malloc_mean_us"] == 1.3


def test_pin_cpus_lists_ranges_and_refuses_cpus_it_may_not_use(bench):
    import os

    allowed = sorted(os.sched_getaffinity(0))
    assert bench.parse_cpus("none") is None and bench.parse_cpus(None) is None
    assert bench.parse_cpus(f"{allowed[0]}-{allowed[0]}") == [allowed[0]]
    assert set(bench.parse_cpus("auto")) <= set(allowed) and bench.parse_cpus("auto")
    with pytest.raises(SystemExit, match="--pin-cpus: 'x' is not a list"):
        bench.parse_cpus("x")
    with pytest.raises(SystemExit, match="may not run on"):
        bench.parse_cpus(str(max(allowed) + 4096))


class _FakeWorker:
    """A persistent worker answering from a table of seconds (no process)."""

    started: list = []
    asked: list = []

    def __init__(self, label, cmd, tree, log_path):
        self.label = label
        self.cmd = cmd
        _FakeWorker.started.append(label)

    def ask(self, cmd, timeout_s):
        _FakeWorker.asked.append((self.label, cmd))
        if cmd is None:
            return {"ready": True, "pid": 1, "cpus": [0], "build": "x", "setup_s": 0.0}
        if cmd["cmd"] == "stop":
            return {"final": True}
        if self.label == "broken" and cmd["round"] == 1:
            return {"error": "exit 1: boom"}
        slow = 1.5 if self.label == "slow" else 1.0
        return {
            "round": cmd["round"],
            "runs": [{"shape": "2x8", "seconds": slow, "tokens_sha": "t"}],
        }

    def close(self):
        pass


def test_persistent_rounds_shuffle_each_round_drop_a_failed_worker_and_settle(
    bench, tmp_path, monkeypatch
):
    import argparse

    _FakeWorker.started, _FakeWorker.asked = [], []
    monkeypatch.setattr(bench, "PersistentWorker", _FakeWorker)
    args = argparse.Namespace(
        out=tmp_path,
        pin_cpus="none",
        worker_timeout=5.0,
        seed=0,
        rounds=12,
        warmup_rounds=1,
        budget_s=None,
        shapes="2x8",
        new_tokens=2,
        layers=1,
        repeats=1,
        device="cpu",
    )
    entries = [(n, n, bench.REPO) for n in ("torch", "fast", "slow", "broken")]
    run = bench.persistent_bench(args, entries)
    assert _FakeWorker.started == ["torch", "fast", "slow", "broken"]  # each started once
    orders = [o["order"] for o in run["orders"]]
    # every round a permutation of the workers alive; "broken" gone after it failed in round 1
    assert len(orders) == 13 and all(
        sorted(o) == ["broken", "fast", "slow", "torch"] for o in orders[:3]
    )
    assert all(sorted(o) == ["fast", "slow", "torch"] for o in orders[3:])
    assert len({tuple(o) for o in orders[3:]}) > 3  # shuffled, not one fixed order
    assert "broken" not in run["finals"]
    rows = {r["allocator"]: r for r in bench.write_paired(args, run, [e[0] for e in entries])}
    assert rows["fast"]["generate_verdict"] == "met" and rows["fast"]["n_rounds"] == 12
    assert rows["slow"]["generate_verdict"] == "missed"
    assert rows["slow"]["ratio_median"] == pytest.approx(1.5)
    assert rows["broken"]["n_rounds"] == 1 and rows["broken"]["generate_verdict"] == "not settled"
    for name in ("torch_alloc_rounds.csv", "torch_alloc_verdict.csv", "torch_alloc_summary.csv"):
        assert (tmp_path / name).is_file()
    # the warm-up round is run but never paired
    assert [c["warmup"] for w, c in _FakeWorker.asked if w == "torch" and c and "round" in c][
        :2
    ] == [True, False]


def test_persistent_rounds_stop_at_the_budget(bench, tmp_path, monkeypatch):
    import argparse

    clock = iter(range(0, 10_000, 10))  # every read of the clock: 10 s later
    monkeypatch.setattr(bench.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(bench, "PersistentWorker", _FakeWorker)
    args = argparse.Namespace(
        out=tmp_path,
        pin_cpus="none",
        worker_timeout=5.0,
        seed=0,
        rounds=100,
        warmup_rounds=0,
        budget_s=100.0,
        shapes="2x8",
        new_tokens=2,
        layers=1,
        repeats=1,
        device="cpu",
    )
    run = bench.persistent_bench(args, [(n, n, bench.REPO) for n in ("torch", "fast")])
    assert 0 < len(run["orders"]) < 10


def test_persistent_workers_run_end_to_end_on_the_cpu(tmp_path):
    # real processes, torch on the CPU and a tiny model: the orchestration itself, not only on a GPU
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import csv
    import json
    import os
    import subprocess
    import sys

    cpu = sorted(os.sched_getaffinity(0))[-1]
    cmd = [
        sys.executable, str(BENCH), "--persistent", "--device", "cpu", "--layers", "1",
        "--shapes", "2x8", "--new-tokens", "2", "--rounds", "3", "-p", "best-fit",
        "--pin-cpus", str(cpu), "--worker-timeout", "120", "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "best-fit: generate" in proc.stdout and "tokens equal PyTorch's in 3 of 3" in proc.stdout
    with open(tmp_path / "torch_alloc_rounds.csv") as f:
        rows = list(csv.DictReader(f))
    timed = [r for r in rows if r["warmup"] == "False"]
    assert sorted((r["round"], r["allocator"]) for r in timed) == [
        (str(r), a) for r in range(3) for a in ("best-fit", "torch")
    ]
    assert all(r["tokens_equal_torch"] == "True" for r in timed)
    paired = json.loads((tmp_path / "torch_alloc_paired.json").read_text())
    # one process per allocator for the whole run, pinned where asked
    assert {w["cpus"] == [cpu] for w in paired["ready"].values()} == {True}
    assert len({w["pid"] for w in paired["ready"].values()}) == 2
    assert set(paired["finals"]) == {"torch", "best-fit"}
    with open(tmp_path / "torch_alloc_verdict.csv") as f:
        (verdict,) = list(csv.DictReader(f))
    assert verdict["allocator"] == "best-fit" and verdict["n_rounds"] == "3"
    assert verdict["generate_verdict"] == "not settled"  # 3 rounds are too few for a verdict


def test_a_rounds_call_means_cover_only_that_rounds_calls(bench):
    # what a persistent policy worker answers each round: the trampoline's samples since the
    # round began, not the model's build before it
    pytest.importorskip("torch")
    from realgpu.torch_allocator import load_shim

    shim = load_shim()
    core = _host_core()
    shim.bind(core)
    shim.reset()
    try:
        build = [shim.probe_malloc(1 << 20)[1] for _ in range(4)]
        n0 = bench._call_counts(shim)
        ptrs = [shim.probe_malloc(4096, release_gil=True)[1] for _ in range(25)]
        for p in ptrs:
            shim.call_free(p, 4096)
        means = bench._call_means(shim, n0)
        assert bench._call_means(shim, bench._call_counts(shim)) == {}  # no call since
    finally:
        shim.bind(None)
    assert means["n_malloc"] == 25 and means["n_free"] == 25
    mallocs = shim.samples(0)[4:] / 1e3
    assert means["malloc_mean_us"] == pytest.approx(float(mallocs.mean()))
    for p in build:
        core.free(p, 1 << 20, 0, 0)
    core.close()


# ------------------------------------------------------------ --floor: the floor row
def test_verdict_rows_pair_each_policy_with_the_floor_of_the_same_round(bench):
    # the machine slows in odd rounds; paired per round, the policy is 1.02x the floor and 1.05x
    # PyTorch's, the floor 1.03x PyTorch's (its row has no ratio to itself)
    records = []
    for r in range(8):
        k = 2.0 if r % 2 else 1.0
        records += [
            _rec("torch", r, [k, k]),
            _rec(bench.FLOOR_LABEL, r, [1.03 * k, 1.03 * k]),
            _rec("p", r, [1.03 * 1.02 * k, 1.03 * 1.02 * k], malloc_us=1.0),
        ]
    run = {"records": records, "finals": {}, "ready": {}}
    floor, p = bench.verdict_rows(run, [bench.FLOOR_LABEL, "p"])
    assert floor["ratio_median"] == pytest.approx(1.03) and floor["ratio_to_floor_median"] is None
    assert p["ratio_median"] == pytest.approx(1.03 * 1.02)
    assert p["ratio_to_floor_median"] == pytest.approx(1.02)
    assert p["ratio_to_floor_lo95"] <= 1.02 <= p["ratio_to_floor_hi95"]
    # without a floor worker the columns are there, empty
    (alone,) = bench.verdict_rows(
        {"records": [r for r in records if r["allocator"] != bench.FLOOR_LABEL]}
        | {"finals": {}, "ready": {}},
        ["p"],
    )
    assert alone["ratio_to_floor_median"] is None


def test_the_floor_allocator_reuses_exact_rounded_sizes_and_reports_a_driver_refusal(
    bench, tmp_path
):
    # the C++ floor built as the benchmark builds it, its driver a ctypes stand-in for cudaMalloc
    import ctypes
    import shutil

    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler")
    floor = bench.FloorAllocator(build_dir=tmp_path)
    lib = floor.lib
    lib.floor_malloc.restype = ctypes.c_void_p
    lib.floor_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.floor_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    handed: list[int] = []
    refuse = {"on": False}

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
    def fake_malloc(out, size):
        if refuse["on"]:
            return 2  # cudaErrorMemoryAllocation
        handed.append(size)
        out[0] = 0x10000 * len(handed)
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    def fake_free(ptr):
        return 0

    lib.floor_set_driver(
        ctypes.cast(fake_malloc, ctypes.c_void_p), ctypes.cast(fake_free, ctypes.c_void_p)
    )
    assert lib.floor_malloc(0, 0, None) is None  # 0 bytes: no block, no driver call
    a = lib.floor_malloc(1000, 0, None)
    b = lib.floor_malloc(1024, 0, None)  # the same rounded size: a second block
    assert a and b and a != b and handed == [1024, 1024]
    lib.floor_free(a, 1000, 0, None)
    assert lib.floor_malloc(600, 0, None) == a  # 600 rounds to 1024 too: the freed block
    refuse["on"] = True
    assert lib.floor_malloc(4096, 0, None) is None  # the driver refused: PyTorch raises its OOM
    counters = floor.counters()
    assert counters["num_malloc"] == 4 and counters["num_driver_malloc"] == 3
    assert (
        counters["num_free"] == 1 and counters["held_bytes"] == 1024 + 1024
    )  # the refused 4096 holds nothing


def test_floor_needs_persistent_rounds():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(BENCH), "--floor"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--floor needs --persistent" in proc.stderr
