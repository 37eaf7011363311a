import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import policies
from realgpu.errors import CorruptionError
from realgpu.replay import gpu_replay
from sim.replay.trace_replay import replay
from sim.replay.schema import SUMMARY_COLUMNS, summary_frame
from traces.events import AllocTrace, make_events

MiB = 1 << 20

#: what the simulated and the device replay must agree on exactly (they share the bookkeeping)
SHARED = [
    "n_alloc",
    "n_free",
    "n_failed",
    "peak_live_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "frag_ext_mean",
    "frag_ext_max",
    "internal_waste_frac",
    "n_grow",
    "n_shrink",
    "grown_bytes",
    "shrunk_bytes",
]


def make_trace(ops, name="t"):
    """``ops``: (op, id, nbytes) tuples, in order."""
    return AllocTrace(
        make_events(
            range(len(ops)), [o for o, _, _ in ops], [i for _, i, _ in ops], [n for _, _, n in ops]
        ),
        name=name,
    )


def random_trace(seed, num_allocs=400, max_live=40, max_bytes=6 * MiB, name="random"):
    """Allocations of log-uniform sizes (512 B .. ``max_bytes``), freed in random order, some
    never."""
    rng = np.random.default_rng(seed)
    ops, live = [], []
    for ident in range(num_allocs):
        if live and (len(live) >= max_live or rng.random() < 0.45):
            victim = live.pop(int(rng.integers(len(live))))
            ops.append(("free", victim[0], victim[1]))
        size = int(np.exp(rng.uniform(np.log(512), np.log(max_bytes))))
        live.append((ident, size))
        ops.append(("alloc", ident, size))
    return make_trace(ops, name=name)


def _agree(sim_row, gpu_row):
    return {k: (sim_row[k], gpu_row[k]) for k in SHARED if sim_row[k] != gpu_row[k]}


# page-mapped policies run on the cuMem backend (issue 13), not on the segment backends
@pytest.mark.parametrize(
    "spec", [n for n in policies.available() if policies.registry.device_kind(n) == "segment"]
)
def test_device_replay_agrees_with_the_simulator_on_a_random_trace(spec):
    trace = random_trace(1)
    sim_row = replay(trace, spec, sample_every=7).summary
    gpu_row = gpu_replay(trace, spec, backend="host", sample_every=7).summary
    assert _agree(sim_row, gpu_row) == {}


@pytest.mark.parametrize("spec", ["first-fit", "size-class", "paged"])
def test_device_replay_agrees_on_failures_under_a_tight_capacity(spec):
    trace = random_trace(2, max_live=60)
    capacity = 48 * MiB
    sim_row = replay(trace, spec, capacity_bytes=capacity, sample_every=5).summary
    gpu_row = gpu_replay(
        trace, spec, backend="host", capacity_bytes=capacity, sample_every=5
    ).summary
    assert sim_row["n_failed"] > 0
    assert _agree(sim_row, gpu_row) == {}


def test_device_replay_agrees_on_the_bundled_snapshot(bundled_snapshot):
    sim_row = replay(bundled_snapshot, "best-fit").summary
    gpu_row = gpu_replay(bundled_snapshot, "best-fit", backend="host").summary
    assert _agree(sim_row, gpu_row) == {}
    assert gpu_row["peak_live_bytes"] > 1 << 30


def test_rows_fit_the_report_schema_with_backend_gpu():
    result = gpu_replay(random_trace(3, num_allocs=50), "paged", backend="host")
    frame = summary_frame([result.summary])
    assert list(frame.columns[: len(SUMMARY_COLUMNS)]) == SUMMARY_COLUMNS
    row = result.summary
    assert (row["backend"], row["kind"], row["device"]) == ("gpu", "policy", "host")
    assert set(result.timeseries["backend"]) == {"gpu"}
    assert row["device_mallocs"] == row["n_grow"] and row["device_frees"] == row["n_shrink"]


def test_replay_releases_every_segment_at_the_end():
    trace = random_trace(4, num_allocs=60)
    result = gpu_replay(trace, "first-fit", backend="host")
    assert result.summary["device_mallocs"] >= 1
    assert result.policy.reserved_bytes == 0 and result.policy.device.used_bytes == 0


def test_validated_replay_agrees_and_finds_no_corruption():
    trace = random_trace(5, num_allocs=150)
    plain = gpu_replay(trace, "size-class", backend="host", sample_every=3).summary
    checked = gpu_replay(trace, "size-class", backend="host", validate=True, sample_every=3).summary
    assert _agree(plain, checked) == {} and checked["validate"] is True


