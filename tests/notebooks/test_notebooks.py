"""Every notebook runs top to bottom (nbclient) with its committed parameters: what a user opens
is what CI runs (issue 29: injected small parameters hid a default that stopped at cell 4).
Each takes seconds at full size, so no scaling is needed. Other modes are run with parameters
injected after the parameters cell, in tests of their own."""

import os
from pathlib import Path

import pandas as pd
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def run(name, *, after="", **params):
    """Execute a notebook, with ``params`` (if any) assigned right after its ``parameters`` cell and
    the code ``after`` (if any) run once it has finished, in its kernel; its text outputs and
    images."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    if params:
        at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()))
        injected.metadata["tags"] = ["injected-parameters"]
        nb.cells.insert(at + 1, injected)
    if after:
        nb.cells.append(nbformat.v4.new_code_cell(after))
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError naming the cell on any error
    texts, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
            images += "image/png" in out.get("data", {})
    return "\n".join(texts), images


@pytest.fixture(autouse=True)
def kernel_finds_the_repository(monkeypatch, tmp_path):
    """The kernel inherits the environment: put the repository first on its path, wherever pytest
    ran, and its temporary folders (notebook 3's default result folder) under the test's."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def cell_source(name, marker):
    """The source of the one code cell of notebook ``name`` that contains ``marker``."""
    cells = [
        c.source
        for c in nbformat.read(NOTEBOOKS / name, as_version=4).cells
        if c.cell_type == "code" and marker in c.source
    ]
    assert len(cells) == 1, f"{len(cells)} cells of {name} contain {marker!r}"
    return cells[0]


@pytest.fixture(scope="module")
def small_alloc_trace(tmp_path_factory):
    """A small allocation trace, for the test of the committed-results mode."""
    from traces import generate_alloc_trace, write_alloc_trace

    trace = generate_alloc_trace(
        num_requests=4, seed=3, prompt_tokens=(32, 96), output_tokens=(4, 16)
    )
    return write_alloc_trace(trace, tmp_path_factory.mktemp("trace") / "small.csv")


@pytest.mark.parametrize("name", ALL)
def test_notebook_is_committed_without_outputs_and_with_parameters(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1


def test_the_three_notebooks_exist():
    assert len(ALL) == 3


def test_policies_in_simulation_as_committed(tmp_path):
    """Every policy that can hold KV over the whole bundled slice; then the "keep the results"
    cell once more with ``OUT_DIR`` set, in the same kernel."""
    import policies

    out = tmp_path / "out"
    keep = cell_source("01_policies_in_simulation.ipynb", "if OUT_DIR:")
    text, images = run("01_policies_in_simulation.ipynb", after=f"OUT_DIR = {str(out)!r}\n{keep}")
    specs = policies.available(holds_kv=True)
    assert "1,482 requests" in text and f"policies: {', '.join(specs)}" in text
    assert "vmm-stitch" not in specs and "KV bytes holding tokens" in text
    assert images == 6
    assert (out / "report.html").is_file()
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary["policy"]) == specs and (summary["n_finished"] == 1482).all()


def test_replay_pytorch_snapshot_as_committed():
    import policies

    text, images = run("02_replay_pytorch_snapshot.ipynb")
    assert "PyTorch reserved at most" in text and "vs PyTorch" in text
    assert all(
        f"{name:>14}: peak reserved" in text for name in policies.available()
    )  # every registered policy
    assert images == 4


def test_validate_on_gpu_as_committed():
    """Without CUDA (CI) the cells that need the device step aside, saying so, and the rest runs
    on the host stand-in (or on committed results, where there are some)."""
    from realgpu.cuda import require_cuda
    from realgpu.errors import GpuUnavailableError

    text, images = run("03_validate_on_gpu.ipynb")
    try:
        require_cuda(0)
        has_gpu = True
    except GpuUnavailableError:
        has_gpu = False
    if not has_gpu:
        assert "GPU cells skipped (GpuUnavailableError: " in text
        assert ("mode: host" in text and "baselines: skipped" in text) or "mode: committed" in text
    else:
        assert "mode: live" in text
    assert "paged: pool measures agree exactly" in text
    assert images == 4


def test_validate_on_gpu_reads_committed_results(small_alloc_trace, tmp_path):
    from sim.replay.trace_replay import replay
    from sim.replay.schema import write_results
    from traces import read_alloc_trace

    trace = read_alloc_trace(small_alloc_trace)
    runs = [replay(trace, "paged", backend=b) for b in ("gpu", "sim")]
    write_results(
        tmp_path / "results" / "h200-paged",
        pd.DataFrame([r.summary for r in runs]),
        pd.concat([r.timeseries for r in runs]),
    )
    text, images = run(
        "03_validate_on_gpu.ipynb",
        POLICY="paged",
        MODE="committed",
        RESULTS_DIR=str(tmp_path / "results"),
    )
    assert "mode: committed" in text and "h200-paged" in text
    assert "paged: pool measures agree exactly" in text
    assert images == 4
