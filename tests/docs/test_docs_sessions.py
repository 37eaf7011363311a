"""How the docs test reads a page and compares a run's output with it (``docs_sessions``)."""

from docs_sessions import compare, sessions

TABLE = [
    "  policy  n_failed  peak_reserved_MiB  alloc_p50_us  wall_s",
    "best-fit         0           2,080.00          1.00    0.14",
]


def test_timing_cells_are_not_compared_but_every_other_cell_is():
    assert (
        compare(
            TABLE,
            [
                "policy n_failed peak_reserved_MiB alloc_p50_us wall_s",
                "best-fit 0 2,080.00 27.15 3.20",
            ],
        )
        is None
    )
    diff = compare(
        TABLE,
        ["policy n_failed peak_reserved_MiB alloc_p50_us wall_s", "best-fit 0 2,112.00 1.00 0.14"],
    )
    assert diff is not None and "2,112.00" in diff


def test_a_missing_or_extra_line_is_a_difference_and_an_ellipsis_skips_lines():
    assert compare(["a", "b"], ["a"]) is not None
    assert compare(["a"], ["a", "b"]) is not None
    assert compare(["a", "...", "d"], ["a", "b", "c", "d"]) is None
    assert compare(["a", "...", "d"], ["a", "b", "c", "e"]) is not None
    assert compare(["a", "..."], ["a", "b"]) is None


def test_timing_phrases_and_the_report_size():
    assert (
        compare(
            ["22 run on processes:2, 0 already done (1.5 s)"],
            ["22 run on processes:8, 0 already done (6.2 s)"],
        )
        is None
    )
    assert (
        compare(
            ["22 run on processes:2, 1 already done (1.5 s)"],
            ["22 run on processes:2, 0 already done (1.5 s)"],
        )
        is not None
    )
    shown = ["wrote poollab-out/compare.html (5.57 MiB) from 3 result folder(s)"]
    assert (
        compare(shown, ["wrote poollab-out/compare.html (5.60 MiB) from 3 result folder(s)"])
        is None
    )
    assert (
        compare(shown, ["wrote poollab-out/compare.html (0.71 MiB) from 3 result folder(s)"])
        is not None
    )
    assert (
        compare(shown, ["wrote poollab-out/compare.html (5.57 MiB) from 2 result folder(s)"])
        is not None
    )


def test_sessions_are_read_from_fenced_blocks_with_continuations(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "$ poollab outside a block\n```\n$ poollab replay t.csv \\\n      -p paged\nout 1\n"
        "$ poollab policies\nout 2\n```\n```\n$ pip install x\nnot poollab\n```\n"
    )
    found = sessions(page)
    assert [(s.command, s.expected, s.line) for s in found] == [
        ("poollab replay t.csv -p paged", ["out 1"], 3),
        ("poollab policies", ["out 2"], 6),
    ]
    assert found[0].argv == ["replay", "t.csv", "-p", "paged"]


def test_python_warnings_in_the_output_are_not_the_commands():
    run = [
        "/x/sim/html_report.py:385: PerformanceWarning: DataFrame is highly fragmented.",
        "  t = t.assign(x=1)",
        "wrote a.html (1.00 MiB) from 1 result folder(s)",
    ]
    assert compare(["wrote a.html (1.00 MiB) from 1 result folder(s)"], run) is None
