"""``realgpu.torch_allocator``: the callback table on the host backend (no torch), the compiled
trampoline where torch is importable (no GPU needed), and the real thing on a GPU (``gpu``)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import policies
from policies.best_fit import BestFit

from realgpu.errors import CorruptionError, PoolError, PoolOutOfMemoryError
from realgpu.host import HostDevice
from realgpu.pool import GUARD_WORD, GpuPool
from realgpu.torch_allocator import (
    ALIGNMENT_BYTES,
    DEFAULT_SAMPLE_EVERY,
    AlignedHostDevice,
    AllocatorCore,
    TorchPolicyAllocator,
    use_policy,
)
from sim.replay.schema import SUMMARY_COLUMNS

from .conftest import OverlappingPolicy

REPO = Path(__file__).resolve().parents[2]

MiB = 1 << 20
FAST_POLICIES = ["best-fit", "size-class", "torch-caching", "best-fit:virtual=true"]


def host_core(
    spec: str = "best-fit",
    *,
    validate: bool = False,
    limit_bytes: int | None = None,
    events=None,
    sample_every: int = 1,
    device=None,
) -> AllocatorCore:
    if device is None:
        device = AlignedHostDevice(limit_bytes=limit_bytes)
    pool = GpuPool(
        spec, backend=device, validate=validate, guard_bytes=ALIGNMENT_BYTES, check_contents=False
    )
    return AllocatorCore(pool, events=events, sample_every=sample_every)


class FakeEvents:
    """Events that complete when the test says so."""

    def __init__(self):
        self.recorded: list[list] = []

    def record(self, stream: int):
        token = [stream, False]
        self.recorded.append(token)
        return token

    def done(self, token) -> bool:
        return token[1]

    def wait(self, token) -> None:
        token[1] = True


class _MisalignedHostDevice(HostDevice):
    """Segments that start 64 bytes past a 512-byte boundary, always: numpy's buffers are only
    16- or 64-aligned, but a large one may land on a 512-byte boundary by chance (once in CI), and
    then nothing would go down the realignment path this test checks."""

    def _map(self, nbytes: int):
        got = super()._map(nbytes + ALIGNMENT_BYTES + 64)
        if got is None:
            return None
        ptr, buf = got
        skip = (64 - ptr) % ALIGNMENT_BYTES
        return ptr + skip, buf[skip : skip + nbytes]


# ---------------------------------------------------------------------- the callback table
@pytest.mark.parametrize("spec", FAST_POLICIES)
def test_every_pointer_is_512_aligned_and_the_cost_is_counted(spec):
    # segments 64 past a 512-byte boundary send requests down the realignment path; a page-mapped
    # policy maps pages
    core = host_core(
        spec,
        device=_MisalignedHostDevice()
        if policies.registry.device_kind(spec) == "segment"
        else "host-vmm",
    )
    sizes = [1, 100, 511, 512, 513, 4096, 5000, 100_000, 3 * MiB + 7]
    ptrs = [core.malloc(n, 0, 0) for n in sizes]
    assert all(p % ALIGNMENT_BYTES == 0 for p in ptrs)
    assert len(set(ptrs)) == len(ptrs)
    # the segments start 64 past a 512-byte boundary: what is not aligned is asked again, padded
    # (mapped pages start page-aligned)
    assert core.n_align_padded > 0 or policies.registry.device_kind(spec) == "page-mapped"
    rounding = sum(-n % ALIGNMENT_BYTES for n in sizes)
    assert core.align_extra_bytes == rounding + core.n_align_padded * ALIGNMENT_BYTES
    # each pointer's range lies inside its allocation
    for p, n in zip(ptrs, sizes):
        a = core.live[p]
        start = core.pool.pointer(a)
        assert start <= p and p + n <= start + a.size_bytes
    for p, n in zip(ptrs, sizes):
        core.free(p, n, 0, 0)
    assert core.errors == [] and core.policy.num_live == 0
    core.close()  # a host-vmm pool's pages are memfds, which only closing gives back
    assert core.pool.closed


def test_zero_bytes_answer_null_without_the_policy():
    core = host_core()
    assert core.malloc(0, 0, 0) == 0
    assert core.policy.num_allocs == 0 and core.n_zero_bytes == 1


def test_double_free_is_kept_and_changes_nothing():
    core = host_core()
    p = core.malloc(4096, 0, 0)
    q = core.malloc(4096, 0, 0)
    core.free(p, 4096, 0, 0)
    stats = core.policy.stats()
    core.free(p, 4096, 0, 0)  # must not raise: PyTorch calls free from destructors
    core.free(12345, 8, 0, 0)
    assert len(core.errors) == 2 and "double free" in str(core.errors[0])
    assert core.policy.stats() == stats and core.live.keys() == {q}
    with pytest.raises(PoolError, match="not a live pointer"):
        core.check()


def test_refused_request_raises_the_policys_reason_and_changes_nothing():
    core = host_core("best-fit", limit_bytes=64 * MiB)
    p = core.malloc(MiB, 0, 0)
    before = core.policy.stats()
    with pytest.raises(PoolOutOfMemoryError, match=r"out of memory allocating 1\.0 GiB") as info:
        core.malloc(1 << 30, 0, 0)
    assert core.last_refusal == str(info.value)
    after = core.policy.stats()
    assert (after.num_live, after.live_bytes, after.reserved_bytes) == (
        before.num_live,
        before.live_bytes,
        before.reserved_bytes,
    )
    assert list(core.live) == [p]


class _SamePointer(OverlappingPolicy):
    """A broken policy: its second allocation is its first, again."""

    inside_bytes = 0


def test_a_pointer_handed_out_twice_is_refused():
    pool = GpuPool(_SamePointer(), backend=AlignedHostDevice())
    core = AllocatorCore(pool)
    p = core.malloc(1024, 0, 0)
    first = core.live[p]
    with pytest.raises(PoolError, match="again while it is live"):
        core.malloc(1024, 0, 0)
    assert list(core.live) == [p] and core.live[p] is first  # the first tensor's entry stays


def test_frees_wait_for_their_stream_once_two_streams_allocate():
    events = FakeEvents()
    core = host_core(events=events)
    a = core.malloc(4096, 0, 11)
    core.free(a, 4096, 0, 11)  # one stream so far: freed at once, as PyTorch does
    assert core.policy.num_live == 0 and not events.recorded
    a = core.malloc(4096, 0, 11)
    b = core.malloc(4096, 0, 22)
    core.free(a, 4096, 0, 11)
    assert (
        core.policy.num_live == 2 and core.n_deferred_frees == 1
    )  # stream 11 may still be using it
    assert events.recorded[-1][0] == 11
    c = core.malloc(4096, 0, 22)
    assert c != a and core.policy.num_live == 3  # not reused while stream 11's work is pending
    events.recorded[-1][1] = True  # stream 11 caught up
    d = core.malloc(4096, 0, 22)
    assert core.policy.num_live == 3  # the deferred free went back first
    for p in (b, c, d):
        core.free(p, 4096, 0, 22)
    core.close()
    assert core.pool.closed and core.errors == []


def test_a_refusal_waits_for_deferred_frees_and_retries():
    events = FakeEvents()
    core = host_core("best-fit", limit_bytes=100 * MiB, events=events)
    big = core.malloc(60 * MiB, 0, 1)
    core.malloc(4096, 0, 2)
    core.free(big, 60 * MiB, 0, 1)
    assert core.policy.num_live == 2
    again = core.malloc(64 * MiB, 0, 2)  # fits only once the deferred 24 MiB is back
    assert again and events.recorded[0][1] is True


def test_a_free_set_off_inside_malloc_waits_for_the_policy():
    # the garbage collector may run a tensor's finalizer while the policy is placing a request
    core = host_core()
    victim = core.malloc(4096, 0, 0)
    allocate, free = core._allocate, core._free_policy
    depth = []

    def guarded(fn):
        def call(*args, **kwargs):
            assert not depth, "the policy was entered again in the middle of a call"
            depth.append(1)
            try:
                if fn is allocate and victim in core.live:
                    core.free(victim, 4096, 0, 0)  # what a finalizer would do, right here
                return fn(*args, **kwargs)
            finally:
                depth.pop()

        return call

    core._allocate = core.path.allocate = guarded(allocate)  # the hot path holds its own references
    core._free_policy = core.path.free_policy = guarded(free)
    p = core.malloc(8192, 0, 0)
    assert victim not in core.live and core.policy.num_live == 1 and list(core.live) == [p]
    assert core.errors == []


def test_close_with_live_allocations_drains_then_releases():
    core = host_core()
    p = core.malloc(4096, 0, 0)
    core.close()
    assert not core.pool.closed  # PyTorch still holds a tensor there
    with pytest.raises(PoolError, match="closed"):
        core.malloc(16, 0, 0)
    core.free(p, 4096, 0, 0)
    assert core.pool.closed and core.pool.device.used_bytes == 0


def test_validation_finds_a_write_past_the_end():
    core = host_core("best-fit", validate=True)
    p = core.malloc(1000, 0, 0)
    assert p % ALIGNMENT_BYTES == 0
    a = core.live[p]
    pool = core.pool
    offset = (
        a.extents[0][0] + ALIGNMENT_BYTES + 1024
    )  # first byte past the rounded request: the after-guard
    assert core.n_align_padded == 0
    view = pool.device.view(offset, 1)
    assert view[0] == GUARD_WORD & 0xFF
    view[0] ^= 0xFF
    core.free(p, 1000, 0, 0)  # must not raise
    assert len(core.errors) == 1 and isinstance(core.errors[0], CorruptionError)
    assert core.errors[0].region == "guard-after" and core.policy.num_live == 0


def test_paged_tensors_over_several_pages_get_one_range_of_the_same_memory():
    # the H200's failure: a weight of 8 pages placed on pages that are not one range
    import ctypes

    from realgpu.torch_allocator import _make_pool

    pool = _make_pool(
        "paged:page_bytes=2MiB", validate=False, device=0, capacity_bytes=None, backend="host"
    )
    assert (
        pool.device.kind == "numpy" and type(pool.device).__name__ == "HostVmmDevice"
    )  # the page-mapped backend
    core = AllocatorCore(pool, sample_every=1)
    keep = [core.malloc(2 * MiB, 0, 0) for _ in range(4)]
    core.free(keep[1], 2 * MiB, 0, 0)
    core.free(keep[3], 2 * MiB, 0, 0)
    n = 3 * 2 * MiB - 100  # three pages: the two freed ones (not adjacent) and a fresh one
    p = core.malloc(n, 0, 0)
    a = core.live[p]
    assert len(a.extents) == 3 and not all(
        o2 == o1 + l1 for (o1, l1), (o2, _) in zip(a.extents, a.extents[1:])
    )
    assert p % ALIGNMENT_BYTES == 0 and p not in {core.pool.pointer(a)}
    ctypes.memset(p, 0x5A, n)  # the tensor writes its range ...
    for k, (offset, length) in enumerate(
        a.extents
    ):  # ... and each page, where the policy put it, holds it
        page = ctypes.string_at(pool.device.address(offset), length)
        want = min(length, n - k * 2 * MiB)
        assert page[:want] == b"\x5a" * want
    core.free(p, n, 0, 0)
    assert core._stitched == {} and core.n_stitched_maps == 1
    # the same pages again, in the same order (LIFO reuse): the range kept mapped serves, no driver
    # call
    maps = pool.device.num_calls["map"]
    assert (
        core.malloc(n, 0, 0) == p
        and pool.device.num_calls["map"] == maps
        and core.n_stitched_maps == 1
    )
    core.free(p, n, 0, 0)
    assert core.malloc(2 * MiB, 0, 0) in {
        pool.device.address(o) for o, _ in a.extents
    }  # its pages are reused
    assert core.errors == []
    for q in list(core.live):
        core.free(q, 1, 0, 0)
    core.close()  # the kept range is unmapped and its memory released with the pool
    assert pool.closed and pool.device.physical_bytes == 0 and pool.device.num_calls["unmap"] > 0


def _paged_core(spec="paged:page_bytes=2MiB", **device_kw):
    from realgpu.host_vmm import HostVmmDevice
    from realgpu.torch_allocator import _make_pool

    pool = _make_pool(
        spec, validate=False, device=0, capacity_bytes=None, backend=HostVmmDevice(**device_kw)
    )
    return AllocatorCore(pool, sample_every=1)


def _scattered(core, num_pages: int) -> tuple[int, list[int]]:
    """A tensor of ``num_pages`` pages whose pages are not one range: ``(pointer, pages kept
    live)``."""
    keep = [core.malloc(2 * MiB, 0, 0) for _ in range(2 * num_pages)]
    for q in keep[1::2]:
        core.free(q, 2 * MiB, 0, 0)
    return core.malloc(num_pages * 2 * MiB, 0, 0), keep[0::2]


def test_kept_ranges_past_the_bound_go_in_one_batch(monkeypatch):
    # one device synchronize per fresh stitch (an eviction each past the bound) made paged 1.3-4x
    # slower than PyTorch on the H200: past the bound, the oldest go together, the first unmap
    # waiting for the GPU and the rest finding it idle
    import realgpu.torch_allocator as ta

    monkeypatch.setattr(ta, "MAX_IDLE_STITCHED_RANGES", 4)
    monkeypatch.setattr(ta, "IDLE_EVICT_BATCH", 3)
    core = _paged_core()
    syncs = []
    monkeypatch.setattr(core.pool.device, "synchronize", lambda: syncs.append(1))
    held = []
    for _ in range(5):  # five tensors over different scattered pages, each freed: five kept ranges
        p, keep = _scattered(core, 2)
        held += keep
        core.free(p, 4 * MiB, 0, 0)
    assert core.n_stitched_maps == 5 and core.n_idle_evictions == 1 and len(core._idle_ranges) == 2
    assert (
        len(syncs) == 3
    )  # three ranges unmapped in the batch (the device's call; it waits only once on a GPU)
    for _ in range(2):
        p, keep = _scattered(core, 2)
        held += keep
        core.free(p, 4 * MiB, 0, 0)
    assert (
        core.n_idle_evictions == 1 and len(core._idle_ranges) == 4 and len(syncs) == 3
    )  # up to the bound: kept
    row = TorchPolicyAllocator(core.pool, core, "pluggable", None).summary_row()
    assert (
        row["n_idle_evictions"] == 1 and row["n_stitched_maps"] == 7 and row["n_stitch_reuses"] == 0
    )
    core.close()  # the pages still held keep the pool open; freeing the last releases it all
    assert not core.pool.closed
    for q in held:
        core.free(q, 2 * MiB, 0, 0)
    assert core.pool.closed and core.pool.device.physical_bytes == 0 and core.errors == []


def test_a_kept_range_over_most_of_the_pages_is_taken_over_once_its_work_is_done(monkeypatch):
    # the paged stack shifted by a small request in between: the same tensor comes back over pages
    # one off a kept range's; only that page is remapped, once the range's work is done, no wait
    import ctypes

    events = FakeEvents()
    core = _paged_core()
    core.events = events
    syncs = []
    monkeypatch.setattr(core.pool.device, "synchronize", lambda: syncs.append(1))
    t1, held = _scattered(core, 4)
    core.free(t1, 8 * MiB, 0, 0)  # kept: range 1, its work not done yet
    s1 = core.malloc(2 * MiB, 0, 0)  # takes t1's first page
    t2 = core.malloc(8 * MiB, 0, 0)  # three of t1's pages and another: range 1 is still busy
    assert core.n_stitched_maps == 2 and core.n_stitch_takeovers == 0
    core.free(t2, 8 * MiB, 0, 0)
    for token in events.recorded:  # the GPU is done with both ranges
        token[1] = True
    s2 = core.malloc(2 * MiB, 0, 0)  # takes t2's first page
    t3 = core.malloc(8 * MiB, 0, 0)  # t2's other three and one more
    a = core.live[t3]
    assert t3 == t2 and core.n_stitched_maps == 2 and core.n_stitch_takeovers == 1
    assert core.n_stitch_pages_remapped == 1 and syncs == []
    for k in range(4):  # each 2 MiB of the tensor lands on one of its pages, each page once
        ctypes.memset(t3 + k * 2 * MiB, 0x40 + k, 2 * MiB)
    device = core.pool.device
    found = sorted(ctypes.string_at(device.address(offset), 1)[0] for offset, _ in a.extents)
    assert found == [0x40, 0x41, 0x42, 0x43]
    assert all(
        ctypes.string_at(device.address(o), 2 * MiB)
        == bytes([ctypes.string_at(device.address(o), 1)[0]]) * (2 * MiB)
        for o, _ in a.extents
    )
    core.free(t3, 8 * MiB, 0, 0)
    for q in [s1, s2, *held]:
        core.free(q, 2 * MiB, 0, 0)
    assert core.errors == []
    core.close()
    assert core.pool.device.physical_bytes == 0


def _count_driver_calls(device) -> dict[str, int]:
    """Count the calls that reach ``device``'s driver (the mmap stand-in here, cuMem* on a GPU)."""
    counts: dict[str, int] = {}
    driver = device.driver
    for call in ("address_reserve", "create", "map", "set_access", "unmap", "release"):
        real = getattr(driver, call)

        def counted(*args, _real=real, _call=call):
            counts[_call] = counts.get(_call, 0) + 1
            return _real(*args)

        setattr(driver, call, counted)
    return counts


