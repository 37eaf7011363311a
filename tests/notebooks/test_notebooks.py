"""Every notebook runs top to bottom (nbclient) on small inputs injected after its parameters cell."""

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


def run(name, **params):
    """Execute a notebook with ``params`` assigned right after its ``parameters`` cell; its text outputs."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()))
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(at + 1, injected)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    texts, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
            images += "image/png" in out.get("data", {})
    return "\n".join(texts), images


@pytest.fixture(autouse=True)
def kernel_finds_the_repository(monkeypatch):
    """The kernel inherits the environment: put the repository first on its path, wherever pytest ran."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="module")
def small_alloc_trace(tmp_path_factory):
    from traces import generate_alloc_trace, write_alloc_trace

    trace = generate_alloc_trace(num_requests=4, seed=3, prompt_tokens=(32, 96), output_tokens=(4, 16))
    return write_alloc_trace(trace, tmp_path_factory.mktemp("trace") / "small.csv")


@pytest.mark.parametrize("name", ALL)
def test_notebook_is_committed_without_outputs_and_with_parameters(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1


def test_the_three_notebooks_exist():
    assert len(ALL) == 3


def test_policies_in_simulation(tmp_path):
    text, images = run("01_policies_in_simulation.ipynb", POLICIES=["best-fit", "paged"], MAX_REQUESTS=120,
                       OUT_DIR=str(tmp_path / "out"))
    assert "120 requests" in text and "KV bytes holding tokens" in text
    assert images == 6
    assert (tmp_path / "out" / "report.html").is_file()
    assert set(pd.read_csv(tmp_path / "out" / "summary.csv")["policy"]) == {"best-fit", "paged"}


def test_replay_pytorch_snapshot():
    text, images = run("02_replay_pytorch_snapshot.ipynb", POLICIES=["best-fit", "torch-caching"])
    assert "PyTorch reserved at most" in text and "vs PyTorch" in text
    assert images == 4


def test_validate_on_gpu_without_a_gpu_or_results_runs_the_host_stand_in(small_alloc_trace, tmp_path):
    text, images = run("03_validate_on_gpu.ipynb", POLICY="best-fit", TRACE=str(small_alloc_trace),
                       RESULTS_DIR=str(tmp_path / "none"), OUT_DIR=str(tmp_path / "run"))
    assert ("mode: host" in text) or ("mode: live" in text)
    assert "best-fit: pool measures agree exactly" in text
    assert images == 4
    assert (tmp_path / "run" / "summary.csv").is_file()


def test_validate_on_gpu_reads_committed_results(small_alloc_trace, tmp_path):
    from sim.replay import replay
    from sim.report import write_results
    from traces import read_alloc_trace

    trace = read_alloc_trace(small_alloc_trace)
    runs = [replay(trace, "paged", backend=b) for b in ("gpu", "sim")]
    write_results(tmp_path / "results" / "h200-paged", pd.DataFrame([r.summary for r in runs]),
                  pd.concat([r.timeseries for r in runs]))
    text, images = run("03_validate_on_gpu.ipynb", POLICY="paged", MODE="committed",
                       RESULTS_DIR=str(tmp_path / "results"))
    assert "mode: committed" in text and "h200-paged" in text
    assert "paged: pool measures agree exactly" in text
    assert images == 4
