"""A row whose figures cannot all be true is announced under every table, never printed as
healthy."""

import pandas as pd

from sim.replay.schema import format_table, invariant_warnings


def _rows(live, reserved):
    return pd.DataFrame(
        {
            "policy": ["a", "b"],
            "backend": ["sim", "gpu"],
            "peak_live_bytes": live,
            "peak_reserved_bytes": reserved,
        }
    )


def test_live_above_reserved_is_announced_under_the_table():
    table = format_table(
        _rows([2 << 20, 1 << 20], [1 << 20, 1 << 20]), ["policy", "peak_live_bytes"]
    )
    lines = table.splitlines()
    assert lines[-1].startswith(
        "warning: a (sim): peak live 2.00 MiB is above peak reserved 1.00 MiB"
    )
    assert sum(line.startswith("warning:") for line in lines) == 1


def test_healthy_rows_print_no_warning():
    assert invariant_warnings(_rows([1 << 20, 1 << 20], [2 << 20, 1 << 20])) == []
    assert "warning" not in format_table(_rows([1 << 20, 1], [2 << 20, 1]), ["policy"])
