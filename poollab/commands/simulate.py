"""``poollab simulate``: a request trace through a simulated inference server, one run per
policy."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import click

from policies.units import format_bytes
from poollab.commands._common import (
    check_specs,
    load_calibration,
    load_costs,
    read_requests_or_explain,
    step_time_line,
)
from poollab.commands.plan import KV_CAPACITY, KvBudgetSource
from poollab.errors import UsageError
from poollab.options import (
    INT64_MAX,
    ByteSize,
    Count,
    FiniteFloat,
    engine_option,
    format_option,
    gpu_option,
    model_file_options,
    model_option,
    out_option,
    policy_option,
    progress_option,
    rate_scale_option,
)
from sim.serving.config import Knob, ServerConfig, knobs
from sim.serving.choices import VIRTUAL
from sim.replay.schema import format_table, summary_frame, write_results
from sim.serving.simulate import check_kv_policy, result_tables, simulate_runs

#: What the command prints per policy (the files hold every column; README "Columns" says what
#: each means). What decides a comparison comes first: failures, preemptions, prefix hits.
TABLE_COLUMNS = [
    "policy",
    "kv_strategy",
    "n_finished",
    "n_rejected",
    "n_failed",
    "n_preempted",
    "prefix_hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_p99_s",
    "input_tok_s",
    "output_tok_s",
    "goodput_rps",
    "slo_attainment",
    "kv_token_util",
    "kv_token_util_pressure",
    "peak_reserved_bytes",
    "frag_ext_mean",
    "n_grow",
    "wall_s",
]
#: What the command prints per policy and layer group of a hybrid model
#: (``sim.serving.kv_groups.GROUP_TABLE_COLUMNS`` has them all; kv_groups.parquet holds every one).
GROUP_COLUMNS = [
    "policy",
    "group",
    "kind",
    "num_layers",
    "tokens_per_page",
    "page_bytes",
    "capacity_bytes",
    "peak_held_bytes",
    "peak_padding_bytes",
    "peak_data_bytes",
    "peak_waste_bytes",
]
#: Columns left out of the table when no SLO is set (they are NaN; the header says why).
SLO_COLUMNS = ("goodput_rps", "slo_attainment")


#: How ``--help`` names a knob's unit.
_UNIT_WORDS = {"s": "seconds", "tokens": "tokens", "bytes": "bytes, e.g. 8GiB"}


def register(cli: click.Group) -> None:
    cli.add_command(simulate_command)


def _click_type(k: Knob) -> Any:
    """The option type for knob ``k`` (``poollab.options``): its choices and range, checked at parse
    time (no nan, no inf, sizes and counts within int64)."""
    if (
        k.cli == "kv-capacity"
    ):  # a size, or the budgets `poollab plan` found (poollab.commands.plan)
        return KV_CAPACITY
    if k.unit == "bytes":
        return ByteSize(_whole_low(k), _whole_high(k))
    if k.choices:
        return click.Choice(k.choices)
    if k.type is int:
        return Count(_whole_low(k), _whole_high(k))
    if k.type is float:
        return FiniteFloat(k.low, k.high, low_open=k.low_open, high_open=k.high_open)
    return k.type


def _whole_low(k: Knob) -> int:
    """The least whole number knob ``k`` takes (0 when unbounded below: sizes and counts are not
    negative)."""
    if k.low is None:
        return 0
    return int(k.low) + 1 if k.low_open else math.ceil(k.low)


def _whole_high(k: Knob) -> int:
    """The greatest whole number knob ``k`` takes (int64's largest when unbounded above)."""
    if k.high is None:
        return INT64_MAX
    return math.ceil(k.high) - 1 if k.high_open else int(k.high)


def _option(name: str, k: Knob, default: Any) -> Callable:
    """One ``poollab simulate`` option for the ``ServerConfig`` field ``name``."""
    text = k.help + (f" In {_UNIT_WORDS.get(k.unit, k.unit)}." if k.unit else "")
    if default is None:
        return click.option(
            f"--{k.cli}", name, type=_click_type(k), default=None, help=f"{text} Default: {k.none}."
        )
    if k.type is bool:
        return click.option(
            f"--{k.cli}/--no-{k.cli}", name, default=default, show_default=True, help=text
        )
    if k.unit == "bytes":  # a size reads better than click's plain integer
        return click.option(
            f"--{k.cli}",
            name,
            type=_click_type(k),
            default=default,
            help=f"{text} Default: {format_bytes(default)}.",
        )
    return click.option(
        f"--{k.cli}", name, type=_click_type(k), default=default, show_default=True, help=text
    )


#: How the settings line tells each of ``sim.serving.simulate.PREFIX_CACHING_OFF``.
_PREFIX_CACHING_OFF_TEXT = {
    "config": "off by --no-prefix-caching",
    "virtual": "off: virtual KV has no block table",
    "hybrid": "off: KV layer groups of a hybrid model share no prefix blocks (not modelled)",
    "contiguous": "off: contiguous KV cannot share blocks",
}


def settings_line(config: ServerConfig, runs: list[Any], *, has_hash_ids: bool = True) -> str:
    """One line with what decides the comparison besides the policy: the KV budget, max_model_len,
    tensor parallelism, prefix caching per policy (and why off, as each run says:
    ``SimResult.prefix_caching_off``), the contiguous policies' strategy, and every other knob
    that differs from its default."""
    summary = summary_frame([r.summary for r in runs])
    first = summary.iloc[0]
    parts = [
        f"KV budget {format_bytes(int(first['kv_budget_bytes']))}"
        + (f" per GPU x {config.tensor_parallel} (tp)" if config.tensor_parallel > 1 else ""),
        f"max_model_len {int(first['max_model_len']):,}"
        + ("" if config.max_model_len else " (the model's)"),
    ]
    on = [r.summary["policy"] for r in runs if r.prefix_caching_off is None]
    off = [r for r in runs if r.prefix_caching_off is not None]
    caching = []
    if on:
        caching.append(
            f"on for {', '.join(on)} ({config.prefix_eviction.upper()} eviction, "
            f"{int(first['prefix_block_tokens'])}-token blocks"
            + ("" if has_hash_ids else "; the trace has no hash_ids, so nothing is shared")
            + ")"
        )
    for why in dict.fromkeys(r.prefix_caching_off for r in off):
        caching.append(
            f"{_PREFIX_CACHING_OFF_TEXT[why]} "
            f"for {', '.join(r.summary['policy'] for r in off if r.prefix_caching_off == why)}"
        )
    parts.append("prefix caching " + "; ".join(caching))
    if any(s != "paged" for s in summary["kv_strategy"]):
        parts.append(
            "KV strategy virtual (one virtual range per request, pages mapped as it grows)"
            if config.kv_strategy == VIRTUAL
            else f"contiguous strategy {config.kv_strategy}"
        )
    shown = {
        "kv_capacity_bytes",
        "max_model_len",
        "tensor_parallel",
        "prefix_caching",
        "prefix_eviction",
        "prefix_block_tokens",
        "kv_strategy",
    }
    defaults = ServerConfig()
    for name, k in knobs().items():
        value = getattr(config, name)
        if name in shown or value == getattr(defaults, name):
            continue
        parts.append(
            f"--{k.cli} "
            + (format_bytes(value) if k.unit == "bytes" and value is not None else str(value))
        )
    if not any(v is not None for v in (config.slo_ttft_s, config.slo_tpot_s, config.slo_e2e_s)):
        parts.append("no SLO set: goodput not reported (--slo-ttft, --slo-tpot)")
    return "settings: " + "; ".join(parts)


def rejection_warnings(summary: Any) -> list[str]:
    """One warning line per distinct set of rejections (usually one line for all policies)."""
    groups: dict[tuple[int, str], list[str]] = {}
    for policy, n, why in zip(summary["policy"], summary["n_rejected"], summary["rejected_by"]):
        if n:
            groups.setdefault((int(n), why), []).append(policy)
    total = int(summary["n_requests"].iloc[0])
    return [
        f"warning: {n:,} of {total:,} requests rejected ({why}) under {', '.join(names)}; "
        "the latency and throughput columns cover served requests only "
        "(see --max-model-len, --kv-capacity)"
        for (n, why), names in groups.items()
    ]


def range_warnings(summary: Any, by: str = "policy") -> list[str]:
    """One warning line per distinct ``range_warning`` of the runs (a calibration's steps
    extrapolated: ``sim.serving.fit_range.range_warning_lines``), naming the runs (``by``: their
    column) it is of."""
    from sim.serving.fit_range import range_warning_lines

    if "range_warning" not in summary:
        return []
    return range_warning_lines(zip(summary[by], summary["range_warning"]))


def engine_options(engine: str, model: Any, gpu: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (the command's ``ServerConfig`` values) with engine preset ``engine``'s in
    place of those the user left at their defaults (``sim.serving.engines``); ValueError for an
    unknown engine."""
    from sim.serving.engines import load_engine

    try:
        preset = load_engine(engine)
    except ValueError as exc:
        raise ValueError(f"--engine: {exc}") from None
    ctx = click.get_current_context(silent=True)
    explicit = {
        name: value
        for name, value in options.items()
        if ctx is None or ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    }
    return {
        **options,
        **preset.server_options(
            model, gpu, explicit=explicit, tensor_parallel=options.get("tensor_parallel", 1)
        ),
    }


def config_options(command: Callable, config_cls: type = ServerConfig) -> Callable:
    """Add one option per ``ServerConfig`` field (generated from its ``Knob``: name, help, unit,
    choices, range, default), in field order, each passed to the command under the field's name.
    ``config_cls``: a dataclass extending ``ServerConfig`` (a new serving feature's field gets its
    option from its ``Knob`` alone)."""
    defaults = config_cls()
    # click lists options in the order they decorate
    for name, k in reversed(knobs(config_cls).items()):
        command = _option(name, k, getattr(defaults, name))(command)
    return command


@click.command("simulate")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@policy_option("Policy spec for the KV cache, repeatable (default: the five built-ins).")
@model_option()
@gpu_option()
@format_option()
@rate_scale_option()
@config_options
@engine_option(
    "Schedule and size the KV cache as this engine does (sim/data/engines.json: vllm, "
    "transformers); options given explicitly win. Default: the options as given (vLLM-like)."
)
@model_file_options
@out_option("poollab-out/simulate")
@progress_option("Progress bar on stderr, in simulated seconds.")
def simulate_command(
    trace: Path,
    specs,
    model,
    gpu,
    fmt,
    rate_scale,
    engine,
    calibration,
    costs,
    out_dir: Path,
    progress: bool,
    **options: Any,
) -> None:
    """Simulate serving the request TRACE with each policy managing the KV cache."""
    spec_list = check_specs(specs)
    for (
        spec
    ) in spec_list:  # before any work: a policy that cannot hold the KV cache is a bad --policy
        try:
            check_kv_policy(spec)
        except ValueError as exc:
            raise UsageError(f"--policy {spec}: {exc}") from None
    check_specs([options["aux_policy"]])
    kv_source = options["kv_capacity_bytes"]
    if isinstance(
        kv_source, KvBudgetSource
    ):  # plan:RESULT or auto:SNAPSHOT: one budget per policy, set below
        options["kv_capacity_bytes"] = None
    else:
        kv_source = None
    from sim.replay.hardware import load_gpu
    from sim.replay.models import load_model

    try:
        model_spec, gpu_spec = load_model(model), load_gpu(gpu)
        if engine is not None:
            options = engine_options(engine, model_spec, gpu_spec, options)
        config = ServerConfig(**options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    step_calibration = load_calibration(calibration)  # each file read once, passed on loaded
    cost_model = load_costs(costs)
    step_time = step_time_line(step_calibration)
    requests = read_requests_or_explain(trace, fmt)
    if rate_scale != 1.0:
        requests = requests.scale_rate(rate_scale)
    budgets = (
        kv_source.budgets(spec_list, model=model_spec, gpu=gpu_spec)
        if kv_source is not None
        else None
    )
    try:
        runs = [
            run
            for spec in spec_list
            for run in simulate_runs(
                requests,
                [spec],
                model=model_spec,
                gpu=gpu_spec,
                calibration=step_calibration,
                costs=cost_model,
                config=config
                if budgets is None
                else config.replace(kv_capacity_bytes=budgets[spec]),
                progress=progress,
            )
        ]
    except (
        ValueError
    ) as exc:  # a knob or file the user gave (PolicyError and TraceFormatError pass through)
        if type(exc) is not ValueError:
            raise
        raise UsageError(str(exc)) from None
    import pandas as pd

    summary, timeseries, table = result_tables(runs)
    groups = [
        r.kv_groups for r in runs if len(r.kv_groups)
    ]  # a hybrid model's layer groups, per policy
    kv_groups = pd.concat(groups, ignore_index=True) if groups else None
    write_results(
        out_dir,
        summary,
        timeseries,
        extra_tables={
            "requests": table,
            **({"kv_groups": kv_groups} if kv_groups is not None else {}),
        },
        meta={
            "command": "simulate",
            "trace": str(trace),
            "policies": spec_list,
            "model": model_spec.name,
            "gpu": gpu_spec.name,
            "rate_scale": rate_scale,
            **config.as_dict(),
            "calibration": str(calibration) if calibration else "bundled",
            "engine": engine,
            "costs": str(costs) if costs else "bundled",
        },
    )
    click.echo(
        f"{requests.name}: {len(requests):,} requests over {requests.duration_s:,.0f} s "
        f"({requests.format}); {model_spec.name} on {gpu_spec.name}"
    )
    click.echo(
        settings_line(config, runs, has_hash_ids="hash_ids" in requests.requests.columns)
        + (f"; engine {engine}" if engine else "")
        + f"; {step_time}"
        + (f"; {kv_source.describe(budgets)}" if kv_source is not None else "")
    )
    for line in rejection_warnings(summary) + range_warnings(summary):
        click.echo(line, err=True)
    has_slo = any(v is not None for v in (config.slo_ttft_s, config.slo_tpot_s, config.slo_e2e_s))
    columns = TABLE_COLUMNS if has_slo else [c for c in TABLE_COLUMNS if c not in SLO_COLUMNS]
    click.echo(format_table(summary, columns=columns))
    for note in dict.fromkeys(n for text in summary["kv_note"] if text for n in text.split("; ")):
        click.echo(f"note: {note}")
    if kv_groups is not None:
        click.echo(
            f"KV layer groups of {model_spec.name} (layout {config.hybrid_kv_layout}; bytes held, "
            "padded, "
            f"needed and wasted when the cache held the most):"
        )
        click.echo(format_table(kv_groups, columns=GROUP_COLUMNS))
    click.echo(
        f"wrote {out_dir}/summary.csv, {out_dir}/timeseries.parquet, {out_dir}/requests.parquet"
        + (f", {out_dir}/kv_groups.parquet" if kv_groups is not None else "")
    )
