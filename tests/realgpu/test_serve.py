"""``poollab gpu serve``: the request plan, the real-time driver, the step log and request table,
the summary row and the command's option mapping, with a fake engine on a fake clock; a CPU smoke
run of transformers' real engine on a tiny model where torch and transformers are installed; a GPU
run."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from poollab.cli import cli, main
from realgpu.serve import (
    PYTORCH,
    Completion,
    ServeRun,
    ServeSettings,
    StepRow,
    drive,
    plan_requests,
    policy_slug,
    serve_summary_row,
    served_table,
    step_table,
    write_serve_results,
)
from sim.replay.schema import SUMMARY_COLUMNS, summary_frame
from sim.replay.serving_metrics import SERVING_COLUMNS
from traces.engine_profile import STEP_COLUMNS, read_served_requests, read_step_profile

#: A start-up snapshot of transformers' continuous batching, recorded on the H200 by `poollab gpu
#: serve --snapshot`
STARTUP_SNAPSHOT = (
    Path(__file__).resolve().parents[2]
    / "tests"
    / "data"
    / "snapshots_h200"
    / "startup_transformers_cb.pickle.gz"
)
AZURE = Path(__file__).resolve().parents[2] / "traces" / "data" / "azure_code_slice.csv"


def _requests(arrival, prompt, output) -> pd.DataFrame:
    return pd.DataFrame({"arrival_s": arrival, "prompt_tokens": prompt, "output_tokens": output})


# --- the plan -------------------------------------------------------------------------------------


def test_plan_caps_prompt_and_output_to_the_longest_sequence():
    plan = plan_requests(
        _requests([0.0, 1.0, 2.0], [100, 9000, 10], [50, 10, 9000]), max_len_tokens=8192
    )
    assert plan["prompt_tokens"].tolist() == [100, 8182, 1]
    assert plan["output_tokens"].tolist() == [50, 10, 8191]
    assert (plan["prompt_tokens"] + plan["output_tokens"] <= 8192).all()
    assert plan["trace_prompt_tokens"].tolist() == [100, 9000, 10]


def test_plan_scales_then_cuts_in_real_seconds_and_rebases():
    req = _requests([10.0, 12.0, 14.0, 16.0, 30.0], [5] * 5, [3] * 5)
    plan = plan_requests(req, max_len_tokens=64, rate_scale=2.0, duration_s=3.5)
    assert plan["arrival_s"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the 30 s one lands at 10 s: cut
    assert plan["request"].tolist() == [0, 1, 2, 3]
    assert len(plan_requests(req, max_len_tokens=64, max_requests=2)) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rate_scale": 0}, "--rate-scale 0 must be > 0"),
        ({"duration_s": -1}, "--duration -1 must be > 0"),
        ({"max_requests": 0}, "--max-requests 0 must be >= 1"),
        ({"max_len_tokens": 1}, "leaves no room"),
    ],
)
def test_plan_names_the_option_that_leaves_nothing(kwargs, message):
    args = {"max_len_tokens": 64, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan_requests(_requests([0.0], [5], [3]), **args)


def test_plan_of_an_empty_trace_says_so():
    with pytest.raises(ValueError, match="no request to serve: the trace is empty"):
        plan_requests(_requests([], [], []), max_len_tokens=64, duration_s=0.5)


# --- the driver, with a fake engine on a fake clock -----------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Prefills a whole prompt in one step (first token at the step's end), then one token a step;
    every step takes ``step_s`` of the fake clock; ``die_after`` steps, it stops."""

    def __init__(self, clock: FakeClock, step_s: float = 0.1, die_after: int | None = None):
        self.clock, self.step_s, self.die_after = clock, step_s, die_after
        self.active: dict[int, dict] = {}
        self.steps: list[StepRow] = []
        self.submitted: list[tuple[int, float, int, int]] = []

    def submit(self, request_id, prompt_ids, output_tokens):
        self.submitted.append((request_id, self.clock.now, len(prompt_ids), output_tokens))
        self.active[request_id] = {
            "prompt": len(prompt_ids),
            "left": output_tokens,
            "done": 0,
            "first": math.nan,
        }

    def alive(self):
        return self.die_after is None or len(self.steps) < self.die_after

    def results(self, timeout_s):
        end = self.clock.now + timeout_s
        out = []
        if not self.active or not self.alive():
            self.clock.now = end
            return out
        start = self.clock.now
        pre = [r for r in self.active.values() if r["done"] == 0]
        dec = [r for r in self.active.values() if r["done"] > 0]
        self.clock.now += self.step_s
        self.steps.append(
            StepRow(
                start,
                self.step_s,
                len(pre),
                sum(r["prompt"] for r in pre),
                sum(r["prompt"] for r in pre),
                len(dec),
                sum(r["prompt"] + r["done"] for r in dec),
            )
        )
        for rid, r in list(self.active.items()):
            if r["done"] == 0:
                r["first"] = self.clock.now
            r["done"] += 1
            r["left"] -= 1
            if r["left"] == 0:
                out.append(Completion(rid, r["first"], self.clock.now, r["done"]))
                del self.active[rid]
        return out


