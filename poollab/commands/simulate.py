"""``poollab simulate``: a request trace through a simulated inference server, one run per policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import click

from policies.units import format_bytes
from poollab.commands._common import BYTES, check_specs, out_option, read_requests_or_explain
from poollab.errors import UsageError
from sim.config import Knob, ServerConfig, knobs
from sim.report import format_table, write_results
from sim.simulate import simulate_many

#: What the command prints per policy (the files hold every column).
TABLE_COLUMNS = ["policy", "kv_strategy", "n_finished", "n_rejected", "n_preempted", "ttft_p50_s", "ttft_p99_s",
                 "tpot_p50_s", "tpot_p99_s", "e2e_p99_s", "throughput_tok_s", "goodput_rps", "kv_token_util",
                 "peak_reserved_bytes", "frag_ext_mean", "n_grow", "wall_s"]


#: How ``--help`` names a knob's unit.
_UNIT_WORDS = {"s": "seconds", "tokens": "tokens", "bytes": "bytes, e.g. 8GiB"}


def register(cli: click.Group) -> None:
    cli.add_command(simulate_command)


def _click_type(k: Knob) -> Any:
    """The option type for knob ``k``: its choices and range as click shows them in ``--help``."""
    if k.unit == "bytes":
        return BYTES
    if k.choices:
        return click.Choice(k.choices)
    if k.type in (int, float) and (k.low is not None or k.high is not None):
        kind = click.IntRange if k.type is int else click.FloatRange
        return kind(k.low, k.high, min_open=k.low_open, max_open=k.high_open)
    return k.type


def _option(name: str, k: Knob, default: Any) -> Callable:
    """One ``poollab simulate`` option for the ``ServerConfig`` field ``name``."""
    text = k.help + (f" In {_UNIT_WORDS.get(k.unit, k.unit)}." if k.unit else "")
    if default is None:
        return click.option(f"--{k.cli}", name, type=_click_type(k), default=None,
                            help=f"{text} Default: {k.none}.")
    if k.type is bool:
        return click.option(f"--{k.cli}/--no-{k.cli}", name, default=default, show_default=True, help=text)
    if k.unit == "bytes":  # a size reads better than click's plain integer
        return click.option(f"--{k.cli}", name, type=BYTES, default=default,
                            help=f"{text} Default: {format_bytes(default)}.")
    return click.option(f"--{k.cli}", name, type=_click_type(k), default=default, show_default=True, help=text)


def config_options(command: Callable) -> Callable:
    """Add one option per ``ServerConfig`` field (generated from its ``Knob``: name, help, unit,
    choices, range, default), in field order, each passed to the command under the field's name."""
    defaults = ServerConfig()
    for name, k in reversed(knobs().items()):  # click lists options in the order they decorate
        command = _option(name, k, getattr(defaults, name))(command)
    return command


@click.command("simulate")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--policy", "-p", "specs", multiple=True, metavar="SPEC",
              help="Policy spec for the KV cache, repeatable (default: the five built-ins).")
@click.option("--model", default="Llama-3-8B", show_default=True, help="Model preset or JSON file.")
@click.option("--gpu", default="H200", show_default=True, help="GPU preset or JSON file.")
@click.option("--format", "fmt", default=None, help="Trace format, when detection from content is not wanted.")
@click.option("--rate-scale", type=float, default=1.0, show_default=True,
              help="Multiply the request rate (2 = arrivals twice as dense).")
@config_options
@click.option("--calibration", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Step-time calibration JSON (default: bundled factors).")
@click.option("--costs", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Driver cost model JSON (default: bundled H200 figures).")
@out_option("poollab-out/simulate")
def simulate_command(trace: Path, specs, model, gpu, fmt, rate_scale, calibration, costs, out_dir: Path,
                     **options: Any) -> None:
    """Simulate serving the request TRACE with each policy managing the KV cache."""
    spec_list = check_specs(specs)
    check_specs([options["aux_policy"]])
    try:
        config = ServerConfig(**options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from sim.hardware import load_gpu
    from sim.models import load_model

    try:
        model_spec, gpu_spec = load_model(model), load_gpu(gpu)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if rate_scale <= 0:
        raise UsageError(f"--rate-scale {rate_scale} must be > 0")
    requests = read_requests_or_explain(trace, fmt)
    if rate_scale != 1.0:
        requests = requests.scale_rate(rate_scale)
    try:
        summary, timeseries, table = simulate_many(requests, spec_list, model=model_spec, gpu=gpu_spec,
                                                   calibration=calibration, costs=costs, config=config)
    except ValueError as exc:  # a knob or file the user gave (PolicyError and TraceFormatError pass through)
        if type(exc) is not ValueError:
            raise
        raise UsageError(str(exc)) from None
    write_results(out_dir, summary, timeseries, extra_tables={"requests": table},
                  meta={"command": "simulate", "trace": str(trace), "policies": spec_list, "model": model_spec.name,
                        "gpu": gpu_spec.name, "rate_scale": rate_scale, **config.as_dict(),
                        "calibration": str(calibration) if calibration else "bundled",
                        "costs": str(costs) if costs else "bundled"})
    click.echo(f"{requests.name}: {len(requests):,} requests over {requests.duration_s:,.0f} s ({requests.format}); "
               f"{model_spec.name} on {gpu_spec.name}")
    click.echo(format_table(summary, columns=TABLE_COLUMNS))
    for note in dict.fromkeys(n for text in summary["kv_note"] if text for n in text.split("; ")):
        click.echo(f"note: {note}")
    click.echo(f"wrote {out_dir}/summary.csv, {out_dir}/timeseries.parquet, {out_dir}/requests.parquet")
