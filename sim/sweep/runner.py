"""Running a sweep's cells: a local process pool by default, Dask distributed on request.

The same cells and the same ``run_cell`` go to every scheduler, so the results table does not
depend on where the cells ran:

- ``None`` / ``"processes"``: a local process pool of ``workers`` processes (default: the cores);
- ``"local:N"`` (or ``"local"`` with ``workers``): a Dask ``LocalCluster`` of N single-thread
  worker processes, started and stopped here;
- ``"tcp://HOST:8786"`` (any Dask address): an existing Dask cluster; its workers must import
  poollab and see the trace files at the same paths;
- a ``distributed.Client``: that client's cluster (notebooks, tests);
- ``"serial"``: one cell after another in this process (debuggers, profilers);
- an executor object from this module, used as it is.

Finished cells are stored as they arrive (``sim.sweep.store``), so an interrupted sweep resumes
where it stopped; failed cells are stored too and only run again with ``retry_failed``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pandas as pd

from sim.replay.schema import SUMMARY_COLUMNS, write_results
from sim.serving.fit_range import RENAMED_RANGE_COLUMNS
from sim.sweep import cells as _cells
from sim.sweep.cells import STATUS_FAILED, STATUS_LOST, STATUS_OK, Cell, cell_columns, lost_record
from sim.sweep.errors import SweepError
from sim.sweep.pareto import pareto_table
from sim.sweep.spec import SweepSpec
from sim.sweep.store import CellStore
from traces.atomic import process_alive
from traces.knobs import check_int

__all__ = [
    "SweepOutcome",
    "run_sweep",
    "plan_sweep",
    "results_frame",
    "make_executor",
    "STATUS_COLUMNS",
    "DIST_HINT",
]

#: Columns every results row has after the report schema's.
STATUS_COLUMNS = ["status", "error", "elapsed_s"]
DIST_HINT = "install the optional extra: pip install 'poollab[dist]'"
#: What the fork server imports once for every worker it forks.
_PRELOAD = ["sim.sweep.cells", "sim.replay.trace_replay", "sim.serving.simulate", "traces"]
#: How long to wait for an existing Dask scheduler to answer.
_CONNECT_TIMEOUT_S = 20


@dataclass
class SweepOutcome:
    """What ``run_sweep`` did: the merged table, the fronts and the counts."""

    results: pd.DataFrame
    pareto: pd.DataFrame
    out_dir: Path
    scheduler: str
    num_cells: int
    num_cached: int
    num_run: int
    num_failed: int
    num_lost: int
    wall_s: float
    #: where the wall time went: ``plan_s`` (reading the store), ``startup_s`` (starting the
    #: workers), ``cells_s`` (the cells, from the first handed out to the last collected, less
    #: ``startup_s``), ``collect_s`` (merging and writing the tables).
    phases_s: dict[str, float] = field(default_factory=dict)


class SerialExecutor:
    label = "serial"
    startup_s = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, cells: list[Cell]) -> Iterator[tuple[Cell, dict[str, Any]]]:
        for cell in cells:
            yield cell, _cells.run_cell(cell)


class ProcessExecutor:
    """A ``ProcessPoolExecutor`` fed batches of cells; a worker that dies loses its batch's cells
    (recorded, not stored).

    The workers start once, all before the first cell (``startup_s`` is that time, apart from
    the cells'), and each task is a batch of cells of one trace (``batch_cells``: large batches
    first, single cells last, longest traces first), all submitted at once: the pool hands the
    next batch to whichever worker is free, so a few round trips per worker instead of one per
    cell keep the serial part (scheduling, pickling, collection) small, and the tail is one cell.
    Workers come from a fork server that has imported the replay and simulation code once (cheap to
    start, and safe where ``fork`` of a threaded parent is not); ``start_method`` picks another
    ``multiprocessing`` start method.
    """

    def __init__(self, num_workers: int, *, start_method: str | None = None):
        self.num_workers = num_workers
        self.start_method = start_method or (
            "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        )
        self.label = f"processes:{num_workers}"
        self.startup_s = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, cells: list[Cell]) -> Iterator[tuple[Cell, dict[str, Any]]]:
        t0 = time.perf_counter()
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)  # no effect once this process's fork server runs
        num_workers = max(1, min(self.num_workers, len(cells)))
        _start_quiet_resource_tracker()
        pool = ProcessPoolExecutor(
            max_workers=num_workers,
            mp_context=ctx,
            initializer=die_with_parent,
            initargs=(os.getpid(),),
        )
        finished = False
        try:
            _start_workers(pool, num_workers)
            self.startup_s = time.perf_counter() - t0
            futures = {
                pool.submit(_cells.run_cells, batch): batch
                for batch in batch_cells(cells, num_workers)
            }
            for fut in as_completed(futures):
                batch = futures.pop(fut)
                try:
                    records = fut.result()
                except Exception as exc:  # BrokenProcessPool: a worker was killed (memory, signal)
                    records = [lost_record(cell, exc) for cell in batch]
                yield from zip(batch, records)
            finished = True
        finally:
            if finished:
                pool.shutdown(wait=True, cancel_futures=True)
            # Ctrl-C, an error, or the caller stopped reading: nothing more is wanted from the
            # workers
            else:
                stop_pool(pool)


def _start_quiet_resource_tracker() -> None:
    """Start ``multiprocessing``'s resource tracker, if it is not running, with its stderr on
    /dev/null (``ensure_running`` does nothing when it runs already).

    An interrupted sweep terminates its workers (``stop_pool``), possibly inside one of the pool's
    queues; the tracker then unlinks the semaphores they left, as it should, but says so on stderr
    ("leaked semaphore objects", after "poollab: interrupted"): noise about its own cleanup, not the
    user's error. Its stderr is this process's when it starts, so it is started here with fd 2 on
    /dev/null for that moment.
    """
    from multiprocessing import resource_tracker

    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


#: How long ``stop_pool`` lets a worker end on SIGTERM before it is killed.
_STOP_GRACE_S = 0.5


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """End ``pool`` now: pending batches cancelled, running ones abandoned, workers terminated.

    What an interrupted sweep needs: a worker runs its batch to the end (minutes, maybe), so
    ``shutdown(wait=True)`` would hold Ctrl-C that long, and a worker interrupted inside the
    pool's queues can leave the others blocked on a lock forever (the hang of issue 29). So the
    workers ignore SIGINT (``die_with_parent``), and here they are terminated and joined; the
    cells already collected are in the store, the abandoned batches run again next time.
    """
    processes = list(
        (getattr(pool, "_processes", None) or {}).values()
    )  # CPython's pool keeps them here
    manager = getattr(pool, "_executor_manager_thread", None)  # shutdown forgets it
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        with contextlib.suppress(Exception):
            proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in processes:
        with contextlib.suppress(Exception):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(_STOP_GRACE_S)
    if manager is not None:
        # joined, so that it has closed its wakeup pipe before the interpreter's exit writes to
        # it: CPython 3.11's exit hook tests the pipe, then writes to it, without the pool's lock,
        # and a close between the two was a "Bad file descriptor" traceback after "poollab:
        # interrupted" (once in a CI run)
        manager.join(_STOP_GRACE_S)


def _start_workers(pool: ProcessPoolExecutor, num_workers: int) -> None:
    """Every worker of ``pool`` up, once, started from a thread that blocks SIGINT.

    Processes inherit the signal mask of the thread that starts them, so the fork server (while
    it imports the preloaded modules: seconds) and each worker (until ``die_with_parent``) are
    deaf to a Ctrl-C sent to the process group, instead of each printing a traceback; this
    thread, which only waits, takes the Ctrl-C at once and ``stop_pool`` ends what started.
    """
    failed: list[BaseException] = []

    def start() -> None:
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            for fut in [pool.submit(os.getpid) for _ in range(num_workers)]:
                fut.result()
        except BaseException as exc:  # noqa: BLE001 (handed to the waiting thread)
            failed.append(exc)

    if not hasattr(signal, "pthread_sigmask"):
        start()
    else:
        starter = threading.Thread(target=start, name="poollab-pool-start", daemon=True)
        starter.start()
        try:
            while starter.is_alive():
                starter.join(0.05)  # a short wait, so that Ctrl-C interrupts it
        except BaseException:
            # the starter may wait on it (importing the preloaded modules): end the wait
            _stop_fork_server()
            raise
    if failed:
        raise failed[0]


def _stop_fork_server() -> None:
    """Kill this process's ``multiprocessing`` fork server, if it runs (CPython keeps its pid in
    ``forkserver._forkserver``); the next pool starts a fresh one. Workers it forked die with it
    (``die_with_parent``)."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # not reaped here: ensure_running reaps it and starts anew


