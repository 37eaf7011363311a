from pathlib import Path

import pandas as pd
import pytest

from poollab.cli import main
from realgpu.baselines import BASELINES, available_baselines, make_baseline
from realgpu.errors import PoolError

MiB = 1 << 20


def test_the_four_baselines_are_listed():
    assert list(BASELINES) == [
        "cudaMalloc",
        "cupy.MemoryPool",
        "cupy.MemoryAsyncPool",
        "torch.cuda",
    ]


def test_unknown_baseline_is_refused_with_the_choices():
    with pytest.raises(PoolError, match="cupy.MemoryPool"):
        make_baseline("jemalloc")


def test_available_baselines_are_known_ones():
    assert set(available_baselines()) <= set(BASELINES)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name", ["cudaMalloc", "cupy.MemoryPool", "cupy.MemoryAsyncPool", "torch.cuda"]
)
def test_each_baseline_allocates_reads_reserved_and_gives_back(name):
    if name not in available_baselines():
        pytest.skip(f"{name} is not available here")
    bl = make_baseline(name)
    h = bl.alloc(3 * MiB)
    bl.note_alloc()
    assert bl.pointer(h) != 0
    assert bl.reserved_bytes() >= 3 * MiB
    counters = bl.counters()
    assert counters["peak_reserved_bytes"] >= 3 * MiB
    if bl.drop:
        del h
    else:
        bl.free(h)
    bl.close()


SNAPSHOT = (
    Path(__file__).resolve().parents[1] / "data" / "snapshots_h200" / "static_empty_cache.pickle.gz"
)


@pytest.mark.gpu
def test_torch_cuda_on_the_recorded_streams_matches_the_emulation(tmp_path):
    """Issue 14: replayed on the trace's streams, the real caching allocator reserves what
    ``torch-caching`` emulates (on one stream it had reserved 482 MiB against the emulation's
    550)."""
    if "torch.cuda" not in available_baselines():
        pytest.skip("torch with CUDA is not importable here")
    from traces.pytorch_snapshot import read_pytorch_snapshot

    assert read_pytorch_snapshot(SNAPSHOT).events["stream"].nunique() > 1, (
        "the fixture exercises several streams"
    )
    out = tmp_path / "out"
    main(
        [
            "gpu",
            "replay",
            str(SNAPSHOT),
            "-p",
            "torch-caching",
            "-b",
            "torch.cuda",
            "--sim",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    summary = pd.read_csv(out / "summary.csv").set_index(["policy", "backend"])
    real = summary.loc[("torch.cuda", "gpu"), "peak_reserved_bytes"]
    emulated = summary.loc[("torch-caching", "sim"), "peak_reserved_bytes"]
    assert real == pytest.approx(emulated, rel=0.01)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cupy.MemoryPool", "cupy.MemoryAsyncPool", "torch.cuda"])
def test_a_stream_keyed_baseline_replays_several_streams_and_restores_the_current_one(name):
    if name not in available_baselines():
        pytest.skip(f"{name} is not available here")
    import cupy

    from realgpu.replay import baseline_replay
    from traces.events import AllocTrace, make_events

    # a block freed on stream 5 is not reused by stream 0's next request: both are reserved
    ops = ["alloc", "free", "alloc", "free"]
    trace = AllocTrace(
        make_events(range(4), ops, [0, 0, 1, 1], [8 * MiB] * 4, stream=[5, 5, 0, 0]), name="two"
    )

    def current_streams():
        torch_stream = None
        if name == "torch.cuda":
            import torch

            torch_stream = torch.cuda.current_stream().cuda_stream
        return cupy.cuda.get_current_stream().ptr, torch_stream

    before = current_streams()
    row = baseline_replay(trace, name).summary
    assert (row["n_alloc"], row["n_failed"]) == (2, 0)
    assert current_streams() == before
    if name != "cupy.MemoryAsyncPool":  # the driver may reuse a completed free across streams
        assert row["peak_reserved_bytes"] >= 16 * MiB
