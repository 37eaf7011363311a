"""The page-mapped device on the GPU: cuMem* through cuda-bindings (``gpu`` marker; skipped without
CUDA).

Run on the device with ``pytest -q -m gpu tests/realgpu/test_vmm.py -rA``. Every assertion
message says what was expected and what the driver or NVML showed, so a failure log alone
tells what broke. The host stand-in (``test_host_vmm.py``) runs the same scenarios on the CPU.
"""

import gc
import os
import sys

import pytest

import policies
from policies.device import VMM_STAT_KEYS
from policies.mapped_device import VMM_CALLS
from realgpu.errors import CorruptionError, VmmDriverError

sys.path.insert(0, os.path.dirname(__file__))
from test_replay import SHARED, random_trace  # noqa: E402

pytestmark = pytest.mark.gpu

MiB = 1 << 20
G = 2 * MiB
MAPPED_SHARED = SHARED + list(VMM_STAT_KEYS[:4])


def _free_bytes() -> int:
    import cupy

    cupy.cuda.Device().synchronize()
    return cupy.cuda.runtime.memGetInfo()[0]


def _device():
    from realgpu.vmm import CudaVmmDevice

    return CudaVmmDevice()


def test_the_driver_reports_the_h200_granularity_and_the_device_uses_it():
    d = _device()
    assert (
        d.driver.granularity_bytes >= 4096 and d.granularity_bytes == d.driver.granularity_bytes
    ), f"cuMemGetAllocationGranularity said {d.driver.granularity_bytes} B (the H200's is 2 MiB)"
    d.close()


def test_a_block_spanning_pages_mapped_at_different_times_reads_and_writes_on_the_gpu():
    d = _device()
    g = d.granularity_bytes
    va = d.address_reserve(64 * g)
    assert d.map_new(va, g)
    d.fill(va + g - 1000, 1000, 0x80000001, 0)
    other = d.address_reserve(4 * g)
    assert d.map_new(other, g)
    assert d.map_new(va + g, 3 * g), "cuMemCreate refused 3 pages on an idle GPU"
    assert d.address(va + g) - d.address(va) == g
    d.fill(va + g - 300, 2 * g + 600, 0x80ABCDEF, 3)
    assert d.first_mismatch(va + g - 300, 2 * g + 600, 0x80ABCDEF, 3) == -1, (
        "pattern across page boundaries differs"
    )
    assert d.first_mismatch(va + g - 1000, 700, 0x80000001, 0) == -1, (
        "bytes written before the grow changed"
    )
    d.view(va + 2 * g, 1)[:] = 0
    assert d.first_mismatch(va + g - 300, 2 * g + 600, 0x80ABCDEF, 3) == g + 300
    d.close()


def test_one_handle_mapped_at_two_addresses_shows_the_same_bytes_on_the_gpu():
    d = _device()
    g = d.granularity_bytes
    a, b = d.address_reserve(g), d.address_reserve(2 * g)
    h = d.create(g)
    d.map(a, h)
    d.map(b + g, h)
    d.set_access(a, g)
    d.set_access(b + g, g)
    d.fill(a + 5, 4096, 0x80C0FFEE, 1)
    assert d.read_bytes(b + g + 5, 4096) == d.read_bytes(a + 5, 4096), (
        "the second mapping shows other bytes"
    )
    d.close()


def test_pages_are_physical_memory_and_closing_gives_it_back():
    d = _device()
    free0 = _free_bytes()
    va = d.address_reserve(1 << 40)  # a terabyte of address space costs no memory
    assert abs(_free_bytes() - free0) <= 2 * MiB, "cuMemAddressReserve took physical memory"
    assert d.map_new(va, 256 * MiB)
    free1 = _free_bytes()
    assert free0 - free1 >= 256 * MiB, f"mapping 256 MiB took only {(free0 - free1) / MiB:.1f} MiB"
    d.close()
    free2 = _free_bytes()
    assert abs(free2 - free0) <= 2 * MiB, (
        f"after close {(free0 - free2) / MiB:.1f} MiB are still held"
    )


