"""The generated parts of the docs: the summary columns, the policies and their knobs.

An mkdocs hook (``hooks:`` in ``mkdocs.yml``). A page asks for a generated block with a marker
line ``<!-- poollab:generate NAME -->``; ``on_page_markdown`` replaces it with
``GENERATORS[NAME]()``, computed from the code at build time, so the pages change when a column, a
policy or a knob does:

- ``columns``: the report schema (``sim.replay.schema.SUMMARY_COLUMNS``, ``DEVICE_COLUMNS``,
  ``TIMESERIES_COLUMNS``, ``LATENCY_SAMPLE_COLUMNS``;
  ``sim.replay.serving_metrics.SERVING_COLUMNS``,
  ``sim.serving.simulate.CALIBRATION_COLUMNS``), in schema order, each with its unit (from the
  name: ``*_bytes``, ``*_us``, ``n_*``, ...) and the header the command line prints it under
  (``sim.replay.schema.format_table`` itself). Meanings come from ``columns.yml`` beside this file,
  keyed by column; ``tests/docs`` fails when a schema column has none there or when it describes a
  column the schema no longer has.
- ``policies``: every registered policy (``policies.available()``: built-ins and entry points),
  its summary line, capabilities (``can_hold_kv``, ``device_kind``), knobs with their defaults
  (``Policy.param_defaults``) and the knob's line from the class's ``Args:`` docstring section,
  and ``poollab policies``' own output.
- ``policies-output``: ``poollab policies``' output alone.
- ``engine-profile``: the columns of the engine-profile tables (``traces.engine_profile``).

The commands' reference is mkdocs-click's (``docs/reference/commands.md``); ``on_config`` loads
every lazily imported sub-command first, so that it sees them all. Nothing here imports mkdocs:
the tests import this file to check what it generates.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Callable

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the build runs from the root; the tests import this file by path
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"^<!-- poollab:generate ([\w-]+) -->$", re.M)
COLUMNS_FILE = Path(__file__).with_name("columns.yml")


# ---------------------------------------------------------------------------------------- columns


def schema_tables() -> dict[str, list[str]]:
    """Each table of the report schema -> its columns, in schema order."""
    from sim.replay import schema as report
    from sim.replay import serving_metrics
    from sim.serving.simulate import CALIBRATION_COLUMNS

    return {
        "summary.csv: every backend": list(report.SUMMARY_COLUMNS),
        "summary.csv: the device's calls (every row)": list(report.DEVICE_COLUMNS),
        "summary.csv: the serving simulator": list(serving_metrics.SERVING_COLUMNS),
        "summary.csv: a simulation calibrated by a step fit": list(CALIBRATION_COLUMNS),
        "timeseries.parquet": list(report.TIMESERIES_COLUMNS),
        "latency_samples.parquet (replays)": list(report.LATENCY_SAMPLE_COLUMNS),
    }


def column_descriptions() -> dict[str, str]:
    return yaml.safe_load(COLUMNS_FILE.read_text()) or {}


def column_unit(column: str, shown_as: str) -> str:
    """The unit of a column, from its name (the project's naming rule: names carry units)."""
    if shown_as.endswith("_%"):
        return "fraction 0-1"
    if column.endswith("_bytes"):
        return "bytes"
    if column.startswith("driver_ns_") or column.endswith("_ns"):
        return "ns"
    if column.endswith("_us"):
        return "µs"
    if column.endswith("_tok_s"):
        return "tokens/s"
    if column.endswith("_rps"):
        return "requests/s"
    if column.endswith("_s"):
        return "s"
    if column.startswith(("n_", "num_")):
        return "count"
    return ""


def shown_as(column: str) -> str:
    """The header the command line's tables print the column under
    (``sim.replay.schema.format_table``)."""
    import pandas as pd
    from sim.replay.schema import format_table

    header = format_table(pd.DataFrame({column: [0.0]}), [column]).splitlines()[0]
    return header.strip()


def columns_markdown() -> str:
    meanings = column_descriptions()
    out = []
    for title, columns in schema_tables().items():
        out += [f"### {title}", "", "| column | unit | printed as | meaning |", "|---|---|---|---|"]
        for col in columns:
            printed = shown_as(col)
            meaning = meanings.get(col, "").strip().replace("\n", " ").replace("|", "\\|")
            out.append(f"| `{col}` | {column_unit(col, printed)} | `{printed}` | {meaning} |")
        out.append("")
    return "\n".join(out)


def undescribed_columns() -> list[str]:
    meanings = column_descriptions()
    return [
        c
        for cols in schema_tables().values()
        for c in cols
        if not str(meanings.get(c) or "").strip()
    ]


def stale_descriptions() -> list[str]:
    known = {c for cols in schema_tables().values() for c in cols}
    return [c for c in column_descriptions() if c not in known]


# --------------------------------------------------------------------------------------- policies

_ARG_LINE = re.compile(r"^(\s+)(\w+(?:, \w+)*)(?: \([^)]*\))?: (.*)$")


def knob_lines(cls: type) -> dict[str, str]:
    """Knob -> its line in the ``Args:`` docstring sections of the class, its bases and
    ``__init__``."""
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        for doc in (klass.__doc__, getattr(klass.__dict__.get("__init__"), "__doc__", None)):
            for name, text in _args_section(inspect.cleandoc(doc or "")).items():
                found.setdefault(name, text)
    return found


def _args_section(doc: str) -> dict[str, str]:
    args: dict[str, str] = {}
    lines = doc.splitlines()
    inside, indent, current = False, None, None
    for line in lines:
        if line.strip() in ("Args:", "Arguments:", "Parameters:", "Knobs:"):
            inside, indent, current = True, None, None
            continue
        if not inside:
            continue
        if line.strip() and not line.startswith((" ", "\t")):
            inside = False  # the section ended at the next unindented line
            continue
        m = _ARG_LINE.match(line)
        if m and (indent is None or len(m.group(1)) == indent):
            indent = len(m.group(1))
            for current in m.group(2).split(", "):  # "capacity_bytes, device: ..." names several
                args[current] = m.group(3).strip()
        elif current and line.strip():
            args[current] += " " + line.strip()
        elif not line.strip():
            current = None
    return args


def _rst_to_md(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|")


def _default_text(knob: str, default) -> str:
    """A knob's default as a spec would write it; a size also in binary units."""
    text = f"`{default!r}`"
    if (
        knob.endswith("_bytes")
        and isinstance(default, int)
        and not isinstance(default, bool)
        and default >= 1024
    ):
        from policies.units import format_bytes

        text += f" ({format_bytes(default)})"
    return text


def policies_output() -> str:
    from click.testing import CliRunner
    from poollab.cli import cli

    result = CliRunner().invoke(cli, ["policies"])
    if result.exit_code != 0:
        raise RuntimeError(f"poollab policies failed: {result.output}")
    return result.output.rstrip("\n")


def policies_markdown() -> str:
    import policies
    from policies import registry

    out = ["```", "$ poollab policies", policies_output(), "```", ""]
    for name in policies.available():
        cls = policies.get(name)
        doc = inspect.cleandoc(cls.__doc__ or "")
        summary = " ".join(doc.split("\n\n")[0].split())
        kind = registry.device_kind(name)
        holds = "yes" if registry.can_hold_kv(name) else "no"
        out += [
            f"### `{name}`",
            "",
            _rst_to_md(summary),
            "",
            f"`{cls.__module__}.{cls.__qualname__}` · holds a simulated KV cache: "
            f"**{holds}** (`can_hold_kv`) · device: **{kind}** (`device_kind`)",
            "",
        ]
        params = {k: v for k, v in cls.param_defaults().items()}
        if params:
            lines = knob_lines(cls)
            out += ["| knob | default | meaning |", "|---|---|---|"]
            for knob, default in params.items():
                out.append(
                    f"| `{knob}` | {_default_text(knob, default)} "
                    f"| {_rst_to_md(lines.get(knob, ''))} |"
                )
            out.append("")
    return "\n".join(out)


# -------------------------------------------------------------------------------- engine profiles


def engine_profile_markdown() -> str:
    """The two engine-profile tables' columns, required then optional
    (``traces.engine_profile``)."""
    from traces import engine_profile as ep

    served_optional = getattr(ep, "_SERVED_OPTIONAL_COLUMNS", ())
    rows = [
        ("step profile", ep.STEP_COLUMNS, ep.STEP_OPTIONAL_COLUMNS),
        ("served requests", ep.SERVED_REQUEST_COLUMNS, served_optional),
    ]
    out = ["| table | required columns | optional columns |", "|---|---|---|"]
    for name, required, optional in rows:
        out.append(
            f"| {name} | {', '.join(f'`{c}`' for c in required)} "
            f"| {', '.join(f'`{c}`' for c in optional)} |"
        )
    return "\n".join(out)


GENERATORS: dict[str, Callable[[], str]] = {
    "columns": columns_markdown,
    "engine-profile": engine_profile_markdown,
    "policies": policies_markdown,
    "policies-output": lambda: "\n".join(["```", "$ poollab policies", policies_output(), "```"]),
}


def render(markdown: str) -> str:
    """The page's markdown with each marker replaced by what its generator makes now."""

    def one(m: re.Match) -> str:
        if m.group(1) not in GENERATORS:
            raise KeyError(
                f"unknown generated block {m.group(1)!r}; known: {', '.join(GENERATORS)}"
            )
        return GENERATORS[m.group(1)]()

    return MARKER.sub(one, markdown)


def load_all_commands() -> None:
    """Import every lazily registered sub-command, so that mkdocs-click documents them all."""
    import click
    from poollab.cli import cli

    ctx = click.Context(cli, info_name="poollab")
    for name in cli.list_commands(ctx):
        cli.get_command(ctx, name)


# ------------------------------------------------------------------------------------ mkdocs hooks


def on_config(config, **kwargs):
    load_all_commands()
    return config


def on_page_markdown(markdown, page, config, files, **kwargs):
    return render(markdown)


#: What mkdocs-click prints as the default of an option that has none under click 8.3
#: (``multiple=True`` options, ``-p``): click's internal sentinel, which means "not given".
_CLICK_UNSET = "Sentinel.UNSET"


def on_page_content(html, page, config, files, **kwargs):
    return html.replace(_CLICK_UNSET, "none")
