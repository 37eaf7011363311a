"""``poollab gpu serve``: a real continuous-batching engine serving a request trace, each policy in
turn holding all of PyTorch's memory, written in the tables ``simulate`` writes.

What happens, per policy spec (``pytorch`` is PyTorch's own caching allocator, no poollab policy):

1. The trace becomes a request plan (``plan_requests``): arrival times scaled by ``rate_scale`` and
   cut by ``duration_s``/``max_requests``, every prompt capped so that prompt + output fit the
   engine's longest sequence; prompts are random token ids of those lengths (no shared prefixes),
   outputs exactly the trace's length (EOS disabled).
2. A fresh Python process (``realgpu.serve_engine``) installs the policy as PyTorch's allocator
   before its first CUDA allocation (``realgpu.torch_allocator.use_policy``), builds the model
   (random weights of a ``sim/data/models.json`` preset's shape, made on the GPU in the preset's
   dtype, or a ``--checkpoint``), starts transformers' ``ContinuousBatchingManager`` (paged KV,
   sized by the engine unless ``num_blocks`` is given), warms it up, and submits the plan in real
   time (``drive``). It records one row per engine step (``traces.engine_profile`` step profile) and
   one per request.
3. This process assembles the summary row (``serve_summary_row``): the report schema's memory
   columns (``sim.replay.schema.summary_row``) and the serving columns ``simulate`` has
   (``sim.replay.serving_metrics``), and writes the result folder (``write_serve_results``).

The engine allocates its KV cache as one tensor per layer for K and one for V at start-up and
manages its blocks itself; an allocator sees those tensors, the weights and the activations, never a
KV block. So a paged policy here holds the run's memory but cannot page its KV: what the real run
compares is the allocators' footprint and call cost under a real engine, not KV paging.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np
import pandas as pd

from sim.replay.models import DEFAULT_MODEL
from traces.engine_profile import STEP_COLUMNS, write_served_requests, write_step_profile

__all__ = [
    "PYTORCH",
    "ServeSettings",
    "StepRow",
    "Completion",
    "Engine",
    "plan_requests",
    "drive",
    "step_table",
    "served_table",
    "serve_summary_row",
    "serve",
    "ServeRun",
    "ServeError",
    "ServeOutcome",
    "write_serve_results",
    "policy_slug",
    "serve_trace",
    "Compare",
    "check_engine_installed",
    "check_serve_specs",
    "check_cuda_graphs",
    "resolve_max_len",
]

#: The spec that means PyTorch's own caching allocator (no poollab policy, no subprocess hooks).
PYTORCH = "pytorch"
#: What ``--snapshot-until`` takes: the start-up only, the whole run, or both (two snapshots).
SNAPSHOT_UNTIL = ("startup", "end", "both")
#: The simulator's stand-in for PyTorch's own allocator (``ServeRun.policy_spec``).
SIM_TWIN_OF_PYTORCH = "torch-caching"


@dataclass(frozen=True)
class ServeSettings:
    """The engine's settings; the defaults are those of the shared recordings
    (``../shared/data/engine``).

    Attributes:
        model: a ``sim/data/models.json`` preset (or JSON file) whose shape the random weights take.
        checkpoint: a Hugging Face model folder to load instead (its own weights and shape).
        block_tokens: KV block size of the paged cache (tokens).
        max_batch_tokens: token budget of one engine step.
        max_num_seqs: most requests in one step (transformers' ``max_requests_per_batch``).
        num_blocks: KV cache blocks; None: the engine sizes it from free memory
            (``max_memory_percent`` of it, transformers' default 0.9).
        max_memory_percent: share of free memory the engine gives the KV cache when it sizes it.
        max_len_tokens: longest sequence (prompt + output); None: the model's context limit.
        attn_implementation: transformers' attention (``paged|sdpa``; ``paged|flash_attention_2``
            where installed).
        cuda_graphs: let the engine capture CUDA graphs (off in the shared recordings).
        warmup: before the trace, serve a batch that fills one step's token budget and one that
            decodes ``max_num_seqs`` at once (kernels loaded, the largest activations allocated
            once),
            unrecorded.
        snapshot: record PyTorch's memory history and write it (``snapshot_until``: ``startup``
            stops after warm-up, before the first trace request; ``end`` keeps it to the end;
            ``both`` writes the start-up one and the whole run's), each with the device memory the
            engine's process held outside PyTorch's allocator beside it (``traces.engine_memory``).
        allocator_mode: ``pluggable`` (the policy is PyTorch's allocator) or ``mempool`` (the policy
            supplies the segments PyTorch's caching allocator splits).
        validate: the policy's validation mode (guards and patterns).
        seed: prompts' token ids and the weights.
        device: CUDA device index.
        sample_every_steps: memory sample (time series) every n steps.
        on_cpu: run the engine on the host (a dry run of a tiny model; no memory columns).
        engine_footprint_check: let transformers refuse a ``num_blocks`` whose footprint by its own
            estimate exceeds ``max_memory_percent`` of free memory (its ``_check_footprint``); off,
            the engine starts at exactly ``num_blocks`` and real memory decides (a plan's check).
    """

    model: str = DEFAULT_MODEL
    checkpoint: str | None = None
    block_tokens: int = 256
    max_batch_tokens: int = 8192
    max_num_seqs: int = 1024
    num_blocks: int | None = None
    max_memory_percent: float | None = None
    max_len_tokens: int | None = None
    attn_implementation: str = "paged|sdpa"
    cuda_graphs: bool = False
    warmup: bool = True
    snapshot: bool = False
    snapshot_until: str = "startup"
    allocator_mode: str = "pluggable"
    validate: bool = False
    seed: int = 0
    device: int = 0
    sample_every_steps: int = 8
    on_cpu: bool = False
    engine_footprint_check: bool = True

    def __post_init__(self) -> None:
        for name in ("block_tokens", "max_batch_tokens", "max_num_seqs", "sample_every_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num-blocks {self.num_blocks} must be >= 1")
        if self.max_len_tokens is not None and self.max_len_tokens < 2:
            raise ValueError(
                f"max-len {self.max_len_tokens} must be >= 2 (one prompt and one output token)"
            )
        if self.max_memory_percent is not None and not 0 < self.max_memory_percent <= 1:
            raise ValueError(f"max-memory-percent {self.max_memory_percent} must be in (0, 1]")
        if self.snapshot_until not in SNAPSHOT_UNTIL:
            raise ValueError(
                f"snapshot-until {self.snapshot_until!r} must be one of {', '.join(SNAPSHOT_UNTIL)}"
            )
        if self.allocator_mode not in ("pluggable", "mempool"):
            raise ValueError(
                f"allocator-mode {self.allocator_mode!r} must be 'pluggable' or 'mempool'"
            )


@dataclass(frozen=True)
class StepRow:
    """One engine step as the engine adapter records it (clock seconds, not yet rebased)."""

    start_t: float
    duration_s: float
    num_prefill_seqs: int
    num_prefill_tokens: int
    prefill_context_tokens: int
    num_decode_seqs: int
    decode_context_tokens: int
    #: CPU seconds the engine's thread spent in the step (``time.thread_time``; NaN: not
    #: measured). A wall well above it is time the thread waited off the CPU (descheduled, or
    #: blocked on the GIL); a spin-wait on the GPU counts as CPU time.
    cpu_s: float = math.nan


@dataclass(frozen=True)
class Completion:
    """A request the engine is done with: first token and finish in clock seconds (NaN: never)."""

    request_id: int
    first_token_t: float
    finish_t: float
    num_generated: int
    error: str = ""


class Engine(Protocol):
    """What ``drive`` needs of an engine (``realgpu.serve_engine.TransformersEngine``, or a fake
    one)."""

    def submit(self, request_id: int, prompt_ids: list[int], output_tokens: int) -> None: ...

    def results(self, timeout_s: float) -> list[Completion]: ...

    def alive(self) -> bool: ...


def plan_requests(
    requests: pd.DataFrame,
    *,
    max_len_tokens: int,
    rate_scale: float = 1.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
) -> pd.DataFrame:
    """The requests to serve: ``arrival_s`` divided by ``rate_scale``, those arriving before
    ``duration_s`` (in the scaled time: the real seconds the run takes arrivals for), at most
    ``max_requests``, rebased to the first; each output capped at ``max_len_tokens - 1`` and its
    prompt so that prompt
    + output <= ``max_len_tokens`` (at least one prompt token).

    Columns: ``request``, ``arrival_s``, ``prompt_tokens``, ``output_tokens``,
    ``trace_prompt_tokens``. Raises ValueError naming the option that leaves nothing to serve.
    """
    if rate_scale <= 0:
        raise ValueError(f"--rate-scale {rate_scale} must be > 0")
    if max_len_tokens < 2:
        raise ValueError(
            "the engine's longest sequence "
            f"({max_len_tokens} tokens) leaves no room for a prompt and an output"
        )
    df = requests.sort_values("arrival_s", kind="stable").reset_index(drop=True)
    arrival = (
        (df["arrival_s"].to_numpy(np.float64) - float(df["arrival_s"].iloc[0])) / rate_scale
        if len(df)
        else np.zeros(0)
    )
    keep = np.ones(len(df), dtype=bool)
    if duration_s is not None:
        if duration_s <= 0:
            raise ValueError(f"--duration {duration_s} must be > 0")
        keep &= arrival < duration_s
    idx = np.flatnonzero(keep)
    if max_requests is not None:
        if max_requests < 1:
            raise ValueError(f"--max-requests {max_requests} must be >= 1")
        idx = idx[:max_requests]
    if idx.size == 0:
        raise ValueError("no request to serve: the trace is empty")  # the first always arrives at 0
    output = np.minimum(df["output_tokens"].to_numpy(np.int64)[idx], max_len_tokens - 1)
    output = np.maximum(output, 1)
    prompt_trace = df["prompt_tokens"].to_numpy(np.int64)[idx]
    prompt = np.clip(prompt_trace, 1, max_len_tokens - output)
    return pd.DataFrame(
        {
            "request": np.arange(idx.size),
            "arrival_s": arrival[idx] - arrival[idx[0]],
            "prompt_tokens": prompt,
            "output_tokens": output,
            "trace_prompt_tokens": prompt_trace,
        }
    )


def drive(
    engine: Engine,
    plan: pd.DataFrame,
    *,
    vocab_size: int,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    poll_s: float = 0.05,
    give_up_s: float | None = None,
) -> tuple[float, np.ndarray, list[Completion]]:
    """Submit ``plan``'s requests to a started ``engine`` at their arrival times, in real time, and
    collect what it finishes, until every request is done, the engine dies, or ``give_up_s`` seconds
    pass after the last arrival.

    Returns ``(t0, submit_t, completions)``: the clock at the first arrival, each request's clock at
    submission (NaN: never submitted) and the completions in the order they came.
    """
    rng = np.random.default_rng(seed)
    arrival = plan["arrival_s"].to_numpy(np.float64)
    prompts = plan["prompt_tokens"].to_numpy(np.int64)
    outputs = plan["output_tokens"].to_numpy(np.int64)
    # every prompt drawn before the clock starts: drawing 8k ids takes no engine time this way
    token_ids = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in prompts]
    submit_t = np.full(len(plan), np.nan)
    done: list[Completion] = []
    num_done, nxt, n = 0, 0, len(plan)
    t0 = clock()
    while num_done < n:
        now = clock() - t0
        while nxt < n and arrival[nxt] <= now:
            submit_t[nxt] = clock()
            engine.submit(nxt, token_ids[nxt], int(outputs[nxt]))
            token_ids[nxt] = None  # the engine holds its copy
            nxt += 1
        wait = min(poll_s, max(0.0, arrival[nxt] - (clock() - t0))) if nxt < n else poll_s
        got = engine.results(wait)
        done.extend(got)
        num_done += len(got)
        if not engine.alive():
            done.extend(engine.results(0.0))
            break
        if give_up_s is not None and nxt == n and clock() - t0 > arrival[-1] + give_up_s:
            break
    return t0, submit_t, done


def step_table(steps: Iterable[StepRow], t0: float) -> pd.DataFrame:
    """The step profile (``traces.engine_profile`` columns, ``start_s`` from the first arrival, and
    ``cpu_s`` where every step has it) of the steps that began at or after ``t0`` (warm-up steps
    before it are left out)."""
    rows = [s for s in steps if s.start_t >= t0]
    df = pd.DataFrame([asdict(s) for s in rows], columns=list(StepRow.__dataclass_fields__))
    df.insert(0, "start_s", df.pop("start_t") - t0)
    cpu = ["cpu_s"] if len(df) and df["cpu_s"].notna().all() else []
    return df[["start_s", *STEP_COLUMNS, *cpu]].astype({c: np.int64 for c in STEP_COLUMNS[1:]})


def served_table(
    plan: pd.DataFrame, t0: float, submit_t: np.ndarray, completions: Iterable[Completion]
) -> pd.DataFrame:
    """One row per planned request (``traces.engine_profile`` served-request columns, seconds from
    the first arrival; NaN where a request never got a first token or never finished) plus
    ``num_generated`` and ``error``."""
    n = len(plan)
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    generated = np.zeros(n, dtype=np.int64)
    error = np.full(n, "no result: the engine stopped first", dtype=object)
    for c in completions:
        first[c.request_id] = c.first_token_t - t0
        generated[c.request_id] = c.num_generated
        error[c.request_id] = c.error
        if not c.error:
            finish[c.request_id] = c.finish_t - t0
    arrival = submit_t - t0
    never = np.isnan(arrival)
    error[never] = "never submitted"
    return pd.DataFrame(
        {
            "request": plan["request"].to_numpy(),
            "arrival_s": np.where(never, plan["arrival_s"], arrival),
            "prompt_tokens": plan["prompt_tokens"].to_numpy(),
            "output_tokens": plan["output_tokens"].to_numpy(),
            "first_token_s": first,
            "finish_s": finish,
            "num_generated": generated,
            "error": error,
        }
    )


def serve_summary_row(
    memory_row: dict[str, Any],
    served: pd.DataFrame,
    steps: pd.DataFrame,
    *,
    kv_capacity_tokens: int,
    num_preemptions: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    """The summary row ``simulate`` writes, from a real run: ``memory_row`` (the report schema's
    columns, ``sim.replay.schema.summary_row``'s) and the serving columns
    (``sim.replay.serving_metrics.serving_summary`` over the request table
    ``sim.replay.serving_metrics.request_frame`` builds), then the engine's columns and
    ``extra``.

    ``kv_token_util`` is the step-time-weighted share of the KV cache's tokens the step's sequences
    held (their context tokens over ``kv_capacity_tokens``); ``duration_s`` the time from the first
    arrival to the last finish.
    """
    from sim.replay.serving_metrics import FINISHED, RUNNING, request_frame, serving_summary

    finished = np.isfinite(served["finish_s"].to_numpy(np.float64))
    table = request_frame(
        pd.DataFrame(
            {
                "request_id": served["request"].to_numpy(np.int64),
                "arrival_s": served["arrival_s"].to_numpy(np.float64),
                "prompt_tokens": served["prompt_tokens"].to_numpy(np.int64),
                "output_tokens": served["output_tokens"].to_numpy(np.int64),
                "num_generated": served["num_generated"].to_numpy(np.int64),
                "first_token_s": served["first_token_s"].to_numpy(np.float64),
                "finish_s": served["finish_s"].to_numpy(np.float64),
                "num_preemptions": 0,
                "num_swaps": 0,
                "prefix_hit_tokens": 0,
                "status": np.where(finished, FINISHED, RUNNING),
                "reject_reason": "",
                "reject_kind": "",
            }
        )
    )
    finish = served["finish_s"].to_numpy(np.float64)
    duration_s = float(np.nanmax(finish)) if np.isfinite(finish).any() else math.nan
    busy_s = float(steps["duration_s"].sum()) if len(steps) else 0.0
    held = (steps["prefill_context_tokens"] + steps["decode_context_tokens"]).to_numpy(np.float64)
    util = (
        float((held * steps["duration_s"]).sum() / (busy_s * kv_capacity_tokens))
        if busy_s > 0 and kv_capacity_tokens > 0
        else math.nan
    )
    serving = serving_summary(
        table,
        duration_s=duration_s,
        num_preemptions=num_preemptions,
        kv_token_util=util,
        busy_s=busy_s,
    )
    d = steps["duration_s"].to_numpy(np.float64)
    engine = {
        "duration_s": duration_s,
        "num_steps": len(steps),
        "busy_s": busy_s,
        "step_p50_s": float(np.percentile(d, 50)) if d.size else math.nan,
        "step_p99_s": float(np.percentile(d, 99)) if d.size else math.nan,
        "n_request_errors": int((served["error"] != "").sum()),
        "kv_capacity_tokens": kv_capacity_tokens,
    }
    return {**memory_row, **serving, **engine, **extra}


def policy_slug(spec: str) -> str:
    """A file-name-safe form of a policy spec (``best-fit:virtual=true`` ->
    ``best-fit_virtual-true``)."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", spec.replace("=", "-")).strip("_") or "policy"


@dataclass
class ServeRun:
    """One policy's real run: its summary row, step profile, request table, time series and
    files."""

    spec: str
    summary: dict[str, Any]
    steps: pd.DataFrame
    served: pd.DataFrame
    timeseries: pd.DataFrame | None = None
    snapshot_path: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)
    run_snapshot_path: Path | None = (
        None  # the whole run's, beside the start-up one (``snapshot_until="both"``)
    )

    @property
    def policy_spec(self) -> str:
        """The poollab policy that stands for this run's allocator in the simulator
        (``torch-caching`` for PyTorch's own)."""
        return SIM_TWIN_OF_PYTORCH if self.spec == PYTORCH else self.spec


class ServeError(RuntimeError):
    """A policy's engine process failed; the message is its last error line."""


def serve(
    plan: pd.DataFrame,
    specs: Sequence[str],
    settings: ServeSettings,
    *,
    trace_name: str,
    log: Callable[[str], None] = print,
    python: str | None = None,
    timeout_s: float | None = None,
) -> list[ServeRun]:
    """Serve ``plan`` under each spec in turn, each in a fresh process (``realgpu.serve_engine``),
    and return the runs. ``pytorch`` runs PyTorch's own allocator; any other spec goes through
    ``realgpu.torch_allocator.use_policy``. Raises ``ServeError`` with the child's last error
    line."""
    runs = []
    for spec in specs:
        with tempfile.TemporaryDirectory(prefix="poollab-serve-") as tmp:
            work = Path(tmp)
            plan.to_csv(work / "plan.csv", index=False)
            (work / "job.json").write_text(
                json.dumps({"spec": spec, "trace": trace_name, "settings": asdict(settings)})
            )
            log(
                f"{spec}: starting the engine ({settings.checkpoint or settings.model}"
                + (
                    ""
                    if settings.engine_footprint_check
                    else "; transformers' footprint check off: "
                    f"exactly {settings.num_blocks or 'the sized'} blocks"
                )
                + ")"
            )
            cmd = [python or sys.executable, "-m", "realgpu.serve_engine", str(work)]
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
                ).rstrip(os.pathsep),
            }
            tail: collections.deque[str] = collections.deque(maxlen=12)
            with subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            ) as proc:
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                for line in proc.stdout:  # the engine's progress lines as they come
                    line = line.rstrip("\n")
                    tail.append(line)
                    if line.startswith("serve: "):
                        log(f"{spec}: {line[len('serve: ') :]}")
                    if deadline is not None and time.monotonic() > deadline:
                        proc.kill()
                        break
                returncode = proc.wait()
            result = work / "result.json"
            if returncode != 0 or not result.is_file():
                err = work / "error.txt"
                why = (
                    err.read_text().strip()
                    if err.is_file()
                    else (tail[-1] if tail else f"exit status {returncode}")
                )
                for line in tail:  # the engine's own last words, for whoever debugs
                    log(f"{spec}:   | {line}")
                raise ServeError(f"gpu serve: policy {spec!r}: {why}")
            runs.append(read_run(work, spec))
            if runs[-1].snapshot_path is not None or runs[-1].run_snapshot_path is not None:
                keep = Path(
                    tempfile.mkdtemp(prefix="poollab-snapshot-")
                )  # out of the temporary folder before it goes
                runs[-1].snapshot_path = _move_snapshot(runs[-1].snapshot_path, keep)
                runs[-1].run_snapshot_path = _move_snapshot(runs[-1].run_snapshot_path, keep)
    return runs


