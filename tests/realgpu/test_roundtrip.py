import pytest

from realgpu.pool import GpuPool
from realgpu.roundtrip import pool_roundtrip, time_roundtrips

MiB = 1 << 20


@pytest.mark.parametrize("path", ["allocate", "malloc"])
def test_pool_round_trips_leave_nothing_live(path):
    pool = GpuPool("size-class", backend="host")
    row = pool_roundtrip(pool, MiB, path=path, iterations=500, warmup=10)
    assert (row["allocator"], row["path"], row["nbytes"], row["iterations"]) == (
        "size-class",
        path,
        MiB,
        500,
    )
    assert 0 < row["p50_us"] <= row["p99_us"]
    assert pool.policy.num_allocs == 510 and pool.policy.num_live == 0


def test_round_trip_times_every_iteration_after_warmup():
    calls = []
    samples = time_roundtrips(
        lambda n: calls.append(n) or n, lambda h: None, 64, iterations=7, warmup=3
    )
    assert samples.shape == (7,) and (samples >= 0).all() and calls == [64] * 10


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path"):
        pool_roundtrip(GpuPool("paged", backend="host"), MiB, path="mmap")


@pytest.mark.gpu
def test_round_trips_on_the_device_against_a_baseline():
    from realgpu.baselines import make_baseline
    from realgpu.roundtrip import baseline_roundtrip

    pool = GpuPool("paged", capacity_bytes=1 << 30)
    ours = pool_roundtrip(pool, MiB, path="malloc", iterations=2000)
    cupy_pool = make_baseline("cupy.MemoryPool")
    theirs = baseline_roundtrip(cupy_pool, MiB, iterations=2000)
    cupy_pool.close()
    pool.close()
    assert ours["p50_us"] > 0 and theirs["p50_us"] > 0


@pytest.mark.gpu
def test_the_pointer_floor_builds_real_pointers_and_frees_nothing():
    import cupy

    from realgpu.roundtrip import pointer_floor_roundtrip

    used = cupy.get_default_memory_pool().used_bytes()
    for finalizer in (False, True):
        row = pointer_floor_roundtrip(MiB, iterations=500, warmup=10, finalizer=finalizer)
        assert row["iterations"] == 500 and row["p50_us"] > 0 and "floor" in row["allocator"]
    assert cupy.get_default_memory_pool().used_bytes() == used  # its one buffer is gone again