def test_a_create_past_the_gpus_memory_is_a_refusal_not_an_error():
    import cupy

    d = _device()
    total = cupy.cuda.runtime.memGetInfo()[1]
    too_much = -(-(total + 4 * d.granularity_bytes) // d.granularity_bytes) * d.granularity_bytes
    assert d.create(too_much) is None and d.num_refused == 1, (
        "cuMemCreate past the GPU's memory did not refuse"
    )
    va = d.address_reserve(too_much)
    assert not d.map_new(va, too_much, page_bytes=too_much)
    d.close()


def test_a_driver_error_names_the_call():
    d = _device()
    with pytest.raises(VmmDriverError, match="cuMemMap") as info:
        h = d.driver.create(d.granularity_bytes)
        try:
            d.driver.map(0x1000, d.granularity_bytes, h)  # no reservation there
        finally:
            d.driver.release(h)
    assert info.value.error.startswith("CUDA_ERROR_"), info.value.error
    d.close()


# ---------------------------------------------------------------------------- pools and replays
@pytest.mark.parametrize("spec", ["best-fit", "size-class", "paged", "torch-caching"])
def test_mapped_replay_on_the_gpu_agrees_with_the_simulator_and_gives_memory_back(spec):
    from realgpu.replay import gpu_replay
    from sim.replay.costs import costed_device
    from sim.replay.trace_replay import replay

    warm = gpu_replay(
        random_trace(9, num_allocs=20),
        spec,
        backend="cuda-vmm",
        validate=True,
        capacity_bytes=1 << 30,
    )  # contexts, kernels and NVML loaded before the measured run
    assert warm.summary["device_kind"] == "page-mapped"
    trace = random_trace(1)
    gpu_row = gpu_replay(
        trace, spec, backend="cuda-vmm", validate=True, capacity_bytes=4 << 30, sample_every=7
    ).summary
    sim_row = replay(
        trace,
        policies.create(spec, capacity_bytes=4 << 30, device=costed_device("page-mapped")),
        sample_every=7,
    ).summary
    differ = {k: (sim_row[k], gpu_row[k]) for k in MAPPED_SHARED if sim_row[k] != gpu_row[k]}
    assert differ == {}, f"simulator vs GPU (cuMem) differ on {differ}"
    assert gpu_row["n_map"] > 0 and gpu_row["driver_ns_map"] > 0
    leaked = gpu_row["nvml_end_used_bytes"] - gpu_row["nvml_base_used_bytes"]
    assert abs(leaked) <= 2 * MiB, (
        f"NVML: used memory after teardown is {leaked / MiB:+.1f} MiB off the start "
        f"({gpu_row['memory_source']})"
    )


def test_cupy_code_runs_on_mapped_pages_through_set_allocator():
    import cupy

    from realgpu.pool import GpuPool

    pool = GpuPool("best-fit", backend="cuda-vmm", capacity_bytes=1 << 30)
    expected = float(cupy.arange(1_000_000, dtype=cupy.float64).sum())
    with cupy.cuda.using_allocator(pool.malloc):
        x = cupy.arange(1_000_000, dtype=cupy.float64)
        y = (x * 2.0).reshape(1000, 1000) @ cupy.ones((1000, 1), dtype=cupy.float64)
        got = float(y.sum()) / 2.0
        assert pool.device.call_stats()["n_map"] > 0
        del x, y
    gc.collect()
    assert got == expected, (
        f"a CuPy computation on cuMem-mapped pages gave {got}, expected {expected}"
    )
    pool.close()


def test_validation_catches_an_overrun_on_mapped_pages():
    import cupy

    from realgpu.pool import GpuPool

    pool = GpuPool(
        "best-fit", backend="cuda-vmm", capacity_bytes=256 * MiB, validate=True, guard_bytes=64
    )
    p = pool.malloc(1000)
    cupy.cuda.runtime.memset(p.ptr + 1000, 0, 1)
    del p
    gc.collect()
    with pytest.raises(CorruptionError, match="guard-after"):
        pool.close()


def test_calibration_measures_the_vmm_calls_into_a_usable_cost_file(tmp_path):
    from realgpu.calibrate import calibrate, write_costs
    from sim.replay.costs import CostModel

    table = calibrate(
        sizes=(4096, MiB),
        repeats=5,
        copy_bytes=64 * MiB,
        host_copy_bytes=16 * MiB,
        copy_repeats=3,
        vmm_sizes=(2 * MiB, 20 * MiB),
    )
    assert "vmm_us" in table, (
        "no vmm_us in the table: cuda-bindings missing? (see the progress line)"
    )
    model = CostModel.load(write_costs(table, tmp_path / "costs.json"))
    assert model.vmm_source == str(tmp_path / "costs.json")
    for call in VMM_CALLS:
        assert table["vmm_us"][call]["nbytes"] == [2 * MiB, 20 * MiB]
        assert model.vmm_call_ns(call, 2 * MiB) > 0
    # field notes (H200, driver 580): create + map + set-access of a 2 MiB page is about 44 us
    page = sum(table["vmm_us"][c]["us"][0] for c in ("create", "map", "set_access"))
    assert 5 < page < 500, f"a 2 MiB page cost {page:.1f} us to create, map and set access"