def test_drive_submits_at_arrival_times_and_collects_every_request():
    clock = FakeClock()
    engine = FakeEngine(clock)
    plan = plan_requests(_requests([0.0, 0.25, 1.0], [4, 6, 8], [3, 1, 2]), max_len_tokens=64)
    t0, submit_t, done = drive(engine, plan, vocab_size=50, clock=clock, poll_s=0.05)
    assert t0 == 100.0
    assert sorted(c.request_id for c in done) == [0, 1, 2]
    for (rid, at, prompt, output), arrival in zip(engine.submitted, plan["arrival_s"]):
        assert (
            at - t0 >= arrival and at - t0 < arrival + 0.11
        )  # never early, at most one fake step late
        assert prompt == plan["prompt_tokens"][rid] and output == plan["output_tokens"][rid]
    served = served_table(plan, t0, submit_t, done)
    assert served["num_generated"].tolist() == [3, 1, 2]
    assert (served["first_token_s"] > served["arrival_s"]).all()
    assert (served["finish_s"] >= served["first_token_s"]).all()
    assert (served["error"] == "").all()


def test_drive_prompt_ids_are_random_token_ids_of_the_plans_lengths():
    clock = FakeClock()
    seen = []

    class Recording(FakeEngine):
        def submit(self, request_id, prompt_ids, output_tokens):
            seen.append(list(prompt_ids))
            super().submit(request_id, prompt_ids, output_tokens)

    plan = plan_requests(_requests([0.0, 0.0], [300, 300], [1, 1]), max_len_tokens=1024)
    drive(Recording(clock), plan, vocab_size=1000, clock=clock, seed=3)
    assert [len(p) for p in seen] == [300, 300]
    assert all(0 <= t < 1000 for p in seen for t in p)
    assert seen[0] != seen[1]  # no shared prefixes between requests


def test_drive_stops_when_the_engine_dies_and_marks_the_rest_unfinished():
    clock = FakeClock()
    engine = FakeEngine(clock, die_after=2)
    plan = plan_requests(_requests([0.0, 0.0, 5.0], [4, 4, 4], [1, 9, 1]), max_len_tokens=64)
    t0, submit_t, done = drive(engine, plan, vocab_size=50, clock=clock)
    served = served_table(plan, t0, submit_t, done)
    assert math.isfinite(served["finish_s"][0])
    assert (
        math.isnan(served["finish_s"][1])
        and served["error"][1] == "no result: the engine stopped first"
    )
    assert served["error"][2] == "never submitted" and math.isnan(served["first_token_s"][2])


def test_step_table_has_the_profile_columns_and_leaves_warm_up_steps_out():
    steps = [
        StepRow(5.0, 0.2, 1, 100, 100, 0, 0),
        StepRow(10.5, 0.1, 0, 0, 0, 2, 210),
        StepRow(11.0, 0.3, 1, 50, 150, 1, 101),
    ]
    table = step_table(steps, t0=10.0)
    assert list(table.columns) == ["start_s", *STEP_COLUMNS]
    assert table["start_s"].tolist() == [0.5, 1.0]
    assert table["decode_context_tokens"].tolist() == [210, 101]


def test_step_table_keeps_the_cpu_time_only_where_every_step_has_it():
    timed = [
        StepRow(10.5, 0.1, 0, 0, 0, 2, 210, cpu_s=0.06),
        StepRow(11.0, 0.3, 1, 50, 150, 1, 101, cpu_s=0.25),
    ]
    assert step_table(timed, t0=10.0)["cpu_s"].tolist() == [0.06, 0.25]
    partly = [timed[0], StepRow(11.0, 0.3, 1, 50, 150, 1, 101)]
    assert "cpu_s" not in step_table(partly, t0=10.0)