@pytest.mark.parametrize("num_pages", [3, 5])
def test_a_fresh_range_costs_one_reserve_a_map_a_page_and_one_access_call(num_pages):
    # what a tensor over scattered pages costs the driver: no create (the pages are the policy's),
    # one cuMemAddressReserve, one cuMemMap a page (a map cannot start inside a handle), one
    # cuMemSetAccess over the whole range; a tensor over the first pages of it once freed: none
    core = _paged_core()
    keep = [core.malloc(2 * MiB, 0, 0) for _ in range(2 * num_pages)]
    for q in keep[1::2]:
        core.free(q, 2 * MiB, 0, 0)
    counts = _count_driver_calls(core.pool.device)
    t = core.malloc(num_pages * 2 * MiB, 0, 0)
    assert counts == {"address_reserve": 1, "map": num_pages, "set_access": 1}
    assert core.n_stitched_maps == 1
    pages = [off for off, _ in core.live[t].extents]
    core.free(t, num_pages * 2 * MiB, 0, 0)
    counts.clear()
    u = core.malloc((num_pages - 1) * 2 * MiB, 0, 0)  # its first pages, in order (the LIFO stack)
    assert counts == {} and u == t and core.n_stitch_inside_reuses == 1
    assert [off for off, _ in core.live[u].extents] == pages[: num_pages - 1]
    import ctypes

    device = core.pool.device
    for k, off in enumerate(pages[: num_pages - 1]):  # each 2 MiB of the tensor is its own page
        ctypes.memset(u + k * 2 * MiB, 0x30 + k, 2 * MiB)
        assert ctypes.string_at(device.address(off), 1)[0] == 0x30 + k
    core.free(u, (num_pages - 1) * 2 * MiB, 0, 0)
    assert len(core._idle_ranges) == 1  # the range went back whole
    v = core.malloc(num_pages * 2 * MiB, 0, 0)  # all of them again: the exact range, no call
    assert counts == {} and v == t and core.n_stitch_reuses == 1
    core.free(v, num_pages * 2 * MiB, 0, 0)
    for q in keep[0::2]:
        core.free(q, 2 * MiB, 0, 0)
    assert core.errors == []
    core.close()
    assert device.physical_bytes == 0


