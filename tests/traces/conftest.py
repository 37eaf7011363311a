"""Fixtures for the allocation-trace tests: the real traces (skipped when absent) and snapshot
files."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pytest

#: CI keeps the real data next to the repository: ``<repo>/../shared/data/traces``.
SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
REAL_SNAPSHOT = SHARED_TRACES / "llama1b_generate_mixed.pickle.gz"
REAL_AZURE = SHARED_TRACES / "AzureLLMInferenceTrace_code.csv"


@pytest.fixture(scope="session")
def real_snapshot_path() -> Path:
    if not REAL_SNAPSHOT.is_file():
        pytest.skip(f"real snapshot not present at {REAL_SNAPSHOT}")
    return REAL_SNAPSHOT


@pytest.fixture(scope="session")
def real_azure_path() -> Path:
    if not REAL_AZURE.is_file():
        pytest.skip(f"real Azure trace not present at {REAL_AZURE}")
    return REAL_AZURE


@pytest.fixture(scope="session")
def real_snapshot(real_snapshot_path):
    """The real snapshot read once per session (about a second)."""
    from traces.pytorch_snapshot import read_pytorch_snapshot

    return read_pytorch_snapshot(real_snapshot_path)


@pytest.fixture
def write_snapshot(tmp_path):
    """``write_snapshot(entries, segments=(), name=..., gz=True, devices=None) -> Path``."""

    def write(
        entries, segments=(), *, name="snap.pickle.gz", gz=True, device_traces=None, **extra
    ) -> Path:
        snap = {
            "segments": list(segments),
            "device_traces": device_traces if device_traces is not None else [list(entries)],
            "allocator_settings": {"expandable_segments": False},
            **extra,
        }
        path = tmp_path / name
        data = pickle.dumps(snap, protocol=4)
        path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
        return path

    return write


@pytest.fixture
def snap_entry():
    """``snap_entry(action, addr, size, time_us, stream=0) -> dict``: a trace entry shaped like
    PyTorch's."""

    def entry(action: str, addr: int, size: int, time_us: int, stream: int = 0, **extra) -> dict:
        return {
            "action": action,
            "addr": addr,
            "size": size,
            "stream": stream,
            "time_us": time_us,
            "compile_context": "N/A",
            "user_metadata": "",
            **extra,
        }

    return entry
