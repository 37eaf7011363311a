import pytest

from realgpu.baselines import BASELINES, available_baselines, make_baseline
from realgpu.errors import PoolError

MiB = 1 << 20


def test_the_four_baselines_are_listed():
    assert list(BASELINES) == ["cudaMalloc", "cupy.MemoryPool", "cupy.MemoryAsyncPool", "torch.cuda"]


def test_unknown_baseline_is_refused_with_the_choices():
    with pytest.raises(PoolError, match="cupy.MemoryPool"):
        make_baseline("jemalloc")


def test_available_baselines_are_known_ones():
    assert set(available_baselines()) <= set(BASELINES)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cudaMalloc", "cupy.MemoryPool", "cupy.MemoryAsyncPool", "torch.cuda"])
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
