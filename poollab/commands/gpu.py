"""``poollab gpu``: policies as real GPU pools, the allocators people use, and cost calibration.

``poollab gpu replay TRACE``: replay a trace with real allocations under each policy (and each
``--baseline``), timing every alloc and free; ``poollab gpu calibrate``: measure the driver's
costs into a JSON the simulator reads (``poollab replay --costs``), VMM calls included. Without
CuPy or a GPU both exit 2 with one line saying why (``--backend host`` replays on the CPU
stand-in instead). ``--device-kind vmm`` backs the policies with pages mapped into reserved
virtual ranges (``cuMem*`` through cuda-bindings; ``mmap``/``memfd`` on the host) instead of
``cudaMalloc`` segments.
"""

from __future__ import annotations

from pathlib import Path

import click
import pandas as pd

import policies
from poollab.commands._common import out_option
from poollab.errors import UsageError
from poollab.options import BYTES, COUNT, DEVICE


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
    """Every registered policy when none (or ``all``) is given; each spec is checked before any work."""
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
@click.option("--policy", "-p", "specs", multiple=True, metavar="SPEC",
              help="Policy spec, repeatable; 'all' or nothing: every registered policy.")
@click.option("--baseline", "-b", "baselines", multiple=True, metavar="NAME",
              help="Also replay through cudaMalloc, cupy.MemoryPool, cupy.MemoryAsyncPool or torch.cuda; 'all' for "
                   "every one available here. Repeatable.")
@click.option("--capacity", type=BYTES, default=None,
              help="Most bytes a policy may reserve. Default: the GPU's free memory less 1 GiB.")
@click.option("--validate", is_flag=True, help="Fill every allocation with a pattern and check it before its free.")
@click.option("--sim/--no-sim", "with_sim", default=False,
              help="Also replay each policy in the simulator (same capacity) and add its rows (backend=sim).")
@click.option("--costs", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Cost model JSON for the --sim rows (from `poollab gpu calibrate`).")
@click.option("--backend", type=click.Choice(["cuda", "host"]), default="cuda", show_default=True,
              help="'host' replays on host memory standing in for the GPU (no baselines).")
@click.option("--device-kind", type=click.Choice(["segments", "vmm"]), default="segments", show_default=True,
              help="'vmm': pages mapped into reserved virtual ranges (cuMemCreate/cuMemMap; mmap on the host), "
                   "and the --sim rows on the simulator's page-mapped device. A policy that builds a page-mapped "
                   "device of its own gets one either way.")
@click.option("--device", "device_id", type=DEVICE, default=0, show_default=True, help="CUDA device.")
@click.option("--format", "fmt", default=None, help="Trace format, when detection from content is not wanted.")
@click.option("--sample-every", type=COUNT, default=None, help="Stats sample stride in events.")
@out_option("poollab-out/gpu")
@click.option("--progress/--no-progress", default=True, help="Progress bars on stderr.")
def replay_command(trace: Path, specs, baselines, capacity, validate: bool, with_sim: bool, costs, backend: str,
                   device_kind: str, device_id: int, fmt, sample_every, out_dir: Path, progress: bool) -> None:
    """Replay the allocation TRACE on the GPU under each policy (and baseline), with real allocations."""
    if backend == "cuda":
        _require_gpu(device_id, vmm=device_kind == "vmm")
    spec_list = _policy_specs(specs)
    baseline_list = _baseline_names(baselines)
    if baseline_list and backend != "cuda":
        raise UsageError("--baseline needs --backend cuda: the baselines are real CUDA allocators")

    from realgpu.replay import baseline_replay, gpu_replay, model_device
    from sim.replay import replay
    from sim.report import format_table, latency_samples, summary_frame, write_results
    from poollab.commands._common import load_costs, read_alloc_or_explain

    cost_model = load_costs(costs)
    alloc_trace = read_alloc_or_explain(trace, fmt)
    click.echo(f"{alloc_trace.name}: {len(alloc_trace):,} events ({alloc_trace.format})")
    pool_backend = f"{backend}-vmm" if device_kind == "vmm" else backend
    rows, series, runs = [], [], []
    for spec in spec_list:
        result = gpu_replay(alloc_trace, spec, backend=pool_backend, capacity_bytes=capacity, validate=validate,
                            sample_every=sample_every, progress=progress, device_id=device_id)
        rows.append(result.summary)
        series.append(result.timeseries)
        runs.append(result)
        if with_sim:
            twin = spec
            if result.summary["device_kind"] == "vmm":  # the simulator's page-mapped device, same pages
                twin = policies.create(spec, capacity_bytes=result.summary["capacity_bytes"],
                                       device=model_device("vmm", cost_model))
            sim = replay(alloc_trace, twin, capacity_bytes=result.summary["capacity_bytes"], costs=cost_model,
                         sample_every=sample_every, progress=progress)
            rows.append({**sim.summary, "kind": "policy", "device_kind": result.summary["device_kind"]})
            series.append(sim.timeseries)
            runs.append(sim)
    for name in baseline_list:
        result = baseline_replay(alloc_trace, name, sample_every=sample_every, progress=progress, device_id=device_id)
        rows.append(result.summary)
        series.append(result.timeseries)
        runs.append(result)
    summary = summary_frame(rows)
    write_results(out_dir, summary, pd.concat(series, ignore_index=True),
                  extra_tables={"latency_samples": latency_samples(runs)},
                  meta={"command": "gpu replay", "trace": str(trace), "policies": spec_list, "baselines": baseline_list,
                        "capacity_bytes": capacity, "validate": validate, "backend": backend,
                        "device_kind": device_kind, "device": device_id,
                        "costs": str(costs) if costs else ("bundled" if with_sim else None)})
    click.echo(format_table(summary, ["policy", "backend", "n_failed", "peak_live_bytes", "peak_reserved_bytes",
                                      "overhead", "frag_ext_mean", "alloc_p50_us", "alloc_p99_us", "free_p50_us",
                                      "free_p99_us", "nvml_peak_used_bytes"]))
    click.echo(f"wrote {out_dir}/summary.csv, {out_dir}/timeseries.parquet")


@gpu_group.command("calibrate")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=Path("costs.json"),
              show_default=True, help="Cost file to write (the schema of sim/data/costs_h200.json).")
