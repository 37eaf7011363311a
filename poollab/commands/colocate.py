"""``poollab colocate``: several model instances (tenants) on one simulated GPU, one run per memory
layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from policies.units import format_bytes
from poollab.commands._common import (
    check_specs,
    load_calibration,
    load_costs,
    read_requests_or_explain,
    step_time_line,
)
from poollab.commands.simulate import config_options, range_warnings
from poollab.errors import UsageError
from poollab.options import (
    COUNT,
    POSITIVE,
    RATE_SCALE,
    FloatList,
    format_option,
    gpu_option,
    model_file_options,
    model_option,
    out_option,
    policy_option,
    progress_option,
    rate_scale_option,
)
from sim.serving.config import ServerConfig
from sim.replay.models import DEFAULT_MODEL
from sim.replay.schema import format_table, write_results

#: ``sim.serving.tenants.COMPUTE_MODES``, spelt here so that --help imports no simulator
COMPUTE_CHOICES = ("time-sliced", "independent")


#: What the command prints per (layout, tenant); the files hold every column.
TABLE_COLUMNS = [
    "tenant_layout",
    "tenant",
    "model",
    "n_requests",
    "n_finished",
    "n_rejected",
    "n_preempted",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "e2e_p99_s",
    "kv_budget_bytes",
    "peak_reserved_bytes",
    "n_wakes",
    "wake_s",
]


def register(cli: click.Group) -> None:
    cli.add_command(colocate_command)


@click.command("colocate")
@click.argument(
    "traces_",
    metavar="TRACE...",
    nargs=-1,
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
)
@click.option(
    "--tenants",
    "num_tenants",
    type=COUNT,
    default=None,
    help="With one TRACE: deal its requests round-robin to this many tenants. "
    "Default: one tenant per TRACE.",
)
@click.option(
    "--layout",
    "layouts",
    multiple=True,
    type=click.Choice(["static", "shared", "sleep"]),
    help="Memory layout, repeatable (default: all three): equal static KV pools, "
    "one shared elastic page pool (kvcached), "
    "or the shared pool plus sleep/wake of idle tenants' weights (vLLM).",
)
@policy_option("KV pool policy (a paged one for the shared layouts).", default="page-pool")
@model_option(
    "Model preset or JSON file, repeatable: "
    f"one for all tenants or one per tenant (default: {DEFAULT_MODEL}).",
    repeatable=True,
)
@gpu_option()
@format_option()
@rate_scale_option("Multiply every tenant's request rate (2 = arrivals twice as dense).")
@click.option(
    "--tenant-rate-scale",
    "tenant_rate_scales",
    type=FloatList(RATE_SCALE),
    default=None,
    metavar="F,F,...",
    help="Multiply each tenant's request rate by its own factor, one per tenant (e.g. 1,2,4: "
    "unequal loads), on top of --rate-scale.",
)
@click.option(
    "--compute",
    type=click.Choice(COMPUTE_CHOICES),
    default=COMPUTE_CHOICES[0],
    show_default=True,
    help="How tenants share the GPU's compute: time-sliced "
    "(CUDA's default for several processes: their steps take turns) or independent "
    "(each steps as if alone: the lower bound MPS or MIG-style spatial sharing approaches).",
)
@click.option(
    "--sleep-after",
    "sleep_after_s",
    type=POSITIVE,
    default=30.0,
    show_default=True,
    help="Idle seconds before a tenant sleeps (sleep layout).",
)
@config_options
@model_file_options
@out_option("poollab-out/colocate")
@progress_option("Progress bar on stderr, in simulated seconds.")
def colocate_command(
    traces_: tuple[Path, ...],
    num_tenants,
    layouts,
    spec,
    models,
    gpu,
    fmt,
    rate_scale,
    tenant_rate_scales,
    compute,
    sleep_after_s,
    calibration,
    costs,
    out_dir: Path,
    progress: bool,
    **options: Any,
) -> None:
    """Simulate several model instances (tenants) sharing one GPU's memory, under each layout.

    Each TRACE is one tenant's requests (or, with --tenants N, one TRACE is dealt to N tenants).
    Every tenant has its own scheduler and KV manager; the GPU's memory left after all weights,
    activations and workspaces is the KV memory the layout hands out. summary.csv has one row
    per layout and tenant (columns tenant_layout, tenant).
    """
    check_specs([spec])
    step_calibration = load_calibration(calibration)  # read once, passed on loaded
    step_time = step_time_line(step_calibration)
    if options.get("kv_capacity_bytes") is not None:
        raise UsageError("--kv-capacity does not apply: the layout decides each tenant's KV memory")
    try:
        config = ServerConfig(**options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if num_tenants is not None and len(traces_) != 1:
        raise UsageError(
            f"--tenants deals ONE trace to tenants; got {len(traces_)} traces (each is a tenant)"
        )
    from sim.serving.tenants import (
        COMPUTE_MODES,
        LAYOUTS,
        colocate_layouts,
        scale_tenant_rates,
        share_trace,
    )

    assert COMPUTE_CHOICES == COMPUTE_MODES, (
        "colocate's --compute choices follow sim.serving.tenants"
    )

    read = [read_requests_or_explain(p, fmt) for p in traces_]
    if rate_scale != 1.0:
        read = [t.scale_rate(rate_scale) for t in read]
    try:
        tenant_traces = share_trace(read[0], num_tenants) if num_tenants else read
        if tenant_rate_scales is not None:
            tenant_traces = scale_tenant_rates(tenant_traces, tenant_rate_scales)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    names = [f"t{i}" for i in range(len(tenant_traces))]
    cost_model = load_costs(costs)
    try:
        runs = colocate_layouts(
            tenant_traces,
            spec,
            layouts=layouts or LAYOUTS,
            tenant_names=names,
            models=list(models) or [DEFAULT_MODEL],
            gpu=gpu,
            config=config,
            sleep_after_s=sleep_after_s,
            calibration=step_calibration,
            costs=cost_model,
            compute=compute,
            progress=progress,
        )
    except ValueError as exc:  # a knob, model or size the user gave (PolicyError passes through)
        if type(exc) is not ValueError:
            raise
        raise UsageError(str(exc)) from None
    summary = runs.summary
    write_results(
        out_dir,
        summary,
        runs.timeseries,
        extra_tables={"requests": runs.requests},
        meta={
            "command": "colocate",
            "traces": [str(p) for p in traces_],
            "num_tenants": len(names),
            "policy": spec,
            "models": list(models) or [DEFAULT_MODEL],
            "gpu": gpu,
            "rate_scale": rate_scale,
            "tenant_rate_scales": tenant_rate_scales,
            "compute": compute,
            "sleep_after_s": sleep_after_s,
            **config.as_dict(),
            "calibration": str(calibration) if calibration else "bundled",
            "costs": str(costs) if costs else "bundled",
        },
    )
    first = summary.iloc[0]
    click.echo(
        f"{len(names)} tenants on {first['gpu']} ({', '.join(t.name for t in tenant_traces)}); "
        f"KV memory {format_bytes(int(first['gpu_kv_bytes']))} after every tenant's weights, "
        f"activations and workspace; policy {spec}; compute {compute}; {step_time}"
    )
    runs_named = summary.assign(run=summary["tenant"] + " " + summary["tenant_layout"])
    for line in range_warnings(runs_named, by="run"):
        click.echo(line, err=True)
    click.echo(format_table(summary, columns=TABLE_COLUMNS))
    click.echo("all tenants' requests:")
    # independent compute: steps of different tenants overlap, so their sum may pass 100 %
    busy_text = (
        "the tenants' steps add up to {:.0%} of the run (independent compute: they overlap)"
        if compute == "independent"
        else "GPU busy {:.0%} of the run"
    ).format
    for row in runs.served().itertuples():
        click.echo(
            f"  {row.tenant_layout:>6}: {row.n_finished:,} of {row.n_requests:,} finished; "
            f"TTFT p50 {row.ttft_p50_s:.3f} s, p99 {row.ttft_p99_s:.3f} s, "
            f"mean {row.ttft_mean_s:.3f} s; " + busy_text(row.gpu_busy_share)
        )
    click.echo(
        f"wrote {out_dir}/summary.csv, {out_dir}/timeseries.parquet, {out_dir}/requests.parquet"
    )
