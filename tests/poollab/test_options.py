"""``poollab.options``: the option types every command's numbers and sizes go through (issue 29)."""

from __future__ import annotations

import click
import pytest

from poollab.cli import COMMANDS, cli
from poollab.options import (
    BYTES,
    COUNT,
    FRACTION,
    INT64_MAX,
    RATE_SCALE,
    ByteSize,
    Count,
    FiniteFloat,
    FloatList,
)


def every_command() -> list[tuple[str, click.Command]]:
    """Every command and group of the command line, with its path (``"gpu serve"``), groups
    before their commands (``tests/poollab/test_option_declarations.py`` walks it too)."""
    ctx = click.Context(cli)
    out = []

    def walk(cmd: click.Command, path: str) -> None:
        out.append((path, cmd))
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), f"{path} {name}")

    for name in COMMANDS:
        walk(cli.get_command(ctx, name), name)
    return out


def _every_option() -> list[tuple[str, click.Parameter]]:
    return [(path, p) for path, cmd in every_command() for p in cmd.params]


def test_no_command_takes_a_number_click_checks_alone():
    """click's INT/FLOAT (and their ranges) take nan, inf and 400-digit numbers: every numeric
    option is one of poollab.options' types instead."""
    options = _every_option()
    assert len(options) > 80
    plain = [
        f"{path} {p.opts[0] if p.opts else p.name}"
        for path, p in options
        if isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType))
        and not isinstance(p.type, (FiniteFloat, Count))
    ]
    assert plain == []
    ours = [p for _, p in options if isinstance(p.type, (ByteSize, FiniteFloat, Count, FloatList))]
    assert len(ours) > 40


@pytest.mark.parametrize(
    "kind, text",
    [
        (BYTES, "9" * 400),
        (BYTES, "9" * 400 + "GiB"),
        (BYTES, str(2**63)),
        (BYTES, "8EiB"),
        (BYTES, "1.5"),
        (FRACTION, "nan"),
        (FRACTION, "inf"),
        (FRACTION, "0"),
        (FRACTION, "1.5"),
        (RATE_SCALE, "1e-300"),
        (RATE_SCALE, "1e300"),
        (RATE_SCALE, "-inf"),
        (RATE_SCALE, "x"),
        (COUNT, "0"),
        (COUNT, "9" * 5000),
        (COUNT, "1.5"),
        (COUNT, str(2**63)),
        (FloatList(RATE_SCALE), "1,nan"),
        (FloatList(RATE_SCALE), ",".join(["1"] * 5000)),
    ],
)
def test_values_that_do_not_fit_are_refused(kind, text):
    with pytest.raises(click.BadParameter) as info:
        kind.convert(text, None, None)
    assert len(info.value.format_message()) < 200  # one short line, however long the value


def test_values_that_fit_are_converted():
    assert BYTES.convert("80GiB", None, None) == 80 << 30
    assert BYTES.convert(str(INT64_MAX), None, None) == INT64_MAX
    assert ByteSize(64 << 10, 2 << 20).convert("2MiB", None, None) == 2 << 20
    assert (
        FRACTION.convert("1", None, None) == 1.0 and RATE_SCALE.convert("1e-6", None, None) == 1e-6
    )
    assert COUNT.convert("1_000", None, None) == 1000 and Count(0).convert("0", None, None) == 0
    assert FloatList(RATE_SCALE).convert("1,2.5", None, None) == [1.0, 2.5]
