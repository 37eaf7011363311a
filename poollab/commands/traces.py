"""``poollab traces``: look at a trace, or make a synthetic one."""

from __future__ import annotations

import math
from pathlib import Path

import click

import traces
from policies.units import format_bytes
from poollab.errors import UsageError
from poollab.options import (
    COUNT,
    POSITIVE,
    RATE_SCALE,
    duration_option,
    model_option,
    num_requests_option,
    out_file_option,
    rate_option,
    seed_option,
)
from traces.alloc_table import output_format
from traces.errors import TraceFormatError
from traces.formats import trace_kind
from traces.source import open_source
from traces.synth_requests import synth_requests


def register(cli: click.Group) -> None:
    cli.add_command(traces_group)


@click.group("traces")
def traces_group() -> None:
    """Inspect allocation and request traces; generate synthetic ones."""


@traces_group.command("info")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
def info_command(trace: Path) -> None:
    """Describe TRACE: an allocation trace (snapshot, RMM log, CSV/Parquet) or a request trace."""
    src = open_source(trace)  # read once: a pipe too
    kind, fmt = trace_kind(src)
    if kind == "alloc":
        row = traces.describe_alloc_trace(traces.read_alloc_trace(src, format=fmt))
    else:
        row = traces.read_request_trace(src, format=fmt).describe()
    width = max(len(k) for k in row)
    for key, value in row.items():
        click.echo(f"{key:<{width}}  {_fmt(key, value)}")


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and key.endswith("bytes"):
        return f"{value:,} ({format_bytes(value)})"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(
            f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}" for k, v in value.items()
        )
    return str(value)


def _check_out_suffix(out_path: Path) -> None:
    """A trace file we cannot write (``--out x.txt``) fails before any work."""
    try:
        output_format(out_path)
    except ValueError as exc:
        raise UsageError(f"--out {out_path}: {exc}") from None


@traces_group.command("synth")
@rate_option("Mean arrival rate, requests per second.", required=True)
@num_requests_option("How many requests.")
@duration_option("Time window in seconds.")
@click.option(
    "--arrival", type=click.Choice(["poisson", "gamma"]), default="poisson", show_default=True
)
@click.option(
    "--cv",
    type=POSITIVE,
    default=1.0,
    show_default=True,
    help="Burstiness (Gamma arrivals): coefficient of variation of the gaps.",
)
@click.option(
    "--prompt",
    default="lognormal:median=1000,sigma=1.0",
    show_default=True,
    help="Prompt length distribution: "
    "lognormal:median=,sigma= | zipf:a= | fixed:N | empirical:trace=FILE,column=prompt",
)
@click.option(
    "--output",
    "output_dist",
    default="lognormal:median=128,sigma=1.0",
    show_default=True,
    help="Output length distribution (same forms as --prompt).",
)
@click.option(
    "--prefix-sharing",
    default=None,
    help="e.g. num_prefixes=8,fraction=0.9 (shared prompt prefixes as hash_ids).",
)
@click.option(
    "--scale",
    type=RATE_SCALE,
    default=1.0,
    show_default=True,
    help="Rate scale applied after generation.",
)
@seed_option()
@out_file_option("Output file (.csv or .parquet).")
def synth_command(
    rate_rps,
    num_requests,
    duration_s,
    arrival,
    cv,
    prompt,
    output_dist,
    prefix_sharing,
    scale,
    seed,
    out_path: Path,
) -> None:
    """Generate a seeded synthetic request trace for `poollab simulate`."""
    if num_requests is None and duration_s is None:
        raise UsageError("give --num-requests, --duration or both")
    _check_out_suffix(out_path)
    try:
        trace = synth_requests(
            num_requests=num_requests,
            duration_s=duration_s,
            rate_rps=rate_rps,
            arrival=arrival,
            cv=cv,
            prompt=traces.parse_length_dist(prompt),
            output=traces.parse_length_dist(output_dist),
            seed=seed,
            prefix_sharing=traces.parse_prefix_sharing(prefix_sharing) if prefix_sharing else None,
            name=out_path.stem,
        )
        if scale != 1.0:
            trace = trace.scale_rate(scale)
    except ValueError as exc:
        if isinstance(exc, TraceFormatError):
            raise
        raise UsageError(str(exc)) from None
    traces.write_request_trace(trace, out_path)
    d = trace.describe()
    click.echo(
        f"wrote {out_path}: {d['num_requests']:,} requests over {d['duration_s']:,.1f} s "
        f"({d['rate_rps']:.2f} req/s), prompt p50 {d['prompt_tokens_p50']:.0f}, "
        f"output p50 {d['output_tokens_p50']:.0f}"
    )


@traces_group.command("synth-alloc")
@model_option("Model preset (see sim presets) or JSON file.", default="llama-3.2-1b")
@num_requests_option(default=32)
@click.option("--max-batch", type=COUNT, default=8, show_default=True)
@click.option("--kv-chunk-tokens", type=COUNT, default=16, show_default=True)
@rate_option("Poisson arrival rate; default: all arrive at once.", name="rate")
@seed_option()
@out_file_option("Output file (.csv or .parquet).")
def synth_alloc_command(
    model, num_requests, max_batch, kv_chunk_tokens, rate, seed, out_path: Path
) -> None:
    """Generate a seeded synthetic allocation trace of LLM inference for `poollab replay`."""
    from sim.replay.models import load_model

    _check_out_suffix(out_path)
    try:
        spec = load_model(model)
        trace = traces.generate_alloc_trace(
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            vocab_size=spec.vocab_size,
            dtype_bytes=spec.dtype_bytes,
            num_requests=num_requests,
            arrival_rate_per_s=rate,
            max_batch=max_batch,
            kv_chunk_tokens=kv_chunk_tokens,
            seed=seed,
        )
    except ValueError as exc:
        if isinstance(exc, TraceFormatError):
            raise
        raise UsageError(str(exc)) from None
    traces.write_alloc_trace(trace, out_path)
    click.echo(f"wrote {out_path}: {len(trace):,} events ({spec.name}, {num_requests} requests)")