def test_compaction_moves_bytes_with_the_allocations_during_a_validated_replay():
    trace = random_trace(2, max_live=60)
    sim_row = replay(trace, "compacting", capacity_bytes=48 * MiB, sample_every=3).summary
    gpu_row = gpu_replay(
        trace, "compacting", backend="host", capacity_bytes=48 * MiB, validate=True, sample_every=3
    ).summary
    assert gpu_row["moved_bytes"] > 0  # allocations moved, their patterns went with them
    assert _agree(sim_row, gpu_row) == {}


def test_validated_replay_stops_at_a_policy_that_overlaps(overlapping_policy):
    trace = make_trace(
        [("alloc", 1, 8192), ("alloc", 2, 1024), ("free", 1, 8192), ("free", 2, 1024)]
    )
    with pytest.raises(CorruptionError, match="live allocation"):
        gpu_replay(trace, overlapping_policy, backend="host", validate=True)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    spec=st.sampled_from(["first-fit", "best-fit", "size-class", "paged"]),
    capacity=st.sampled_from([None, 24 * MiB, 64 * MiB]),
)
def test_agreement_holds_for_any_trace_and_capacity(seed, spec, capacity):
    trace = random_trace(seed, num_allocs=120, max_bytes=4 * MiB)
    sim_row = replay(trace, spec, capacity_bytes=capacity, sample_every=4).summary
    gpu_row = gpu_replay(
        trace, spec, backend="host", capacity_bytes=capacity, sample_every=4
    ).summary
    assert _agree(sim_row, gpu_row) == {}


# ---------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["best-fit", "paged"])
def test_cuda_replay_agrees_with_the_simulator(spec):
    trace = random_trace(11)
    sim_row = replay(trace, spec, capacity_bytes=1 << 30, sample_every=3).summary
    gpu_row = gpu_replay(trace, spec, capacity_bytes=1 << 30, sample_every=3).summary
    assert _agree(sim_row, gpu_row) == {}
    assert gpu_row["nvml_peak_used_bytes"] >= gpu_row["nvml_base_used_bytes"] + gpu_row[
        "peak_reserved_bytes"
    ] - (2 << 20)
    assert gpu_row["driver_ns_total"] > 0


@pytest.mark.gpu
def test_cuda_validated_replay_finds_no_corruption():
    trace = random_trace(12, num_allocs=200)
    row = gpu_replay(trace, "size-class", capacity_bytes=1 << 30, validate=True).summary
    assert row["validate"] is True and row["n_failed"] == 0


@pytest.mark.gpu
def test_every_available_baseline_replays_a_trace():
    from realgpu.baselines import available_baselines
    from realgpu.replay import baseline_replay

    trace = random_trace(13, num_allocs=150)
    for name in available_baselines():
        result = baseline_replay(trace, name)
        row = result.summary
        assert (row["policy"], row["backend"], row["kind"], row["n_failed"]) == (
            name,
            "gpu",
            "baseline",
            0,
        )
        assert row["peak_reserved_bytes"] >= row["peak_live_bytes"] > 0
        assert row["n_alloc"] == 150 and len(result.alloc_ns) == 150
        summary_frame([row])


class _HostBaseline:
    """A stand-in baseline on host memory (the CUDA ones need a GPU): every request its own
    array, nothing cached; ``drop`` picks how a free happens, as the real baselines do."""

    name = "host.malloc"
    oom_errors = (MemoryError,)
    keys_by_stream = False
    empty_cache = None  # caches nothing

    def __init__(self, *, drop: bool, limit_bytes: int | None = None):
        self.drop = drop
        self.limit_bytes = limit_bytes
        self._live: dict[int, int] = {}
        self.peak = self.n_malloc = self.n_free = 0
        self.closed = False
        self.free = None if drop else self._free

    def alloc(self, nbytes: int):
        if self.limit_bytes is not None and sum(self._live.values()) + nbytes > self.limit_bytes:
            raise MemoryError(nbytes)
        buf = np.zeros(nbytes, dtype=np.uint8)
        self._live[id(buf)] = nbytes
        self.n_malloc += 1
        if self.drop:  # freed when the last reference goes, like a CuPy pointer
            import weakref

            weakref.finalize(buf, self._dropped, id(buf))
        return buf

    def _dropped(self, key: int) -> None:
        del self._live[key]
        self.n_free += 1

    def _free(self, buf) -> None:
        self._dropped(id(buf))

    def pointer(self, buf) -> int:
        return buf.ctypes.data

    def note_alloc(self) -> None:
        self.peak = max(self.peak, sum(self._live.values()))

    def reserved_bytes(self) -> int:
        return sum(self._live.values())

    def allocated_bytes(self) -> float:
        return float("nan")

    def counters(self) -> dict:
        return {
            "peak_allocated_bytes": float("nan"),
            "peak_reserved_bytes": self.peak,
            "n_grow": self.n_malloc,
            "n_shrink": self.n_free,
        }

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("drop", [False, True])
def test_a_baseline_runs_on_the_same_engine_and_row_as_a_policy(drop):
    """The baseline path (no GPU needed with a host stand-in): same loop, same summary_row."""
    from realgpu.replay import _baseline_run

    trace = random_trace(3, num_allocs=200)
    bl = _HostBaseline(drop=drop)
    touched = []
    result = _baseline_run(
        trace,
        bl,
        watch=None,
        touch=lambda ptr, n: touched.append(n),
        sample_every=7,
        progress=False,
        device="host",
        synchronize=lambda: None,
        timer=time_ns_counter(),
    )
    row = result.summary
    summary_frame([row])
    sim = replay(trace, "best-fit", sample_every=7).summary
    assert (row["n_alloc"], row["n_free"], row["n_failed"], row["peak_live_bytes"]) == (
        sim["n_alloc"],
        sim["n_free"],
        sim["n_failed"],
        sim["peak_live_bytes"],
    )
    # nothing cached: every byte reserved is a live byte, and every allocation was touched once
    assert row["peak_reserved_bytes"] == row["peak_live_bytes"] and row["overhead"] == 0.0
    assert len(touched) == row["n_alloc"] and row["device_mallocs"] == row["n_alloc"]
    assert row["device_frees"] == row["n_free"], "a free (or drop) happens inside the replay"
    assert np.isnan(row["frag_ext_mean"]) and np.isnan(row["internal_waste_frac"])
    assert row["kind"] == "baseline" and bl.closed
    assert len(result.alloc_ns) == row["n_alloc"] and (result.free_ns > 0).all()
    assert list(result.timeseries["event"]) == list(
        replay(trace, "best-fit", sample_every=7).timeseries["event"]
    )


