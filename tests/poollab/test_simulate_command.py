"""``poollab simulate``: the report files for good input, one line and exit 2 for bad input."""

import pandas as pd
import pytest

from sim.replay.hardware import available_gpus
from sim.replay.models import available_models


def test_simulate_writes_summary_requests_and_timeseries(trace, tmp_path, cli_ok):
    out_dir = tmp_path / "out"
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
            "--gpu",
            "H200",
            "--out",
            str(out_dir),
        ]
    )
    summary = pd.read_csv(out_dir / "summary.csv")
    assert list(summary["policy"]) == ["paged", "best-fit"]
    assert (summary["n_finished"] == 12).all() and (summary["backend"] == "sim").all()
    assert (out_dir / "timeseries.parquet").exists() and (out_dir / "requests.parquet").exists()
    assert "paged" in out and "best-fit" in out


@pytest.mark.parametrize(
    "model, groups", [("Gemma-2-9B", ["sliding-4096", "full"]), ("Bamba-9B", ["full", "mamba"])]
)
def test_a_hybrid_model_writes_and_prints_its_layer_groups(trace, tmp_path, model, groups, cli_ok):
    out_dir = tmp_path / "out"
    out, _ = cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "paged",
            "--model",
            model,
            "--kv-capacity",
            "4GiB",
            "--hybrid-kv-layout",
            "two-level",
            "--out",
            str(out_dir),
        ]
    )
    table = pd.read_parquet(out_dir / "kv_groups.parquet")
    summary = pd.read_csv(out_dir / "summary.csv")
    assert list(table["group"]) == groups and set(table["kv_layout"]) == {"two-level"}
    assert (table["peak_waste_bytes"] == table["peak_held_bytes"] - table["peak_data_bytes"]).all()
    assert table["peak_waste_bytes"].sum() == summary["kv_peak_waste_bytes"].iloc[0]
    assert f"KV layer groups of {model} (layout two-level" in out
    assert "peak_waste_MiB" in out and all(g in out for g in groups)
    assert "kv_groups.parquet" in out and "share no prefix blocks" in out


def test_a_plain_model_writes_no_group_table(trace, tmp_path, cli_ok):
    out, _ = cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "paged",
            "--model",
            "Llama-3.2-1B",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert not (tmp_path / "o" / "kv_groups.parquet").exists() and "layer groups" not in out


def test_options_reach_the_simulator(trace, tmp_path, cli_ok):
    out_dir = tmp_path / "out"
    cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "first-fit",
            "--model",
            "Llama-3.2-1B",
            "--kv-strategy",
            "max",
            "--preemption",
            "swap",
            "--pool-layout",
            "shared",
            "--out",
            str(out_dir),
        ]
    )
    row = pd.read_csv(out_dir / "summary.csv").iloc[0]
    assert (row.kv_strategy, row.preemption, row.pool_layout) == ("max", "swap", "shared")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "gpt-17"], "unknown model 'gpt-17'"),
        (["--gpu", "tpu-v9"], "unknown GPU"),
        (["-p", "no-such-policy"], "unknown policy 'no-such-policy'"),
        (["-p", "paged:bogus=1"], "bogus"),
        (
            ["-p", "vmm-stitch"],
            "--policy vmm-stitch: policy 'vmm-stitch' cannot hold a KV cache",
        ),  # issue 29
        (["-p", "paged:page_bytes=4096"], "set page_bytes (e.g. paged:page_bytes="),
    ],
)
def test_bad_model_gpu_or_policy_is_one_line_and_exit_2(trace, tmp_path, argv, words, cli):
    code, _, err = cli(["simulate", str(trace), *argv, "--out", str(tmp_path / "o")])
    assert code == 2
    assert words.lower() in err.lower()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_malformed_trace_names_file_and_line(tmp_path, cli):
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,lots,8\n"
    )
    code, _, err = cli(["simulate", str(bad), "-p", "paged", "--out", str(tmp_path / "o")])
    assert code == 2
    assert f"{bad}:3" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_trace_is_exit_2(tmp_path, cli):
    code, _, err = cli(
        ["simulate", str(tmp_path / "nope.csv"), "-p", "paged", "--out", str(tmp_path / "o")]
    )
    assert code == 2 and "nope.csv" in err


def test_pool_controls_reach_the_simulator(trace, tmp_path, cli_ok):
    out_dir = tmp_path / "out"
    cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "elastic:base=[paged]",
            "--model",
            "Llama-3.2-1B",
            "--pregrow-safety",
            "1.5",
            "--freeze-after-steps",
            "3",
            "--out",
            str(out_dir),
        ]
    )
    row = pd.read_csv(out_dir / "summary.csv").iloc[0]
    assert row["n_pregrows"] > 0
    assert row["frozen_at_s"] >= 0