def _snapshot_files(snapshot: Path) -> list[Path]:
    """A written snapshot and, where there is one, the JSON of the engine's memory beside it."""
    from traces.engine_memory import sidecar_path

    return [snapshot] + [p for p in (sidecar_path(snapshot),) if p.is_file()]


def _move_snapshot(snapshot: Path | None, folder: Path) -> Path | None:
    """Move a snapshot and its JSON into ``folder``; the snapshot's new path."""
    if snapshot is None:
        return None
    for path in _snapshot_files(snapshot):
        path.replace(folder / path.name)
    return folder / snapshot.name


def read_run(work: Path, spec: str) -> ServeRun:
    """A child's result folder as a ``ServeRun`` (summary assembled here, in the parent)."""
    from traces.engine_profile import read_served_requests, read_step_profile

    result = json.loads((work / "result.json").read_text())
    steps = (
        read_step_profile(work / "steps.csv")
        if (work / "steps.csv").stat().st_size and result["num_steps"]
        else pd.DataFrame(columns=["start_s", *STEP_COLUMNS])
    )
    served = pd.read_csv(work / "requests.csv", dtype={"error": object})
    served["error"] = served["error"].fillna("")
    read_served_requests(work / "requests.csv")  # the schema's checks, naming a bad cell
    ts = (
        pd.read_parquet(work / "timeseries.parquet")
        if (work / "timeseries.parquet").is_file()
        else None
    )
    summary = serve_summary_row(
        result["memory_row"],
        served,
        steps,
        kv_capacity_tokens=result["kv_capacity_tokens"],
        num_preemptions=result["num_preemptions"],
        **result["extra"],
    )
    snap = work / result["snapshot"] if result.get("snapshot") else None
    run_snap = work / result["run_snapshot"] if result.get("run_snapshot") else None
    return ServeRun(
        spec=spec,
        summary=summary,
        steps=steps,
        served=served,
        timeseries=ts,
        snapshot_path=snap,
        info=result,
        run_snapshot_path=run_snap,
    )


