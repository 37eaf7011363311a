"""``poollab plan``: the largest KV cache each policy leaves room for, from an engine's start-up
snapshot.

Also ``KV_CAPACITY``, the type of ``simulate --kv-capacity``: a size, ``plan:RESULT`` (a plan
folder or its ``plan.csv``) or ``auto:SNAPSHOT`` (plan the simulated policies on that snapshot).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from policies.units import format_bytes
from poollab.options import (
    BYTES,
    FRACTION,
    block_tokens_option,
    engine_option,
    gpu_option,
    model_option,
    out_option,
    policy_option,
    progress_option,
    trace_device_option,
)
from poollab.errors import UsageError

#: What the command prints per policy (plan.csv holds every ``sim.planner.plan.PLAN_COLUMNS``
#: column).
TABLE_COLUMNS = [
    "policy",
    "safe_kv_bytes",
    "safe_kv_tokens",
    "kv_linked_bytes",
    "peak_non_kv_reserved_bytes",
    "frag_at_peak",
    "margin_bytes",
    "util_rule_kv_bytes",
    "util_rule_fits",
    "num_replays",
    "plan_s",
]


def register(cli: click.Group) -> None:
    cli.add_command(plan_command)


def device_memory(gpu: str | None, memory: int | None) -> tuple[int, str]:
    """``(device_bytes, what it is)`` from ``--gpu`` or ``--memory`` (neither: the default GPU
    preset)."""
    if gpu is not None and memory is not None:
        raise UsageError("--gpu and --memory both give the device's memory: pass one")
    if memory is not None:
        if memory <= 0:
            raise UsageError(f"--memory {memory} must be > 0")
        return memory, f"--memory {format_bytes(memory)}"
    from sim.replay.hardware import DEFAULT_GPU, load_gpu

    try:
        spec = load_gpu(gpu or DEFAULT_GPU)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return (
        spec.memory_bytes,
        f"--gpu {spec.name}" if gpu else f"the {spec.name} preset (--gpu, --memory)",
    )


def plan_memory(snapshot: Path, gpu: str | None, memory: int | None, non_torch_bytes: int | None):
    """The ``sim.planner.plan.DeviceMemory`` of a plan: ``--gpu``/``--memory`` and ``--non-torch``
    where given, else the figures the engine's process measured beside the snapshot, else the H200
    preset and 0
    B."""
    from sim.planner.plan import PlanError, device_memory_of

    given = device_memory(gpu, memory) if gpu is not None or memory is not None else None
    try:
        return device_memory_of(
            snapshot,
            device_bytes=given[0] if given else None,
            device_source=given[1] if given else "",
            non_torch_bytes=non_torch_bytes,
            non_torch_source="--non-torch",
            default_device=device_memory(None, None),
        )
    except PlanError as exc:
        raise UsageError(str(exc)) from None


def run_plan(
    snapshot: Path,
    specs: list[str],
    *,
    memory: Any,
    kv: tuple[str, ...] = (),
    model: str | None = None,
    block_tokens: int | None = 16,
    util_fraction: float = 0.9,
    device_index: int | None = None,
    progress: bool = False,
    kv_linked: tuple[str, ...] = (),
    engine: str | None = None,
):
    """``sim.planner.plan.plan_snapshot`` with the command line's errors: a bad option is a
    ``UsageError``. ``memory``: a ``sim.planner.plan.DeviceMemory`` (``plan_memory``).
    ``block_tokens`` None: the engine preset's ``tokens_per_page`` (else
    ``sim.planner.plan.DEFAULT_BLOCK_TOKENS``)."""
    from sim.planner.plan import (
        DEFAULT_BLOCK_TOKENS,
        PlanError,
        parse_kv_linked,
        parse_kv_selector,
        plan_snapshot,
    )

    try:
        selectors = [parse_kv_selector(text) for text in kv]
        linked = [parse_kv_linked(text) for text in kv_linked]
        preset = None
        if engine is not None:
            from sim.serving.engines import load_engine

            preset = load_engine(engine)
        if block_tokens is None:
            block_tokens = (
                int(preset.options.get("tokens_per_page", DEFAULT_BLOCK_TOKENS))
                if preset
                else DEFAULT_BLOCK_TOKENS
            )
        return plan_snapshot(
            snapshot,
            specs,
            device=device_index,
            memory=memory,
            kv=selectors,
            model=model,
            block_tokens=block_tokens,
            util_fraction=util_fraction,
            progress=progress,
            kv_linked=linked,
            engine=preset,
        )
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # an unknown model preset or a bad model file
        if type(exc) is not ValueError:
            raise
        raise UsageError(str(exc)) from None


@click.command("plan")
@click.argument("snapshot", type=click.Path(dir_okay=False, path_type=Path))
@policy_option(
    "Policy spec, repeatable. Default: torch-caching with the snapshot's allocator_settings."
)
@gpu_option(
    "GPU preset or JSON file whose memory the run must fit. Default: "
    "the device total measured beside the snapshot "
    "(SNAPSHOT.json, which `gpu serve --snapshot` writes), else H200.",
    default=None,
)
@click.option(
    "--memory",
    type=BYTES,
    default=None,
    help="The device's memory instead of a --gpu preset (e.g. 80GiB).",
)
@click.option(
    "--non-torch",
    "non_torch_bytes",
    type=BYTES,
    default=None,
    help="Device memory outside the allocator (CUDA context, NCCL, cuBLAS): "
    "the pool gets the rest. Default: what the engine's process held outside PyTorch's allocator, "
    "measured beside the snapshot (SNAPSHOT.json), else 0 (said to be unmeasured).",
)
@click.option(
    "--kv",
    "kv",
    multiple=True,
    metavar="SELECTOR",
    help="The KV allocation(s), when the snapshot does not tell: size=SIZE "
    "(every never-freed allocation of that size), entries=I-J,K "
    "(device_traces indices of their alloc entries) or addr=0xADDRESS. Repeatable. "
    "Default: recognised (the largest burst of equal-size allocations that live to the end).",
)
@click.option(
    "--kv-linked",
    "kv_linked",
    multiple=True,
    metavar="SELECTOR:BYTES_PER_PAGE",
    help="An allocation the engine sizes by its KV cache, resized with it in every replay: "
    "a --kv selector (any allocation of the trace) and how much it grows per page, "
    "e.g. entries=655:4MiB. Repeatable.",
)
@engine_option(
    "Engine preset (sim/data/engines.json) whose rules recognise the buffers it sizes by "
    "the KV cache (transformers: the paged|sdpa attention mask; needs --model) and "
    "whose block size --block-tokens defaults to."
)
@model_option(
    "Model preset or JSON file: a page is --block-tokens tokens of its KV, "
    "and budgets are also given in tokens. Default: none (pages of 2 MiB per KV tensor).",
    default=None,
)
@block_tokens_option(
    "Tokens per KV page (with --model): the plan is exact to one page. "
    "Default: the --engine preset's block, else 16."
)
@click.option(
    "--utilization",
    "util_fraction",
    type=FRACTION,
    default=0.9,
    show_default=True,
    help="gpu_memory_utilization of the engine rule the plan is compared with.",
)
@trace_device_option()
@out_option(
    None,
    "Also write plan.csv (one row per policy) here; `simulate --kv-capacity plan:DIR` reads it.",
)
@progress_option("Progress bar on stderr (one per policy, counting its replays).")
def plan_command(
    snapshot: Path,
    specs,
    gpu,
    memory,
    non_torch_bytes,
    kv,
    kv_linked,
    engine,
    model,
    block_tokens,
    util_fraction,
    device_index,
    out_dir,
    progress: bool,
) -> None:
    """Size the KV cache before deploy: the largest KV allocation with which the start-up SNAPSHOT
    still fits.

    Replays the engine's recorded start-up (weights, profiling, KV cache allocation, CUDA-graph
    capture, warm-up steps) under each policy with the KV tensors resized, the pool limited to
    the device's memory, and bisects to the largest KV size (exact to one page) with which every
    request is served. Beside it: what a gpu_memory_utilization rule (fraction x memory - weights -
    profiled peak) would pick, and whether that runs out of memory in the replay.
    """
    from poollab.commands._common import check_specs
    from sim.replay.schema import format_table

    spec_list = check_specs(specs) if specs else []
    memory_plan = plan_memory(snapshot, gpu, memory, non_torch_bytes)
    result = run_plan(
        snapshot,
        spec_list,
        memory=memory_plan,
        kv=kv,
        model=model,
        block_tokens=block_tokens,
        util_fraction=util_fraction,
        device_index=device_index,
        progress=progress,
        kv_linked=kv_linked,
        engine=engine,
    )
    inputs = result.inputs
    rec = inputs.rec
    click.echo(
        f"{rec.name}: {len(rec.ops):,} requests, {len(rec.seed_segments)} segments "
        f"({format_bytes(rec.initial_reserved_bytes)}) before recording"
    )
    click.echo(f"KV cache {inputs.kv.how}")
    for buffer in inputs.linked:
        click.echo(f"sized by the KV cache, resized with it: {buffer.how}")
    if engine is not None and not inputs.linked:
        click.echo(
            f"sized by the KV cache: none of engine {engine}'s buffers is in the snapshot at "
            "the recorded size"
        )
    click.echo(f"device {format_bytes(inputs.device_bytes)}: {inputs.device_source}")
    click.echo(
        f"outside PyTorch's allocator {format_bytes(memory_plan.non_torch_bytes)}: "
        f"{inputs.non_torch_source}; "
        f"the pool gets {format_bytes(inputs.capacity_bytes)}"
    )
    page_text = (
        f"{inputs.block_tokens} tokens of {inputs.model} = {format_bytes(inputs.page_bytes)}"
        if inputs.model
        else f"{format_bytes(inputs.page_bytes)} (2 MiB per KV tensor; --model for tokens)"
    )
    click.echo(
        f"page {page_text}; weights/resident {format_bytes(inputs.weights_bytes)}; "
        f"profiled peak beyond them {format_bytes(inputs.profiled_peak_bytes)}"
    )
    table = result.table()
    shown = [
        c
        for c in TABLE_COLUMNS
        if (c != "safe_kv_tokens" or inputs.model) and (c != "kv_linked_bytes" or inputs.linked)
    ]
    click.echo(format_table(table, shown))
    for p, row in zip(result.plans, table.itertuples()):
        click.echo(_policy_line(result, p, row))
    if out_dir is not None:
        from sim.planner.plan import write_plan

        click.echo(f"wrote {write_plan(out_dir, result)}")


def _policy_line(result, p, row) -> str:
    """One sentence per policy: the answer, why one page more fails, and the engine rule's fate."""
    if p.safe is None:
        why = (
            "the allocations live when recording began do not fit"
            if p.next_page.at_start
            else f"out of memory at {result.describe_oom(p.next_page.oom_op)}"
        )
        text = f"{p.spec}: the recorded run does not fit even with one page of KV ({why})"
    else:
        text = (
            f"{p.spec}: safe KV {format_bytes(row.safe_kv_bytes)} ({row.safe_kv_pages:,} pages"
            + (
                f", {int(row.safe_kv_tokens):,} tokens"
                if row.safe_kv_tokens == row.safe_kv_tokens and row.safe_kv_tokens is not None
                else ""
            )
            + (
                f"; the engine's --num-blocks {int(row.engine_num_blocks):,} "
                f"of {p.inputs.engine_block_tokens} tokens, "
                f"its {p.inputs.engine_padding_blocks} padding blocks aside"
                if row.engine_num_blocks == row.engine_num_blocks
                and row.engine_num_blocks is not None
                else ""
            )
            + (
                f", {format_bytes(row.kv_linked_bytes)} in the buffers sized by it"
                if p.inputs.linked
                else ""
            )
            + f"); one page more runs out of memory at {result.describe_oom(p.next_page.oom_op)}"
        )
    rule = (
        f"gpu_memory_utilization={result.util_fraction:g} "
        f"would pick {format_bytes(row.util_rule_kv_bytes)}"
    )
    pages = p.util_pages - p.safe_pages
    if p.util is None:
        rule += " (nothing left after weights and the profiled peak)"
    elif p.util.fits:
        rule += f" ({-pages:,} pages below the safe size): fits"
    else:
        rule += (
            f" ({pages:,} pages above the safe size): "
            f"out of memory at {result.describe_oom(p.util.oom_op)}"
        )
    return f"{text}; {rule}"


