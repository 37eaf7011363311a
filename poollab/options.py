"""The command line's option types: every number or size an option takes is checked here, at parse
time.

One ``click.ParamType`` per kind of value, shared by every command (and by the commands other
modules add): byte sizes (``BYTES``), finite numbers in a range (``FiniteFloat``; ``POSITIVE``,
``FRACTION``, ``RATE_SCALE``), whole-number counts in a range (``Count``; ``COUNT``, ``SEED``,
``DEVICE``) and comma-separated lists of them (``FloatList``). A value that does not fit fails
before the command starts, as click's usage error naming the option
(``poollab: error: Invalid value for '--rate-scale': nan is not a finite number``), exit status 2.

Why bounds beyond the obvious ones: sizes and counts end up in int64 columns (Parquet, NumPy),
so a 400-digit ``--capacity`` must stop here rather than as an ``OverflowError`` deep in a run;
a rate scale of 1e-300 stretches a trace's times past what float seconds and int64 nanoseconds
hold.
"""

from __future__ import annotations

import math
from typing import Any

import click

from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from policies.units import parse_bytes

__all__ = [
    "INT64_MAX",
    "ByteSize",
    "FiniteFloat",
    "Count",
    "FloatList",
    "BYTES",
    "POSITIVE",
    "FRACTION",
    "RATE_SCALE",
    "COUNT",
    "SEED",
    "DEVICE",
    "MIN_RATE_SCALE",
    "MAX_RATE_SCALE",
    "DeviceKindType",
    "DEVICE_KIND",
]

#: The largest size or count an option takes: what an int64 column holds.
INT64_MAX = 2**63 - 1
#: ``--rate-scale`` and its kin: a million times slower to a million times faster. Beyond that a
#: trace's hour becomes a century (or a microsecond), and scaled times leave float/int64 range.
MIN_RATE_SCALE, MAX_RATE_SCALE = 1e-6, 1e6


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def _within(
    value: float, low: float | None, high: float | None, low_open: bool, high_open: bool
) -> bool:
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or (value < high if high_open else value <= high)


class ByteSize(click.ParamType):
    """A size in bytes: ``80GiB``, ``512MiB``, ``4096``; whole, within ``[min_bytes,
    INT64_MAX]``."""

    name = "SIZE"

    def __init__(self, min_bytes: int = 0, max_bytes: int = INT64_MAX):
        self.min_bytes, self.max_bytes = min_bytes, min(max_bytes, INT64_MAX)

    def convert(self, value: Any, param, ctx) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool):
            self.fail(f"{value!r} is not a size in bytes", param, ctx)
        text = str(value).strip().replace("_", "")
        try:
            # a plain count of bytes exactly (parse_bytes goes through a float, which rounds past
            # 2**53)
            nbytes = int(text) if text.isdigit() and len(text) <= 19 else parse_bytes(value)
        except PolicyError as exc:
            self.fail(str(exc), param, ctx)
        except (OverflowError, ValueError):  # 400 digits: the float behind a unit is infinite
            self.fail(
                f"{_short(value)} is too large: at most {INT64_MAX:,} bytes (8 EiB)", param, ctx
            )
        if nbytes > self.max_bytes:
            self.fail(f"{_short(value)} is too large: at most {self.max_bytes:,} bytes", param, ctx)
        if nbytes < self.min_bytes:
            self.fail(
                f"{_short(value)} is too small: at least {self.min_bytes:,} bytes", param, ctx
            )
        return nbytes


class FiniteFloat(click.FloatRange):
    """A finite number (never nan or inf), optionally within bounds (``low_open``: ``> low``).

    A ``click.FloatRange`` for ``--help`` (which shows the range), with a conversion of its own:
    click's takes nan (no comparison with it fails) and inf."""

    name = "NUMBER"

    def __init__(
        self,
        low: float | None = None,
        high: float | None = None,
        *,
        low_open: bool = False,
        high_open: bool = False,
    ):
        super().__init__(low, high, min_open=low_open, max_open=high_open)
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open

    def convert(self, value: Any, param, ctx) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool):
            self.fail(f"{value!r} is not a number", param, ctx)
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            self.fail(f"{_short(value)} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{_short(value)} is not a finite number", param, ctx)
        if not _within(number, self.low, self.high, self.low_open, self.high_open):
            self.fail(
                f"{_short(value)} is not "
                f"{_interval(self.low, self.high, self.low_open, self.high_open)}",
                param,
                ctx,
            )
        return number

    def __repr__(self) -> str:
        return f"FiniteFloat({_interval(self.low, self.high, self.low_open, self.high_open)})"