def test_pregrowth_without_an_elastic_pool_is_exit_2(trace, tmp_path, cli):
    code, _, err = cli(
        [
            "simulate",
            str(trace),
            "-p",
            "best-fit",
            "--model",
            "Llama-3.2-1B",
            "--pregrow-safety",
            "1.5",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2 and "pregrow_safety" in err and "Traceback" not in err


def test_help_lists_every_config_knob_with_its_choices(cli_ok):
    from sim.serving.config import knobs

    out = cli_ok(["simulate", "--help"]).out
    flat = " ".join(out.split())
    for k in knobs().values():
        assert f"--{k.cli}" in out
        if k.choices:
            assert "[" + "|".join(k.choices) + "]" in flat
    for old in (
        "--kv-capacity",
        "--swap-space",
        "--slo-ttft",
        "--no-chunked-prefill",
        "--gpu-memory-utilization",
    ):
        assert old in out  # the names users' commands already use


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-num-seqs", "0"], "max-num-seqs"),
        (["--kv-strategy", "lucky"], "kv-strategy"),
        (["--kv-capacity", "lots"], "kv-capacity"),
    ],
)
def test_a_bad_knob_value_is_exit_2_naming_the_option(trace, tmp_path, argv, words, cli):
    code, _, err = cli(["simulate", str(trace), "-p", "paged", *argv, "--out", str(tmp_path / "o")])
    assert code == 2 and words in err and "Traceback" not in err


def test_knobs_new_to_the_command_line_reach_the_simulator(trace, tmp_path, cli_ok):
    out_dir = tmp_path / "out"
    cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "paged",
            "--model",
            "Llama-3.2-1B",
            "--horizon",
            "2",
            "--tokens-per-page",
            "32",
            "--out",
            str(out_dir),
        ]
    )
    row = pd.read_csv(out_dir / "summary.csv").iloc[0]
    assert row["sim_time_s"] <= 2.0 and "tokens_per_page=32" in row["params"]


# -- the headline: settings line, one rejection warning, SLO columns, --tp; poollab presets (issue
# 15)
def write(tmp_path, rows):
    p = tmp_path / "t.csv"
    p.write_text(
        "request_id,arrival_s,prompt_tokens,output_tokens\n"
        + "".join(f"{i},{0.1 * i},{pr},{o}\n" for i, (pr, o) in enumerate(rows))
    )
    return p


def test_header_only_trace_is_one_line_and_exit_2(tmp_path, cli):
    p = tmp_path / "empty.csv"
    p.write_text("request_id,arrival_s,prompt_tokens,output_tokens\n")
    code, out, err = cli(["simulate", str(p), "-p", "paged", "--out", str(tmp_path / "o")])
    assert (
        code == 2
        and "no requests" in err
        and len(err.strip().splitlines()) == 1
        and "Traceback" not in err
    )
    assert not (tmp_path / "o").exists()


