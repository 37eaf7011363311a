"""The page-mapped device on real (host) memory: mmap/memfd standing in for cuMem*, as CI runs
it."""

import os
import sys

import numpy as np
import pytest

import policies
from policies.device import VMM_STAT_KEYS
from policies.errors import PolicyError
from policies.mapped_device import VMM_CALLS, PageMappedDevice
from realgpu.calibrate import time_vmm_calls, write_costs
from realgpu.errors import CorruptionError, VmmDriverError
from realgpu.host_vmm import HostMmapDriver, HostVmmDevice
from realgpu.pool import GpuPool
from realgpu.replay import gpu_replay
from sim.replay.costs import costed_device
from sim.replay.costs import CostModel
from sim.replay.trace_replay import replay

sys.path.insert(0, os.path.dirname(__file__))
from conftest import BUNDLED_SNAPSHOT, open_memfds as _open_memfds  # noqa: E402
from test_replay import SHARED, random_trace  # noqa: E402

pytestmark = pytest.mark.skipif(
    not hasattr(os, "memfd_create"), reason="the host stand-in needs Linux memfd"
)

MiB = 1 << 20
G = 2 * MiB
#: the pool figures and the device columns a mapped replay and its simulation must share
MAPPED_SHARED = SHARED + list(VMM_STAT_KEYS[:4])


def _maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def _mapped_pages_of(base: int, nbytes: int) -> list[str]:
    """Lines of /proc/self/maps for memfd pages inside ``[base, base + nbytes)``."""
    out = []
    for line in _maps().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo < base + nbytes and hi > base and "memfd:poollab-page" in line:
            out.append(line)
    return out


# ---------------------------------------------------------------------------- the device
def test_a_block_spanning_pages_mapped_at_different_times_reads_and_writes_correctly():
    d = HostVmmDevice()
    va = d.address_reserve(64 * G)
    assert d.map_new(va, G)
    d.fill(va + G - 1000, 1000, 0x80000001, 0)  # written while only the first page exists
    other = d.address_reserve(4 * G)  # a range reserved in between does not break contiguity
    assert d.map_new(other, G)
    assert d.map_new(va + G, 3 * G)  # the grow lands right after, in the same range
    assert d.address(va + G) - d.address(va) == G
    d.fill(va + G - 300, 2 * G + 600, 0x80ABCDEF, 3)  # one block across three page boundaries
    assert d.first_mismatch(va + G - 300, 2 * G + 600, 0x80ABCDEF, 3) == -1
    assert (
        d.first_mismatch(va + G - 1000, 700, 0x80000001, 0) == -1
    )  # the older bytes survived the grow
    d.view(va + 2 * G, 1)[:] = 0  # a byte on the boundary of the second and third pages
    assert d.first_mismatch(va + G - 300, 2 * G + 600, 0x80ABCDEF, 3) == G + 300
    d.close()


def test_one_handle_mapped_at_two_addresses_shows_the_same_bytes():
    d = HostVmmDevice()
    a, b = d.address_reserve(G), d.address_reserve(2 * G)
    h = d.create(G)
    d.map(a, h)
    d.map(b + G, h)  # stitched into a second range
    d.set_access(a, G)
    d.set_access(b + G, G)
    d.fill(a + 5, 4096, 0x80C0FFEE, 1)
    assert d.read_bytes(b + G + 5, 4096) == d.read_bytes(a + 5, 4096)
    d.unmap_release(a, G)
    assert d.num_handles == 1 and d.first_mismatch(b + G + 5, 4096, 0x80C0FFEE, 1) == -1
    d.close()


def test_reserving_takes_address_space_only_and_ranges_are_aligned_to_the_granularity():
    d = HostVmmDevice(limit_bytes=4 * G)
    va = d.address_reserve(1 << 40)  # 1 TiB: far past this machine's memory
    assert d.address(va) % G == 0 and d.physical_bytes == 0 and _open_memfds() == 0
    d.address_free(va, 1 << 40)
    assert d.peak_virtual_bytes == 1 << 40
    d.close()


