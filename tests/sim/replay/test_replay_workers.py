"""Several policies over one trace: one event table shared by the runs, in worker processes or
not, and the same summaries as before the table and the workers existed."""

from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from poollab.cli import cli
from sim.replay.trace_replay import replay, replay_tables, trace_events
from traces import bundled_path, read_alloc_trace

FIVE = ["best-fit", "paged", "torch-caching", "expandable", "vmm-stitch"]
#: The bundled slice's summary under FIVE from the code before the shared table and the workers
#: (commit 5bcbb02), every column that is no measured time. Regenerate it only for a change
#: that is meant to alter results, and say so in the commit.
EXPECTED = Path(__file__).parents[1] / "data" / "llama1b_slice_five_policies_summary.csv"


def _untimed(summary: pd.DataFrame) -> pd.DataFrame:
    expected = pd.read_csv(EXPECTED)
    return summary[expected.columns].reset_index(drop=True)


@pytest.fixture(scope="module")
def slice_trace():
    return read_alloc_trace(bundled_path("llama1b_generate_slice.pickle.gz"))


@pytest.mark.parametrize("workers", [1, 2])
def test_replay_command_summary_is_the_one_from_before_in_every_untimed_column(tmp_path, workers):
    out = tmp_path / "out"
    args = [
        "replay",
        str(bundled_path("llama1b_generate_slice.pickle.gz")),
        "--workers",
        str(workers),
        "--out",
        str(out),
        "--no-progress",
    ] + [a for spec in FIVE for a in ("-p", spec)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    got = pd.read_csv(out / "summary.csv")
    pd.testing.assert_frame_equal(
        _untimed(got), pd.read_csv(EXPECTED), check_exact=False, rtol=1e-12
    )


def test_workers_give_the_tables_of_one_process(slice_trace):
    specs = ["best-fit", "paged", "size-class"]
    one = replay_tables(slice_trace, specs, workers=1)
    two = replay_tables(slice_trace, specs, workers=2)
    timing = [c for c in one.summary.columns if c.endswith("_us") or c.endswith("_s")]
    pd.testing.assert_frame_equal(
        one.summary.drop(columns=timing), two.summary.drop(columns=timing)
    )
    pd.testing.assert_frame_equal(one.timeseries, two.timeseries)
    assert list(two.latency_samples.columns) == list(one.latency_samples.columns)
    assert len(two.latency_samples) == len(
        one.latency_samples
    )  # the same sampled calls, timed elsewhere


def test_a_worker_error_surfaces_in_the_caller(slice_trace):
    with pytest.raises(Exception, match="no-such-policy"):
        replay_tables(slice_trace, ["best-fit", "no-such-policy"], workers=2, with_bounds=False)


def test_the_event_table_is_compact_and_replays_as_the_trace_does(slice_trace):
    ev = trace_events(slice_trace)
    n = len(slice_trace)
    for column in (ev.keys, ev.sizes, ev.streams, ev.times_us):
        assert (
            len(column) == n and column.itemsize == 8
        )  # array('q'): 8 bytes an event, no int objects
    assert ev.keys.tolist() == slice_trace.events["alloc_id"].tolist()
    shared = replay(slice_trace, "best-fit", events=ev).summary
    own = replay(slice_trace, "best-fit").summary
    assert {k: v for k, v in shared.items() if not k.endswith(("_us", "_s"))} == {
        k: v for k, v in own.items() if not k.endswith(("_us", "_s"))
    }


def _worker_gc_state(job: int):
    """A job that reports its worker's collector state (forked workers find it by name)."""
    import gc

    return gc.get_threshold()[0], gc.get_freeze_count()


def test_workers_collect_less_often_and_the_parent_unfreezes_after(slice_trace, monkeypatch):
    import gc

    from sim.replay import trace_replay

    monkeypatch.setattr(trace_replay, "_worker_job", _worker_gc_state)
    events = trace_events(slice_trace)
    assert gc.get_freeze_count() == 0
    results, _ = trace_replay._replay_in_workers(
        slice_trace, events, ["paged", "best-fit"], {}, False, 2, False
    )
    assert gc.get_freeze_count() == 0  # unfrozen once the workers are done
    for threshold, frozen in results:
        assert threshold == trace_replay.WORKER_GC_THRESHOLD
        assert frozen > 0  # the parent's objects, inherited frozen
    assert gc.get_threshold()[0] != trace_replay.WORKER_GC_THRESHOLD  # this process's untouched


def test_a_callers_own_frozen_objects_stay_frozen(slice_trace):
    import gc

    gc.freeze()
    try:
        replay_tables(slice_trace, ["paged", "best-fit"], workers=2, with_bounds=False)
        # not unfrozen (which would empty it; frozen objects freed since leave it too)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
