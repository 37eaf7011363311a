"""The generated reference pages follow the code: a column, a knob or an option changed there
changes the page, with no hand edit (``docs/_hooks/reference.py``; mkdocs-click for options)."""

from __future__ import annotations

import importlib.util

import pytest

from docs_sessions import ROOT

import policies
from policies import registry
from policies.testing import SegmentPerRequest


def _hook():
    spec = importlib.util.spec_from_file_location(
        "docs_reference_hook", ROOT / "docs" / "_hooks" / "reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _hook()


def test_every_schema_column_has_a_meaning_and_no_meaning_is_stale():
    assert hook.undescribed_columns() == [], "add a line for each to docs/_hooks/columns.yml"
    assert hook.stale_descriptions() == [], (
        "these are in docs/_hooks/columns.yml but no longer in the schema"
    )


def test_a_new_schema_column_appears_with_its_unit_and_printed_header(monkeypatch):
    from sim.replay import schema as report

    monkeypatch.setattr(
        report, "SUMMARY_COLUMNS", [*report.SUMMARY_COLUMNS, "spill_bytes", "spill_rate"]
    )
    page = hook.columns_markdown()
    assert "| `spill_bytes` | bytes | `spill_MiB` |" in page
    assert "| `spill_rate` |" in page
    assert hook.undescribed_columns() == ["spill_bytes", "spill_rate"]


def test_units_follow_the_names_and_the_printed_headers_follow_format_table():
    assert hook.column_unit("alloc_p99_us", hook.shown_as("alloc_p99_us")) == "µs"
    assert hook.column_unit("overhead", hook.shown_as("overhead")) == "fraction 0-1"
    assert hook.shown_as("overhead") == "overhead_%"
    assert hook.column_unit("n_grow", "n_grow") == "count"
    assert hook.column_unit("driver_ns_map", "driver_ns_map") == "ns"
    assert hook.column_unit("output_tok_s", "output_tok_s") == "tokens/s"


class _Documented(SegmentPerRequest):
    """Hands out a segment per request, for the docs test.

    Args:
        rounding_bytes: what each request is rounded up to.
        spare_segments: segments kept for reuse, at most.
    """

    name = "docs-test-policy"
    can_hold_kv = False

    def __init__(
        self,
        *,
        spare_segments: int = 3,
        rounding_bytes: int = 512,
        capacity_bytes=None,
        device=None,
    ):
        self.spare_segments = spare_segments
        super().__init__(
            rounding_bytes=rounding_bytes, capacity_bytes=capacity_bytes, device=device
        )


def test_a_registered_policy_appears_with_its_knobs_capabilities_and_lines(monkeypatch):
    monkeypatch.setattr(registry, "_runtime", {**registry._runtime})
    before = hook.policies_markdown()
    assert "docs-test-policy" not in before
    policies.register("docs-test-policy", _Documented)
    page = hook.policies_markdown()
    assert "### `docs-test-policy`" in page
    assert "Hands out a segment per request, for the docs test." in page
    assert "holds a simulated KV cache: **no**" in page
    assert "| `spare_segments` | `3` | segments kept for reuse, at most. |" in page
    assert "docs-test-policy" in hook.policies_output()  # `poollab policies` itself lists it


def test_knob_lines_come_from_the_args_sections_of_the_class_and_its_bases():
    lines = hook.knob_lines(
        policies.get("best-fit")
    )  # BestFit documents its knobs on ContiguousPolicy
    assert lines["segment_bytes"].startswith("size of the segment reserved on a miss")


def test_markers_are_replaced_and_an_unknown_one_fails_the_build():
    assert "$ poollab policies" in hook.render("<!-- poollab:generate policies-output -->")
    with pytest.raises(KeyError):
        hook.render("<!-- poollab:generate no-such-block -->")


def test_the_commands_reference_is_generated_from_click(monkeypatch):
    mkdocs_click = pytest.importorskip("mkdocs_click._docs")
    import click
    from poollab.cli import cli

    hook.load_all_commands()

    def page() -> str:
        return "\n".join(mkdocs_click.make_command_docs("poollab", cli, depth=1, style="table"))

    assert "--kv-capacity" in page()
    replay = cli.commands["replay"]
    monkeypatch.setattr(
        replay, "params", [*replay.params, click.Option(["--docs-test-option"], help="Made up.")]
    )
    assert "--docs-test-option" in page()


def test_the_engine_profile_samples_read_and_the_columns_follow_the_reader():
    from traces.engine_profile import STEP_COLUMNS, read_served_requests, read_step_profile

    steps = read_step_profile(ROOT / "docs" / "samples" / "step_profile.csv")
    served = read_served_requests(ROOT / "docs" / "samples" / "served_requests.csv")
    assert len(steps) == 4 and len(served) == 3 and served["finish_s"].isna().sum() == 1
    table = hook.engine_profile_markdown()
    assert all(f"`{c}`" in table for c in STEP_COLUMNS)
