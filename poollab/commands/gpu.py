"""``poollab gpu``: policies as real GPU pools, the allocators people use, and cost calibration.

``poollab gpu replay TRACE``: replay a trace with real allocations under each policy (and each
``--baseline``), timing every alloc and free; ``poollab gpu calibrate``: measure the driver's
costs into a JSON the simulator reads (``poollab replay --costs``), VMM calls included. Without
CuPy or a GPU both exit 2 with one line saying why (``--backend host`` replays on the CPU
stand-in instead). ``--device-kind page-mapped`` backs the policies with pages mapped into reserved
virtual ranges (``cuMem*`` through cuda-bindings; ``mmap``/``memfd`` on the host) instead of
``cudaMalloc`` segments.
"""

from __future__ import annotations

import functools
from pathlib import Path

import click
import pandas as pd

import policies
from poollab.errors import UsageError
from policies.device_kind import PLATFORMS, DeviceKind
from poollab.options import (
    BYTES,
    COUNT,
    DEVICE_KIND,
    FRACTION,
    block_tokens_option,
    calibration_option,
    capacity_option,
    costs_option,
    cuda_device_option,
    duration_option,
    format_option,
    gpu_option,
    model_option,
    out_file_option,
    out_option,
    policy_option,
    progress_option,
    rate_scale_option,
    sample_every_option,
    seed_option,
    sim_option,
    validate_option,
)


def register(cli: click.Group) -> None:
    cli.add_command(gpu_group)


@click.group("gpu")
def gpu_group() -> None:
    """Run policies as real GPU memory pools (CuPy); measure baselines; calibrate the simulator."""


def _require_gpu(device_id: int, *, vmm: bool = False) -> None:
    from realgpu.errors import GpuUnavailableError

    try:
        if vmm:
            from realgpu.vmm import require_vmm

            require_vmm(device_id)
        else:
            from realgpu.cuda import require_cuda

            require_cuda(device_id)
    except GpuUnavailableError as exc:
        raise UsageError(str(exc)) from None


def _policy_specs(specs: tuple[str, ...]) -> list[str]:
    """Every registered policy when none (or ``all``) is given; each spec is checked before any
    work."""
    out = [name for spec in specs for name in (policies.available() if spec == "all" else [spec])]
    out = out or policies.available()
    for spec in out:
        policies.create(spec)  # raises PolicyError naming the spec
    return out


def _baseline_names(names: tuple[str, ...]) -> list[str]:
    from realgpu.baselines import BASELINES, available_baselines, canonical_name

    out = []
    for name in names:
        if name.lower() == "all":
            out += available_baselines()
        elif canonical_name(name) is None:
            raise UsageError(f"unknown baseline {name!r}; available: {', '.join(BASELINES)}, all")
        else:
            out.append(canonical_name(name))
    return out