def test_a_baseline_refusal_is_counted_and_its_free_skipped():
    from realgpu.replay import _baseline_run

    ops = [("alloc", 1, 3 * MiB), ("alloc", 2, 3 * MiB), ("free", 2, 3 * MiB), ("free", 1, 3 * MiB)]
    bl = _HostBaseline(drop=False, limit_bytes=4 * MiB)
    row = _baseline_run(
        make_trace(ops),
        bl,
        watch=None,
        touch=lambda ptr, n: None,
        sample_every=1,
        progress=False,
        device="host",
        synchronize=lambda: None,
        timer=time_ns_counter(),
    ).summary
    assert (row["n_alloc"], row["n_failed"], row["n_free"], row["failure_rate"]) == (2, 1, 1, 0.5)


@pytest.mark.parametrize("drop", [False, True])
def test_a_long_baseline_replay_counts_every_free_though_it_times_a_sample(drop):
    """Past 20,000 events the engine times a sample of the calls; the row's counts are still
    every call's (a free count taken from the timed frees would be short)."""
    from realgpu.replay import _baseline_run
    from sim.replay.engine import LATENCY_SAMPLE_CALLS

    num_allocs = LATENCY_SAMPLE_CALLS  # twice as many events with the frees
    ops = [("alloc", i, 64) for i in range(num_allocs)] + [
        ("free", i, 64) for i in range(num_allocs - 10)
    ]
    bl = _HostBaseline(drop=drop)
    result = _baseline_run(
        make_trace(ops),
        bl,
        watch=None,
        touch=lambda ptr, n: None,
        sample_every=1000,
        progress=False,
        device="host",
        synchronize=lambda: None,
        timer=time_ns_counter(),
    )
    row = result.summary
    assert (row["n_alloc"], row["n_free"], row["n_failed"]) == (num_allocs, num_allocs - 10, 0)
    assert row["device_frees"] == row["n_free"]
    assert len(result.free_ns) < row["n_free"] and 0.4 < row["latency_sampled_frac"] < 0.6


class _HostStreamBaseline(_HostBaseline):
    """The stand-in, caching per stream: it logs the stream current at each allocation and at
    each switch, and reads the timer in ``use_stream`` so a switch inside a timed call would
    show."""

    keys_by_stream = True

    def __init__(self, timer):
        super().__init__(drop=False)
        self.timer = timer
        self.stream = 0
        self.alloc_streams: dict[int, int] = {}  # id(buf) -> stream current when it was made
        self.num_switches = 0

    def use_stream(self, stream_id: int) -> None:
        self.timer()
        self.stream = stream_id
        self.num_switches += 1

    def alloc(self, nbytes: int):
        buf = super().alloc(nbytes)
        self.alloc_streams[id(buf)] = self.stream
        return buf