def write_serve_results(
    out_dir: Path,
    runs: Sequence[ServeRun],
    meta: dict[str, Any],
    comparison: pd.DataFrame | None = None,
) -> list[Path]:
    """The result folder: ``summary.csv``, ``timeseries.parquet``, ``requests.parquet`` (every run's
    request table, ``sim.replay.serving_metrics`` columns) and ``run.json`` as ``simulate`` writes
    them, and per policy ``steps_<policy>.csv`` (step profile), ``requests_<policy>.csv`` (served
    requests) and, when recorded, ``snapshot_<policy>.pickle.gz`` (and the whole run's
    ``snapshot_<policy>_run.pickle.gz``), each with its ``.json`` of the engine's memory. Returns
    the per-policy files."""
    from sim.replay.schema import summary_frame, write_results

    summary = summary_frame([r.summary for r in runs])
    tables = [r.served.assign(policy=r.spec) for r in runs]
    series = [r.timeseries for r in runs if r.timeseries is not None]
    extra = {"requests": pd.concat(tables, ignore_index=True)}
    if comparison is not None:
        extra["sim_comparison"] = comparison
    write_results(
        out_dir,
        summary,
        pd.concat(series, ignore_index=True) if series else None,
        extra_tables=extra,
        meta=meta,
    )
    written = []
    for r in runs:
        slug = policy_slug(r.spec)
        written.append(write_step_profile(r.steps, out_dir / f"steps_{slug}.csv"))
        written.append(write_served_requests(r.served, out_dir / f"requests_{slug}.csv"))
        for snapshot, name in (
            (r.snapshot_path, f"snapshot_{slug}"),
            (r.run_snapshot_path, f"snapshot_{slug}_run"),
        ):
            if snapshot is not None:
                for path, dest in zip(
                    _snapshot_files(snapshot), (f"{name}.pickle.gz", f"{name}.json")
                ):
                    (out_dir / dest).write_bytes(path.read_bytes())
                    written.append(out_dir / dest)
    return written


