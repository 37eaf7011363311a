"""``poollab sweep``: a SWEEP.yaml grid of replays or simulations, locally or on Dask, resumable."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import click

from poollab.errors import UsageError
from poollab.options import out_option, progress_option, workers_option
from sim.sweep import SweepError, format_fronts, load_sweep, make_executor, plan_sweep, run_sweep
from sim.sweep.store import CellRecordWarning

#: Failed cells listed by name in the output (the table has them all).
_MAX_FAILED_SHOWN = 5
#: Distinct range warnings printed (each cell's shares differ; summary.csv has them all).
_MAX_RANGE_WARNINGS = 5
#: The cell inputs that name a cell in a warning when they vary over the sweep.
_CELL_LABEL_COLUMNS = ("cell_model", "cell_gpu", "cell_rate_scale", "cell_capacity_bytes")


def register(cli: click.Group) -> None:
    cli.add_command(sweep_command)


@click.command("sweep")
@click.argument("sweep_file", metavar="SWEEP.yaml", type=click.Path(dir_okay=False, path_type=Path))
@out_option(
    "poollab-out/sweep",
    help="Folder of the sweep: cells/ (one record per finished cell), results.parquet, "
    "summary.csv, pareto.csv. Re-use it to resume; files you put there are kept.",
)
@click.option(
    "--scheduler",
    default=None,
    metavar="ADDRESS",
    help="Where cells run: tcp://HOST:8786 (an existing Dask cluster), local:N "
    "(a local Dask cluster of N workers), processes (default: a local process pool) or serial.",
)
@workers_option(
    "Processes of the local pool (default: the machine's cores), or N of --scheduler local."
)
@click.option("--retry-failed", is_flag=True, help="Run cells that failed in an earlier run again.")
@click.option(
    "--dry-run", is_flag=True, help="Validate the file and count the cells to run; run nothing."
)
@progress_option()
def sweep_command(
    sweep_file: Path,
    out_dir: Path,
    scheduler,
    workers,
    retry_failed: bool,
    dry_run: bool,
    progress: bool,
) -> None:
    """Run every cell of the grid in SWEEP.yaml that is not yet in --out; merge them into one table.

    Exit status 1 when a cell failed (the others still ran; see the error column). A damaged
    record in --out/cells is named in one warning line and its cell runs again.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("always", CellRecordWarning)
        warnings.showwarning = _one_line_warning
        outcome, spec = _run(
            sweep_file, out_dir, scheduler, workers, retry_failed, dry_run, progress
        )
    if outcome is None:
        return
    click.echo(
        f"{outcome.num_run} run on {outcome.scheduler}, "
        f"{outcome.num_cached} already done ({outcome.wall_s:,.1f} s)"
    )
    click.echo(format_fronts(outcome.pareto, by=spec.pareto_by))
    for line in range_warnings(outcome.results):
        click.echo(line, err=True)
    click.echo(f"wrote {out_dir}/results.parquet, {out_dir}/summary.csv, {out_dir}/pareto.csv")
    bad = outcome.results[outcome.results["status"] != "ok"]
    if len(bad):
        click.echo(
            f"{outcome.num_failed} cells failed, {outcome.num_lost} lost to dead workers "
            "(lost ones run again next time; failed ones with --retry-failed):",
            err=True,
        )
        for row in bad.head(_MAX_FAILED_SHOWN).itertuples():
            click.echo(f"  {row.trace} · {row.policy} · {row.cell_key}: {row.error}", err=True)
        sys.exit(1)


def _run(
    sweep_file: Path,
    out_dir: Path,
    scheduler,
    workers,
    retry_failed: bool,
    dry_run: bool,
    progress: bool,
):
    """``(outcome, spec)`` of the sweep; outcome None for ``--dry-run`` (its line printed here)."""
    try:
        make_executor(
            scheduler, workers
        )  # a bad --scheduler fails before any work (nothing starts here)
        spec = load_sweep(sweep_file)
        if dry_run:
            todo, done = plan_sweep(spec, out_dir, retry_failed=retry_failed)
            click.echo(_plan_line(spec, len(done)) + f"; {len(todo)} to run")
            return None, spec
        out_dir.mkdir(
            parents=True, exist_ok=True
        )  # --out under a file fails here, before any cell runs
        click.echo(_plan_line(spec, None), err=True)
        outcome = run_sweep(
            spec,
            out_dir,
            scheduler=scheduler,
            workers=workers,
            retry_failed=retry_failed,
            progress=progress,
        )
    except SweepError as exc:  # a bad file or scheduler: one line, exit 2
        raise UsageError(str(exc)) from None
    return outcome, spec


def range_warnings(results) -> list[str]:
    """The finished cells' range warnings (a calibration's steps past what its fit saw:
    ``sim.serving.fit_range``), cached cells included: one line per distinct warning, at most
    ``_MAX_RANGE_WARNINGS``, each naming its cells by trace, policy and the inputs that vary
    over the sweep (``rate_scale=2``: a load past the fit's)."""
    from sim.serving.fit_range import range_warning_lines

    if "range_warning" not in results:
        return []
    ok = results[results["status"] == "ok"]
    varying = [
        c
        for c in ok.columns
        if (c in _CELL_LABEL_COLUMNS or str(c).startswith("option_"))
        and ok[c].nunique(dropna=False) > 1
    ]
    labels = [
        " ".join(
            [str(row["trace"]), str(row["policy"])]
            + [
                f"{c.removeprefix('cell_').removeprefix('option_')}={_text(row[c])}"
                for c in varying
            ]
        )
        for _, row in ok.iterrows()
    ]
    return range_warning_lines(zip(labels, ok["range_warning"]), max_lines=_MAX_RANGE_WARNINGS)


def _text(value) -> str:
    """A cell input as a warning names it: ``4`` for a rate scale of 4.0."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A damaged cell record (``CellRecordWarning``) and the like, as one line on stderr."""
    click.echo(f"poollab: warning: {' '.join(str(message).split())}", err=True)


def _plan_line(spec, num_done: int | None) -> str:
    dups = f", {spec.num_duplicates} duplicates dropped" if spec.num_duplicates else ""
    done = f", {num_done} already done" if num_done is not None else ""
    return f"{spec.path}: {len(spec.cells)} {spec.mode} cells{dups}{done}"