#: Guided handout: each batch takes 1 / (this x workers) of the cells not yet handed out, so
#: batches shrink as the sweep goes on and the last ones are single cells: the first are large
#: (few round trips), the last worker to finish waits on one cell, not on an equal-size batch.
TASKS_PER_WORKER = 2


def batch_cells(
    cells: list[Cell], num_workers: int, tasks_per_worker: int = TASKS_PER_WORKER
) -> list[list[Cell]]:
    """``cells`` as batches to hand out in order, each of one trace file (a worker parses a
    trace once and keeps it), every cell once.

    The longest expected first: traces by file size, largest first (a cell's cost follows its
    trace's length; within one trace the grid order is kept). Batch sizes are guided: a batch
    holds ``ceil(remaining / (tasks_per_worker x num_workers))`` cells, so they shrink to one
    cell at the end. The pool hands batches to workers as they become free, so a worker that
    drew cheap cells takes more (dynamic), and the tail is one cell long.
    """
    by_trace: dict[str, list[Cell]] = {}
    for cell in cells:
        by_trace.setdefault(cell.trace.fingerprint, []).append(cell)
    groups = sorted(
        by_trace.values(), key=lambda g: -_file_bytes(g[0].trace.path)
    )  # stable: ties keep grid order
    divisor = max(1, num_workers * tasks_per_worker)
    remaining = len(cells)
    batches: list[list[Cell]] = []
    for group in groups:
        i = 0
        while i < len(group):
            size = -(-remaining // divisor)
            batches.append(group[i : i + size])
            i += size
            remaining -= len(batches[-1])
    return batches


def _file_bytes(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # not here (a cluster's path): no estimate, grid order
        return 0


#: How often a pool worker's watchdog looks whether the sweep's main process still lives.
_PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(main_pid: int) -> None:
    """Pool-worker initializer: the worker ends when the sweep's process does, even after ``kill
    -9``.

    A killed process runs no cleanup, so without this its workers would run their cells to the
    end and linger (and with them the fork server and the resource tracker, which wait for
    them). On Linux the kernel kills the worker when its parent dies (``PR_SET_PDEATHSIG``);
    the parent of a fork-server worker is the fork server, though, which outlives the main
    process, so a daemon thread also polls the main process (``main_pid``) and its own parent
    and exits when either is gone: the portable part. The worker ignores SIGINT: Ctrl-C reaches
    the whole process group, and it is the main process that stops the pool (``stop_pool``).
    """
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C is the main process's to handle (stop_pool)
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl here: the watchdog alone
            pass

    def gone() -> bool:
        return os.getppid() != parent or not process_alive(main_pid)

    if gone():  # it died before the kernel was told
        os._exit(1)

    def watch() -> None:
        while not gone():
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="poollab-parent-watchdog", daemon=True).start()


class DaskExecutor:
    """Cells as Dask tasks keyed by cell key, on a client made here or given."""

    def __init__(
        self, *, address: str | None = None, num_workers: int | None = None, client: Any = None
    ):
        self.address, self.num_workers, self.client = address, num_workers, client
        self._own: list[Any] = []
        self.startup_s = 0.0
        if client is not None:
            self.label = f"dask:{getattr(client.scheduler, 'address', 'client')}"
        elif address is not None:
            self.label = address
        else:
            self.label = f"local:{num_workers}"

    def __enter__(self):
        t0 = time.perf_counter()
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise SweepError(
                f"--scheduler {self.label} needs Dask distributed; {DIST_HINT}"
            ) from None
        if self.client is None:
            if self.address is not None:
                try:
                    self.client = Client(self.address, timeout=f"{_CONNECT_TIMEOUT_S}s")
                except (OSError, TimeoutError) as exc:
                    raise SweepError(
                        f"cannot reach the Dask scheduler at {self.address}: {exc}"
                    ) from None
            else:  # one thread per worker: cells are pure Python and hold the GIL
                cluster = LocalCluster(
                    n_workers=self.num_workers,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=":0",
                )
                self._own.append(cluster)
                self.client = Client(cluster)
            self._own.insert(0, self.client)
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        for obj in self._own:
            obj.close()
        self._own.clear()

    def run(self, cells: list[Cell]) -> Iterator[tuple[Cell, dict[str, Any]]]:
        from distributed import as_completed as dask_as_completed

        keys = [f"poollab-cell-{cell.key}" for cell in cells]
        futures = self.client.map(_cells.run_cell, cells, key=keys, retries=0)
        by_key = dict(zip(keys, cells))
        try:
            for fut in dask_as_completed(futures):
                cell = by_key[fut.key]
                try:
                    record = fut.result()
                except Exception as exc:  # KilledWorker, a lost connection, a cancelled task
                    record = lost_record(cell, exc)
                fut.release()
                yield cell, record
        finally:
            self.client.cancel([f for f in futures if not f.done()])


def make_executor(scheduler: Any = None, workers: int | None = None):
    """The executor for a ``--scheduler`` value (see the module docstring); SweepError if
    unusable."""
    check_int("--workers", workers, none_ok=True, error=SweepError)
    if scheduler is None or scheduler == "processes":
        return ProcessExecutor(workers or os.cpu_count() or 1)
    if isinstance(scheduler, (SerialExecutor, ProcessExecutor, DaskExecutor)):
        return scheduler
    if not isinstance(scheduler, str):
        return DaskExecutor(client=scheduler)
    if scheduler == "serial":
        if workers not in (None, 1):
            raise SweepError(
                f"--scheduler serial runs one cell at a time; --workers {workers} does not apply"
            )
        return SerialExecutor()
    if scheduler == "local" or scheduler.startswith("local:"):
        text = scheduler.partition(":")[2]
        if text and not (text.isdigit() and int(text) >= 1):
            raise SweepError(f"--scheduler {scheduler!r}: N in local:N must be a whole number >= 1")
        n = int(text) if text else (workers or os.cpu_count() or 1)
        if text and workers is not None and workers != n:
            raise SweepError(
                f"--scheduler {scheduler} and --workers {workers} disagree; give one of them"
            )
        return DaskExecutor(num_workers=n)
    if "://" in scheduler:
        if workers is not None:
            raise SweepError(
                f"--workers does not apply to the existing cluster at {scheduler}; it has its own"
            )
        return DaskExecutor(address=scheduler)
    raise SweepError(
        f"--scheduler {scheduler!r} is not understood; give tcp://HOST:PORT (a Dask scheduler), "
        "local:N (a local Dask cluster), processes (the default) or serial"
    )


def plan_sweep(
    spec: SweepSpec, out_dir: str | Path, *, retry_failed: bool = False
) -> tuple[list[Cell], dict[str, dict[str, Any]]]:
    """``(cells to run, records of cells already done)``: stored ok cells are done; stored failed
    cells too unless ``retry_failed``."""
    store = CellStore(out_dir)
    todo, done = [], {}
    for cell in spec.cells:
        record = store.load(cell.key)
        if record is None or (retry_failed and record.get("status") != STATUS_OK):
            todo.append(cell)
        else:
            done[cell.key] = record
    return todo, done


def run_sweep(
    spec: SweepSpec,
    out_dir: str | Path,
    *,
    scheduler: Any = None,
    workers: int | None = None,
    retry_failed: bool = False,
    progress: bool = False,
) -> SweepOutcome:
    """Run the cells of ``spec`` not yet in ``out_dir`` and write the merged tables there.

    Writes ``cells/<key>.json`` per cell as it finishes, then ``results.parquet`` (and the
    same table as ``summary.csv``), ``pareto.csv`` and ``run.json``.

    Args:
        spec: from ``load_sweep``.
        out_dir: the sweep's folder (re-use it to resume).
        scheduler, workers: where the cells run (see the module docstring).
        retry_failed: run stored failed cells again.
        progress: a progress bar on stderr.

    Raises:
        SweepError: the scheduler cannot be used (no Dask, unreachable, bad value).
    """
    wall0 = time.perf_counter()
    out_dir = Path(out_dir)
    executor = make_executor(scheduler, workers)
    todo, records = plan_sweep(spec, out_dir, retry_failed=retry_failed)
    num_cached = len(records)
    store = CellStore(out_dir)
    plan_s = time.perf_counter() - wall0
    run_s = 0.0
    if todo:
        from tqdm.auto import tqdm

        with (
            executor,
            tqdm(
                total=len(todo),
                desc=spec.name,
                unit="cell",
                disable=None if progress else True,  # None: only on a terminal
                mininterval=0.5,
            ) as bar,
        ):
            num_bad = 0
            arriving = executor.run(todo)
            try:
                for cell, record in arriving:
                    if record["status"] != STATUS_LOST:  # a lost cell is retried by the next run
                        store.save(cell, record)
                    records[cell.key] = record
                    num_bad += record["status"] != STATUS_OK
                    bar.update(1)
                    if num_bad:
                        bar.set_postfix(failed=num_bad, refresh=False)
            # Ctrl-C or an error here: stop the workers now, not when the generator is collected
            finally:
                arriving.close()
        run_s = time.perf_counter() - wall0 - plan_s
    collect0 = time.perf_counter()
    results = results_frame(spec.cells, records)
    pareto = pareto_table(results, spec.pareto_x, spec.pareto_y, by=spec.pareto_by)
    statuses = results["status"].value_counts() if len(results) else pd.Series(dtype=int)
    outcome = SweepOutcome(
        results=results,
        pareto=pareto,
        out_dir=out_dir,
        scheduler=executor.label,
        num_cells=len(spec.cells),
        num_cached=num_cached,
        num_run=len(todo),
        num_failed=int(statuses.get(STATUS_FAILED, 0)),
        num_lost=int(statuses.get(STATUS_LOST, 0)),
        wall_s=time.perf_counter() - wall0,
    )
    _write(spec, outcome)
    outcome.phases_s = {
        "plan_s": plan_s,
        "startup_s": executor.startup_s,
        "cells_s": run_s - executor.startup_s,
        "collect_s": time.perf_counter() - collect0,
    }
    return outcome


def results_frame(cells: Iterable[Cell], records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per cell with a record, in grid order: report schema, status, cell inputs, extras."""
    rows = []
    for cell in cells:
        record = records.get(cell.key)
        if record is None:
            continue
        row = dict(record.get("summary") or {}) or {
            "trace": cell.trace_name,
            "policy": cell.policy,
            "backend": "sim",
            "capacity_bytes": cell.capacity_bytes,
        }
        for old, new in RENAMED_RANGE_COLUMNS.items():  # a record written before session 21
            if old in row:
                row[new] = row.pop(old)
        row.update(
            status=record["status"], error=record.get("error"), elapsed_s=record.get("elapsed_s")
        )
        row.update(cell_columns(cell))
        rows.append(row)
    df = pd.DataFrame(rows)
    for (
        col
    ) in df.columns:  # whole numbers with gaps (no capacity, a knob one policy lacks) stay integers
        values = [row[col] for row in rows if not _is_missing(row.get(col))]
        if df[col].dtype == np.float64 and values and all(type(v) is int for v in values):
            df[col] = df[col].astype("Int64")
    seen = set(SUMMARY_COLUMNS + STATUS_COLUMNS)
    cell_cols = [
        c for c in df.columns if c.startswith(("cell_", "param_", "option_")) and c not in seen
    ]
    rest = [c for c in df.columns if c not in seen and c not in cell_cols]
    df = df.reindex(columns=SUMMARY_COLUMNS + STATUS_COLUMNS + cell_cols + rest)
    return _arrow_safe(df)


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))


def _arrow_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Columns mixing types (a knob given as 4 in one cell and 'auto' in another) become text,
    so the table writes to Parquet."""
    for col in df.columns:
        if df[col].dtype != object:
            continue
        kinds = {type(v) for v in df[col] if not _is_missing(v)}
        if len(kinds) > 1:
            df[col] = [None if _is_missing(v) else str(v) for v in df[col]]
    return df


def _write(spec: SweepSpec, outcome: SweepOutcome) -> None:
    out = outcome.out_dir
    meta = {
        "command": "sweep",
        "sweep": str(spec.path),
        "name": spec.name,
        "mode": spec.mode,
        "scheduler": outcome.scheduler,
        "num_cells": outcome.num_cells,
        "num_cached": outcome.num_cached,
        "num_run": outcome.num_run,
        "num_failed": outcome.num_failed,
        "num_lost": outcome.num_lost,
        "wall_s": outcome.wall_s,
        "pareto": {"x": spec.pareto_x, "y": spec.pareto_y, "by": spec.pareto_by},
        "poollab_version": _cells._poollab_version(),
    }
    write_results(
        out,
        outcome.results,
        extra_tables={"results": outcome.results},
        meta=meta,
        csv_tables={"pareto": outcome.pareto},
    )