def check_engine_installed() -> None:
    """Raise ValueError saying what is missing when torch or transformers is not installed (the
    ``engine`` extra)."""
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"gpu serve needs {' and '.join(missing)} (pip install 'poollab[engine]'); "
            f"the GPU machine has both"
        )


def check_serve_specs(specs: Sequence[str]) -> list[str]:
    """The specs to run (default ``pytorch``), each checked before any work (``PolicyError`` names a
    bad one)."""
    import policies

    out = list(specs) or [PYTORCH]
    for spec in out:
        if spec != PYTORCH:
            policies.create(spec)
    return out


def check_cuda_graphs(specs: Sequence[str], settings: ServeSettings) -> None:
    """Refuse, before any engine starts, CUDA graphs under a pluggable policy: the engine captures
    into a ``torch.cuda.MemPool`` of PyTorch's caching allocator, which a pluggable allocator
    replaces (``realgpu.torch_allocator`` refuses the capture). In mempool mode the graphs' memory
    is PyTorch's own graph pool and the rest the policy's."""
    if not settings.cuda_graphs or settings.allocator_mode != "pluggable":
        return
    policies = [s for s in specs if s != PYTORCH]
    if policies:
        raise ValueError(
            f"--cuda-graphs with policy {policies[0]!r} needs --allocator-mode mempool: "
            "the engine captures its graphs into a pool of PyTorch's caching allocator, "
            "which a pluggable policy replaces"
        )


