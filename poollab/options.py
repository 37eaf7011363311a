"""The command line's option types (every number or size an option takes is checked here, at
parse time) and the options several commands take, each declared once.

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

Below the types, the options that several commands take, each declared once (``format_option``,
``model_option``, ``out_option``, ...): a command passes what differs (its help, a default) as
arguments, so the name, type and meaning of ``--model`` are the same wherever it appears
(``tests/poollab/test_option_declarations.py`` fails on a second ``click.option`` of a name).
The ``ServerConfig`` knobs' options are generated from their ``Knob`` instead
(``poollab.commands.simulate.config_options``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import click

from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from policies.units import parse_bytes
from sim.replay.hardware import DEFAULT_GPU
from sim.replay.models import DEFAULT_MODEL
from traces.atomic import check_out_folder

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
    "format_option",
    "policy_option",
    "model_option",
    "gpu_option",
    "rate_scale_option",
    "duration_option",
    "num_requests_option",
    "rate_option",
    "engine_option",
    "block_tokens_option",
    "capacity_option",
    "sample_every_option",
    "validate_option",
    "sim_option",
    "costs_option",
    "calibration_option",
    "model_file_options",
    "seed_option",
    "cuda_device_option",
    "trace_device_option",
    "workers_option",
    "out_option",
    "check_out",
    "out_file_option",
    "progress_option",
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
                f"{_short(value)} is not a device kind; "
                f"one of {', '.join(k.value for k in DeviceKind)} (or segments, vmm)",
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


# -- Options several commands take, each declared once ---------------------------------------------

Decorator = Callable[[Callable], Callable]
#: An input or output file (not a folder), as a ``Path``.
FILE_PATH = click.Path(dir_okay=False, path_type=Path)


def format_option() -> Decorator:
    """``--format``: a trace's format by name, instead of detecting it from the content."""
    return click.option(
        "--format",
        "fmt",
        default=None,
        help="Trace format, when detection from content is not wanted.",
    )


def policy_option(help: str, *, default: str | None = None) -> Decorator:
    """``--policy`` / ``-p``: policy specs, repeatable, as ``specs``; with a ``default``, one spec
    (``spec``)."""
    if default is not None:
        return click.option(
            "--policy", "-p", "spec", default=default, show_default=True, metavar="SPEC", help=help
        )
    return click.option("--policy", "-p", "specs", multiple=True, metavar="SPEC", help=help)


def model_option(
    help: str = "Model preset or JSON file.",
    *,
    default: str | None = DEFAULT_MODEL,
    repeatable: bool = False,
) -> Decorator:
    """``--model``: a model preset (``sim/data/models.json``) or a model JSON file;
    ``repeatable``: several, as ``models`` (no default: ``help`` says what none means)."""
    if repeatable:
        return click.option("--model", "models", multiple=True, metavar="MODEL", help=help)
    return click.option("--model", default=default, show_default=default is not None, help=help)


def gpu_option(
    help: str = "GPU preset or JSON file.",
    *,
    default: str | None = DEFAULT_GPU,
    name: str = "gpu",
) -> Decorator:
    """``--gpu``: a GPU preset (``sim/data/gpus.json``) or a GPU JSON file, as ``name``."""
    return click.option("--gpu", name, default=default, show_default=default is not None, help=help)


def rate_scale_option(
    help: str = "Multiply the request rate (2 = arrivals twice as dense).",
) -> Decorator:
    """``--rate-scale``: a factor on a request trace's arrival rate (``RATE_SCALE``)."""
    return click.option("--rate-scale", type=RATE_SCALE, default=1.0, show_default=True, help=help)


def duration_option(help: str) -> Decorator:
    """``--duration``: a window of a request trace in seconds, as ``duration_s``."""
    return click.option("--duration", "duration_s", type=POSITIVE, default=None, help=help)


def num_requests_option(help: str | None = None, *, default: int | None = None) -> Decorator:
    """``--num-requests``: how many requests a generated trace has."""
    return click.option(
        "--num-requests", type=COUNT, default=default, show_default=default is not None, help=help
    )


def rate_option(help: str, *, name: str = "rate_rps", required: bool = False) -> Decorator:
    """``--rate``: a generated trace's mean arrival rate in requests per second, as ``name``."""
    return click.option("--rate", name, type=POSITIVE, required=required, default=None, help=help)