def test_rejections_are_one_warning_line_with_count_and_reason(tmp_path, cli_ok):
    p = write(tmp_path, [(9000, 10), (9500, 10), (100, 10)])
    out, err = cli_ok(
        [
            "simulate",
            str(p),
            "-p",
            "paged",
            "-p",
            "best-fit",
            "--model",
            "Llama-3-8B",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert (
        "2 of 3 requests rejected (prompt>=max_model_len: 2) under paged, best-fit" in warnings[0]
    )
    out, err = cli_ok(
        [
            "simulate",
            str(p),
            "-p",
            "paged",
            "--model",
            "Llama-3.1-8B",
            "--out",
            str(tmp_path / "o2"),
        ]
    )
    assert "warning" not in err and "max_model_len 131,072 (the model's)" in out


def test_settings_line_names_what_decides_the_comparison(tmp_path, cli_ok):
    p = write(tmp_path, [(100, 10)] * 4)
    out, _ = cli_ok(
        [
            "simulate",
            str(p),
            "-p",
            "paged",
            "-p",
            "best-fit",
            "--model",
            "Llama-3.2-1B",
            "--kv-capacity",
            "1GiB",
            "--kv-strategy",
            "max",
            "--max-num-seqs",
            "8",
            "--prefix-eviction",
            "lfu",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    settings = next(line for line in out.splitlines() if line.startswith("settings:"))
    for part in (
        "KV budget 1.0 GiB",
        "prefix caching on for paged (LFU eviction",
        "for best-fit",
        "contiguous strategy max",
        "--max-num-seqs 8",
        "no SLO set: goodput not reported",
    ):
        assert part in settings, part
    header = next(line for line in out.splitlines() if line.lstrip().startswith("policy"))
    for col in (
        "n_failed",
        "n_preempted",
        "prefix_hit_rate_%",
        "input_tok_s",
        "output_tok_s",
        "kv_token_util_pressure_%",
    ):
        assert col in header, col
    assert "goodput_rps" not in header


def test_with_an_slo_the_table_shows_goodput_and_attainment(tmp_path, cli_ok):
    p = write(tmp_path, [(100, 10)] * 4)
    out, _ = cli_ok(
        [
            "simulate",
            str(p),
            "-p",
            "paged",
            "--model",
            "Llama-3.2-1B",
            "--slo-ttft",
            "1",
            "--slo-tpot",
            "0.1",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert "goodput_rps" in out and "slo_attainment_%" in out and "no SLO set" not in out
    assert "--slo-ttft 1.0" in out


def test_tp_runs_70b_on_h200s_and_says_so(tmp_path, cli, cli_ok):
    p = write(tmp_path, [(1000, 10)] * 3)
    code, _, err = cli(
        ["simulate", str(p), "-p", "paged", "--model", "Llama-3-70B", "--out", str(tmp_path / "a")]
    )
    assert code == 2 and "no memory left for the KV cache" in err
    out, _ = cli_ok(
        [
            "simulate",
            str(p),
            "-p",
            "paged",
            "--model",
            "Llama-3-70B",
            "--tp",
            "4",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert "per GPU x 4 (tp)" in out
    code, _, err = cli(
        [
            "simulate",
            str(p),
            "-p",
            "paged",
            "--model",
            "Llama-3-70B",
            "--tp",
            "3",
            "--out",
            str(tmp_path / "c"),
        ]
    )
    assert code == 2 and "tensor parallelism 3 must divide" in err


def test_presets_lists_every_model_and_gpu(cli_ok):
    out, _ = cli_ok(["presets"])
    for name in available_models() + available_gpus():
        assert name in out
    assert "131072" in out and "link_GB_s" in out


def test_virtual_kv_strategy_runs_and_says_what_it_turns_off(trace, tmp_path, cli_ok):
    out_dir = tmp_path / "out"
    out, _ = cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "best-fit",
            "--model",
            "Llama-3.2-1B",
            "--kv-strategy",
            "virtual",
            "--virtual-page",
            "64KiB",
            "--no-map-overlap",
            "--out",
            str(out_dir),
        ]
    )
    row = pd.read_csv(out_dir / "summary.csv").iloc[0]
    assert (row.kv_strategy, row.kv_page_bytes, bool(row.map_overlap)) == (
        "virtual",
        64 << 10,
        False,
    )
    assert (
        row.n_finished == 12
        and row.n_map > 0
        and row.kv_driver_step_s == pytest.approx(row.kv_driver_s)
    )
    assert "note: prefix caching off" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--virtual-page", "100KiB"], "power of two"),
        (["--virtual-page", "4MiB"], "--virtual-page"),
        (["--pool-layout", "shared"], "pool_layout"),
    ],
)
def test_a_bad_virtual_setting_is_exit_2(trace, tmp_path, argv, words, cli):
    code, _, err = cli(
        [
            "simulate",
            str(trace),
            "-p",
            "best-fit",
            "--model",
            "Llama-3.2-1B",
            "--kv-strategy",
            "virtual",
            *argv,
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert (
        code == 2 and words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    )


def test_a_new_serving_knob_gets_its_option_from_its_knob_alone():
    """ARCHITECTURE.md's "where to add a serving feature": a field with its ``Knob`` on a config
    extending ``ServerConfig`` is an option of the command, parsed, ranged and passed on."""
    import dataclasses

    import click
    from click.testing import CliRunner

    from poollab.commands.simulate import config_options
    from sim.serving.config import Knob, ServerConfig, knobs

    @dataclasses.dataclass(frozen=True)
    class ToyConfig(ServerConfig):
        toy_draft_tokens: int = dataclasses.field(
            default=0, metadata={"knob": Knob("Toy: draft tokens a step.", low=0, high=16)}
        )

    assert list(knobs(ToyConfig))[-1] == "toy_draft_tokens"
    assert "toy_draft_tokens" not in knobs()
    got = {}

    @click.command()
    def toy(**options):
        got.update(options)

    cmd = config_options(toy, ToyConfig)
    result = CliRunner().invoke(cmd, ["--toy-draft-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert got["toy_draft_tokens"] == 4 and set(knobs()) < set(got)
    assert "--toy-draft-tokens" in CliRunner().invoke(cmd, ["--help"]).output
    bad = CliRunner().invoke(cmd, ["--toy-draft-tokens", "17"])
    assert bad.exit_code == 2 and "--toy-draft-tokens" in bad.output