class Count(click.IntRange):
    """A whole number within ``[low, high]`` (``high`` at most ``INT64_MAX``): counts, indices,
    seeds.

    A ``click.IntRange`` for ``--help`` (int64's bound left unsaid), with a conversion of its
    own: bounded above, and a 5,000-digit value is an error line, not Python's digit limit."""

    name = "INTEGER"

    def __init__(self, low: int | None = 0, high: int | None = INT64_MAX):
        high = INT64_MAX if high is None else min(high, INT64_MAX)
        super().__init__(low, high if high < INT64_MAX else None)
        self.low, self.high = low, high

    def convert(self, value: Any, param, ctx) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool):
            self.fail(f"{value!r} is not a whole number", param, ctx)
        if isinstance(value, int):
            number = value
        else:
            text = str(value).strip().replace("_", "")
            try:
                number = int(text)
            except ValueError:  # also Python's digit limit (4,300 digits): not a count anyone means
                self.fail(f"{_short(value)} is not a whole number", param, ctx)
        if not _within(number, self.low, self.high, False, False):
            self.fail(
                f"{_short(value)} is not in [{self.low if self.low is not None else '-inf'}, "
                f"{self.high:,}]",
                param,
                ctx,
            )
        return number


class FloatList(click.ParamType):
    """``1,2,4``: comma-separated numbers, each of ``item`` (a ``FiniteFloat``), at most
    ``max_items``."""

    name = "F,F,..."

    def __init__(self, item: FiniteFloat | None = None, max_items: int = 4096):
        self.item = item or FiniteFloat(0, low_open=True)
        self.max_items = max_items

    def convert(self, value: Any, param, ctx) -> list[float] | None:
        if value is None or isinstance(value, list):
            return value
        parts = str(value).split(",")
        if len(parts) > self.max_items:
            self.fail(f"{len(parts):,} numbers given; at most {self.max_items:,}", param, ctx)
        out = []
        for part in parts:
            try:
                out.append(self.item.convert(part, None, None))
            except click.BadParameter as exc:
                self.fail(f"{_short(value)}: {exc.message}", param, ctx)
        return out


class DeviceKindType(click.ParamType):
    """A device kind (``policies.device_kind.DeviceKind``): ``segment`` or ``page-mapped``, or
    the spellings earlier releases took (``segments``, ``vmm``), read by ``DeviceKind.parse``."""

    name = "|".join(k.value for k in DeviceKind)

    def get_metavar(
        self, param, ctx=None
    ) -> str:  # click upper-cases ``name``; users type the values
        return f"[{self.name}]"

    def convert(self, value: Any, param, ctx) -> DeviceKind | None:
        if value is None:
            return None
        try:
            return DeviceKind.parse(value, where=str(value))
        except ValueError:
            self.fail(
                f"{_short(value)} is not a device kind; one of "
                f"{', '.join(k.value for k in DeviceKind)} (or segments, vmm)",
                param,
                ctx,
            )

    def shell_complete(self, ctx, param, incomplete):
        from click.shell_completion import CompletionItem

        return [CompletionItem(k.value) for k in DeviceKind if k.value.startswith(incomplete)]


def _short(value: Any, limit: int = 40) -> str:
    """``value`` for an error line: a 400-digit number shown by its start and length."""
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else f"{text[:20]}... ({len(text):,} characters)"


BYTES = ByteSize()
#: A finite number > 0 (rates, durations, factors).
POSITIVE = FiniteFloat(0, low_open=True)
#: A share in (0, 1].
FRACTION = FiniteFloat(0, 1, low_open=True)
#: A multiplier of a trace's request rate (see ``MIN_RATE_SCALE``).
RATE_SCALE = FiniteFloat(MIN_RATE_SCALE, MAX_RATE_SCALE)
#: A count >= 1 (requests, workers, tenants, a stride).
COUNT = Count(1)
#: A random seed (NumPy takes any non-negative integer; int64 keeps it in a column).
SEED = Count(0)
#: A CUDA device index.
DEVICE = Count(0, 1023)
#: Segments or mapped pages (``DeviceKindType``).
DEVICE_KIND = DeviceKindType()