def test_the_engine_loop_records_its_threads_cpu_time_beside_the_wall():
    """``TransformersEngine``'s timed loop body (no transformers needed: a stand-in manager): a step
    that computes has CPU time close to its wall, one that waits (sleeps) far less."""
    from types import SimpleNamespace

    from realgpu.serve_engine import TransformersEngine

    engine = object.__new__(TransformersEngine)
    scheduler = object()
    processor = SimpleNamespace(scheduler=scheduler)

    def body(batch_processor, bootstrapping):
        engine._batch = [0, 0, 0, 1, 10]
        if bootstrapping == "compute":
            t = time.thread_time()
            while time.thread_time() - t < 0.05:
                pass
        else:
            time.sleep(0.05)
        return True

    engine.manager = SimpleNamespace(_generation_loop_body=body)
    engine.steps, engine._on_step, engine._batch, engine._scheduler = [], None, None, scheduler
    engine._instrument()
    engine.manager._generation_loop_body(processor, "compute")
    engine.manager._generation_loop_body(processor, "wait")
    computed, waited = engine.steps
    assert 0.05 <= computed.cpu_s <= computed.duration_s + 1e-3
    assert waited.duration_s >= 0.05 and waited.cpu_s < 0.5 * waited.duration_s
    assert (waited.num_decode_seqs, waited.decode_context_tokens) == (1, 10)


def test_failed_request_keeps_its_first_token_but_no_finish():
    plan = plan_requests(_requests([0.0, 0.0], [4, 4], [2, 2]), max_len_tokens=64)
    done = [Completion(0, 10.5, 11.0, 2), Completion(1, 10.4, 10.9, 1, error="OutOfMemoryError")]
    served = served_table(plan, 10.0, np.array([10.0, 10.0]), done)
    assert served["finish_s"][0] == pytest.approx(1.0)
    assert math.isnan(served["finish_s"][1]) and served["error"][1] == "OutOfMemoryError"


# --- the summary row ------------------------------------------------------------------------------


def _memory_row() -> dict:
    row = dict.fromkeys(SUMMARY_COLUMNS, 0)
    row.update(
        trace="t", policy=PYTORCH, backend="torch-cuda", params="", peak_reserved_bytes=1 << 30
    )
    return row


def test_summary_row_has_simulates_serving_columns_from_the_request_table():
    served = pd.DataFrame(
        {
            "request": [0, 1],
            "arrival_s": [0.0, 1.0],
            "prompt_tokens": [10, 20],
            "output_tokens": [5, 1],
            "first_token_s": [0.5, 3.0],
            "finish_s": [2.5, 3.0],
            "num_generated": [5, 1],
            "error": ["", ""],
        }
    )
    steps = pd.DataFrame(
        {
            "start_s": [0.0, 1.0],
            "duration_s": [1.0, 3.0],
            "num_prefill_seqs": [1, 0],
            "num_prefill_tokens": [10, 0],
            "prefill_context_tokens": [10, 0],
            "num_decode_seqs": [0, 1],
            "decode_context_tokens": [0, 30],
        }
    )
    row = serve_summary_row(_memory_row(), served, steps, kv_capacity_tokens=100, num_preemptions=2)
    assert set(SERVING_COLUMNS) <= set(row)
    assert row["ttft_p50_s"] == pytest.approx((0.5 + 2.0) / 2)
    assert row["tpot_p50_s"] == pytest.approx(
        0.5
    )  # (2.5 - 0.5) / 4; a one-token output has no TPOT
    assert row["e2e_p99_s"] == pytest.approx(np.percentile([2.5, 2.0], 99))
    assert row["output_tok_s"] == pytest.approx(6 / 3.0)  # last finish at 3 s
    assert row["kv_token_util"] == pytest.approx((10 * 1 + 30 * 3) / (4 * 100))
    assert (
        row["n_preempted"] == 2
        and row["num_steps"] == 2
        and row["step_p50_s"] == pytest.approx(2.0)
    )
    assert list(summary_frame([row]).columns[: len(SUMMARY_COLUMNS)]) == SUMMARY_COLUMNS


def test_unfinished_requests_count_against_n_finished_not_the_latencies():
    served = pd.DataFrame(
        {
            "request": [0, 1],
            "arrival_s": [0.0, 0.0],
            "prompt_tokens": [10, 10],
            "output_tokens": [2, 2],
            "first_token_s": [1.0, np.nan],
            "finish_s": [2.0, np.nan],
            "num_generated": [2, 0],
            "error": ["", "never submitted"],
        }
    )
    steps = pd.DataFrame(columns=["start_s", *STEP_COLUMNS])
    row = serve_summary_row(_memory_row(), served, steps, kv_capacity_tokens=100)
    assert row["n_requests"] == 2 and row["n_finished"] == 1 and row["n_request_errors"] == 1
    assert row["ttft_p99_s"] == pytest.approx(1.0)
    assert math.isnan(row["kv_token_util"])


