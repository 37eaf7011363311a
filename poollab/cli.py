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
    """Console-script entry point."""
    try:
        cli.main(args=argv, prog_name="poollab", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("poollab: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:  # bad options: click's own message, exit 2
        exc.show()
        sys.exit(2 if exc.exit_code == 2 else exc.exit_code)
    except USER_ERRORS as exc:
        click.echo(f"poollab: error: {_one_line(exc)}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("poollab: interrupted", err=True)
        sys.exit(130)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, PermissionError)) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    return " ".join(str(exc).split()) or type(exc).__name__