def test_a_take_over_makes_one_access_call_per_run_of_remapped_pages():
    # a kept range of 6 pages, its first two now held by others: the next 6-page tensor takes it
    # over, unmapping and mapping the two slots, and grants access over both in one call
    events = FakeEvents()
    core = _paged_core()
    core.events = events
    t1, held = _scattered(core, 6)
    core.free(t1, 12 * MiB, 0, 0)
    for token in events.recorded:
        token[1] = True  # its GPU work is done
    s = [core.malloc(2 * MiB, 0, 0) for _ in range(2)]  # take t1's first two pages
    counts = _count_driver_calls(core.pool.device)
    t2 = core.malloc(12 * MiB, 0, 0)  # t1's other four and two more
    assert core.n_stitch_takeovers == 1 and core.n_stitch_pages_remapped == 2 and t2 == t1
    assert counts == {"unmap": 2, "map": 2, "set_access": 1}
    a = core.live[t2]
    import ctypes

    device = core.pool.device
    pages = [off for off, length in a.extents for off in range(off, off + length, 2 * MiB)]
    for k, off in enumerate(pages):
        ctypes.memset(t2 + k * 2 * MiB, 0x50 + k, 2 * MiB)
    # each 2 MiB of the tensor lands on one of its pages, each page once (a taken-over range keeps
    # its shared pages in their slots, so the order may differ from the policy's)
    assert sorted(ctypes.string_at(device.address(off), 1)[0] for off in pages) == [
        0x50 + k for k in range(6)
    ]
    core.free(t2, 12 * MiB, 0, 0)
    for q in [*s, *held]:
        core.free(q, 2 * MiB, 0, 0)
    assert core.errors == []
    core.close()
    assert device.physical_bytes == 0