def resolve_max_len(settings: ServeSettings) -> int:
    """The engine's longest sequence: ``max_len_tokens``, else the checkpoint's or preset's context
    limit."""
    if settings.max_len_tokens is not None:
        return settings.max_len_tokens
    if settings.checkpoint:
        cfg = Path(settings.checkpoint) / "config.json"
        try:
            value = json.loads(cfg.read_text()).get("max_position_embeddings")
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"--checkpoint {settings.checkpoint}: cannot read config.json ({exc})"
            ) from None
        if not isinstance(value, int) or value < 2:
            raise ValueError(
                f"--checkpoint {settings.checkpoint}: config.json has no max_position_embeddings; "
                f"give --max-len"
            )
        return value
    from sim.replay.models import load_model

    return int(load_model(settings.model).max_position_embeddings or 8192)


class Compare(Protocol):
    """What ``serve_trace`` hands its runs to: each run's measured-against-predicted table by spec
    (``sim.serving.engine_compare.compare_with_engine``)."""

    def __call__(
        self,
        runs: Sequence[ServeRun],
        plan: pd.DataFrame,
        settings: ServeSettings,
        *,
        trace_name: str,
    ) -> dict[str, pd.DataFrame]: ...


@dataclass
class ServeOutcome:
    """What ``serve_trace`` did: the plan, each policy's run, the policies whose engine failed
    (spec: reason) and, with ``compare``, each run's measured-against-predicted table."""

    plan: pd.DataFrame
    runs: list[ServeRun]
    failed: dict[str, str]
    comparisons: dict[str, pd.DataFrame]
    files: list[Path]


