"""``poollab demo``: the main job runs offline on the bundled data and leaves its tables and
report."""

import re
import pandas as pd

from poollab.cli import main
from poollab.commands._common import DEFAULT_POLICIES
from poollab.commands.demo import BASELINES


def test_demo_replays_simulates_and_writes_a_report(tmp_path, capsys):
    try:
        main(["demo", "--out", str(tmp_path), "--no-progress"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    out = capsys.readouterr().out
    assert "== replay" in out and "== simulate" in out and "best possible" in out
    replay = pd.read_csv(tmp_path / "replay" / "summary.csv")
    assert list(replay["policy"]) == list(DEFAULT_POLICIES + BASELINES)
    assert (replay["n_failed"] == 0).all()
    simulate = pd.read_csv(tmp_path / "simulate" / "summary.csv")
    assert list(simulate["policy"]) == list(DEFAULT_POLICIES)
    assert (simulate["n_finished"] == simulate["n_requests"]).all()
    assert (tmp_path / "simulate" / "requests.parquet").exists()
    html = (tmp_path / "report.html").read_text()
    # the inlined plotly.min.js holds URLs in its strings; the page around it names none
    # (tests/sim/report/test_interactive_report.py checks in Chromium that nothing is fetched)
    page = re.sub(r"<script.*?</script>", "", html, flags=re.S)
    assert "<img" in page and "http://" not in page and "https://" not in page