@click.option("--device", "device_id", type=DEVICE, default=0, show_default=True, help="CUDA device.")
@click.option("--max-size", type=BYTES, default=None,
              help="Largest cudaMalloc size (and VMM page size) to time (default 4GiB; VMM pages up to 2GiB).")
@click.option("--vmm/--no-vmm", default=True, show_default=True,
              help="Also time the cuMem* calls (cuda-bindings) at page sizes 2 MiB to 2 GiB into the file's vmm_us.")
def calibrate_command(out_path: Path, device_id: int, max_size, vmm: bool) -> None:
    """Measure cudaMalloc/cudaFree (4 KiB to 4 GiB), the VMM calls and copy bandwidths into a cost file."""
    _require_gpu(device_id)
    from realgpu.calibrate import DEFAULT_SIZES, DEFAULT_VMM_SIZES, calibrate, write_costs

    sizes = tuple(s for s in DEFAULT_SIZES if max_size is None or s <= max_size)
    if not sizes:
        raise UsageError(f"--max-size {max_size} is below the smallest size timed ({DEFAULT_SIZES[0]} B)")
    vmm_sizes = tuple(s for s in DEFAULT_VMM_SIZES if max_size is None or s <= max_size) if vmm else ()
    table = calibrate(device_id=device_id, sizes=sizes, vmm_sizes=vmm_sizes, progress=click.echo)
    write_costs(table, out_path)
    click.echo(f"copy: device {table['d2d_bytes_per_s'] / 1e9:,.0f} GB/s, host->device {table['h2d_bytes_per_s'] / 1e9:,.1f} "
               f"GB/s, device->host {table['d2h_bytes_per_s'] / 1e9:,.1f} GB/s (pinned)")
    if "vmm_us" in table:
        v = table["vmm_us"]
        click.echo(f"VMM at {v['map']['nbytes'][0] >> 20} MiB pages: create {v['create']['us'][0]:.1f} us, map "
                   f"{v['map']['us'][0]:.1f} us, set-access {v['set_access']['us'][0]:.1f} us, unmap {v['unmap']['us'][0]:.1f} us, "
                   f"release {v['release']['us'][0]:.1f} us")
    click.echo(f"wrote {out_path} ({table['device']})")