def test_a_refusal_unmaps_kept_ranges_holding_released_memory_and_retries():
    # a kept range holds its pages' physical memory after the policy released their segment (a
    # trim): the device is then full of memory nobody uses, until the range is unmapped
    core = _paged_core("paged:page_bytes=2MiB,segment_bytes=8MiB", limit_bytes=16 * MiB)
    p, keep = _scattered(core, 2)  # 4 pages live in one segment, 2 more in a second, stitched
    core.free(p, 4 * MiB, 0, 0)
    for q in keep:
        core.free(q, 2 * MiB, 0, 0)
    assert (
        len(core._idle_ranges) == 1 and core.policy.trim() > 0 and core.policy.reserved_bytes == 0
    )
    assert core.pool.device.physical_bytes > 0  # held by the kept range alone
    q = core.malloc(16 * MiB, 0, 0)  # the whole device: only after the kept range lets go
    assert q and core._idle_ranges == {} and core.errors == []
    core.free(q, 16 * MiB, 0, 0)
    core.close()
    assert core.pool.device.physical_bytes == 0


def test_paged_is_refused_up_front_where_its_pages_cannot_be_one_range():
    with pytest.raises(PoolError, match="needs a page-mapped device.*cuda-vmm"):
        host_core(
            "paged:page_bytes=2MiB"
        )  # a segment device: cudaMalloc'd memory is never mapped again
    with pytest.raises(
        PoolError, match="no whole number.*set page_bytes to a multiple of 2,097,152"
    ):
        AllocatorCore(
            GpuPool("paged:page_bytes=64KiB", backend="host-vmm", guard_bytes=ALIGNMENT_BYTES)
        )
    with pytest.raises(PoolError, match="validation mode"):
        AllocatorCore(
            GpuPool(
                "paged:page_bytes=2MiB",
                backend="host-vmm",
                validate=True,
                guard_bytes=ALIGNMENT_BYTES,
            )
        )


@pytest.mark.parametrize("spec", ["best-fit", "size-class", "torch-caching"])
def test_pytorchs_own_traffic_through_the_table_reserves_what_replay_reserves(spec):
    # the bundled snapshot is PyTorch's own requests (generate on a 1B Llama): served through the
    # callback table, the policy must make replay's decisions; only the live bytes differ, by the
    # rounding to 512 B of the requests PyTorch's snapshot records unrounded
    from sim.replay.trace_replay import replay
    from traces import bundled_path, read_alloc_trace

    trace = read_alloc_trace(bundled_path("llama1b_generate_slice.pickle.gz"))
    _, is_alloc, ids, nbytes, streams = trace.arrays()
    core = host_core(spec, sample_every=DEFAULT_SAMPLE_EVERY)
    ptrs = {}
    for alloc, key, n, stream in zip(
        is_alloc.tolist(), ids.tolist(), nbytes.tolist(), streams.tolist()
    ):
        if alloc:
            ptrs[key] = core.malloc(n, 0, stream)
        elif key in ptrs:
            core.free(ptrs.pop(key), n, 0, stream)
    got, want = core.policy.stats(), replay(trace, spec).summary
    assert (
        got.num_failures == want["n_failed"] == 0 and core.errors == [] and core.n_align_padded == 0
    )
    assert got.peak_reserved_bytes == want["peak_reserved_bytes"]
    rounding = int((-nbytes[is_alloc] % ALIGNMENT_BYTES).sum())
    assert want["peak_live_bytes"] <= got.peak_live_bytes <= want["peak_live_bytes"] + rounding


def test_summary_row_is_the_report_row():
    core = host_core(sample_every=4)
    alloc = TorchPolicyAllocator(core.pool, core, "pluggable", None)
    ptrs = [core.malloc(n, 0, 0) for n in (1000, 2000, 3000)]
    for p in ptrs:
        core.free(p, 0, 0, 0)
    alloc.close()
    row = alloc.summary_row(trace="generate-8x128")
    assert list(row)[: len(SUMMARY_COLUMNS)] == SUMMARY_COLUMNS
    assert row["trace"] == "generate-8x128" and row["backend"] == "torch-pluggable"
    assert row["n_alloc"] == 3 and row["n_free"] == 3 and row["n_failed"] == 0
    assert row["align_extra_bytes"] == core.align_extra_bytes and row["n_live_at_close"] == 0
    assert alloc.stats().num_allocs == 3  # kept after the pool was released
    assert core.pool.closed
    ts = core.monitor.timeseries()
    # calls 1 and 5 sampled (every 4th call), then the closing sample at the last call
    assert list(ts["event"]) == [0, 4, 5]
    assert list(ts["live_bytes"]) == [1024, 3072, 0] and ts["time_us"].is_monotonic_increasing


def test_a_moving_policy_is_refused():
    with pytest.raises(PoolError, match="move live allocations"):
        host_core("compacting:base=best-fit")


def test_bad_mode_is_one_clear_error():
    with pytest.raises(PoolError, match="mode"):
        with use_policy("best-fit", mode="paged-attention"):
            pass


class _FakeTorch:
    """Just what ``use_policy`` touches of torch, for its control flow on a machine without CUDA."""

    class OutOfMemoryError(RuntimeError):
        pass

    def __init__(self, *, swap_error: str | None = None):
        fake = self
        self.swapped = []
        self.pools = []
        self.recording = {}  # pool id -> the thread routed to it
        self.use_count = {}

        class Memory:
            class CUDAPluggableAllocator:
                def __init__(self, path, malloc_name, free_name):
                    self.names = (path, malloc_name, free_name)

                def allocator(self):
                    return self

            @staticmethod
            def change_current_allocator(wrapper):
                if swap_error:
                    raise RuntimeError(swap_error)
                fake.swapped.append(wrapper)

            # what use_mem_pool calls, with PyTorch's rules (CUDACachingAllocator.cpp): a pool is
            # routed for one thread (or capture) at a time, and each entry counts one more user
            @staticmethod
            def _cuda_beginAllocateCurrentThreadToPool(device, pool_id):
                fake.use_count[pool_id] = fake.use_count.get(pool_id, 0) + 1
                if pool_id in fake.recording:
                    raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
                fake.recording[pool_id] = threading.get_ident()

            @staticmethod
            def _cuda_endAllocateToPool(device, pool_id):
                if fake.recording.pop(pool_id, None) is None:
                    raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

            @staticmethod
            def _cuda_releasePool(device, pool_id):
                fake.use_count[pool_id] -= 1

        class Cuda:
            memory = Memory

            @staticmethod
            def is_available():
                return True

            @staticmethod
            def init():
                pass

            @staticmethod
            def MemPool(allocator):  # noqa: N802 - torch's name
                fake.pools.append(allocator)
                pool = SimpleNamespace(id=(0, len(fake.pools)), allocator=allocator)
                fake.use_count[pool.id] = 1  # the MemPool object's own
                return pool

            @staticmethod
            @contextlib.contextmanager
            def use_mem_pool(pool, device=None):
                yield

        class Tensor:
            def record_stream(self, stream):
                return "recorded"

        class CUDAGraph:
            """As PyTorch's: ``capture_begin`` registers the graph with the default generator,
            which allocates its graph RNG state (two 8-byte tensors) before the capture starts
            and keeps it while the graph lives (``CUDAGeneratorState::register_graph``)."""

            def capture_begin(self, pool=None, capture_error_mode="global"):
                self.rng_state = [fake.core.malloc(8, 0, 0) for _ in range(2)]
                fake.capturing = True

        class Graph:  # torch.cuda.graph
            def __init__(self, cuda_graph, pool=None):
                self.cuda_graph = cuda_graph
                self.pool = () if pool is None else (pool,)

            def __enter__(self):
                fake.stream = "capture"  # torch.cuda.graph switches streams before capture_begin
                self.cuda_graph.capture_begin(*self.pool)

            def __exit__(self, *exc):
                fake.stream = "default"

        class Graphs:
            pass

        Graphs.CUDAGraph, Graphs.graph = CUDAGraph, Graph
        Cuda.graphs, Cuda.CUDAGraph, Cuda.graph = Graphs, CUDAGraph, Graph
        self.core = None
        self.capturing = False
        self.stream = "default"
        self.cuda = Cuda
        self.Tensor = Tensor


