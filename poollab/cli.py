"""``poollab``: the root command group and the one place user errors become exit status 2.

Sub-commands live in ``poollab/commands/`` (one module each, with ``register(cli)``); they only
parse options, call the library and print. Errors in ``USER_ERRORS`` are printed as one line
``poollab: error: <what and where>`` with exit status 2, never a traceback.
"""

from __future__ import annotations

import importlib
import sys

import click

from poollab import __version__
from poollab.errors import USER_ERRORS

#: Sub-command modules, in the order ``poollab --help`` lists them.
COMMAND_MODULES = [
    "poollab.commands.policies",
    "poollab.commands.replay",
    "poollab.commands.simulate",
    "poollab.commands.fidelity",
    "poollab.commands.gpu",
    "poollab.commands.report",
    "poollab.commands.sweep",
    "poollab.commands.traces",
    "poollab.commands.demo",
]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="poollab")
def cli() -> None:
    """poollab: compare GPU memory-pool policies for LLM inference.

    Replay allocation traces, simulate an inference server, or run a policy as a real GPU pool;
    every run ends in the same report (fragmentation, failures, latency).
    """


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(cli)


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
    except click.exceptions.Abort:
        click.echo("poollab: aborted", err=True)
        sys.exit(130)
    except USER_ERRORS as exc:
        _fail(_one_line(exc))
    except KeyboardInterrupt:
        click.echo("poollab: interrupted", err=True)
        sys.exit(130)


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"poollab: error: {message}", err=True)
    sys.exit(code)


def _one_line(exc: BaseException) -> str:
    """The error in one line; an OS error names its file (and the second one of a rename)."""
    if isinstance(exc, OSError) and exc.filename:
        where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else str(exc.filename)
        return f"{where}: {exc.strerror or type(exc).__name__}"
    return " ".join(str(exc).split()) or type(exc).__name__
