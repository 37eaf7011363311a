"""Progress hooks: simulate reports simulated time as it advances; the report and simulate bars stay
off a non-terminal stderr."""

import numpy as np
import pandas as pd

from sim.serving.simulate import simulate, simulate_many
from traces.requests import RequestTrace, make_requests


def _requests(n=25):
    rng = np.random.default_rng(3)
    return RequestTrace(
        make_requests(
            np.cumsum(rng.exponential(1 / 20, n)),
            rng.integers(50, 300, n),
            rng.integers(10, 100, n),
        ),
        name="synth",
    )


def test_simulate_reports_simulated_time_until_the_end():
    seen = []
    res = simulate(_requests(), "paged", model="Llama-3.2-1B", gpu="H200", progress=seen.append)
    assert len(seen) > 10
    assert seen == sorted(seen) and seen[0] >= 0
    assert seen[-1] == res.summary["sim_time_s"]


def test_simulate_many_with_a_bar_gives_the_same_tables(capsys):
    a = simulate_many(_requests(), ["best-fit"], model="Llama-3.2-1B", gpu="H200", progress=True)
    b = simulate_many(_requests(), ["best-fit"], model="Llama-3.2-1B", gpu="H200")
    drop = [c for c in a[0].columns if c.endswith("_us") or c == "wall_s"]  # measured timings
    pd.testing.assert_frame_equal(a[0].drop(columns=drop), b[0].drop(columns=drop))
    pd.testing.assert_frame_equal(a[1], b[1])
    assert capsys.readouterr().err == ""  # stderr is not a terminal here: no bar