class _FakeShim:
    path = "/nonexistent/poollab_torch_shim.so"

    def __init__(self):
        self.bound = []

    def bind(self, core, *, null_on_refusal=False):
        self.bound.append((core, null_on_refusal))

    def reset(self):
        pass

    def set_capture_check(self, address):
        pass

    def samples(self, kind):
        return np.empty(0, dtype=np.int64)

    def counters(self):
        return {}


@pytest.fixture
def fake_engine(monkeypatch):
    """use_policy over a fake torch and shim, with a host-backed pool: its control flow on the
    CPU."""
    import realgpu.torch_allocator as ta

    shim = _FakeShim()
    monkeypatch.setattr(ta, "load_shim", lambda: shim)
    monkeypatch.setattr(
        ta,
        "_make_pool",
        lambda policy, **kw: GpuPool(
            policy,
            backend=AlignedHostDevice(),
            validate=kw["validate"],
            capacity_bytes=kw["capacity_bytes"],
            guard_bytes=ALIGNMENT_BYTES,
        ),
    )
    monkeypatch.setattr(ta, "CudaStreamEvents", lambda device: FakeEvents())
    monkeypatch.setattr(ta, "_routing", ta._Routing())
    monkeypatch.setattr(ta, "_pluggable_installed", False)
    monkeypatch.setattr(ta, "_cudart_capture_check", lambda: None)

    def install(**kw):
        fake = _FakeTorch(**kw)
        monkeypatch.setitem(sys.modules, "torch", fake)
        return fake

    return shim, install


def test_pluggable_too_late_is_one_clear_error_and_frees_the_claim(fake_engine):
    shim, install = fake_engine
    install(swap_error="Can't swap an already initialized allocator")
    for _ in range(2):  # the second try gets the same answer: nothing was left claimed
        with pytest.raises(
            PoolError, match="before the process's first CUDA allocation.*mode='mempool'"
        ):
            with use_policy("best-fit"):
                pass
    assert shim.bound[-1] == (None, False)


def test_pluggable_installs_once_serves_and_refuses_record_stream(fake_engine):
    shim, install = fake_engine
    torch = install()
    with use_policy("size-class") as alloc:
        ptr = alloc.core.malloc(4096, 0, 0)
        with pytest.raises(PoolError, match="record_stream"):
            torch.Tensor().record_stream(None)
        alloc.core.free(ptr, 4096, 0, 0)
    assert torch.Tensor().record_stream(None) == "recorded"  # torch's own method is back
    assert len(torch.swapped) == 1 and torch.swapped[0].names[1:] == (
        "poollab_malloc",
        "poollab_free",
    )
    assert alloc.pool.closed and alloc.summary_row()["n_alloc"] == 1
    with use_policy("best-fit") as second:  # the trampoline stays installed: only rebound
        pass
    assert len(torch.swapped) == 1 and shim.bound[-1][0] is second.core


def test_pluggable_refuses_graph_capture_before_pytorch_allocates_for_it(fake_engine):
    """The H200's leak: refused at the first malloc inside the capture, the two tensors PyTorch's
    capture_begin allocates beforehand stayed live in the policy while the graph object lived."""
    _, install = fake_engine
    torch = install()
    own = torch.cuda.CUDAGraph.capture_begin, torch.cuda.graph.__enter__
    with use_policy("best-fit") as alloc:
        torch.core = alloc.core
        g = torch.cuda.CUDAGraph()
        with pytest.raises(PoolError, match='refuses CUDA graph capture.*mode="mempool"'):
            with torch.cuda.graph(g):
                pass
        assert (
            torch.stream == "default"
        )  # refused before torch.cuda.graph switched to its capture stream
        with pytest.raises(PoolError, match="refuses CUDA graph capture"):
            g.capture_begin()
        assert not torch.capturing and alloc.core.num_live == 0  # nothing allocated for the graph
    assert alloc.summary_row()["n_live_at_close"] == 0 and alloc.pool.closed
    assert (
        torch.cuda.CUDAGraph.capture_begin,
        torch.cuda.graph.__enter__,
    ) == own  # torch's own are back


def test_policies_follow_one_another_while_tensors_of_the_first_live(fake_engine):
    import realgpu.torch_allocator as ta

    shim, install = fake_engine
    install()
    with use_policy("best-fit") as first:
        kept = first.core.malloc(
            4096, 0, 0
        )  # a tensor that outlives the block (the model's weights)
        with pytest.raises(PoolError, match="end its use_policy block"):
            with use_policy("size-class"):
                pass
    with use_policy("size-class") as second:
        assert (
            shim.bound[-1][0] is ta._routing
        )  # frees are routed to their owner while the first drains
        ptr = ta._routing.malloc(4096, 0, 0)
        assert ptr in second.core.live
        ta._routing.free(kept, 4096, 0, 0)  # PyTorch frees the old tensor: back to best-fit
        assert first.pool.closed and first.core.errors == []
        assert (
            shim.bound[-1][0] is second.core
        )  # nothing left to route: straight to the policy again
        ta._routing.free(ptr, 4096, 0, 0)
    assert second.core.errors == [] and second.pool.closed


def test_mempool_routes_this_thread_and_hands_the_pool_to_another(fake_engine):
    # gpu serve in mempool mode on the H200: the engine's thread entered the pool this thread was
    # routed to, and PyTorch refused ("already recording to mempool_id"); the engine never started
    _, install = fake_engine
    torch = install()
    with use_policy("best-fit", mode="mempool") as alloc:
        pool_id = alloc.mempool.id
        assert torch.recording == {pool_id: threading.get_ident()} and alloc.routing
        alloc.pause_routing()
        assert torch.recording == {} and not alloc.routing
        errors = []

        def engine_thread():
            try:
                with_pool = torch.cuda.memory  # what use_mem_pool does in that thread
                with_pool._cuda_beginAllocateCurrentThreadToPool(0, pool_id)
                with_pool._cuda_endAllocateToPool(0, pool_id)
                with_pool._cuda_releasePool(0, pool_id)
            except RuntimeError as exc:
                errors.append(exc)

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()
        assert errors == []
        alloc.resume_routing()
        assert torch.recording == {pool_id: threading.get_ident()}
    assert (
        torch.recording == {} and torch.use_count[pool_id] == 1
    )  # every entry released: only the MemPool's own
    with use_policy("best-fit", mode="mempool") as alloc:
        second_id = alloc.mempool.id
        alloc.pause_routing()  # the block may end paused (an engine that failed before it stopped)
    assert torch.recording == {} and torch.use_count[second_id] == 1