@gpu_group.command("replay")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@policy_option("Policy spec, repeatable; 'all' or nothing: every registered policy.")
@click.option(
    "--baseline",
    "-b",
    "baselines",
    multiple=True,
    metavar="NAME",
    help="Also replay through cudaMalloc, cupy.MemoryPool, cupy.MemoryAsyncPool or torch.cuda; "
    "'all' for every one available here. Repeatable.",
)
@capacity_option("Most bytes a policy may reserve. Default: the GPU's free memory less 1 GiB.")
@validate_option("Fill every allocation with a pattern and check it before its free.")
@sim_option(
    "Also replay each policy in the simulator (same capacity) and add its rows (backend=sim)."
)
@costs_option("Cost model JSON for the --sim rows (from `poollab gpu calibrate`).")
@click.option(
    "--backend",
    type=click.Choice(PLATFORMS),
    default="cuda",
    show_default=True,
    help="'host' replays on host memory standing in for the GPU (no baselines).",
)
@click.option(
    "--device-kind",
    type=DEVICE_KIND,
    default=DeviceKind.SEGMENT.value,
    show_default=True,
    help="'page-mapped' (or 'vmm'): pages mapped into reserved virtual ranges "
    "(cuMemCreate/cuMemMap; mmap on the host), "
    "and the --sim rows on the simulator's page-mapped device. "
    "A policy that builds a page-mapped device of its own gets one either way.",
)
@cuda_device_option()
@format_option()
@sample_every_option()
@out_option("poollab-out/gpu")
@progress_option("Progress bars on stderr.")
def replay_command(
    trace: Path,
    specs,
    baselines,
    capacity,
    validate: bool,
    with_sim: bool,
    costs,
    backend: str,
    device_kind: DeviceKind,
    device_id: int,
    fmt,
    sample_every,
    out_dir: Path,
    progress: bool,
) -> None:
    """Replay the allocation TRACE on the GPU under each policy (and baseline), with real
    allocations."""
    if backend == "cuda":
        _require_gpu(device_id, vmm=device_kind is DeviceKind.PAGE_MAPPED)
    spec_list = _policy_specs(specs)
    baseline_list = _baseline_names(baselines)
    if baseline_list and backend != "cuda":
        raise UsageError("--baseline needs --backend cuda: the baselines are real CUDA allocators")

    from realgpu.replay import gpu_replay_tables
    from sim.replay.schema import format_table, write_results
    from poollab.commands._common import load_costs, read_alloc_or_explain

    cost_model = load_costs(costs)
    alloc_trace = read_alloc_or_explain(trace, fmt)
    click.echo(f"{alloc_trace.name}: {len(alloc_trace):,} events ({alloc_trace.format})")
    tables = gpu_replay_tables(
        alloc_trace,
        spec_list,
        baselines=baseline_list,
        backend=backend,
        device_kind=device_kind,
        capacity_bytes=capacity,
        validate=validate,
        with_sim=with_sim,
        costs=cost_model,
        sample_every=sample_every,
        progress=progress,
        device_id=device_id,
    )
    summary = tables.summary
    write_results(
        out_dir,
        summary,
        tables.timeseries,
        extra_tables={"latency_samples": tables.latency_samples},
        meta={
            "command": "gpu replay",
            "trace": str(trace),
            "policies": spec_list,
            "baselines": baseline_list,
            "capacity_bytes": capacity,
            "validate": validate,
            "backend": backend,
            "device_kind": device_kind.value,
            "device": device_id,
            "costs": str(costs) if costs else ("bundled" if with_sim else None),
        },
    )
    click.echo(
        format_table(
            summary,
            [
                "policy",
                "backend",
                "n_failed",
                "peak_live_bytes",
                "peak_reserved_bytes",
                "overhead",
                "frag_ext_mean",
                "alloc_p50_us",
                "alloc_p99_us",
                "free_p50_us",
                "free_p99_us",
                "nvml_peak_used_bytes",
            ],
        )
    )
    click.echo(f"wrote {out_dir}/summary.csv, {out_dir}/timeseries.parquet")


@gpu_group.command("calibrate")
@out_file_option(
    "Cost file to write (the schema of sim/data/costs_h200.json).", default=Path("costs.json")
)
@cuda_device_option()
@click.option(
    "--max-size",
    type=BYTES,
    default=None,
    help="Largest cudaMalloc size (and VMM page size) to time "
    "(default 4GiB; VMM pages up to 2GiB).",
)
@click.option(
    "--vmm/--no-vmm",
    default=True,
    show_default=True,
    help="Also time the cuMem* calls "
    "(cuda-bindings) at page sizes 2 MiB to 2 GiB into the file's vmm_us.",
)
def calibrate_command(out_path: Path, device_id: int, max_size, vmm: bool) -> None:
    """Measure cudaMalloc/cudaFree (4 KiB to 4 GiB), the VMM calls and copy bandwidths into a cost
    file."""
    _require_gpu(device_id)
    from realgpu.calibrate import DEFAULT_SIZES, DEFAULT_VMM_SIZES, calibrate, write_costs

    sizes = tuple(s for s in DEFAULT_SIZES if max_size is None or s <= max_size)
    if not sizes:
        raise UsageError(
            f"--max-size {max_size} is below the smallest size timed ({DEFAULT_SIZES[0]} B)"
        )
    vmm_sizes = (
        tuple(s for s in DEFAULT_VMM_SIZES if max_size is None or s <= max_size) if vmm else ()
    )
    table = calibrate(device_id=device_id, sizes=sizes, vmm_sizes=vmm_sizes, progress=click.echo)
    write_costs(table, out_path)
    click.echo(
        f"copy: device {table['d2d_bytes_per_s'] / 1e9:,.0f} GB/s, "
        f"host->device {table['h2d_bytes_per_s'] / 1e9:,.1f} GB/s, "
        f"device->host {table['d2h_bytes_per_s'] / 1e9:,.1f} GB/s (pinned)"
    )
    if "vmm_us" in table:
        v = table["vmm_us"]
        click.echo(
            f"VMM at {v['map']['nbytes'][0] >> 20} MiB pages: "
            f"create {v['create']['us'][0]:.1f} us, map {v['map']['us'][0]:.1f} us, "
            f"set-access {v['set_access']['us'][0]:.1f} us, unmap {v['unmap']['us'][0]:.1f} us, "
            f"release {v['release']['us'][0]:.1f} us"
        )
    click.echo(f"wrote {out_path} ({table['device']})")


