"""The CUDA backend: clear refusals everywhere, real memory where a GPU is present (``gpu``
marker)."""

import gc
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import realgpu.cuda as rcuda
from realgpu.errors import CorruptionError, GpuUnavailableError, PoolOutOfMemoryError

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def _fake_cupy(count):
    return SimpleNamespace(
        cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=lambda: count))
    )


def test_without_cupy_the_reason_says_what_to_install(monkeypatch):
    monkeypatch.setattr(rcuda, "cupy", None)
    monkeypatch.setattr(rcuda, "_IMPORT_ERROR", ImportError("No module named 'cupy'"))
    with pytest.raises(GpuUnavailableError, match=r"install poollab\[gpu\]"):
        rcuda.require_cuda(0)


def test_without_a_device_the_reason_says_so(monkeypatch):
    monkeypatch.setattr(rcuda, "cupy", _fake_cupy(0))
    with pytest.raises(GpuUnavailableError, match="no CUDA device found"):
        rcuda.require_cuda(0)


def test_a_missing_device_index_is_named(monkeypatch):
    monkeypatch.setattr(rcuda, "cupy", _fake_cupy(1))
    with pytest.raises(GpuUnavailableError, match="device 3 does not exist"):
        rcuda.require_cuda(3)


def test_realgpu_and_its_host_backend_work_with_cupy_blocked():
    code = (
        "import sys; sys.modules['cupy'] = None\n"  # any 'import cupy' now raises ImportError
        "import realgpu, realgpu.replay, realgpu.baselines, realgpu.calibrate, realgpu.roundtrip\n"
        "pool = realgpu.GpuPool('paged', backend='host')\n"
        "pool.free(pool.allocate(1000)); pool.close()\n"
        "try:\n    realgpu.GpuPool('paged')\nexcept realgpu.GpuUnavailableError as e:\n    "
        "print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert "install poollab[gpu]" in done.stdout


# ---------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_reserve_is_a_real_allocation_that_release_frees():
    import cupy

    dev = rcuda.CudaDevice()
    off = dev.reserve(64 * MiB)
    view = dev.view(off, 64 * MiB)
    view[:] = 3
    assert int(view.sum()) == 3 * 64 * MiB
    del view
    cupy.get_default_memory_pool().free_all_blocks()  # the sum's output came from CuPy's own pool
    cupy.cuda.Device().synchronize()
    free1, _ = cupy.cuda.runtime.memGetInfo()
    dev.release(off, 64 * MiB)
    free2, _ = cupy.cuda.runtime.memGetInfo()
    assert 64 * MiB <= free2 - free1 <= 66 * MiB
    off = dev.reserve(64 * MiB)
    assert cupy.cuda.runtime.memGetInfo()[0] <= free2 - 64 * MiB
    dev.close()


@pytest.mark.gpu
@pytest.mark.parametrize("phase", [0, 3])
def test_fill_and_check_on_the_device(phase):
    dev = rcuda.CudaDevice()
    off = dev.reserve(4 * MiB)
    dev.fill(off + 5, 100_003, 0x80ABCDEF, phase)
    assert dev.first_mismatch(off + 5, 100_003, 0x80ABCDEF, phase) == -1
    dev.view(off + 5 + 777, 1)[:] = 0
    assert dev.first_mismatch(off + 5, 100_003, 0x80ABCDEF, phase) == 777
    dev.close()


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["first-fit", "size-class", "paged"])
def test_cupy_code_runs_on_a_policy_through_set_allocator(spec):
    import cupy

    from realgpu.pool import GpuPool

    pool = GpuPool(spec, capacity_bytes=1 << 30)
    expected = float(cupy.arange(1_000_000, dtype=cupy.float64).sum())
    with cupy.cuda.using_allocator(pool.malloc):
        x = cupy.arange(1_000_000, dtype=cupy.float64)
        y = (x * 2.0).reshape(1000, 1000) @ cupy.ones((1000, 1), dtype=cupy.float64)
        got = float(y.sum()) / 2.0
        assert pool.policy.num_live >= 2
        del x, y
    gc.collect()
    assert got == expected
    assert pool.policy.num_live == 0
    pool.close()


@pytest.mark.gpu
def test_out_of_memory_is_cupys_error_carrying_the_pools_stats():
    import cupy

    from realgpu.pool import GpuPool

    pool = GpuPool("first-fit", capacity_bytes=64 * MiB)
    keep = pool.malloc(48 * MiB)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        pool.malloc(48 * MiB)
    assert isinstance(info.value, PoolOutOfMemoryError)
    assert "capacity 64.0 MiB" in str(info.value) and "reserved" in str(info.value)
    del keep
    pool.close()


