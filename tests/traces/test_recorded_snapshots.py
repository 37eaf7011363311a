"""The H200 snapshots of server patterns (CUDA-graph pools, expandable segments, empty_cache) read
right."""

import collections
import gzip
import json
import pickle
from pathlib import Path

import pytest

from traces import read_alloc_trace
from traces.events import PRE_TRACE_TAG

HERE = Path(__file__).resolve().parents[1] / "data" / "snapshots_h200"
NAMES = ["graphs", "expandable", "static_empty_cache"]


def _raw(name):
    with gzip.open(HERE / f"{name}.pickle.gz") as f:
        return pickle.load(f)


@pytest.mark.parametrize("name", NAMES)
def test_every_recorded_request_becomes_one_event(name):
    snap = _raw(name)
    actions = collections.Counter(e["action"] for t in snap["device_traces"] for e in t)
    ev = read_alloc_trace(HERE / f"{name}.pickle.gz").events
    in_trace = ev["tag"] != PRE_TRACE_TAG
    assert ((ev["op"] == "alloc") & in_trace).sum() == actions["alloc"]
    assert ((ev["op"] == "free") & in_trace).sum() == actions["free_completed"]


@pytest.mark.parametrize("name", NAMES)
def test_peak_live_is_within_what_torch_allocated(name):
    """Requested bytes live at once never exceed torch's own peak of (rounded) allocated bytes."""
    meta = json.loads((HERE / f"{name}.json").read_text())
    ev = read_alloc_trace(HERE / f"{name}.pickle.gz").events
    sign = ev["op"].map({"alloc": 1, "free": -1})
    peak_live = int((sign * ev["nbytes"]).cumsum().max())
    assert 0.9 * meta["peak_allocated_bytes"] <= peak_live <= meta["peak_allocated_bytes"]


def test_the_server_patterns_are_in_the_recordings():
    graphs, expandable, empty = (_raw(n) for n in NAMES)
    # one shared private graph pool besides the default pool
    assert {str(s["segment_pool_id"]) for s in graphs["segments"]} == {"(0, 0)", "(0, 1)"}
    assert all(s["is_expandable"] for s in expandable["segments"])
    assert any(e["action"] == "segment_map" for t in expandable["device_traces"] for e in t)
    # empty_cache(): a run of segment frees with no allocation between them
    actions = [e["action"] for t in empty["device_traces"] for e in t]
    runs = [
        len(r)
        for r in "".join("F" if a == "segment_free" else "." for a in actions).split(".")
        if r
    ]
    assert max(runs) >= 4