@gpu_group.command("serve")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@policy_option(
    "Who holds PyTorch's memory, repeatable, each in its own process: "
    "'pytorch' (PyTorch's own caching allocator, the default) or a policy spec."
)
@model_option("Model preset (or JSON file) whose shape the random weights take.")
@click.option(
    "--checkpoint",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="A Hugging Face model folder to serve instead of random weights (no download).",
)
@format_option()
@rate_scale_option()
@duration_option("Serve the requests arriving in the first this many seconds (after --rate-scale).")
@click.option("--max-requests", type=COUNT, default=None, help="Serve at most this many requests.")
@block_tokens_option("KV block size (tokens).", default=256)
@click.option(
    "--max-batch-tokens",
    type=COUNT,
    default=8192,
    show_default=True,
    help="Token budget of one step.",
)
@click.option(
    "--max-num-seqs", type=COUNT, default=1024, show_default=True, help="Most requests in one step."
)
@click.option(
    "--num-blocks",
    type=COUNT,
    default=None,
    help="KV cache blocks. Default: the engine sizes the cache from free memory.",
)
@click.option(
    "--max-memory-percent",
    type=FRACTION,
    default=None,
    help="Share of free memory the engine gives the KV cache when it sizes it (transformers: 0.9).",
)
@click.option(
    "--engine-footprint-check/--no-engine-footprint-check",
    default=True,
    show_default=True,
    help="Let transformers refuse a --num-blocks beyond its own footprint estimate "
    "(max-memory-percent of free memory); "
    "off, the engine starts at exactly --num-blocks and real memory decides.",
)
@click.option(
    "--max-len",
    "max_len_tokens",
    type=COUNT,
    default=None,
    help="Longest sequence, prompt + output (prompts are cut to fit). "
    "Default: the model's context.",
)
@click.option(
    "--attn",
    "attn_implementation",
    default="paged|sdpa",
    show_default=True,
    help="transformers attention implementation (paged|sdpa, paged|flash_attention_2, ...).",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=False,
    show_default=True,
    help="Let the engine capture CUDA graphs.",
)
@click.option(
    "--warmup/--no-warmup",
    default=True,
    show_default=True,
    help="Serve one full-budget prefill and one wide decode, unrecorded, before the trace.",
)
@click.option(
    "--snapshot",
    is_flag=True,
    help="Write PyTorch's memory snapshot "
    "(snapshot_<policy>.pickle.gz) and beside it the device memory "
    "the engine's process held outside PyTorch's allocator "
    "(snapshot_<policy>.json; `poollab plan` reads it).",
)
@click.option(
    "--snapshot-until",
    type=click.Choice(["startup", "end", "both"]),
    default="startup",
    show_default=True,
    help="'startup': weights, KV cache and warm-up, stopped before the first request; 'end': "
    "the whole run; 'both': the start-up one and the whole run's "
    "(snapshot_<policy>_run.pickle.gz).",
)
@click.option(
    "--allocator-mode",
    type=click.Choice(["pluggable", "mempool"]),
    default="pluggable",
    show_default=True,
    help="A policy as PyTorch's allocator, "
    "or supplying the segments PyTorch's caching allocator splits.",
)
@validate_option("The policy's validation mode (guards and patterns).")
@seed_option("Random weights and prompt token ids.")
@cuda_device_option()
@sim_option(
    "Also run `simulate` with the matching settings "
    "(the run's KV bytes, block size, step and sequence limits; the --model preset's shape) "
    "and print measured against predicted."
)
@gpu_option("GPU preset of the --sim run.", name="gpu_preset")
@calibration_option("Step-time calibration JSON of the --sim run.")
@out_option("poollab-out/gpu-serve")
def serve_command(
    trace: Path,
    specs,
    model,
    checkpoint,
    fmt,
    rate_scale,
    duration_s,
    max_requests,
    block_tokens,
    max_batch_tokens,
    max_num_seqs,
    num_blocks,
    max_memory_percent,
    engine_footprint_check,
    max_len_tokens,
    attn_implementation,
    cuda_graphs,
    warmup,
    snapshot,
    snapshot_until,
    allocator_mode,
    validate,
    seed,
    device_id,
    with_sim,
    gpu_preset,
    calibration,
    out_dir: Path,
) -> None:
    """Serve the request TRACE with a real continuous-batching engine (transformers, paged KV) in
    real time, each policy in turn holding all of PyTorch's memory; write what `simulate` writes
    plus the engine's step log."""
    from realgpu.serve import ServeSettings, check_engine_installed, check_serve_specs, serve_trace
    from sim.replay.schema import format_table
    from poollab.commands._common import load_calibration, read_requests_or_explain

    spec_list = check_serve_specs(specs)
    # read once, before the engine's run (not after it): the --sim side gets the loaded file
    step_calibration = load_calibration(calibration) if with_sim else None
    try:
        settings = ServeSettings(
            model=model,
            checkpoint=str(checkpoint) if checkpoint else None,
            block_tokens=block_tokens,
            max_batch_tokens=max_batch_tokens,
            max_num_seqs=max_num_seqs,
            num_blocks=num_blocks,
            max_memory_percent=max_memory_percent,
            max_len_tokens=max_len_tokens,
            attn_implementation=attn_implementation,
            cuda_graphs=cuda_graphs,
            warmup=warmup,
            snapshot=snapshot,
            snapshot_until=snapshot_until,
            allocator_mode=allocator_mode,
            validate=validate,
            seed=seed,
            device=device_id,
            engine_footprint_check=engine_footprint_check,
        )
        if rate_scale <= 0:
            raise ValueError(f"--rate-scale {rate_scale} must be > 0")
        if checkpoint is not None and not checkpoint.is_dir():
            raise ValueError(f"--checkpoint {checkpoint}: no such folder")
        requests = read_requests_or_explain(trace, fmt)
        check_engine_installed()
        outcome = serve_trace(
            requests,
            spec_list,
            settings,
            out_dir=out_dir,
            rate_scale=rate_scale,
            duration_s=duration_s,
            max_requests=max_requests,
            compare=_engine_comparison(gpu_preset, step_calibration) if with_sim else None,
            log=click.echo,
            meta={"trace_path": str(trace)},
        )
    except (
        ValueError
    ) as exc:  # an option, the model preset or a failed engine (PolicyError, TraceFormatError pass)
        if type(exc) is not ValueError:
            raise
        raise UsageError(str(exc)) from None
    summary = pd.DataFrame([r.summary for r in outcome.runs])
    click.echo(
        f"{requests.name}: {len(outcome.plan):,} requests "
        f"over {outcome.plan['arrival_s'].iloc[-1]:,.1f} s (rate x{rate_scale:g}); "
        f"{settings.checkpoint or settings.model}, "
        f"KV {int(summary['kv_blocks'].iloc[0]):,} blocks of {block_tokens} tokens"
    )
    click.echo(format_table(summary, SERVE_TABLE_COLUMNS))
    for spec, table in outcome.comparisons.items():
        click.echo(f"measured against `simulate` ({spec}; error = predicted / measured - 1):")
        click.echo(table.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
    click.echo(
        f"wrote {out_dir}/summary.csv, {out_dir}/requests.parquet, "
        + ", ".join(str(p.name) for p in outcome.files)
    )


def _engine_comparison(gpu_preset: str, calibration):
    """``--sim``: the simulator's side of ``gpu serve`` (imported only then: it needs simpy);
    ``calibration``: the loaded ``--calibration`` (``load_calibration``), or None."""
    from sim.serving.engine_compare import compare_with_engine

    return functools.partial(
        compare_with_engine,
        gpu=gpu_preset,
        calibration=calibration,
        warn=lambda line: click.echo(line, err=True),
    )


#: What ``gpu serve`` prints per policy (summary.csv has every column).
SERVE_TABLE_COLUMNS = [
    "policy",
    "n_finished",
    "n_request_errors",
    "n_failed",
    "n_preempted",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "output_tok_s",
    "num_steps",
    "step_p50_s",
    "peak_reserved_bytes",
    "frag_ext_mean",
    "alloc_p50_us",
    "alloc_p99_us",
]