def test_result_folder_round_trips_through_the_profile_readers(tmp_path):
    served = pd.DataFrame(
        {
            "request": [0],
            "arrival_s": [0.0],
            "prompt_tokens": [10],
            "output_tokens": [2],
            "first_token_s": [0.4],
            "finish_s": [0.6],
            "num_generated": [2],
            "error": [""],
        }
    )
    steps = step_table(
        [StepRow(1.0, 0.4, 1, 10, 10, 0, 0), StepRow(1.4, 0.2, 0, 0, 0, 1, 11)], t0=1.0
    )
    row = serve_summary_row(_memory_row(), served, steps, kv_capacity_tokens=512)
    run = ServeRun(spec="best-fit:virtual=true", summary=row, steps=steps, served=served)
    files = write_serve_results(tmp_path / "out", [run], {"command": "gpu serve"})
    assert [f.name for f in files] == [
        "steps_best-fit_virtual-true.csv",
        "requests_best-fit_virtual-true.csv",
    ]
    back = read_step_profile(files[0])
    assert back["num_decode_seqs"].tolist() == [0, 1] and back["start_s"].tolist() == pytest.approx(
        [0.0, 0.4]
    )
    assert read_served_requests(files[1])["finish_s"].tolist() == [0.6]
    assert pd.read_csv(tmp_path / "out" / "summary.csv")["policy"].tolist() == [PYTORCH]
    assert json.loads((tmp_path / "out" / "run.json").read_text())["command"] == "gpu serve"


def test_both_snapshots_and_their_memory_figures_land_in_the_result_folder(tmp_path):
    from traces.engine_memory import read_engine_memory, write_engine_memory

    served = pd.DataFrame(
        {
            "request": [0],
            "arrival_s": [0.0],
            "prompt_tokens": [10],
            "output_tokens": [2],
            "first_token_s": [0.4],
            "finish_s": [0.6],
            "num_generated": [2],
            "error": [""],
        }
    )
    steps = step_table([StepRow(1.0, 0.4, 1, 10, 10, 0, 0)], t0=1.0)
    work = tmp_path / "work"
    work.mkdir()
    for name, what in (("snapshot.pickle.gz", "startup"), ("snapshot_run.pickle.gz", "run")):
        (work / name).write_bytes(name.encode())
        write_engine_memory(
            work / name,
            {"snapshot": what, "non_torch_startup_bytes": 7, "mem_get_info_total_bytes": 99},
        )
    run = ServeRun(
        spec=PYTORCH,
        summary=serve_summary_row(_memory_row(), served, steps, kv_capacity_tokens=512),
        steps=steps,
        served=served,
        snapshot_path=work / "snapshot.pickle.gz",
        run_snapshot_path=work / "snapshot_run.pickle.gz",
    )
    files = write_serve_results(tmp_path / "out", [run], {"command": "gpu serve"})
    assert [f.name for f in files][2:] == [
        "snapshot_pytorch.pickle.gz",
        "snapshot_pytorch.json",
        "snapshot_pytorch_run.pickle.gz",
        "snapshot_pytorch_run.json",
    ]
    assert (
        tmp_path / "out" / "snapshot_pytorch_run.pickle.gz"
    ).read_bytes() == b"snapshot_run.pickle.gz"
    found = read_engine_memory(
        tmp_path / "out" / "snapshot_pytorch.pickle.gz"
    )  # what `poollab plan` reads
    assert found.non_torch_bytes == 7 and found.total_bytes == 99
    assert (
        json.loads((tmp_path / "out" / "snapshot_pytorch_run.json").read_text())["snapshot"]
        == "run"
    )


def test_the_engines_non_torch_memory_is_the_devices_used_less_pytorchs_reserved(monkeypatch):
    torch = pytest.importorskip("torch")
    from realgpu.serve_engine import NonTorchMemory

    readings = iter(
        [(40, 100, 50), (30, 100, 60), (35, 100, 40), (20, 100, 75)]
    )  # free, total, reserved
    now = {}

    def mem_get_info(device=None):
        now["free"], total, now["reserved"] = next(readings)
        return now["free"], total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: now["reserved"])
    watch = NonTorchMemory(torch.device("cuda", 0))
    watch.at_startup()  # used 60, PyTorch 50: 10 outside
    for _ in range(3):  # serving: 10, 25, 5 outside; the largest is kept with its reading
        watch.sample()
    fields = watch.fields()
    assert fields["mem_get_info_total_bytes"] == 100 and fields["non_torch_startup_bytes"] == 10
    assert (
        fields["non_torch_serving_max_bytes"],
        fields["device_used_serving_max_bytes"],
        fields["torch_reserved_serving_max_bytes"],
    ) == (25, 65, 40)


