"""``poollab demo``: the main job on bundled data, offline, in well under a minute.

Replays the bundled slice of a real PyTorch memory snapshot (Llama-architecture generation on an
H200) under the five built-in policies and the emulations of PyTorch's and CuPy's pools,
simulates the bundled slice of the Azure LLM inference trace under the five policies, prints
both comparisons, writes the tables and one HTML report.
"""

from __future__ import annotations

from pathlib import Path

import click

from poollab.commands._common import DEFAULT_POLICIES
from poollab.options import out_option, progress_option
from poollab.commands.replay import replay_columns
from sim.replay.trace_replay import replay_tables
from sim.replay.schema import format_table, write_results
from sim.replay.hardware import DEFAULT_GPU
from sim.report.html import write_html_report
from sim.replay.models import DEFAULT_MODEL
from sim.serving.simulate import simulate_many
from traces import bundled_path, read_alloc_trace, read_request_trace

DEMO_SNAPSHOT = "llama1b_generate_slice.pickle.gz"
DEMO_REQUESTS = "azure_code_slice.csv"
#: Emulations of the allocators people run today, as reference rows beside the five policies.
BASELINES = ("torch-caching", "cupy-pool")
DEMO_MODEL = DEFAULT_MODEL
DEMO_GPU = DEFAULT_GPU
# Memory pressure makes the policies differ: with the whole H200 for KV every policy serves this
# slice alike, so the demo gives the KV cache 8 GiB and compresses arrivals 3x.
DEMO_KV_BYTES = 8 << 30
DEMO_RATE_SCALE = 3.0
SIM_COLUMNS = [
    "policy",
    "n_finished",
    "n_preempted",
    "n_failed",
    "kv_token_util",
    "frag_ext_mean",
    "n_grow",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_p99_s",
    "throughput_tok_s",
]


def register(cli: click.Group) -> None:
    cli.add_command(demo_command)


@click.command("demo")
@out_option("poollab-demo")
@progress_option("Progress bars on stderr.")
def demo_command(out_dir: Path, progress: bool) -> None:
    """Compare the five policies on bundled real traces (replay, then simulation)."""
    snapshot = read_alloc_trace(bundled_path(DEMO_SNAPSHOT))
    click.echo(
        f"== replay: {snapshot.name} ({len(snapshot):,} allocation events, PyTorch snapshot, H200)"
    )
    tables = replay_tables(snapshot, DEFAULT_POLICIES + BASELINES, progress=progress)
    summary = tables.summary
    write_results(
        out_dir / "replay",
        summary,
        tables.timeseries,
        extra_tables={"latency_samples": tables.latency_samples},
        meta={"command": "demo", "trace": DEMO_SNAPSHOT},
    )
    click.echo(format_table(summary, replay_columns()))
    first = summary.iloc[0]
    click.echo(
        f"best possible: lower bound {first['lower_bound_bytes'] / 2**20:,.1f} MiB, "
        f"offline planner {first['planner_peak_bytes'] / 2**20:,.1f} MiB"
    )
    recorded = snapshot.meta.get("recorded_peak_reserved_bytes")
    if recorded:
        click.echo(
            f"PyTorch's own allocator reserved {recorded / 2**20:,.1f} MiB at peak on this slice; "
            "the torch-caching row starts from an empty pool, "
            "`poollab fidelity` replays it from the recorded starting state."
        )
    click.echo(f"wrote {out_dir / 'replay'}/")

    requests = read_request_trace(bundled_path(DEMO_REQUESTS))
    click.echo(
        f"\n== simulate: {requests.name} "
        f"({len(requests.requests):,} requests, Azure LLM inference 2023, "
        f"{requests.duration_s / 60:.0f} min) at {DEMO_RATE_SCALE:g}x its rate, "
        f"{DEMO_MODEL} on {DEMO_GPU} with {DEMO_KV_BYTES >> 30} GiB for the KV cache"
    )
    requests = requests.scale_rate(DEMO_RATE_SCALE)
    summary, ts, per_request = simulate_many(
        requests, DEFAULT_POLICIES, model=DEMO_MODEL, gpu=DEMO_GPU, kv_capacity_bytes=DEMO_KV_BYTES
    )
    write_results(
        out_dir / "simulate",
        summary,
        ts,
        extra_tables={"requests": per_request},
        meta={
            "command": "demo",
            "trace": DEMO_REQUESTS,
            "model": DEMO_MODEL,
            "gpu": DEMO_GPU,
            "kv_capacity_bytes": DEMO_KV_BYTES,
            "rate_scale": DEMO_RATE_SCALE,
        },
    )
    click.echo(format_table(summary, SIM_COLUMNS))
    click.echo(f"wrote {out_dir / 'simulate'}/")

    report = write_html_report(
        [out_dir / "replay", out_dir / "simulate"],
        out_dir / "report.html",
        title="poollab demo: five policies on bundled real traces",
    )
    click.echo(f"\nreport: {report} (open it in a browser; it works offline)")
