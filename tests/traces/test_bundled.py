import gzip
import importlib.util
import pickle

import pytest

from traces.bundled import bundled_names, bundled_path
from traces.events import PRE_TRACE_TAG, validate_events
from traces.info import live_bytes
from traces.pytorch_snapshot import read_pytorch_snapshot

SNAPSHOT = "llama1b_generate_slice.pickle.gz"
AZURE = "azure_code_slice.csv"


def _make_slices():
    path = bundled_path(SNAPSHOT).parent / "make_slices.py"
    spec = importlib.util.spec_from_file_location("make_slices", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def slice_trace():
    return read_pytorch_snapshot(bundled_path(SNAPSHOT))


def test_both_slices_are_bundled():
    assert set(bundled_names()) >= {SNAPSHOT, AZURE}


def test_unknown_name_lists_what_is_there():
    with pytest.raises(FileNotFoundError, match=AZURE):
        bundled_path("nope.csv")


def test_snapshot_slice_is_small():
    assert bundled_path(SNAPSHOT).stat().st_size < 400_000


def test_snapshot_slice_keeps_the_snapshot_keys():
    with gzip.open(bundled_path(SNAPSHOT)) as f:
        snap = pickle.load(f)
    assert set(snap) == {"segments", "device_traces", "allocator_settings", "external_annotations"}


def test_snapshot_slice_reads_as_a_valid_trace(slice_trace):
    validate_events(slice_trace.events, SNAPSHOT)
    assert (slice_trace.events["tag"] == PRE_TRACE_TAG).sum() == 149


def test_snapshot_slice_segments_agree_with_the_trace(slice_trace):
    # every block active in the rebuilt segments is live at the end of the replay
    with gzip.open(bundled_path(SNAPSHOT)) as f:
        snap = pickle.load(f)
    active_bytes = sum(
        b["requested_size"]
        for s in snap["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    )
    assert active_bytes == live_bytes(slice_trace)[-1]
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]


def test_snapshot_slice_reserved_never_exceeds_the_full_run(slice_trace):
    assert slice_trace.meta["recorded_peak_reserved_bytes"] <= 2_214_592_512


def test_azure_slice_spans_ten_minutes():
    import pandas as pd

    df = pd.read_csv(bundled_path(AZURE))
    assert list(df.columns) == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
    span = pd.to_datetime(df["TIMESTAMP"]).agg(["min", "max"])
    assert pd.Timedelta(minutes=9) < span["max"] - span["min"] < pd.Timedelta(minutes=10)


def test_azure_slice_is_the_head_of_the_real_trace(real_azure_path):
    real = real_azure_path
    ours = bundled_path(AZURE).read_text().splitlines()
    assert real.read_text().splitlines()[: len(ours)] == ours


def test_make_slices_reproduces_the_bundled_files(real_snapshot_path, real_azure_path, tmp_path):
    make_slices = _make_slices()
    make_slices.slice_snapshot(real_snapshot_path, tmp_path / SNAPSHOT)
    make_slices.slice_azure(real_azure_path, tmp_path / AZURE)
    assert (tmp_path / SNAPSHOT).read_bytes() == bundled_path(SNAPSHOT).read_bytes()
    assert (tmp_path / AZURE).read_bytes() == bundled_path(AZURE).read_bytes()


MOONCAKE = "mooncake_conversation_slice.jsonl"


def test_mooncake_slice_is_ten_minutes_of_the_conversation_trace_under_1_mb():
    from traces.request_readers import read_request_trace

    path = bundled_path(MOONCAKE)
    assert path.stat().st_size < 1_000_000
    trace = read_request_trace(path)
    assert trace.format == "mooncake" and trace.meta["hash_block_tokens"] == 512
    assert len(trace) == 1_750 and 590 < trace.duration_s < 600
    assert (
        trace.requests["prompt_tokens"].median() > 4_000
    )  # long prompts: what the Azure slice lacks


def test_slice_mooncake_keeps_lines_before_the_cut_unchanged(tmp_path):
    lines = [
        f'{{"timestamp": {t}, "input_length": 10, "output_length": 2, "hash_ids": [0]}}\n'
        for t in (0, 59_999, 60_000, 120_000)
    ]
    src = tmp_path / "trace.jsonl"
    src.write_text("".join(lines))
    n = _make_slices().slice_mooncake(src, tmp_path / "out.jsonl", minutes=1)
    assert n == 2 and (tmp_path / "out.jsonl").read_text() == "".join(lines[:2])
