"""``poollab report``: one self-contained HTML page from result folders (replay, simulate, gpu)."""

from __future__ import annotations

from pathlib import Path

import click

from poollab.errors import UsageError
from poollab.options import out_file_option, progress_option


def register(cli: click.Group) -> None:
    cli.add_command(report_command)


@click.command("report")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@out_file_option("HTML file to write (plots embedded; opens offline).", default=Path("report.html"))
@click.option("--title", default=None, help="Page title (default: 'poollab report').")
@click.option(
    "--static",
    is_flag=True,
    default=False,
    help="PNG figures only, no scripts "
    "(default: interactive timelines and segment view, still offline).",
)
@progress_option()
def report_command(
    dirs: tuple[Path, ...], out_path: Path, title: str | None, static: bool, progress: bool
) -> None:
    """Write one HTML report from the result folders DIRS (any mix of replay, simulate and gpu
    runs)."""
    from sim.report.html import write_html_report

    try:
        path = write_html_report(
            dirs, out_path, title=title, progress=progress, interactive=not static
        )
    except ValueError as exc:  # a folder whose tables lack the report's columns
        raise UsageError(str(exc)) from None
    click.echo(
        f"wrote {path} ({path.stat().st_size / 2**20:,.2f} MiB) from {len(dirs)} result folder(s)"
    )
