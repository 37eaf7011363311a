"""``poollab``: the root command group and the one place user errors become exit status 2.

Sub-commands live in ``poollab/commands/`` (one module each, with ``register(cli)``), imported
only when used (``LazyGroup``); they only parse options, call the library and print. Errors in
``USER_ERRORS`` are printed as one line ``poollab: error: <what and where>`` with exit status 2,
never a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, NoReturn

import click

from poollab import __version__
from poollab.errors import USER_ERRORS

#: Sub-command -> (its module, the first paragraph of its help). The module is imported only when
#: the command runs or shows its own help; ``poollab --help`` lists the summaries, so it does not
#: import pandas, simpy or the simulator (tests/poollab check each summary against the command).
COMMANDS: dict[str, tuple[str, str]] = {
    "policies": (
        "poollab.commands.policies",
        "List registered policies (built-in and third-party) and their parameters.",
    ),
    "presets": (
        "poollab.commands.presets",
        "List the model and GPU presets (shapes, context limits, memory, rates, links).",
    ),
    "replay": (
        "poollab.commands.replay",
        "Replay the allocation TRACE against each policy and compare them.",
    ),
    "simulate": (
        "poollab.commands.simulate",
        "Simulate serving the request TRACE with each policy managing the KV cache.",
    ),
    "colocate": (
        "poollab.commands.colocate",
        "Simulate several model instances (tenants) sharing one GPU's memory, under each layout.",
    ),
    "fidelity": (
        "poollab.commands.fidelity",
        "Does the emulation decide what the real allocator decided on SNAPSHOT?",
    ),
    "calibrate": (
        "poollab.commands.calibrate",
        "Fit the simulator's step time to a real engine "
        "(a step profile, or a request table alone).",
    ),
    "plan": (
        "poollab.commands.plan",
        "Size the KV cache before deploy: "
        "the largest KV allocation with which the start-up SNAPSHOT still fits.",
    ),
    "gpu": (
        "poollab.commands.gpu",
        "Run policies as real GPU memory pools (CuPy); measure baselines; calibrate the simulator.",
    ),
    "report": (
        "poollab.commands.report",
        "Write one HTML report from the result folders DIRS "
        "(any mix of replay, simulate and gpu runs).",
    ),
    "sweep": (
        "poollab.commands.sweep",
        "Run every cell of the grid in SWEEP.yaml that is not yet in --out; "
        "merge them into one table.",
    ),
    "traces": (
        "poollab.commands.traces",
        "Inspect allocation and request traces; generate synthetic ones.",
    ),
    "demo": (
        "poollab.commands.demo",
        "Compare the five policies on bundled real traces (replay, then simulation).",
    ),
}


class LazyGroup(click.Group):
    """A group whose sub-commands are imported on first use (click's documented lazy-loading
    pattern).

    Each module in ``COMMANDS`` registers its command with ``register(group)`` when imported.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            importlib.import_module(COMMANDS[cmd_name][0]).register(self)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list, from ``COMMANDS``' summaries for commands not imported yet."""
        rows = [
            (name, self.commands.get(name) or click.Command(name, help=COMMANDS[name][1]))
            for name in self.list_commands(ctx)
        ]
        rows = [(name, cmd) for name, cmd in rows if not cmd.hidden]
        if rows:
            limit = formatter.width - 6 - max(len(name) for name, _ in rows)
            with formatter.section("Commands"):
                formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in rows])


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="poollab")
def cli() -> None:
    """poollab: compare GPU memory-pool policies for LLM inference.

    Replay allocation traces, simulate an inference server, or run a policy as a real GPU pool;
    every run ends in the same report (fragmentation, failures, latency).
    """


def main(argv: list[str] | None = None) -> None:
    """Run the command line; every way it can fail ends in one line on stderr.

    Exit status 2 for the user's input (``USER_ERRORS``, bad options, a file system that says
    no), 130 for Ctrl-C. Click's own ``main`` is bypassed: it turns an ``EOFError`` (a truncated
    gzip) into "Aborted!" and prints the usage block before an option error.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with cli.make_context("poollab", args) as ctx:
            cli.invoke(ctx)
    except click.exceptions.Exit as exc:  # --help, --version
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # bad options: click's message, on one line
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        _fail(f"{' '.join(exc.format_message().split())}{hint}")
    except click.ClickException as exc:
        _fail(" ".join(exc.format_message().split()), exc.exit_code)
    except (
        BrokenPipeError
    ):  # the reader went away (`poollab presets | head`): stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(
            devnull, sys.stdout.fileno()
        )  # so the interpreter's final flush does not fail again
        sys.exit(141)
    except click.exceptions.Abort:
        click.echo("poollab: aborted", err=True)
        sys.exit(130)
    except USER_ERRORS as exc:
        _fail(_one_line(exc))
    except KeyboardInterrupt:
        click.echo("poollab: interrupted", err=True)
        sys.exit(130)


def _fail(message: str, code: int = 2, prog: str = "poollab") -> None:
    click.echo(f"{prog}: error: {message}", err=True)
    sys.exit(code)


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Run a script's ``main`` (the benchmarks') and exit with its status, with the user's input
    going wrong (``USER_ERRORS``: a malformed trace, a missing file, an unknown policy) printed as
    the command line prints it: one line ``<script>: error: <what and where>``, exit status 2, no
    traceback."""
    try:
        code = main()
    except USER_ERRORS as exc:
        _fail(_one_line(exc), prog=os.path.basename(sys.argv[0]))
    sys.exit(code)


def _one_line(exc: BaseException) -> str:
    """The error in one line; an OS error names its file (and the second one of a rename)."""
    if isinstance(exc, OSError) and exc.filename:
        where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else str(exc.filename)
        return f"{where}: {exc.strerror or type(exc).__name__}"
    return " ".join(str(exc).split()) or type(exc).__name__