def test_mempool_refuses_a_capture_into_its_own_pool_up_front(fake_engine):
    # the H200: PyTorch refused it too, but after switching streams and counting one more user of
    # the pool, whose segments then never went back (4 live at close)
    from realgpu.torch_allocator import MEMPOOL_CAPTURE_REFUSAL

    _, install = fake_engine
    torch = install()
    own = torch.cuda.CUDAGraph.capture_begin, torch.cuda.graph.__enter__
    with use_policy("best-fit", mode="mempool") as alloc:
        torch.core = alloc.core
        pool_id = alloc.mempool.id
        g = torch.cuda.CUDAGraph()
        with pytest.raises(
            PoolError, match="captured into the policy's MemPool.*torch.cuda.graph\\(g\\)"
        ):
            with torch.cuda.graph(g, pool=pool_id):
                pass
        assert torch.stream == "default" and not torch.capturing and torch.use_count[pool_id] == 2
        with pytest.raises(PoolError, match="captured into the policy's MemPool"):
            g.capture_begin(pool=alloc.mempool)
        with torch.cuda.graph(g):  # the graph's own pool: PyTorch's hooks do the work
            pass
        assert torch.capturing
    assert MEMPOOL_CAPTURE_REFUSAL.startswith("a CUDA graph")
    assert (
        torch.cuda.CUDAGraph.capture_begin,
        torch.cuda.graph.__enter__,
    ) == own  # torch's own are back


def test_mempool_out_of_memory_carries_the_policys_reason(fake_engine):
    shim, install = fake_engine
    torch = install()
    with pytest.raises(
        torch.OutOfMemoryError,
        match="CUDA out of memory(.|\n)*poollab pool 'best-fit' is out of memory",
    ):
        with use_policy("best-fit", mode="mempool", capacity_bytes=64 * MiB) as alloc:
            assert shim.bound[-1] == (
                alloc.core,
                True,
            )  # a refusal answers null: PyTorch retries first
            with pytest.raises(PoolOutOfMemoryError):
                alloc.core.malloc(1 << 30, 0, 0)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    assert len(torch.pools) == 1


# ---------------------------------------------------------- the compiled trampoline (torch, no GPU)
@pytest.fixture(scope="module")
def shim():
    pytest.importorskip("torch")
    from realgpu.torch_allocator import load_shim

    s = load_shim()
    yield s
    s.bind(None)


def test_trampoline_routes_calls_and_counts_them(shim):
    core = host_core()
    shim.bind(core)
    shim.reset()
    code, ptr, msg = shim.probe_malloc(1000)
    assert code == 0 and ptr % ALIGNMENT_BYTES == 0 and ptr in core.live
    assert shim.probe_malloc(0) == (0, 0, "")
    shim.call_free(0, 0)  # the null pointer of a 0-byte request: nothing
    shim.call_free(ptr, 1000)
    assert core.policy.num_live == 0
    counters = shim.counters()
    assert (
        counters["n_calls_malloc"] == 1
        and counters["n_calls_free"] == 1
        and counters["n_zero_bytes"] == 1
    )
    assert len(shim.samples(0)) == 1 and shim.samples(0)[0] > 0
    shim.bind(None)


def test_trampoline_calls_the_compiled_hot_path_by_address_else_the_callables(shim):
    import realgpu.malloc_path as mp

    compiled = not mp.__file__.endswith(".py")
    core = host_core(events=FakeEvents())
    assert (core.path.entry_addresses() is not None) == compiled
    shim.bind(core)
    assert shim.uses_entries() == compiled
    # the same stream, another (the trampoline's boxed stream follows), and back
    calls = [(1000, 0), (4096, 0), (512, 0x7000), (8192, 0x7000), (3000, 0)]
    ptrs = []
    for n, stream in calls:
        code, ptr, msg = shim.probe_malloc(n, stream, release_gil=True)
        assert code == 0 and ptr in core.live and ptr % ALIGNMENT_BYTES == 0, msg
        assert core.path.last_stream == stream and core.live[ptr].stream == stream
        ptrs.append(ptr)
    assert len(set(ptrs)) == len(calls) and core.streams == {0, 0x7000}
    for ptr, (n, stream) in zip(ptrs, calls):
        shim.call_free(ptr, n, stream)
    core._drain(wait=True)  # two streams allocated: the frees waited for their stream's work
    assert core.policy.num_live == 0 and core.errors == [] and not core.live
    shim.call_free(ptrs[0], 1000)  # a double free: kept, never raised through the trampoline
    assert len(core.errors) == 1 and "not a live pointer" in str(core.errors[0])
    shim.bind(None)
    assert not shim.uses_entries()


def test_trampoline_turns_a_refusal_into_torchs_out_of_memory(shim):
    core = host_core("best-fit", limit_bytes=64 * MiB)
    shim.bind(core)
    code, ptr, msg = shim.probe_malloc(1 << 30)
    assert code == 1 and ptr == 0  # c10::OutOfMemoryError: torch.OutOfMemoryError in Python
    assert "poollab pool 'best-fit' is out of memory allocating 1.0 GiB" in msg
    shim.bind(core, null_on_refusal=True)  # mempool mode: PyTorch's caching allocator retries
    assert shim.probe_malloc(1 << 30) == (0, 0, "")
    shim.bind(None)


def test_trampoline_other_errors_and_closed_pool(shim):
    core = host_core()
    shim.bind(core)
    core.close()
    code, _, msg = shim.probe_malloc(64)
    assert code == 2 and "PoolError" in msg and "closed" in msg
    shim.bind(None)
    code, _, msg = shim.probe_malloc(64)
    assert code == 2 and "after the policy's pool was closed" in msg
    before = shim.counters()["n_frees_ignored"]
    shim.call_free(0x1000, 64)  # no callbacks: ignored, nothing raised
    assert shim.counters()["n_frees_ignored"] == before + 1


def test_trampoline_checks_for_graph_capture_off_the_null_stream_only(shim):
    import ctypes

    checked = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
    def always_capturing(stream, status):  # cudaStreamIsCapturing's signature, "capturing" always
        checked.append(stream)
        status[0] = 1
        return 0

    core = host_core()
    shim.bind(core)
    shim.reset()
    shim.set_capture_check(ctypes.cast(always_capturing, ctypes.c_void_p).value)
    try:
        # the legacy null stream never captures (cudaStreamBeginCapture refuses it): no check
        code, ptr, msg = shim.probe_malloc(4096)
        assert (code, msg) == (0, "") and ptr in core.live and checked == []
        code, _, msg = shim.probe_malloc(4096, stream=0x7000)
        assert code == 2 and "refuses CUDA graph capture" in msg and checked == [0x7000]
        assert shim.breakdown()["n_capture_checks"] == 1
        assert shim.step_costs_ns(n=1000)["capture_check_ns"] > 0
    finally:
        shim.set_capture_check(None)
        shim.bind(None)
    assert np.isnan(shim.step_costs_ns(n=10)["capture_check_ns"])  # none set: nothing to time
    core.free(ptr, 4096, 0, 0)
    assert not core.live and core.errors == []


