"""PyTorch's recorded layout (``sim.replay.layout.pytorch_layout``): segments from the
snapshot's segment events, and the gaps between the live blocks at their recorded addresses."""

from __future__ import annotations

import numpy as np
import pandas as pd

from sim.replay.layout import pytorch_layout
from traces.detect import read_alloc_trace

SNAPSHOT = "traces/data/llama1b_generate_slice.pickle.gz"


def test_segments_minus_gaps_are_the_live_bytes_after_each_sampled_event():
    trace = read_alloc_trace(SNAPSHOT)
    ev = trace.events
    live_after = np.where(
        ev["op"] == "alloc", ev["nbytes"], np.where(ev["op"] == "free", -ev["nbytes"], 0)
    ).cumsum()
    picks = np.linspace(0, len(ev) - 1, 25).astype(int)
    samples = list(zip(picks.tolist(), ev["time_us"].to_numpy()[picks].tolist()))
    lay = pytorch_layout(trace.meta, samples, ev)
    for (sample, event), rows in lay.groupby(["sample", "event"]):
        segs = rows[rows["kind"] == "segment"]
        gaps = rows[rows["kind"] == "free"]
        assert segs["length_bytes"].sum() - gaps["length_bytes"].sum() == live_after[event]
        # every gap lies inside one segment
        ends = segs["offset_bytes"] + segs["length_bytes"]
        for off, n in gaps[["offset_bytes", "length_bytes"]].itertuples(index=False):
            assert ((segs["offset_bytes"] <= off) & (off + n <= ends)).sum() == 1


def test_without_the_event_table_only_segments_are_rebuilt():
    trace = read_alloc_trace(SNAPSHOT)
    lay = pytorch_layout(trace.meta, [(10, int(trace.events["time_us"].iat[10]))])
    assert set(lay["kind"]) == {"segment"}
    # a trace whose events no longer match the addresses (sliced, say) gets segments only too
    lay = pytorch_layout(
        trace.meta, [(10, int(trace.events["time_us"].iat[10]))], trace.events.iloc[:20]
    )
    assert set(lay["kind"]) == {"segment"}
    assert isinstance(lay, pd.DataFrame)