def test_calls_are_counted_and_timed_as_the_model_counts_them():
    d, model = HostVmmDevice(limit_bytes=4 * G), PageMappedDevice(limit_bytes=4 * G)
    for dev in (d, model):
        va = dev.address_reserve(16 * G)
        assert dev.map_new(va, 3 * G) and not dev.map_new(va + 3 * G, 2 * G)
        dev.unmap_release(va + G, 2 * G)
    assert d.num_calls == model.num_calls and d.call_stats()["n_map"] == 3
    assert all(d.call_ns[c] > 0 for c in VMM_CALLS if d.num_calls[c] and c != "address_free")
    assert (
        d.driver_ns_total == sum(d.call_ns.values()) and d.take_driver_ns() == 0
    )  # measured, not pending
    assert (d.num_maps, d.num_unmaps) == (3, 2)  # physical allocations made and released
    d.close()


def test_misuse_is_refused_by_the_bookkeeping_before_any_driver_call():
    d = HostVmmDevice()
    va = d.address_reserve(4 * G)
    h = d.create(G)
    before = dict(d.num_calls)
    with pytest.raises(PolicyError, match="granularity"):
        d.map(va + MiB, h)
    with pytest.raises(PolicyError, match="not inside one reserved range"):
        d.map(va + 4 * G, h)
    d.map(va, h)
    with pytest.raises(PolicyError, match="still mapped"):
        d.release_handle(h)
    assert d.num_calls["map"] == before["map"] + 1 and d.num_handles == 1
    d.close()


def test_a_driver_error_names_the_call_and_the_error():
    drv = HostMmapDriver()
    base = drv.address_reserve(G)
    with pytest.raises(
        VmmDriverError, match=r"mmap \(map\)\(0x[0-9a-f]+, 2097152\) failed: EBADF"
    ) as info:
        drv.map(base, G, 987_654)  # no such memfd
    assert info.value.error == "EBADF"
    drv.address_free(base, G)


class RefusingDriver(HostMmapDriver):
    """The host driver, out of physical memory after ``num_pages`` creates (as a full GPU
    refuses)."""

    def __init__(self, num_pages):
        super().__init__()
        self.left = num_pages

    def create(self, nbytes):
        if self.left <= 0:
            return None
        self.left -= 1
        return super().create(nbytes)


def test_a_driver_refusal_part_way_undoes_the_grow_and_refuses_the_segment():
    from realgpu.mapped import MappedRealDevice

    class Refusing(HostVmmDevice):
        def __init__(self, num_pages):
            MappedRealDevice.__init__(self, RefusingDriver(num_pages))

    d = Refusing(3)
    va = d.address_reserve(8 * G)
    assert d.map_new(va, 2 * G)
    assert not d.map_new(va + 2 * G, 2 * G)  # the second page is refused: the first goes back
    assert (
        d.mapped_bytes_in(va, 8 * G) == 2 * G and d.physical_bytes == 2 * G and d.num_refused == 1
    )
    assert d.reserve(4 * G) is None and d.num_segments == 1  # the segment's range is given back too
    d.close()
    assert _open_memfds() == 0


# ---------------------------------------------------------------------------- pools and replays
@pytest.mark.parametrize(
    "spec", ["best-fit", "first-fit", "size-class", "paged", "torch-caching", "buddy"]
)
def test_mapped_replay_with_validation_agrees_with_the_simulator(spec):
    trace = random_trace(1)
    sim_row = replay(
        trace, policies.create(spec, device=costed_device("page-mapped")), sample_every=7
    ).summary
    gpu_row = gpu_replay(trace, spec, backend="host-vmm", validate=True, sample_every=7).summary
    assert {k: (sim_row[k], gpu_row[k]) for k in MAPPED_SHARED if sim_row[k] != gpu_row[k]} == {}
    assert gpu_row["device_kind"] == "page-mapped" and gpu_row["n_map"] > 0
    assert gpu_row["driver_ns_total"] >= gpu_row["driver_ns_map"] > 0


def test_mapped_replay_agrees_on_failures_under_a_tight_capacity():
    trace = random_trace(2, max_live=60)
    sim_row = replay(
        trace,
        policies.create("first-fit", capacity_bytes=48 * MiB, device=costed_device("page-mapped")),
        sample_every=5,
    ).summary
    gpu_row = gpu_replay(
        trace,
        "first-fit",
        backend="host-vmm",
        capacity_bytes=48 * MiB,
        validate=True,
        sample_every=5,
    ).summary
    assert sim_row["n_failed"] > 0
    assert {k: (sim_row[k], gpu_row[k]) for k in MAPPED_SHARED if sim_row[k] != gpu_row[k]} == {}