# --------------------------------------------------------------------------- simulate --kv-capacity
@dataclass(frozen=True)
class KvBudgetSource:
    """``simulate --kv-capacity plan:RESULT`` or ``auto:SNAPSHOT``: budgets per simulated policy."""

    kind: str  # "plan" or "auto"
    path: Path

    def budgets(self, specs: list[str], *, model: Any, gpu: Any) -> dict[str, int]:
        """Each spec's planned KV bytes (``auto`` plans them now on ``gpu``'s memory for
        ``model``)."""
        from sim.planner.plan import PlanError, planned_budgets, read_plan

        if self.kind == "plan":
            try:
                return planned_budgets(read_plan(self.path), specs, source=str(self.path))
            except PlanError as exc:
                raise UsageError(str(exc)) from None
        from sim.planner.plan import device_memory_of

        # the simulated GPU's memory, less what the engine's process measured beside the snapshot
        try:
            memory = device_memory_of(
                self.path, device_bytes=gpu.memory_bytes, device_source=f"simulate's GPU {gpu.name}"
            )
        except PlanError as exc:
            raise UsageError(str(exc)) from None
        result = run_plan(self.path, specs, memory=memory, model=model)
        budgets = dict(zip(result.table()["policy"], result.table()["safe_kv_bytes"]))
        empty = [s for s, b in budgets.items() if not b]
        if empty:
            raise UsageError(
                f"--kv-capacity auto:{self.path}: "
                f"{empty[0]} leaves no room for a KV cache on {gpu.name} "
                f"(see `poollab plan {self.path}`)"
            )
        return {s: int(b) for s, b in budgets.items()}

    def describe(self, budgets: dict[str, int]) -> str:
        """For the settings line: where the budgets came from and what they are."""
        what = (
            f"from plan {self.path}"
            if self.kind == "plan"
            else f"planned on {self.path} (`poollab plan`)"
        )
        return f"KV budget {what}: " + ", ".join(
            f"{s} {format_bytes(b)}" for s, b in budgets.items()
        )


class KvCapacity(click.ParamType):
    """``8GiB``, ``plan:RESULT`` or ``auto:SNAPSHOT``."""

    name = "SIZE|plan:RESULT|auto:SNAPSHOT"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, (int, KvBudgetSource)):
            return value
        kind, sep, rest = str(value).partition(":")
        kind = kind.lower()  # --help shows the metavar upper-case
        if sep and kind in ("plan", "auto"):
            if not rest:
                self.fail(
                    f"{value!r}: name the "
                    f"{'plan folder or plan.csv' if kind == 'plan' else 'snapshot'} "
                    f"after '{kind}:'",
                    param,
                    ctx,
                )
            return KvBudgetSource(kind, Path(rest))
        return BYTES.convert(value, param, ctx)


KV_CAPACITY = KvCapacity()