def engine_option(help: str, *, default: str | None = None) -> Decorator:
    """``--engine``: an engine preset (``sim/data/engines.json``) by name."""
    return click.option(
        "--engine", default=default, show_default=default is not None, metavar="NAME", help=help
    )


def block_tokens_option(help: str, *, default: int | None = None) -> Decorator:
    """``--block-tokens``: tokens per KV block (page)."""
    return click.option(
        "--block-tokens", type=COUNT, default=default, show_default=default is not None, help=help
    )


def capacity_option(help: str) -> Decorator:
    """``--capacity``: the most bytes a replayed pool may reserve (``BYTES``; default: ``help``
    says)."""
    return click.option("--capacity", type=BYTES, default=None, help=help)


def sample_every_option() -> Decorator:
    """``--sample-every``: the replays' stride, in events, between samples of the pool's
    statistics (the simulator's ``--sample-every`` is a ``ServerConfig`` knob, in seconds)."""
    return click.option(
        "--sample-every", type=COUNT, default=None, help="Stats sample stride in events."
    )


def validate_option(help: str) -> Decorator:
    """``--validate``: a flag, the policies' checking mode."""
    return click.option("--validate", is_flag=True, help=help)


def sim_option(help: str) -> Decorator:
    """``--sim/--no-sim``: a flag (``with_sim``), also predict the real-GPU run with the
    simulator."""
    return click.option("--sim/--no-sim", "with_sim", default=False, help=help)


def costs_option(
    help: str = "Driver and PCIe cost model JSON (default: bundled H200 figures).",
) -> Decorator:
    """``--costs``: a cost-model file (``sim.replay.costs.CostModel``; ``poollab gpu calibrate``
    writes one)."""
    return click.option("--costs", type=FILE_PATH, default=None, help=help)


def calibration_option(
    help: str = "Step-time calibration JSON (default: bundled factors).",
) -> Decorator:
    """``--calibration``: a step-time calibration file (``poollab calibrate`` writes one)."""
    return click.option("--calibration", type=FILE_PATH, default=None, help=help)


def model_file_options(command: Callable) -> Callable:
    """``--calibration`` and ``--costs``: the step-time and cost-model files of a simulation."""
    return calibration_option()(costs_option()(command))


def seed_option(help: str | None = None) -> Decorator:
    """``--seed``: a random seed (``SEED``), 0 unless given."""
    return click.option("--seed", type=SEED, default=0, show_default=True, help=help)


def cuda_device_option() -> Decorator:
    """``--device``: the CUDA device a command runs on, as ``device_id``."""
    return click.option(
        "--device", "device_id", type=DEVICE, default=0, show_default=True, help="CUDA device."
    )


def trace_device_option() -> Decorator:
    """``--device``: which device's trace of a PyTorch snapshot to read, as ``device_index``."""
    return click.option(
        "--device",
        "device_index",
        type=DEVICE,
        default=None,
        help="Which device's trace to read. Default: the first with entries.",
    )


def workers_option(help: str, *, metavar: str | None = None) -> Decorator:
    """``--workers``: how many processes run side by side (default: ``help`` says)."""
    return click.option("--workers", type=COUNT, default=None, metavar=metavar, help=help)


def out_option(
    default: str | None,
    help: str = "Folder for summary.csv and the other tables "
    "(an earlier run's are replaced; files you put there are kept).",
) -> Decorator:
    """``--out``: a result folder (``out_dir``), checked before any work (``check_out``);
    ``default`` None: no folder unless given."""
    return click.option(
        "--out",
        "out_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=default,
        show_default=default is not None,
        callback=check_out,
        help=help,
    )


def check_out(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A ``--out`` that no run can replace (the current folder or one holding it, the root, a
    file) fails now, not after the run. (A file of the user's in the way is found at the end,
    when the run's outputs are known: nothing is changed then either.)"""
    if value is not None and not ctx.resilient_parsing:
        check_out_folder(value)
    return value


def out_file_option(help: str, *, default: Path | None = None, name: str = "out_path") -> Decorator:
    """``--out``: one output file, as ``name``; required unless there is a ``default``."""
    return click.option(
        "--out",
        name,
        type=FILE_PATH,
        default=default,
        required=default is None,
        show_default=default is not None,
        help=help,
    )


def progress_option(help: str = "Progress bar on stderr.") -> Decorator:
    """``--progress/--no-progress``: progress bars on stderr, on unless turned off."""
    return click.option("--progress/--no-progress", default=True, help=help)