@pytest.mark.gpu
def test_validation_catches_an_overrun_on_the_device():
    import cupy

    from realgpu.pool import GpuPool

    pool = GpuPool("best-fit", capacity_bytes=256 * MiB, validate=True, guard_bytes=64)
    p = pool.malloc(1000)
    cupy.cuda.runtime.memset(p.ptr + 1000, 0, 1)  # one byte past the end
    del p
    gc.collect()
    with pytest.raises(CorruptionError, match="guard-after"):
        pool.close()


@pytest.mark.gpu
def test_closing_a_pool_gives_the_device_its_memory_back():
    import cupy

    from realgpu.pool import GpuPool

    warm = GpuPool("size-class", capacity_bytes=256 * MiB, validate=True)  # load the kernels first
    warm.free(warm.allocate(1000))
    warm.close()
    free0, _ = cupy.cuda.runtime.memGetInfo()
    pool = GpuPool("size-class", capacity_bytes=4 << 30)
    held = [pool.allocate(n) for n in (1000, 30 * MiB, 700 * MiB, 5 * MiB)]
    assert cupy.cuda.runtime.memGetInfo()[0] < free0 - 700 * MiB
    pool.free(held[0])
    pool.close()
    assert abs(cupy.cuda.runtime.memGetInfo()[0] - free0) <= 2 * MiB


@pytest.mark.gpu
def test_a_pool_dropped_without_close_gives_its_segments_back():
    import cupy

    from realgpu.pool import GpuPool

    pool = GpuPool("paged", capacity_bytes=1 << 30)
    pool.allocate(100 * MiB)
    cupy.cuda.Device().synchronize()
    free_held, _ = cupy.cuda.runtime.memGetInfo()
    del pool
    gc.collect()
    assert cupy.cuda.runtime.memGetInfo()[0] >= free_held + 100 * MiB


@pytest.mark.gpu
def test_a_range_past_a_cudamalloc_block_is_refused():
    """Issue 29: two ``cudaMalloc`` blocks are not one range, and nothing on the GPU stops a
    kernel that writes past one; the CUDA device checks each range it fills, checks or touches,
    as the host backend does."""
    dev = rcuda.CudaDevice()
    first = dev.reserve(2 * MiB)
    dev.reserve(2 * MiB)
    end = first + 2 * MiB
    for operation in (
        lambda: dev.fill(end - 8, 16, 0x80ABCDEF, 0),
        lambda: dev.touch(end - 8, 16),
        lambda: dev.first_mismatch(end - 8, 16, 0x80ABCDEF, 0),
    ):
        with pytest.raises(AssertionError, match="outside any segment"):
            operation()
    dev.fill(end - 16, 16, 0x80ABCDEF, 0)
    assert dev.first_mismatch(end - 16, 16, 0x80ABCDEF, 0) == -1
    dev.close()


@pytest.mark.gpu
def test_page_pool_on_cuda_maps_its_pages_into_one_range(tmp_path):
    """Issue 29: ``gpu replay --backend cuda -p page-pool`` of a 1 MiB then a 3 MiB allocation ran
    "clean" with its 3 MiB over two separate ``cudaMalloc`` blocks; it now runs on the cuMem
    device, where its pages are one range, and validation checks every byte."""
    from realgpu.replay import gpu_replay
    from traces.events import AllocTrace, make_events

    events = make_events(
        [0, 1, 2, 3],
        ["alloc", "alloc", "free", "free"],
        [0, 1, 0, 1],
        [1 * MiB, 3 * MiB, 1 * MiB, 3 * MiB],
    )
    result = gpu_replay(
        AllocTrace(events=events, name="one-then-three"),
        "page-pool",
        backend="cuda",
        capacity_bytes=256 * MiB,
        validate=True,
    )
    assert result.summary["device_kind"] == "page-mapped" and result.summary["n_failed"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["elastic", "compacting", "tag-limits", "expandable", "page-pool"])
def test_a_policy_object_runs_on_the_gpu(spec):
    """Issue 29: these, given as objects, failed with ``IndexError`` on ``--backend cuda``."""
    import policies
    from realgpu.pool import GpuPool

    pool = GpuPool(policies.create(spec, capacity_bytes=512 * MiB), validate=True)
    held = [pool.allocate(n) for n in (3 * MiB, 1000, 5 * MiB + 7)]
    assert all(pool.pointer(a) for a in held)
    for a in held:
        pool.free(a)
    pool.close()
