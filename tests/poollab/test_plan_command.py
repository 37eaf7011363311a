"""``poollab plan`` and ``simulate --kv-capacity plan:RESULT``: the budget table, plan.csv, and bad
input as one line with exit status 2."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pandas as pd
import pytest

MiB = 1 << 20
GRAPHS = Path(__file__).resolve().parents[1] / "data" / "snapshots_h200" / "graphs.pickle.gz"


@pytest.fixture
def startup(tmp_path) -> Path:
    """A start-up snapshot (PyTorch's layout): 100 MiB of weights, a 40 MiB profiling step, two KV
    tensors of 128 MiB in one burst, a 250 MiB warm-up step. With 1 GiB and torch-caching the
    largest KV is 2 x 337 MiB (4 MiB pages: 100 + 4 n + 250 <= 1024)."""
    entries, t = [], 0
    for i, (size, freed) in enumerate(
        [
            (100 * MiB, False),
            (40 * MiB, True),
            (128 * MiB, False),
            (128 * MiB, False),
            (250 * MiB, True),
        ]
    ):
        addr = (1 << 40) + i * (1 << 30)
        t += 10
        entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t})
        if freed:
            entries.append(
                {
                    "action": "free_completed",
                    "addr": addr,
                    "size": size,
                    "stream": 0,
                    "time_us": t + 5,
                }
            )
    path = tmp_path / "startup.pickle.gz"
    path.write_bytes(
        gzip.compress(
            pickle.dumps(
                {
                    "segments": [],
                    "device_traces": [entries],
                    "allocator_settings": {"expandable_segments": False},
                }
            ),
            mtime=0,
        )
    )
    return path


def test_plan_prints_the_budget_and_writes_plan_csv(startup, tmp_path, cli_ok):
    out_dir = tmp_path / "plan"
    out, _ = cli_ok(
        [
            "plan",
            str(startup),
            "--memory",
            "1GiB",
            "-p",
            "torch-caching",
            "-p",
            "best-fit",
            "--out",
            str(out_dir),
        ]
    )
    table = pd.read_csv(out_dir / "plan.csv")
    assert list(table["policy"]) == ["torch-caching", "best-fit"]
    row = table.iloc[0]
    assert (
        row.safe_kv_bytes == 168 * 4 * MiB
        and row.device_bytes == 1 << 30
        and row.weights_bytes == 100 * MiB
    )
    assert row.peak_non_kv_reserved_bytes == 350 * MiB
    assert {
        "policy",
        "safe_kv_bytes",
        "safe_kv_tokens",
        "peak_non_kv_reserved_bytes",
        "weights_bytes",
        "device_bytes",
    } <= set(table.columns)
    assert "KV cache recognised: 2 x 128.0 MiB" in out and "safe KV 672.0 MiB (168 pages)" in out
    assert (
        "gpu_memory_utilization=0.9 would pick 780.0 MiB (27 pages above the safe size): "
        "out of memory at event 5 (device_traces[0] index 5): 250.0 MiB" in out
    )
    assert "safe_kv_tokens" not in out  # no model, no tokens
    assert f"wrote {out_dir / 'plan.csv'}" in out


def test_a_model_gives_tokens(startup, tmp_path, cli_ok):
    out_dir = tmp_path / "plan"
    # Llama-3-8B: 128 KiB a token, 16-token pages of 2 MiB, 1 MiB per KV tensor
    out, _ = cli_ok(
        [
            "plan",
            str(startup),
            "--memory",
            "1GiB",
            "--model",
            "Llama-3-8B",
            "--out",
            str(out_dir),
            "--no-progress",
        ]
    )
    row = pd.read_csv(out_dir / "plan.csv").iloc[0]
    assert row.page_bytes == 2 * MiB and row.safe_kv_tokens == row.safe_kv_pages * 16
    # each tensor holds n MiB and torch-caching rounds it to 2 MiB: 2 x 338 + 350 > 1024 MiB, so n =
    # 336, not 337
    assert row.safe_kv_bytes == 2 * 336 * MiB
    assert f"{int(row.safe_kv_tokens):,} tokens" in out


def test_cuda_graph_snapshot_plans_on_a_gpu_preset(tmp_path, cli_ok):
    out, _ = cli_ok(
        [
            "plan",
            str(GRAPHS),
            "--gpu",
            "A100-40GB",
            "--non-torch",
            "38GiB",
            "--out",
            str(tmp_path / "p"),
        ]
    )
    row = pd.read_csv(tmp_path / "p" / "plan.csv").iloc[0]
    assert (
        row.device_bytes == 40 << 30 and row.capacity_bytes == 2 << 30 and row.safe_kv_pages == 46
    )
    assert "device 40.0 GiB: --gpu A100-40GB" in out
    assert "outside PyTorch's allocator 38.0 GiB: --non-torch; the pool gets 2.0 GiB" in out
    assert row.non_torch_bytes == 38 << 30 and row.non_torch_source == "--non-torch"


def _sidecar(snapshot: Path, **fields) -> Path:
    from traces.engine_memory import write_engine_memory

    return write_engine_memory(snapshot, fields)


def test_the_memory_the_engines_process_measured_beside_the_snapshot_sizes_the_pool(
    startup, tmp_path, cli_ok
):
    # what `gpu serve --snapshot` writes beside it: the device's total and, measured in the engine's
    # process, 200 MiB outside PyTorch's allocator at start-up's end and 224 MiB at most while
    # serving
    _sidecar(
        startup,
        mem_get_info_total_bytes=1 << 30,
        non_torch_startup_bytes=200 * MiB,
        non_torch_serving_max_bytes=224 * MiB,
        kv_block_tokens=32,
        kv_padding_blocks=2,
    )
    out, _ = cli_ok(
        ["plan", str(startup), "-p", "torch-caching", "--out", str(tmp_path / "p"), "--no-progress"]
    )
    row = pd.read_csv(tmp_path / "p" / "plan.csv").iloc[0]
    # the larger figure comes off the device: 1,024 - 224 = 800 MiB for 100 MiB of weights, 250 MiB
    # of warm-up
    assert (
        row.device_bytes == 1 << 30
        and row.non_torch_bytes == 224 * MiB
        and row.capacity_bytes == 800 * MiB
    )
    assert row.safe_kv_bytes == (800 - 350) // 4 * 4 * MiB
    assert pd.isna(row.engine_num_blocks)  # no model: pages of no token count, so no engine blocks
    assert "device 1.0 GiB: cudaMemGetInfo's total in the engine's process, startup.json" in out
    assert (
        "outside PyTorch's allocator 224.0 MiB: measured in the engine's process "
        "(200.0 MiB at start-up's end, 224.0 MiB at most while serving), startup.json; "
        "the pool gets 800.0 MiB"
    ) in out
    # with a model: 16-token pages, the engine's blocks of 32 tokens less its 2 padding blocks
    out, _ = cli_ok(
        [
            "plan",
            str(startup),
            "--model",
            "Llama-3-8B",
            "--out",
            str(tmp_path / "m"),
            "--no-progress",
        ]
    )
    row = pd.read_csv(tmp_path / "m" / "plan.csv").iloc[0]
    assert row.engine_num_blocks == row.safe_kv_pages * 16 // 32 - 2
    assert (
        f"the engine's --num-blocks {int(row.engine_num_blocks):,} of 32 tokens, "
        "its 2 padding blocks aside" in out
    )
    # what the user gives wins over what was measured
    cli_ok(
        [
            "plan",
            str(startup),
            "--memory",
            "2GiB",
            "--non-torch",
            "0",
            "--out",
            str(tmp_path / "q"),
            "--no-progress",
        ]
    )
    row = pd.read_csv(tmp_path / "q" / "plan.csv").iloc[0]
    assert (
        row.device_bytes == 2 << 30
        and row.capacity_bytes == 2 << 30
        and row.non_torch_source == "--non-torch"
    )
    # --memory alone: the measured non-PyTorch memory still comes off it
    cli_ok(
        ["plan", str(startup), "--memory", "2GiB", "--out", str(tmp_path / "r"), "--no-progress"]
    )
    assert pd.read_csv(tmp_path / "r" / "plan.csv").iloc[0].capacity_bytes == (2 << 30) - 224 * MiB


def test_without_a_measurement_the_plan_says_it_assumed_none(startup, tmp_path, cli_ok):
    out, _ = cli_ok(
        ["plan", str(startup), "--memory", "1GiB", "--out", str(tmp_path / "p"), "--no-progress"]
    )
    row = pd.read_csv(tmp_path / "p" / "plan.csv").iloc[0]
    assert row.capacity_bytes == 1 << 30 and row.non_torch_bytes == 0
    assert (
        "outside PyTorch's allocator 0 B: none measured (no startup.json beside the snapshot): "
        "0 B assumed" in out
    )
    assert "give --non-torch" in out and row.non_torch_source.startswith("none measured")
    _sidecar(
        startup, kv_blocks=3
    )  # a file without the figure: the device's memory from the preset, said so
    out, _ = cli_ok(["plan", str(startup), "--out", str(tmp_path / "q"), "--no-progress"])
    assert "none measured (startup.json has no non_torch_bytes)" in out and "the H200 preset" in out


def test_simulate_auto_plans_with_the_measured_non_torch_memory(startup, trace, tmp_path, cli_ok):
    def budget(name: str) -> int:
        out, _ = cli_ok(
            [
                "simulate",
                str(trace),
                "-p",
                "best-fit",
                "--model",
                "Llama-3.2-1B",
                "--gpu",
                "H200",
                "--kv-capacity",
                f"auto:{startup}",
                "--out",
                str(tmp_path / name),
                "--no-progress",
            ]
        )
        return int(pd.read_csv(tmp_path / name / "summary.csv")["kv_budget_bytes"].iloc[0])

    unmeasured = budget("bare")
    # measured beside the snapshot: 20 GiB outside PyTorch's allocator (the device's total there is
    # not the simulated GPU's: simulate's --gpu gives the device)
    _sidecar(startup, mem_get_info_total_bytes=80 << 30, non_torch_startup_bytes=20 << 30)
    assert (
        abs(unmeasured - budget("measured") - (20 << 30)) <= 4 * MiB
    )  # a page and PyTorch's 2 MiB rounding


def test_simulate_takes_each_policys_budget_from_the_plan(startup, trace, tmp_path, cli_ok):
    cli_ok(
        [
            "plan",
            str(startup),
            "--memory",
            "1GiB",
            "-p",
            "best-fit",
            "-p",
            "paged",
            "--out",
            str(tmp_path / "p"),
        ]
    )
    plan = pd.read_csv(tmp_path / "p" / "plan.csv").set_index("policy")["safe_kv_bytes"]
    out_dir = tmp_path / "sim"
    out, _ = cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "paged",
            "-p",
            "best-fit",
            "--model",
            "Llama-3.2-1B",
            "--kv-capacity",
            f"plan:{tmp_path / 'p'}",
            "--out",
            str(out_dir),
            "--no-progress",
        ]
    )
    summary = pd.read_csv(out_dir / "summary.csv").set_index("policy")
    assert summary.loc["paged", "kv_budget_bytes"] == plan["paged"]
    assert summary.loc["best-fit", "kv_budget_bytes"] == plan["best-fit"]
    assert f"KV budget from plan {tmp_path / 'p'}: paged" in out


def test_simulate_plans_itself_with_auto(startup, trace, tmp_path, cli_ok):
    out, _ = cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "best-fit",
            "--model",
            "Llama-3.2-1B",
            "--gpu",
            "H200",
            "--kv-capacity",
            f"auto:{startup}",
            "--out",
            str(tmp_path / "sim"),
            "--no-progress",
        ]
    )
    budget = pd.read_csv(tmp_path / "sim" / "summary.csv")["kv_budget_bytes"].iloc[0]
    assert budget > 100 << 30  # an H200 holds far more than the recorded run needs
    assert f"KV budget planned on {startup} (`poollab plan`): best-fit" in out


def test_simulate_still_takes_a_size(trace, tmp_path, cli_ok):
    cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "paged",
            "--model",
            "Llama-3.2-1B",
            "--kv-capacity",
            "4GiB",
            "--out",
            str(tmp_path / "sim"),
            "--no-progress",
        ]
    )
    assert pd.read_csv(tmp_path / "sim" / "summary.csv")["kv_budget_bytes"].iloc[0] == 4 << 30


def test_a_buffer_named_as_sized_by_the_kv_grows_with_it(startup, tmp_path, cli_ok):
    # the 250 MiB warm-up buffer (entry 5) named as growing 2 MiB a page from the recorded 64 pages:
    # 100 + 4 n + (250 + 2 (n - 64)) <= 1024, so n = 133 (168 without it)
    out_dir = tmp_path / "plan"
    out, _ = cli_ok(
        [
            "plan",
            str(startup),
            "--memory",
            "1GiB",
            "-p",
            "torch-caching",
            "--kv-linked",
            "entries=5:2MiB",
            "--out",
            str(out_dir),
            "--no-progress",
        ]
    )
    row = pd.read_csv(out_dir / "plan.csv").iloc[0]
    assert (
        row.safe_kv_pages == 133
        and row.kv_linked_bytes == 388 * MiB
        and row.num_kv_linked_allocs == 1
    )
    assert "resized with it: named by --kv-linked entries=5:2MiB: 1 x 250.0 MiB" in out
    assert "kv_linked_MiB" in out and "388.0 MiB in the buffers sized by it" in out


def test_an_engine_preset_sets_the_block_and_says_when_its_buffer_is_absent(
    startup, tmp_path, cli_ok
):
    out_dir = tmp_path / "plan"
    out, _ = cli_ok(
        [
            "plan",
            str(startup),
            "--memory",
            "1GiB",
            "--model",
            "Llama-3-8B",
            "--engine",
            "transformers",
            "--out",
            str(out_dir),
            "--no-progress",
        ]
    )
    row = pd.read_csv(out_dir / "plan.csv").iloc[0]
    assert row.block_tokens == 256 and row.page_bytes == 32 * MiB and row.kv_linked_bytes == 0
    assert "none of engine transformers's buffers is in the snapshot" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--kv-linked", "entries=5"], "--kv-linked 'entries=5': expected SELECTOR:BYTES_PER_PAGE"),
        (["--kv-linked", "entries=3:1MiB"], "names a KV allocation"),
        (["--engine", "nope"], "unknown engine 'nope'"),
        (["--engine", "transformers"], "give --model"),
        (["--kv", "weights"], "--kv 'weights': expected size=SIZE"),
        (["--kv", "size=3MiB"], "no allocation of the trace that lives to the end matches"),
        (["--gpu", "tpu-v9"], "unknown GPU"),
        (["--gpu", "H200", "--memory", "8GiB"], "--gpu and --memory both"),
        (["--memory", "lots"], "lots"),
        (["--model", "gpt-17"], "unknown model 'gpt-17'"),
        (["--model", "Llama-3.2-1B", "--block-tokens", "0"], "--block-tokens"),
        (["-p", "no-such-policy"], "unknown policy 'no-such-policy'"),
        (["--memory", "1GiB", "--non-torch", "2GiB"], "leaves nothing for it"),
        (["--utilization", "1.5"], "1.5"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(startup, tmp_path, argv, words, cli):
    code, _, err = cli(["plan", str(startup), *argv, "--out", str(tmp_path / "o")])
    assert code == 2, err
    assert words.lower() in err.lower()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_bad_snapshots_are_one_line_and_exit_2(tmp_path, cli):
    truncated = tmp_path / "cut.pickle.gz"
    truncated.write_bytes(gzip.compress(pickle.dumps({"device_traces": [[]]}))[:20])
    no_trace = tmp_path / "empty.pickle"
    no_trace.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    freed = tmp_path / "freed.pickle"
    freed.write_bytes(
        pickle.dumps(
            {
                "segments": [],
                "device_traces": [
                    [
                        {
                            "action": "alloc",
                            "addr": 4096,
                            "size": 64 * MiB,
                            "stream": 0,
                            "time_us": 1,
                        },
                        {
                            "action": "free_completed",
                            "addr": 4096,
                            "size": 64 * MiB,
                            "stream": 0,
                            "time_us": 2,
                        },
                    ]
                ],
            }
        )
    )
    for path, words in (
        (truncated, "not a readable gzipped pickle"),
        (no_trace, "has no allocation trace"),
        (freed, "no allocation made in the trace lives to the end"),
        (tmp_path / "missing.pickle", "missing.pickle"),
    ):
        code, _, err = cli(["plan", str(path)])
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_json_beside_the_snapshot_is_one_line_and_exit_2(startup, tmp_path, cli):
    (tmp_path / "startup.json").write_text('{"non_torch_bytes": "700MiB"}')
    code, _, err = cli(["plan", str(startup), "--memory", "1GiB"])
    assert (
        code == 2
        and "startup.json: non_torch_bytes '700MiB'" in err
        and len(err.strip().splitlines()) == 1
    ), err
    code, _, err = cli(
        ["plan", str(startup), "--memory", "1GiB", "--non-torch", "0"]
    )  # read even then: it is bad
    assert code == 2, err


def test_simulate_with_a_bad_plan_is_one_line_and_exit_2(startup, trace, tmp_path, cli):
    cli(["plan", str(startup), "--memory", "1GiB", "-p", "best-fit", "--out", str(tmp_path / "p")])
    not_a_plan = tmp_path / "summary.csv"
    not_a_plan.write_text("policy,peak_reserved_bytes\nbest-fit,5\n")
    for value, words in (
        (f"plan:{tmp_path / 'p'}", "no plan for policy 'paged'"),
        (f"plan:{not_a_plan}", "no column 'safe_kv_bytes'"),
        (f"plan:{tmp_path / 'nowhere'}", "nowhere"),
        ("plan:", "name the plan folder or plan.csv"),
        ("lots", "lots"),
    ):
        code, _, err = cli(
            [
                "simulate",
                str(trace),
                "-p",
                "paged",
                "--model",
                "Llama-3.2-1B",
                "--kv-capacity",
                value,
                "--out",
                str(tmp_path / "sim"),
            ]
        )
        assert (
            code == 2
            and words in err
            and "Traceback" not in err
            and len(err.strip().splitlines()) == 1
        ), err


def test_out_under_a_file_is_one_line_and_a_failed_plan_leaves_the_old_folder(
    startup, tmp_path, cli, cli_ok
):
    (tmp_path / "blocker").write_text("x")
    code, _, err = cli(
        ["plan", str(startup), "--memory", "1GiB", "--out", str(tmp_path / "blocker" / "out")]
    )
    assert code == 2 and "blocker" in err and len(err.strip().splitlines()) == 1
    out_dir = tmp_path / "plan"
    cli_ok(["plan", str(startup), "--memory", "1GiB", "--out", str(out_dir)])
    before = (out_dir / "plan.csv").read_bytes()
    code, _, err = cli(
        ["plan", str(startup), "--memory", "1GiB", "--kv", "size=3MiB", "--out", str(out_dir)]
    )
    assert code == 2 and (out_dir / "plan.csv").read_bytes() == before
