"""``poollab report``: an HTML file from result folders; one line and exit 2 for a folder that is
not one."""

import pandas as pd
import pytest

from sim.replay.trace_replay import replay
from sim.replay.schema import write_results
from traces import generate_alloc_trace


@pytest.fixture(scope="module")
def result_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    r = replay(
        generate_alloc_trace(num_requests=3, seed=2, prompt_tokens=(32, 64), output_tokens=(4, 8)),
        "best-fit",
    )
    write_results(out, pd.DataFrame([r.summary]), meta={"command": "replay"})
    return out


def test_report_writes_the_html_file(result_dir, tmp_path, cli):
    out = tmp_path / "r.html"
    code, stdout, _ = cli(["report", str(result_dir), "--out", str(out), "--title", "mine"])
    assert code == 0 and f"wrote {out}" in stdout
    assert "<title>mine</title>" in out.read_text(encoding="utf-8")


def test_report_on_a_folder_without_results_exits_2_with_one_line(tmp_path, cli):
    code, _, err = cli(["report", str(tmp_path), "--out", str(tmp_path / "r.html")])
    assert code == 2
    assert (
        err.strip() == f"poollab: error: {tmp_path}: not a poollab result folder (no summary.csv)"
    )
    assert not (tmp_path / "r.html").exists()


def test_report_needs_a_folder(cli):
    code, _, err = cli(["report"])
    assert code == 2 and "DIRS" in err