def test_snapshot_until_takes_both_and_names_a_bad_value(monkeypatch, tmp_path):
    assert ServeSettings(snapshot=True, snapshot_until="both").snapshot_until == "both"
    with pytest.raises(
        ValueError, match="snapshot-until 'later' must be one of startup, end, both"
    ):
        ServeSettings(snapshot_until="later")


def test_policy_slug_is_a_file_name():
    assert policy_slug("best-fit:virtual=true") == "best-fit_virtual-true"
    assert policy_slug("pytorch") == "pytorch"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("block_tokens", 0, "block-tokens 0 must be >= 1"),
        ("num_blocks", 0, "num-blocks 0 must be >= 1"),
        ("max_memory_percent", 1.5, r"max-memory-percent 1.5 must be in \(0, 1\]"),
        ("max_len_tokens", 1, "max-len 1 must be >= 2"),
    ],
)
def test_settings_name_the_bad_option(field, value, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings(**{field: value})


# --- the command ----------------------------------------------------------------------------------


def _run(*args):
    return CliRunner().invoke(cli, ["gpu", "serve", *map(str, args)])


@pytest.fixture
def one_line_error(capsys):
    """``poollab gpu serve ARGS`` fails with exit status 2 and one stderr line holding each
    needle."""

    def check(args, *needles):
        with pytest.raises(SystemExit) as info:
            main(["gpu", "serve", *map(str, args)])
        out = capsys.readouterr()
        assert info.value.code == 2
        assert out.err.count("\n") == 1 and out.err.startswith("poollab: error: "), out.err
        assert "Traceback" not in out.err + out.out
        for n in needles:
            assert n in out.err, out.err

    return check


def test_cli_unknown_policy_is_one_line(one_line_error):
    one_line_error([AZURE, "-p", "no-such-policy"], "no-such-policy")


def test_cli_bad_rate_scale_is_one_line(one_line_error):
    one_line_error([AZURE, "--rate-scale", "0"], "Invalid value for '--rate-scale': 0 is not in")


def test_cli_bad_block_tokens_is_one_line(one_line_error):
    one_line_error(
        [AZURE, "--block-tokens", "0"], "Invalid value for '--block-tokens': 0 is not in"
    )


def test_cli_missing_trace_is_one_line(tmp_path, one_line_error):
    one_line_error([tmp_path / "nope.csv"], "nope.csv")


def test_cli_allocation_trace_points_to_replay(one_line_error):
    snapshot = STARTUP_SNAPSHOT
    one_line_error([snapshot], "allocation trace", "poollab replay")


def test_cli_without_torch_says_what_to_install(monkeypatch, one_line_error):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    one_line_error([AZURE, "--max-requests", "2"], "transformers", "poollab[engine]")


def test_cuda_graphs_under_a_pluggable_policy_are_refused_before_any_engine_starts(tmp_path):
    from realgpu.serve import serve_trace

    settings = ServeSettings(cuda_graphs=True)
    with pytest.raises(
        ValueError, match=r"--cuda-graphs with policy 'best-fit' needs --allocator-mode mempool"
    ):
        serve_trace(
            None, [PYTORCH, "best-fit"], settings, out_dir=tmp_path / "out"
        )  # refused before the trace is read
    assert not (tmp_path / "out").exists()


def test_startup_snapshot_holds_the_kv_cache_tensors():
    """The committed H200 start-up snapshot (issue 34's input): the 64 KV tensors of Llama-3-8B's
    32 layers, allocated in transformers' PagedAttentionCache, 3,060 blocks of 256 tokens each."""
    import gzip
    import pickle

    path = STARTUP_SNAPSHOT
    with gzip.open(path) as f:
        snap = pickle.load(f)
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    kv_bytes = (3060 + 2) * 256 * 8 * 128 * 2  # two padding blocks, 8 KV heads of 128, bf16
    kv = [e for e in allocs if e["size"] == kv_bytes]
    assert len(kv) == 64
    assert all(any(fr["filename"].endswith("cache.py") for fr in e["frames"]) for e in kv)


# --- the real engine on the CPU (a tiny model) ----------------------------------------------------


def tiny_model(tmp_path: Path) -> Path:
    """A model file of a 2-layer Llama shape, small enough for the host."""
    model = tmp_path / "tiny.json"
    model.write_text(
        json.dumps(
            {
                "name": "tiny",
                "num_layers": 2,
                "hidden_size": 64,
                "num_heads": 4,
                "num_kv_heads": 2,
                "head_dim": 16,
                "intermediate_size": 128,
                "vocab_size": 256,
                "param_count": 106816,
                "dtype": "fp32",
                "gated_mlp": True,
                "tied_embeddings": False,
                "max_position_embeddings": 256,
            }
        )
    )
    return model


def test_transformers_engine_on_the_cpu_serves_a_plan_step_by_step(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import functools

    from realgpu.serve import serve_trace
    from sim.serving.engine_compare import compare_with_engine
    from traces.requests import RequestTrace

    model = tiny_model(tmp_path)
    req = _requests([0.0, 0.05, 0.1, 0.3], [10, 100, 40, 200], [5, 8, 3, 10])
    before_s = time.perf_counter()
    settings = ServeSettings(
        model=str(model),
        block_tokens=16,
        max_batch_tokens=64,
        max_num_seqs=8,
        num_blocks=40,
        max_len_tokens=128,
        on_cpu=True,
        warmup=False,
    )
    outcome = serve_trace(
        RequestTrace(requests=req, name="tiny-trace"),
        [PYTORCH],
        settings,
        out_dir=tmp_path / "out",
        compare=functools.partial(compare_with_engine, gpu="H200"),
        log=lambda line: None,
    )
    run = outcome.runs[0]
    # --sim: the simulator's side got the run and the resolved settings; its table is written
    table = outcome.comparisons[PYTORCH].set_index("column")
    # (torch-caching's 2 MiB segments do not fit this tiny cache: the prediction is 0 finished)
    assert table.loc["n_finished", "measured"] == 4 and table.loc["n_finished", "predicted"] == 0
    assert table.loc["ttft_p50_s", "measured"] > 0
    written = pd.read_parquet(tmp_path / "out" / "sim_comparison.parquet")
    assert written["policy"].unique().tolist() == [PYTORCH] and len(written) == len(table)
    plan = outcome.plan
    assert plan["prompt_tokens"].tolist() == [10, 100, 40, 118]  # 200 capped: 118 + 10 = 128
    served, steps = run.served, run.steps
    assert (
        served["num_generated"] == plan["output_tokens"]
    ).all()  # EOS disabled: exactly the trace's length
    assert (served["first_token_s"] >= served["arrival_s"]).all() and (
        served["finish_s"] >= served["first_token_s"]
    ).all()
    # every prompt token prefilled once (chunked to the 64-token budget), one decode per later token
    assert steps["num_prefill_tokens"].sum() == plan["prompt_tokens"].sum()
    assert steps["num_decode_seqs"].sum() == (plan["output_tokens"] - 1).sum()
    assert (steps["num_prefill_tokens"] + steps["num_decode_seqs"] <= 64).all()
    assert (steps["prefill_context_tokens"] >= steps["num_prefill_tokens"]).all()
    assert run.summary["n_finished"] == 4 and run.summary["kv_blocks"] == 40
    # the steps' zero on the machine's monotonic clock (the engine's process measured it), so other
    # processes' logs line up with them: between this test's start and now, the last step ending
    # before now
    t0_s = run.summary["t0_perf_counter_s"]
    assert (
        before_s
        < t0_s
        < t0_s + (steps["start_s"] + steps["duration_s"]).max()
        < time.perf_counter()
    )
    # the engine thread's CPU time in each step: some, and no more than the step's wall (torch's
    # other threads are not the loop's)
    assert (steps["cpu_s"] > 0).all() and (steps["cpu_s"] <= steps["duration_s"] + 1e-3).all()
    written = read_step_profile(tmp_path / "out" / "steps_pytorch.csv")
    assert written["cpu_s"].tolist() == pytest.approx(steps["cpu_s"].tolist())


def test_without_the_footprint_check_the_engine_starts_at_exactly_num_blocks(tmp_path):
    # 1e-7 of the host's memory is far below the tiny cache's footprint: transformers refuses 40
    # blocks by its own estimate; with the check off the option reaches the engine, which starts at
    # exactly 40 and serves
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from realgpu.serve import serve_trace
    from traces.requests import RequestTrace

    model = tiny_model(tmp_path)
    trace = RequestTrace(requests=_requests([0.0, 0.05], [10, 30], [3, 4]), name="tiny-trace")
    common = dict(
        model=str(model),
        block_tokens=16,
        max_batch_tokens=64,
        max_num_seqs=8,
        num_blocks=40,
        max_memory_percent=1e-7,
        max_len_tokens=128,
        on_cpu=True,
        warmup=False,
    )
    with pytest.raises(ValueError, match="Memory footprint .* is more than available memory"):
        serve_trace(
            trace,
            [PYTORCH],
            ServeSettings(**common),
            out_dir=tmp_path / "on",
            log=lambda line: None,
        )
    lines: list[str] = []
    outcome = serve_trace(
        trace,
        [PYTORCH],
        ServeSettings(**common, engine_footprint_check=False),
        out_dir=tmp_path / "off",
        log=lines.append,
    )
    assert outcome.runs[0].summary["kv_blocks"] == 40 and outcome.runs[0].summary["n_finished"] == 2
    assert any("footprint check off: exactly 40 blocks" in line for line in lines), lines
    assert any("transformers estimates" in line and "starting anyway" in line for line in lines), (
        lines
    )
    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

    assert (
        PagedAttentionMemoryHandler._check_footprint.__name__ == "_check_footprint"
    )  # restored after the run


def test_cli_footprint_check_option_reaches_the_settings(monkeypatch, tmp_path):
    import realgpu.serve as serve_module
    from poollab.cli import main

    seen = {}

    def fake_serve_trace(requests, specs, settings, **kwargs):
        seen["settings"] = settings
        raise ValueError("stop here")

    monkeypatch.setattr(serve_module, "check_engine_installed", lambda: None)
    monkeypatch.setattr(serve_module, "serve_trace", fake_serve_trace)
    for flag, expected in (
        ("--no-engine-footprint-check", False),
        ("--engine-footprint-check", True),
    ):
        with pytest.raises(SystemExit):
            main(
                [
                    "gpu",
                    "serve",
                    str(AZURE),
                    "--num-blocks",
                    "7",
                    flag,
                    "--out",
                    str(tmp_path / "o"),
                ]
            )
        assert (
            seen["settings"].engine_footprint_check is expected and seen["settings"].num_blocks == 7
        )


def test_cli_sim_hands_the_simulators_comparison_to_serve_trace(monkeypatch, tmp_path):
    """``--sim`` maps to ``compare=`` ``sim.serving.engine_compare.compare_with_engine`` with the
    ``--gpu`` and ``--calibration`` bound; ``--no-sim`` to none (and then no simulator import)."""
    import realgpu.serve as serve_module
    from poollab.cli import main
    from sim.serving.engine_compare import compare_with_engine

    seen = {}

    def fake_serve_trace(requests, specs, settings, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(serve_module, "check_engine_installed", lambda: None)
    monkeypatch.setattr(serve_module, "serve_trace", fake_serve_trace)
    calibration = tmp_path / "cal.json"
    calibration.write_text(
        json.dumps({"format": "poollab-step-time/2", "terms": {"fixed_s": 0.05}})
    )
    args = ["gpu", "serve", str(AZURE), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit):
        main([*args, "--sim", "--gpu", "H100", "--calibration", str(calibration)])
    compare = seen["compare"]
    assert compare.func is compare_with_engine
    warn = compare.keywords.pop("warn")
    # the file is read once, before the engine's run; the simulator's side gets what was loaded
    assert compare.keywords.pop("gpu") == "H100"
    assert compare.keywords.pop("calibration").terms.fixed_s == 0.05
    assert compare.keywords == {}
    assert callable(warn)  # a range warning of the --sim runs goes to stderr
    with pytest.raises(SystemExit):
        main([*args, "--no-sim"])
    assert seen["compare"] is None


# --- the GPU --------------------------------------------------------------------------------------


def _needs_cuda_engine() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.gpu
def test_gpu_serve_runs_pytorch_and_writes_the_step_profile(tmp_path):
    _needs_cuda_engine()
    result = _run(
        AZURE,
        "-p",
        PYTORCH,
        "--model",
        "Llama-3.2-1B",
        "--max-requests",
        "8",
        "--max-len",
        "2048",
        "--num-blocks",
        "64",
        "--out",
        tmp_path / "out",
    )
    assert result.exit_code == 0, result.output
    steps = read_step_profile(tmp_path / "out" / "steps_pytorch.csv")
    served = read_served_requests(tmp_path / "out" / "requests_pytorch.csv")
    assert len(served) == 8 and served["finish_s"].notna().all()
    assert steps["num_prefill_tokens"].sum() == served["prompt_tokens"].sum()
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert summary["peak_reserved_bytes"][0] > 0 and summary["n_finished"][0] == 8


@pytest.mark.gpu
def test_gpu_serve_captures_cuda_graphs_with_a_policy_in_mempool_mode(tmp_path):
    _needs_cuda_engine()
    result = _run(
        AZURE,
        "-p",
        "best-fit",
        "--allocator-mode",
        "mempool",
        "--cuda-graphs",
        "--model",
        "Llama-3.2-1B",
        "--max-requests",
        "8",
        "--max-len",
        "2048",
        "--num-blocks",
        "64",
        "--out",
        tmp_path / "out",
    )
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert summary["n_finished"][0] == 8 and summary["backend"][0] == "torch-mempool", summary.iloc[
        0
    ].to_dict()
    assert (
        bool(summary["cuda_graphs"][0])
        and summary["n_alloc"][0] > 0
        and summary["n_live_at_close"][0] == 0
    )


def test_under_a_pluggable_policy_the_engine_reads_the_policys_reserved_bytes():
    """PyTorch keeps no counters under a pluggable allocator (memory_reserved raises there), and
    transformers sizes its KV cache from memory_reserved: the run answers with the policy's."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from realgpu.serve_engine import _policy_memory_counters

    alloc = SimpleNamespace(
        mode="pluggable",
        pool=SimpleNamespace(stats=lambda: SimpleNamespace(reserved_bytes=123 << 20)),
    )
    original = torch.cuda.memory_reserved
    with _policy_memory_counters(alloc):
        assert torch.cuda.memory_reserved(0) == 123 << 20
    assert torch.cuda.memory_reserved is original
    with _policy_memory_counters(
        SimpleNamespace(mode="mempool")
    ):  # PyTorch's own counters hold there
        assert torch.cuda.memory_reserved is original


def test_a_policy_whose_engine_fails_is_reported_and_nothing_half_written(tmp_path):
    """The engine process fails (here: a policy on a host run, or no torch at all): serve_trace says
    which policy and why in one line, and writes no result folder."""
    from realgpu.serve import serve_trace
    from traces.requests import RequestTrace

    logged = []
    settings = ServeSettings(model="Llama-3.2-1B", max_len_tokens=128, on_cpu=True, warmup=False)
    with pytest.raises(ValueError, match=r"no policy ran: gpu serve: policy 'best-fit': \w+"):
        serve_trace(
            RequestTrace(requests=_requests([0.0], [4], [2]), name="t"),
            ["best-fit"],
            settings,
            out_dir=tmp_path / "out",
            log=logged.append,
        )
    assert any(line.startswith("warning: gpu serve: policy 'best-fit'") for line in logged)
    assert not (tmp_path / "out").exists()


def test_in_mempool_mode_the_engines_thread_gets_the_pool_from_start_to_stop(monkeypatch):
    # the H200: the engine's thread entered the policy's pool while this thread was routed to it,
    # and PyTorch refused ("beginAllocateToPool: already recording to mempool_id"): the engine never
    # started
    import contextlib
    import sys
    from types import SimpleNamespace

    from realgpu.serve_engine import _engine_thread_in_mempool

    events = []

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        events.append(("enter", pool))
        yield
        events.append(("exit", pool))

    monkeypatch.setitem(
        sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(use_mem_pool=use_mem_pool))
    )
    alloc = SimpleNamespace(
        mempool="policy-pool",
        pause_routing=lambda: events.append("pause"),
        resume_routing=lambda: events.append("resume"),
    )
    manager = SimpleNamespace(_run_generation_loop=lambda: events.append("loop"))

    def start(fail=False):
        manager._run_generation_loop()  # the engine's thread, run here
        if fail:
            raise RuntimeError("the engine did not start")

    engine = SimpleNamespace(manager=manager, start=start, stop=lambda: events.append("stop"))
    _engine_thread_in_mempool(engine, alloc, "cuda:0")
    engine.start()
    engine.stop()
    assert events == [
        "pause",
        ("enter", "policy-pool"),
        "loop",
        ("exit", "policy-pool"),
        "stop",
        "resume",
    ]
    events.clear()
    with pytest.raises(RuntimeError, match="did not start"):
        engine.start(fail=True)
    assert (
        events[0] == "pause" and events[-1] == "resume"
    )  # this thread routed again when the start fails