def test_a_policy_built_on_a_page_mapped_device_gets_the_mapped_backend():
    policy = policies.create(
        "best-fit", device=PageMappedDevice(granularity_bytes=4 * MiB, limit_bytes=64 * MiB)
    )
    pool = GpuPool(policy, backend="host")
    assert isinstance(pool.device, HostVmmDevice)
    assert (pool.device.granularity_bytes, pool.device.limit_bytes) == (4 * MiB, 64 * MiB)
    pool.close()


def test_malloc_gives_one_array_over_pages_mapped_into_one_range():
    pool = GpuPool("best-fit", backend="host-vmm")
    p = pool.malloc(5 * MiB)  # three 2 MiB pages
    p.array[:] = np.arange(5 * MiB, dtype=np.uint64).astype(np.uint8)
    assert pool.device.read_bytes(pool.policy.segments()[0].offset, 16) == bytes(range(16))
    del p
    pool.close()


def test_validation_catches_an_overlap_on_mapped_pages(overlapping_policy):
    pool = GpuPool(overlapping_policy, backend="host-vmm", validate=True, guard_bytes=0)
    first = pool.allocate(8192)
    second = pool.allocate(1000)
    with pytest.raises(CorruptionError, match="also lies in live allocation"):
        pool.free(first)
    pool.free(second)
    pool.close()


def test_teardown_leaves_nothing_mapped():
    pool = GpuPool("size-class", backend="host-vmm", validate=True)
    held = [pool.allocate(n) for n in (1000, 3 * MiB, 9 * MiB, 300_000)]
    ranges = [(pool.device.address(s), s_bytes) for s, s_bytes in pool.device._ranges.items()]
    assert _open_memfds() > 0 and all(_mapped_pages_of(b, n) for b, n in ranges)
    pool.free(held[0])
    pool.close()  # three allocations still live: closing gives their pages back too
    assert _open_memfds() == 0
    assert not any(_mapped_pages_of(b, n) for b, n in ranges)
    maps = _maps()
    for base, _ in ranges:  # the reservations themselves are gone
        assert f"{base:x}-" not in maps
    d = pool.device
    assert (d.physical_bytes, d.virtual_bytes, d.num_handles, d.num_segments) == (0, 0, 0, 0)


# ---------------------------------------------------------------------------- calibration
def test_vmm_calibration_writes_a_table_the_simulator_prices_calls_from(tmp_path):
    measured = time_vmm_calls(HostMmapDriver(), (G, 10 * G), repeats=5)
    assert set(measured["vmm_us"]) == set(VMM_CALLS) and measured["vmm_calls_per_size"] == [5, 5]
    table = {
        "device": "host",
        "malloc_us": {"nbytes": [4096, MiB], "us": [2.0, 40.0]},
        "free_us": {"nbytes": [4096, MiB], "us": [3.0, 30.0]},
        "d2d_bytes_per_s": 2e12,
        "h2d_bytes_per_s": 5e10,
        "d2h_bytes_per_s": 5e10,
        **measured,
    }
    model = CostModel.load(write_costs(table, tmp_path / "costs.json"))
    assert model.vmm_source == str(tmp_path / "costs.json")
    assert model.vmm_call_ns("map", G) == round(measured["vmm_us"]["map"]["us"][0] * 1e3)
    assert _open_memfds() == 0


def test_vmm_calibration_refuses_a_size_off_the_granularity():
    with pytest.raises(ValueError, match="granularity"):
        time_vmm_calls(HostMmapDriver(), (3 * MiB,), repeats=1)


@pytest.mark.parametrize(
    "kind", ["page-mapped", "vmm"]
)  # the kind's name, and the spelling it had before
def test_gpu_replay_command_runs_mapped_on_the_host_next_to_the_simulator(tmp_path, kind):
    import pandas as pd

    from poollab.cli import main

    out = tmp_path / "out"
    main(
        [
            "gpu",
            "replay",
            str(BUNDLED_SNAPSHOT),
            "-p",
            "best-fit",
            "--backend",
            "host",
            "--device-kind",
            kind,
            "--validate",
            "--sim",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    rows = pd.read_csv(out / "summary.csv").set_index("backend")
    assert (rows["device_kind"] == "page-mapped").all()
    for col in MAPPED_SHARED:
        assert rows.loc["gpu", col] == rows.loc["sim", col], col
