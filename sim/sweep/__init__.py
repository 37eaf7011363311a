"""Sweeps: policy x parameter x capacity x trace grids (and models, GPUs, rates for simulations).

``load_sweep("sweep.yaml")`` expands a SWEEP.yaml into independent cells; ``run_sweep(spec, out)``
runs those not yet stored in ``out`` (a local process pool, or Dask distributed) and merges
every cell's report row and inputs into ``results.parquet``; ``pareto_front(df, x, y)`` finds
the configurations no other beats on both axes.
"""

from sim.sweep.cells import Cell, FileRef, cell_columns, cell_key, file_ref, run_cell
from sim.sweep.errors import SweepError, SweepSpecError
from sim.sweep.pareto import format_fronts, pareto_front, pareto_mask, pareto_table
from sim.sweep.runner import (
    STATUS_COLUMNS,
    SweepOutcome,
    make_executor,
    plan_sweep,
    results_frame,
    run_sweep,
)
from sim.sweep.spec import SweepSpec, load_sweep, parse_sweep

__all__ = [
    "Cell",
    "FileRef",
    "cell_columns",
    "cell_key",
    "file_ref",
    "run_cell",
    "SweepError",
    "SweepSpecError",
    "format_fronts",
    "pareto_front",
    "pareto_mask",
    "pareto_table",
    "STATUS_COLUMNS",
    "SweepOutcome",
    "make_executor",
    "plan_sweep",
    "results_frame",
    "run_sweep",
    "SweepSpec",
    "load_sweep",
    "parse_sweep",
]
