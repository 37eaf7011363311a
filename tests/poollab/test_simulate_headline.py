"""``poollab simulate``'s headline: settings line, one rejection warning, SLO columns; ``poollab presets``."""

import pytest

from poollab.cli import main
from sim.hardware import available_gpus
from sim.models import available_models


def run(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def run_ok(argv, capsys):
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    return capsys.readouterr()


def write(tmp_path, rows):
    p = tmp_path / "t.csv"
    p.write_text("request_id,arrival_s,prompt_tokens,output_tokens\n"
                 + "".join(f"{i},{0.1 * i},{pr},{o}\n" for i, (pr, o) in enumerate(rows)))
    return p


def test_header_only_trace_is_one_line_and_exit_2(tmp_path, capsys):
    p = tmp_path / "empty.csv"
    p.write_text("request_id,arrival_s,prompt_tokens,output_tokens\n")
    code, out, err = run(["simulate", str(p), "-p", "paged", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "no requests" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_rejections_are_one_warning_line_with_count_and_reason(tmp_path, capsys):
    p = write(tmp_path, [(9000, 10), (9500, 10), (100, 10)])
    out, err = run_ok(["simulate", str(p), "-p", "paged", "-p", "best-fit", "--model", "Llama-3-8B",
                       "--out", str(tmp_path / "o")], capsys)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "2 of 3 requests rejected (prompt>=max_model_len: 2) under paged, best-fit" in warnings[0]
    out, err = run_ok(["simulate", str(p), "-p", "paged", "--model", "Llama-3.1-8B",
                       "--out", str(tmp_path / "o2")], capsys)
    assert "warning" not in err and "max_model_len 131,072 (the model's)" in out


def test_settings_line_names_what_decides_the_comparison(tmp_path, capsys):
    p = write(tmp_path, [(100, 10)] * 4)
    out, _ = run_ok(["simulate", str(p), "-p", "paged", "-p", "best-fit", "--model", "Llama-3.2-1B",
                     "--kv-capacity", "1GiB", "--kv-strategy", "max", "--max-num-seqs", "8",
                     "--prefix-eviction", "lfu", "--out", str(tmp_path / "o")], capsys)
    settings = next(line for line in out.splitlines() if line.startswith("settings:"))
    for part in ("KV budget 1.0 GiB", "prefix caching on for paged (LFU eviction", "for best-fit",
                 "contiguous strategy max", "--max-num-seqs 8", "no SLO set: goodput not reported"):
        assert part in settings, part
    header = next(line for line in out.splitlines() if line.lstrip().startswith("policy"))
    for col in ("n_failed", "n_preempted", "prefix_hit_rate_%", "input_tok_s", "output_tok_s",
                "kv_token_util_pressure_%"):
        assert col in header, col
    assert "goodput_rps" not in header


def test_with_an_slo_the_table_shows_goodput_and_attainment(tmp_path, capsys):
    p = write(tmp_path, [(100, 10)] * 4)
    out, _ = run_ok(["simulate", str(p), "-p", "paged", "--model", "Llama-3.2-1B", "--slo-ttft", "1",
                     "--slo-tpot", "0.1", "--out", str(tmp_path / "o")], capsys)
    assert "goodput_rps" in out and "slo_attainment_%" in out and "no SLO set" not in out
    assert "--slo-ttft 1.0" in out


def test_tp_runs_70b_on_h200s_and_says_so(tmp_path, capsys):
    p = write(tmp_path, [(1000, 10)] * 3)
    code, _, err = run(["simulate", str(p), "-p", "paged", "--model", "Llama-3-70B", "--out", str(tmp_path / "a")],
                       capsys)
    assert code == 2 and "no memory left for the KV cache" in err
    out, _ = run_ok(["simulate", str(p), "-p", "paged", "--model", "Llama-3-70B", "--tp", "4",
                     "--out", str(tmp_path / "b")], capsys)
    assert "per GPU x 4 (tp)" in out
    code, _, err = run(["simulate", str(p), "-p", "paged", "--model", "Llama-3-70B", "--tp", "3",
                        "--out", str(tmp_path / "c")], capsys)
    assert code == 2 and "tensor parallelism 3 must divide" in err


def test_presets_lists_every_model_and_gpu(capsys):
    out, _ = run_ok(["presets"], capsys)
    for name in available_models() + available_gpus():
        assert name in out
    assert "131072" in out and "link_GB_s" in out