def test_trampoline_splits_a_mallocs_time_and_counts_calls_without_the_gil(shim):
    core = host_core()
    shim.bind(core)
    shim.reset()
    try:
        # every second malloc without the GIL, as PyTorch's bindings call it; frees through
        # ctypes' function pointer, which lets go of the GIL too
        ptrs = [shim.probe_malloc(4096, release_gil=i % 2 == 1)[1] for i in range(40)]
        b = shim.breakdown()
        assert b["n_calls_without_gil"] == 20
        assert b["n_split"] == 3  # every 16th malloc: the 1st, 17th and 33rd
        parts = ["capture_check", "take_gil", "python_call", "release_gil"]
        assert all(b[f"split_{k}_ns"] >= 0 for k in parts) and b["split_python_call_ns"] > 0
        # the split's parts add up to no more than the mean of all mallocs' whole times, by far
        assert sum(b[f"split_{k}_ns"] for k in parts) < 20 * shim.samples(0).mean()
        for ptr in ptrs:
            shim.call_free(ptr, 4096)
        assert shim.breakdown()["n_calls_without_gil"] == 60 and not core.live
        assert shim.counters()["n_calls_malloc"] == 40  # the summary row's counters as before
        assert "n_calls_without_gil" not in shim.counters()
    finally:
        shim.bind(None)


def test_trampoline_times_a_call_in_ns_whichever_clock_it_reads(shim):
    import time

    def slow(size, device, stream):  # 3 ms of Python in the call
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.003:
            pass
        return 1 << 21

    shim.bind(SimpleNamespace(malloc=slow, free=lambda ptr, size, device, stream: None))
    shim.reset()
    try:
        t0 = time.perf_counter_ns()
        for _ in range(5):
            shim.probe_malloc(512)
        wall_ns = (time.perf_counter_ns() - t0) / 5
    finally:
        shim.bind(None)
    samples = shim.samples(0)
    costs = shim.step_costs_ns(n=10_000)
    assert costs["call_clock"] in ("tsc", "monotonic") and costs["clock_read_ns"] > 0
    # each sample is the call as timed inside the trampoline: at least the 3 ms, within the wall
    # time
    assert samples.size == 5 and (samples >= 3_000_000).all() and samples.mean() <= wall_ns * 1.01
    assert shim.breakdown()["split_python_call_ns"] >= 3_000_000  # the first call was split


def test_trampoline_serialises_threads(shim):
    import threading
    from types import SimpleNamespace

    inside, overlaps = [], []

    def malloc(size, device, stream):
        if inside:
            overlaps.append(size)  # another thread is in the middle of a call
        inside.append(1)
        for _ in range(300):  # Python work the GIL may be handed over in
            pass
        inside.pop()
        return 1 << 21

    shim.bind(SimpleNamespace(malloc=malloc, free=lambda ptr, size, device, stream: None))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as possible

    def hammer():
        for _ in range(2000):
            shim.probe_malloc(512)  # ctypes lets go of the GIL: the threads meet in the trampoline

    try:
        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
        shim.bind(None)
    assert overlaps == []


