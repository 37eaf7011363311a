"""``poollab replay``: an allocation trace against one or more policies."""

from __future__ import annotations

from pathlib import Path

import click

from poollab.commands._common import check_specs, load_costs, read_alloc_or_explain
from poollab.options import (
    FRACTION,
    capacity_option,
    costs_option,
    format_option,
    out_option,
    policy_option,
    progress_option,
    sample_every_option,
    workers_option,
)
from traces.read_ahead import start_read

# The replay engine and the report schema (pandas, numpy, the policies' runs) are imported inside
# the command, while a child process parses the snapshot (``traces.read_ahead``): on a many-core
# host the imports and the parse then take the time of the longer, not of both (issue 33).


def replay_columns() -> list[str]:
    """The summary columns the command prints."""
    from sim.replay.schema import DEFAULT_TABLE_COLUMNS

    return DEFAULT_TABLE_COLUMNS + ["gap_to_planner"]


def register(cli: click.Group) -> None:
    cli.add_command(replay_command)


@click.command("replay")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@policy_option(
    "Policy spec, repeatable (default: the five built-ins). E.g. size-class:classes_per_doubling=8"
)
@capacity_option("Most bytes a pool may reserve (e.g. 80GiB). Default: no limit.")
@costs_option(
    "Driver cost model JSON (from `poollab gpu calibrate`). Default: bundled H200 figures."
)
@format_option()
@sample_every_option()
@click.option(
    "--latency-sample",
    type=FRACTION,
    default=None,
    metavar="FRACTION",
    help="Share of calls whose latency is timed, chosen at random "
    "(default: every call up to 20,000 events, about 20,000 beyond; 1 times every call). "
    "Column latency_sampled_frac.",
)
@click.option(
    "--record-layout",
    is_flag=True,
    default=False,
    help="Also record each pool's segment layout over the run "
    "(layout.parquet; the report's segment view).",
)
@workers_option(
    "Processes replaying the policies side by side "
    "(default: the cores available, for a trace of 50,000 events or more; 1: all in this process). "
    "The results are the same either way.",
    metavar="N",
)
@out_option("poollab-out/replay")
@progress_option()
def replay_command(
    trace: Path,
    specs,
    capacity,
    costs,
    fmt,
    sample_every,
    latency_sample,
    record_layout: bool,
    workers,
    out_dir: Path,
    progress: bool,
) -> None:
    """Replay the allocation TRACE against each policy and compare them."""
    with start_read(trace, format=fmt) as reading:  # parsed in a child while this imports
        spec_list = check_specs(specs)
        cost_model = load_costs(costs)
        from sim.replay.schema import format_table, write_results
        from sim.replay.trace_replay import replay_tables

        alloc_trace = read_alloc_or_explain(trace, fmt, reading=reading)
    tables = replay_tables(
        alloc_trace,
        spec_list,
        capacity_bytes=capacity,
        costs=cost_model,
        sample_every=sample_every,
        progress=progress,
        record_layout=record_layout,
        latency_sample=latency_sample,
        workers=workers,
    )
    summary = tables.summary
    write_results(
        out_dir,
        summary,
        tables.timeseries,
        extra_tables={
            "latency_samples": tables.latency_samples,
            **({"layout": tables.layout} if tables.layout is not None else {}),
            **({"compactions": tables.compactions} if tables.compactions is not None else {}),
        },
        meta={
            "command": "replay",
            "trace": str(trace),
            "policies": spec_list,
            "capacity_bytes": capacity,
            "costs": str(costs) if costs else "bundled",
        },
    )
    click.echo(f"{alloc_trace.name}: {len(alloc_trace):,} events ({alloc_trace.format})")
    click.echo(format_table(summary, replay_columns()))
    if "lower_bound_bytes" in summary:
        first = summary.iloc[0]
        click.echo(
            "best possible: lower bound "
            f"(peak live) {first['lower_bound_bytes'] / 2**20:,.1f} MiB, "
            f"offline planner ({first['planner']}) {first['planner_peak_bytes'] / 2**20:,.1f} MiB"
        )
    click.echo(f"wrote {out_dir}/summary.csv, {out_dir}/timeseries.parquet")