def serve_trace(
    requests: Any,
    specs: Sequence[str],
    settings: ServeSettings,
    *,
    out_dir: Path,
    rate_scale: float = 1.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    compare: Compare | None = None,
    log: Callable[[str], None] = print,
    meta: dict[str, Any] | None = None,
) -> ServeOutcome:
    """Plan ``requests`` (a ``RequestTrace``), serve it under each spec, hand the runs to
    ``compare`` when given, and write the result folder (with ``compare``'s tables as
    ``sim_comparison``). A policy whose engine fails is reported in ``failed`` and the others still
    run; ValueError when none ran (or, before anything runs, when ``cuda_graphs`` asks for a capture
    a pluggable policy would refuse).

    ``compare`` is the simulator's side (``sim.serving.engine_compare.compare_with_engine``, with
    its GPU and calibration bound): ``realgpu`` imports only the replay room, so the caller
    brings it."""
    check_cuda_graphs(specs, settings)
    max_len = resolve_max_len(settings)
    settings = ServeSettings(**{**asdict(settings), "max_len_tokens": max_len})
    plan = plan_requests(
        requests.requests,
        max_len_tokens=max_len,
        rate_scale=rate_scale,
        duration_s=duration_s,
        max_requests=max_requests,
    )
    runs, failed = [], {}
    for spec in specs:
        try:
            runs.extend(serve(plan, [spec], settings, trace_name=requests.name, log=log))
        except ServeError as exc:
            failed[spec] = str(exc)
            log(f"warning: {exc}")
    if not runs:
        raise ValueError("gpu serve: no policy ran: " + "; ".join(failed.values()))
    comparisons = compare(runs, plan, settings, trace_name=requests.name) if compare else {}
    comparison = (
        pd.concat([c.assign(policy=s) for s, c in comparisons.items()], ignore_index=True)
        if comparisons
        else None
    )
    files = write_serve_results(
        out_dir,
        runs,
        {
            **(meta or {}),
            "command": "gpu serve",
            "trace": requests.name,
            "policies": list(specs),
            "failed": failed,
            "rate_scale": rate_scale,
            "duration_s": duration_s,
            "max_requests": max_requests,
            "num_requests": len(plan),
            **asdict(settings),
        },
        comparison,
    )
    return ServeOutcome(plan, runs, failed, comparisons, files)