def test_a_stream_keyed_baseline_allocates_each_request_on_its_recorded_stream():
    """Issue 14: the baseline replays the trace's streams (stream 0 is the starting stream), the
    switches happen between events (no timed call includes one) and the starting stream is
    current again at the end."""
    from realgpu.replay import _baseline_run

    streams = [0, 7, 7, 0, 7, 0, 0, 9, 9, 0]
    ops, stream_of = [], []
    for ident, stream in enumerate(streams):
        ops.append(("alloc", ident, (ident + 1) * 512))
        stream_of.append(stream)
    for ident, stream in enumerate(streams):  # frees recorded on their allocation's stream
        ops.append(("free", ident, (ident + 1) * 512))
        stream_of.append(stream)
    trace = AllocTrace(
        make_events(
            range(len(ops)),
            [o for o, _, _ in ops],
            [i for _, i, _ in ops],
            [n for _, _, n in ops],
            stream=stream_of,
        ),
        name="streams",
    )
    timer = time_ns_counter()
    bl = _HostStreamBaseline(timer)
    made: list[tuple[int, int]] = []  # (bytes, stream current when made), in allocation order
    original_alloc = bl.alloc

    def alloc(nbytes):
        buf = original_alloc(nbytes)
        made.append((nbytes, bl.alloc_streams[id(buf)]))
        return buf

    bl.alloc = alloc
    result = _baseline_run(
        trace,
        bl,
        watch=None,
        touch=lambda ptr, n: None,
        sample_every=1,
        progress=False,
        device="host",
        synchronize=lambda: None,
        timer=timer,
    )
    assert made == [((ident + 1) * 512, stream) for ident, stream in enumerate(streams)]
    assert bl.num_switches == 6 + 1, (
        "one switch per change of stream between allocations, one back at the end"
    )
    assert bl.stream == 0
    # the test clock advances 1 us a read: a switch read inside a timed call would make it 2 us
    assert (result.alloc_ns == 1000).all() and (result.free_ns == 1000).all()


def test_a_one_stream_trace_switches_no_stream():
    from realgpu.replay import _baseline_run

    timer = time_ns_counter()
    bl = _HostStreamBaseline(timer)
    _baseline_run(
        random_trace(5, num_allocs=50),
        bl,
        watch=None,
        touch=lambda ptr, n: None,
        sample_every=1,
        progress=False,
        device="host",
        synchronize=lambda: None,
        timer=timer,
    )
    assert set(bl.alloc_streams.values()) == {0} and bl.num_switches == 1  # the restore at the end


def time_ns_counter():
    """A clock that advances 1 us a read: latencies are positive and exact."""
    import itertools

    ticks = itertools.count(0, 1000)
    return lambda: next(ticks)


@pytest.mark.parametrize("backend", ["host", "host-vmm"])
def test_a_real_device_declares_its_clock_and_kind_so_the_replay_reads_them(backend):
    """The replay loop reads a real device's driver time off the clock it declares (measured
    time only: never pending), and its row's ``device_kind`` is the device's declaration."""
    from policies.device_kind import DeviceKind
    from realgpu.pool import GpuPool
    from sim.replay.engine import policy_target

    with GpuPool("best-fit", backend=backend) as pool:
        assert policy_target(pool.policy).driver_clock is pool.device.clock
        assert pool.device.device_kind is DeviceKind.of_backend(backend)
    row = gpu_replay(
        make_trace([("alloc", 1, 4096), ("free", 1, 4096)]), "best-fit", backend=backend
    ).summary
    assert row["device_kind"] == DeviceKind.of_backend(backend).value and row["driver_ns_total"] > 0


def test_replay_tables_pair_each_policy_with_its_simulated_twin():
    from realgpu.replay import gpu_replay_tables

    trace = random_trace(3, num_allocs=120)
    tables = gpu_replay_tables(
        trace, ["paged", "first-fit"], backend="host", with_sim=True, capacity_bytes=256 * MiB
    )
    summary = tables.summary
    assert list(zip(summary["policy"], summary["backend"])) == [
        ("paged", "gpu"),
        ("paged", "sim"),
        ("first-fit", "gpu"),
        ("first-fit", "sim"),
    ]
    for real, sim in (
        (0, 1),
        (2, 3),
    ):  # the twin replays at the capacity the real run had, to the same result
        assert summary["capacity_bytes"].iloc[real] == summary["capacity_bytes"].iloc[sim]
        assert _agree(summary.iloc[sim], summary.iloc[real]) == {}
    assert set(tables.timeseries["backend"]) == {"gpu", "sim"}
    assert len(tables.latency_samples) > 0


def test_replay_tables_on_mapped_pages_give_the_twin_a_page_mapped_device():
    from realgpu.replay import gpu_replay_tables

    tables = gpu_replay_tables(
        random_trace(4, num_allocs=80),
        ["best-fit"],
        backend="host",
        device_kind="vmm",
        with_sim=True,
        capacity_bytes=256 * MiB,
    )
    assert list(tables.summary["device_kind"]) == ["page-mapped", "page-mapped"]