def test_frees_during_interpreter_shutdown_raise_nothing(shim, tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from realgpu.pool import GpuPool
        from realgpu.torch_allocator import ALIGNMENT_BYTES, AllocatorCore, load_shim
        shim = load_shim()
        core = AllocatorCore(GpuPool("best-fit", backend="host", guard_bytes=ALIGNMENT_BYTES))
        shim.bind(core)
        class Tensor:  # frees in its destructor, as PyTorch's storage does
            def __init__(self, n):
                self.n, self.ptr = n, shim.probe_malloc(n)[1]
            def __del__(self):
                shim.call_free(self.ptr, self.n)
        keep = [Tensor(4096) for _ in range(100)]  # module globals: collected during shutdown
        print("ok", flush=True)
    """)
    path = tmp_path / "shutdown.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


# ---------------------------------------------------------------------- the real thing
def _run_gpu_script(body: str, timeout_s: float = 300) -> str:
    """Pluggable mode is once per process: each GPU scenario runs in its own interpreter."""
    script = f"import sys\nsys.path.insert(0, {str(REPO)!r})\n" + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.gpu
def test_pluggable_serves_tensors_maps_oom_refuses_capture_and_leaves_no_leak():
    pytest.importorskip("torch")
    out = _run_gpu_script("""
        import torch
        from realgpu.nvml import MemoryReader
        from realgpu.torch_allocator import use_policy
        reader = MemoryReader()  # not torch.cuda: that would initialise PyTorch's own allocator
        used0 = reader.used_bytes()
        with use_policy("best-fit", capacity_bytes=4 << 30) as alloc:
            xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1, 100, 513, 4096, 3 << 20)]
            assert all(x.data_ptr() % 512 == 0 for x in xs), [x.data_ptr() for x in xs]
            e = torch.empty(0, device="cuda")
            y = (torch.ones(1000, device="cuda") * 2).sum().item()
            assert y == 2000.0
            try:
                torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError as exc:
                assert "poollab pool 'best-fit' is out of memory" in str(exc), str(exc)
            else:
                raise AssertionError("no OutOfMemoryError")
            # refused before PyTorch allocates anything for the graph (its capture_begin allocates
            # the default generator's graph RNG state, two tensors held while g lives) and before
            # torch.cuda.graph switches to its capture stream
            g = torch.cuda.CUDAGraph()
            live_before, stream_before = alloc.core.num_live, torch.cuda.current_stream()
            try:
                with torch.cuda.graph(g):
                    torch.empty(1 << 20, device="cuda")
            except ValueError as exc:  # realgpu.errors.PoolError
                assert "refuses CUDA graph capture" in str(exc), str(exc)
            else:
                raise AssertionError("capture was not refused")
            assert alloc.core.num_live == live_before, (alloc.core.num_live, live_before)
            assert torch.cuda.current_stream() == stream_before
            n_live = alloc.core.num_live
            del xs, e
        row = alloc.summary_row()
        alloc.check()
        torch.cuda.synchronize()
        print("device_used_delta", reader.used_bytes() - used0, "live_at_close", row["n_live_at_close"],
              "capture_check", alloc.capture_check)
        # g is still alive: the refused capture left nothing in the policy, so every segment went back
        assert row["n_live_at_close"] == 0, row["n_live_at_close"]
        assert alloc.pool.closed and alloc.pool.device.used_bytes == 0
        assert row["n_alloc"] >= 6 and row["n_failed"] == 1
        try:
            torch.empty(16, device="cuda")
        except RuntimeError as exc:
            assert "closed" in str(exc)
        else:
            raise AssertionError("allocation after close")
    """)  # noqa: E501
    assert "device_used_delta" in out


@pytest.mark.gpu
def test_paged_serves_tensors_over_several_pages_on_the_page_mapped_device():
    # the H200's engine run: paged's worker died building the model (a weight over 8 pages not in
    # one range)
    pytest.importorskip("torch")
    out = _run_gpu_script("""
        import torch
        from realgpu.torch_allocator import use_policy
        with use_policy("paged:page_bytes=2MiB", capacity_bytes=2 << 30) as alloc:
            assert alloc.pool.device.kind == "cupy" and type(alloc.pool.device).__name__ == "CudaVmmDevice"
            small = [torch.full((1 << 18,), float(i), device="cuda") for i in range(6)]  # one page each
            del small[3], small[1]  # two free pages that are not neighbours (tensors 1 and 3)
            big = torch.arange(3 << 20, dtype=torch.float32, device="cuda")  # 12 MiB: 6 pages
            assert big.data_ptr() % 512 == 0
            assert torch.equal(big.cpu(), torch.arange(3 << 20, dtype=torch.float32))
            assert all(float(t[0]) == i for t, i in zip(small, (0, 2, 4, 5)))  # the other pages untouched
            stitched = alloc.core.n_stitched_maps
            del big
            again = torch.zeros(3 << 20, device="cuda")  # the same pages again: the range kept mapped serves
            assert alloc.core.n_stitched_maps == stitched and float(again.sum()) == 0.0
            del again, small
        row = alloc.summary_row()
        alloc.check()
        print("stitched", row["n_stitched_maps"], "live_at_close", row["n_live_at_close"])
        assert row["n_live_at_close"] == 0 and alloc.pool.closed and alloc.pool.device.physical_bytes == 0
    """)  # noqa: E501
    assert "stitched" in out


@pytest.mark.gpu
def test_pluggable_after_the_first_allocation_says_it_is_too_late():
    pytest.importorskip("torch")
    _run_gpu_script("""
        import torch
        from realgpu.errors import PoolError
        from realgpu.torch_allocator import use_policy
        x = torch.ones(4, device="cuda")
        try:
            with use_policy("best-fit"):
                pass
        except PoolError as exc:
            assert "before the process's first CUDA allocation" in str(exc), str(exc)
            assert "mode='mempool'" in str(exc)
        else:
            raise AssertionError("no PoolError")
    """)


@pytest.mark.gpu
def test_mempool_mode_equal_results_and_oom_reason():
    pytest.importorskip("torch")
    _run_gpu_script("""
        import torch
        from realgpu.torch_allocator import use_policy
        torch.manual_seed(0)
        a = torch.randn(512, 512, device="cuda")
        want = (a @ a).sum().item()
        for spec in ["best-fit", "size-class", "torch-caching"]:
            with use_policy(spec, mode="mempool", capacity_bytes=1 << 30) as alloc:
                b = a.clone()
                got = (b @ b).sum().item()
                assert got == want, (spec, got, want)
                del b
            row = alloc.summary_row()
            assert row["n_alloc"] >= 1 and row["backend"] == "torch-mempool", row
        try:
            with use_policy("best-fit", mode="mempool", capacity_bytes=64 << 20):
                torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            assert "poollab pool 'best-fit' is out of memory" in str(exc), str(exc)
        else:
            raise AssertionError("no OutOfMemoryError")
    """)


@pytest.mark.gpu
def test_mempool_mode_captures_and_replays_cuda_graphs():
    # PyTorch's graph pools do the work in mempool mode: a graph captured into its own private pool
    # (PyTorch's segments) replays right (H200 session 12); one captured into the policy's MemPool
    # from inside the block is refused up front (PyTorch refused it too, after counting one more
    # user of the pool: its 4 segments never went back)
    pytest.importorskip("torch")
    out = _run_gpu_script("""
        import torch
        from realgpu.torch_allocator import use_policy
        with use_policy("best-fit", mode="mempool", capacity_bytes=1 << 30) as alloc:
            static_in = torch.ones(1 << 20, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up on a side stream, as PyTorch asks before a capture
                warm = static_in * 2 + 1
            torch.cuda.current_stream().wait_stream(side)
            outcomes = {}
            for name, pool in (("own pool", None), ("policy's pool", alloc.mempool.id)):
                try:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        static_out = static_in * 2 + 1
                    static_in.fill_(3)
                    g.replay()
                    torch.cuda.synchronize()
                    outcomes[name] = float(static_out.sum()) == 7.0 * (1 << 20)
                    static_in.fill_(1)
                    del g, static_out
                except Exception as exc:
                    outcomes[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:60]
            del static_in, warm
        row = alloc.summary_row()
        alloc.check()
        print("outcomes", outcomes, "n_alloc", row["n_alloc"], "live_at_close", row["n_live_at_close"])
        assert outcomes["own pool"] is True, outcomes
        assert str(outcomes["policy's pool"]).startswith("PoolError: a CUDA graph captured into the policy's"), outcomes
        assert row["n_alloc"] >= 1 and row["n_live_at_close"] == 0, row
    """)  # noqa: E501
    assert "outcomes" in out


# ------------------------------------------------ the hot path's direct calls (both builds)
_COUNTED_CALLS: list[tuple] = []


class CountingBestFit(BestFit):
    """A subclass that overrides the contract's ``allocate`` and ``free``: the hot path must call
    the overrides, not the base's bookkeeping behind them."""

    name = "counting-best-fit"

    def allocate(self, nbytes, *, stream=0, tag=None):
        _COUNTED_CALLS.append(("allocate", nbytes, stream))
        return super().allocate(nbytes, stream=stream, tag=tag)

    def free(self, allocation):
        _COUNTED_CALLS.append(("free", allocation.nbytes))
        super().free(allocation)


def test_hot_path_keeps_the_policys_counters_and_calls_an_override_as_given():
    core = host_core("best-fit")
    p = core.malloc(1000, 0, 0)
    q = core.malloc(4096, 0, 0)
    pol = core.policy
    assert (pol.num_allocs, pol.live_bytes, pol.peak_live_bytes) == (2, 512 * 2 + 4096, 5120)
    core.free(p, 1000, 0, 0)
    core.free(q, 4096, 0, 0)
    assert (pol.num_frees, pol.live_bytes, core.errors) == (2, 0, [])
    _COUNTED_CALLS.clear()
    pool = GpuPool(CountingBestFit(), backend=AlignedHostDevice(), check_contents=False)
    core = AllocatorCore(pool, sample_every=1)
    p = core.malloc(1000, 0, 0)
    core.free(p, 1000, 0, 0)
    assert _COUNTED_CALLS == [("allocate", 1024, 0), ("free", 1024)]


def test_a_bad_free_through_the_hot_path_is_kept_with_the_policys_reason():
    core = host_core("best-fit")
    p = core.malloc(4096, 0, 0)
    a = core.live[p]
    core.policy.free(a)  # behind the table's back: the table's free is now a double free
    core.free(p, 4096, 0, 0)
    assert len(core.errors) == 1 and "double free" in str(core.errors[0])
    assert core.policy.num_frees == 1 and p not in core.live


def test_hot_path_finds_each_pointers_segment_as_segments_come_and_go():
    # large requests each take a new segment; freeing and releasing them shifts the segment lists
    # under the hot path's remembered segment, which must be checked, not trusted
    core = host_core("best-fit")
    sizes = [40 * MiB, 3 * MiB, 70 * MiB, 5000, 33 * MiB, 8192, 90 * MiB, 512]
    ptrs = [(core.malloc(n, 0, 0), n) for n in sizes]
    for ptr, n in ptrs[::2]:
        core.free(ptr, n, 0, 0)
    core.policy.empty_cache()  # the freed segments go: later segments move down the lists
    ptrs = ptrs[1::2] + [(core.malloc(n, 0, 0), n) for n in sizes[::-1]]
    assert len(core.live) == len(ptrs) and core.errors == []
    for ptr, _ in ptrs:
        assert ptr == core._pointer(core.live[ptr])  # the device's own address of the offset
    for ptr, n in ptrs:
        core.free(ptr, n, 0, 0)
    assert core.policy.num_live == 0 and core.errors == []
