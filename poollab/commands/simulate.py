"""``poollab simulate``: a request trace through a simulated inference server, one run per policy."""

from __future__ import annotations

from pathlib import Path

import click

from poollab.commands._common import BYTES, check_specs, out_option, read_requests_or_explain
from poollab.errors import UsageError
from sim.report import format_table, write_results
from sim.simulate import simulate_many

#: What the command prints per policy (the files hold every column).
TABLE_COLUMNS = ["policy", "kv_strategy", "n_finished", "n_rejected", "n_preempted", "ttft_p50_s", "ttft_p99_s",
                 "tpot_p50_s", "tpot_p99_s", "e2e_p99_s", "throughput_tok_s", "goodput_rps", "kv_token_util",
                 "peak_reserved_bytes", "frag_ext_mean", "n_grow", "wall_s"]


def register(cli: click.Group) -> None:
    cli.add_command(simulate_command)


@click.command("simulate")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--policy", "-p", "specs", multiple=True, metavar="SPEC",
              help="Policy spec for the KV cache, repeatable (default: the five built-ins).")
@click.option("--model", default="Llama-3-8B", show_default=True, help="Model preset or JSON file.")
@click.option("--gpu", default="H200", show_default=True, help="GPU preset or JSON file.")
@click.option("--format", "fmt", default=None, help="Trace format, when detection from content is not wanted.")
@click.option("--rate-scale", type=float, default=1.0, show_default=True,
              help="Multiply the request rate (2 = arrivals twice as dense).")
@click.option("--kv-strategy", type=click.Choice(["max", "oracle", "pow2", "pow2-oracle", "grow"]), default="pow2",
              show_default=True, help="Reservation of contiguous policies (paged ones grow a page at a time).")
@click.option("--grow-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Chunk of the 'grow' strategy, in tokens.")
@click.option("--preemption", type=click.Choice(["recompute", "swap"]), default="recompute", show_default=True)
@click.option("--swap-space", type=BYTES, default=None, help="Host memory for swapped KV (default: unlimited).")
@click.option("--pool-layout", type=click.Choice(["separate", "shared"]), default="separate", show_default=True,
              help="KV cache in a pool of its own, or one pool shared with weights and activations.")
@click.option("--aux-policy", default="best-fit", show_default=True,
              help="Policy of the weights/activations/workspace pools in the separate layout.")
@click.option("--kv-capacity", type=BYTES, default=None,
              help="KV budget (default: GPU memory x utilisation - weights - activations - workspace).")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.9, show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=1), default=None, help="Longest sequence (default 8192).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True)
@click.option("--chunked-prefill/--no-chunked-prefill", default=True, show_default=True)
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Share prompt blocks by the trace's hash_ids (paged policies).")
@click.option("--watermark", type=click.FloatRange(0, 1, max_open=True), default=0.01, show_default=True,
              help="Share of the KV budget admission keeps free.")
@click.option("--slo-ttft", type=click.FloatRange(0, min_open=True), default=None, help="TTFT SLO in seconds (goodput).")
@click.option("--slo-tpot", type=click.FloatRange(0, min_open=True), default=None, help="TPOT SLO in seconds (goodput).")
@click.option("--slo-e2e", type=click.FloatRange(0, min_open=True), default=None, help="E2E SLO in seconds (goodput).")
@click.option("--freeze-after-steps", type=click.IntRange(min=0), default=None,
              help="Freeze the KV pool's growth after this many steps (as CUDA Graph capture needs).")
@click.option("--pregrow-safety", type=click.FloatRange(0, min_open=True), default=None,
              help="Before admitting, reserve predicted KV + activation bytes x this factor (elastic policies).")
@click.option("--compact-between-steps/--no-compact-between-steps", default=False, show_default=True,
              help="Call the KV pool's compact() between steps (compacting policies).")
@click.option("--calibration", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Step-time calibration JSON (default: bundled factors).")
@click.option("--costs", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Driver cost model JSON (default: bundled H200 figures).")
@out_option("poollab-out/simulate")
def simulate_command(trace: Path, specs, model, gpu, fmt, rate_scale, kv_strategy, grow_tokens, preemption, swap_space,
                     pool_layout, aux_policy, kv_capacity, gpu_memory_utilization, max_model_len, max_num_seqs,
                     max_num_batched_tokens, chunked_prefill, prefix_caching, watermark, slo_ttft, slo_tpot, slo_e2e,
                     freeze_after_steps, pregrow_safety, compact_between_steps, calibration, costs,
                     out_dir: Path) -> None:
    """Simulate serving the request TRACE with each policy managing the KV cache."""
    spec_list = check_specs(specs)
    check_specs([aux_policy])
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
    options = dict(kv_strategy=kv_strategy, grow_tokens=grow_tokens, preemption=preemption,
                   swap_space_bytes=swap_space, pool_layout=pool_layout, aux_policy=aux_policy,
                   kv_capacity_bytes=kv_capacity, gpu_memory_utilization=gpu_memory_utilization,
                   max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, chunked_prefill=chunked_prefill,
                   prefix_caching=prefix_caching, watermark=watermark, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
                   slo_e2e_s=slo_e2e, freeze_after_steps=freeze_after_steps, pregrow_safety=pregrow_safety,
                   compact_between_steps=compact_between_steps)
    try:
        summary, timeseries, table = simulate_many(requests, spec_list, model=model_spec, gpu=gpu_spec,
                                                   calibration=calibration, costs=costs, **options)
    except ValueError as exc:  # a knob or file the user gave (PolicyError and TraceFormatError pass through)
        if type(exc) is not ValueError:
            raise
        raise UsageError(str(exc)) from None
    write_results(out_dir, summary, timeseries, extra_tables={"requests": table},
                  meta={"command": "simulate", "trace": str(trace), "policies": spec_list, "model": model_spec.name,
                        "gpu": gpu_spec.name, "rate_scale": rate_scale, **options,
                        "calibration": str(calibration) if calibration else "bundled",
                        "costs": str(costs) if costs else "bundled"})
    click.echo(f"{requests.name}: {len(requests):,} requests over {requests.duration_s:,.0f} s ({requests.format}); "
               f"{model_spec.name} on {gpu_spec.name}")
    click.echo(format_table(summary, columns=TABLE_COLUMNS))
    click.echo(f"wrote {out_dir}/summary.csv, {out_dir}/timeseries.parquet, {out_dir}/requests.parquet")
