"""``realgpu.torch_allocator``: the callback table on the host backend (no torch), the compiled
trampoline where torch is importable (no GPU needed), and the real thing on a GPU (``gpu``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import policies
from policies.base import Allocation, Policy
from realgpu.errors import CorruptionError, PoolError, PoolOutOfMemoryError
from realgpu.host import HostDevice
from realgpu.pool import GUARD_WORD, GpuPool
from realgpu.torch_allocator import ALIGNMENT_BYTES, AllocatorCore, TorchPolicyAllocator, use_policy
from sim.report import SUMMARY_COLUMNS

from .conftest import REPO

MiB = 1 << 20
FAST_POLICIES = ["best-fit", "size-class", "torch-caching", "best-fit:virtual=true"]


class AlignedHostDevice(HostDevice):
    """Host segments that start 2 MiB-aligned, as ``cudaMalloc``'s do (numpy's start 64-aligned)."""

    def _map(self, nbytes):
        mapped = super()._map(nbytes + (2 * MiB))
        if mapped is None:
            return None
        base, buf = mapped
        skip = -base % (2 * MiB)
        return base + skip, buf[skip:skip + nbytes]


def host_core(spec: str = "best-fit", *, validate: bool = False, limit_bytes: int | None = None, events=None,
              sample_every: int = 1, device=None) -> AllocatorCore:
    if device is None:
        device = AlignedHostDevice(limit_bytes=limit_bytes)
    pool = GpuPool(spec, backend=device, validate=validate, guard_bytes=ALIGNMENT_BYTES, check_contents=False)
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


# ---------------------------------------------------------------------- the callback table
@pytest.mark.parametrize("spec", FAST_POLICIES)
def test_every_pointer_is_512_aligned_and_the_cost_is_counted(spec):
    core = host_core(spec, device=HostDevice())
    sizes = [1, 100, 511, 512, 513, 4096, 5000, 100_000, 3 * MiB + 7]
    ptrs = [core.malloc(n, 0, 0) for n in sizes]
    assert all(p % ALIGNMENT_BYTES == 0 for p in ptrs)
    assert len(set(ptrs)) == len(ptrs)
    # numpy's segments start 64-aligned, not 512: what is not aligned is asked again, padded
    assert core.n_align_padded > 0
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
    assert (after.num_live, after.live_bytes, after.reserved_bytes) == (before.num_live, before.live_bytes,
                                                                       before.reserved_bytes)
    assert list(core.live) == [p]


class _SameOffset(Policy):
    """A broken policy: every request at offset 0 of one segment."""

    def __init__(self, *, capacity_bytes=None):
        super().__init__(capacity_bytes=capacity_bytes)

    def _reset_state(self):
        self._segment = None

    def _allocate(self, nbytes, stream, tag):
        if self._segment is None:
            self._segment = self._reserve_segment(2 * MiB)
        return Allocation(nbytes, nbytes, ((self._segment.offset, nbytes),), stream, tag)

    def _free(self, a):
        pass

    def _release_free_segments(self, max_bytes):
        return 0

    def _add_segment(self, segment):
        pass

    def free_extents(self):
        return []


def test_a_pointer_handed_out_twice_is_refused():
    pool = GpuPool(_SameOffset(), backend=HostDevice())
    core = AllocatorCore(pool)
    p = core.malloc(1024, 0, 0)
    with pytest.raises(PoolError, match="again while it is live"):
        core.malloc(1024, 0, 0)
    assert list(core.live) == [p]


def test_frees_wait_for_their_stream_once_two_streams_allocate():
    events = FakeEvents()
    core = host_core(events=events)
    a = core.malloc(4096, 0, 11)
    core.free(a, 4096, 0, 11)  # one stream so far: freed at once, as PyTorch does
    assert core.policy.num_live == 0 and not events.recorded
    a = core.malloc(4096, 0, 11)
    b = core.malloc(4096, 0, 22)
    core.free(a, 4096, 0, 11)
    assert core.policy.num_live == 2 and core.n_deferred_frees == 1  # stream 11 may still be using it
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
    offset = a.extents[0][0] + ALIGNMENT_BYTES + 1024  # first byte past the rounded request: the after-guard
    assert core.n_align_padded == 0
    view = pool.device.view(offset, 1)
    assert view[0] == GUARD_WORD & 0xFF
    view[0] ^= 0xFF
    core.free(p, 1000, 0, 0)  # must not raise
    assert len(core.errors) == 1 and isinstance(core.errors[0], CorruptionError)
    assert core.errors[0].region == "guard-after" and core.policy.num_live == 0


def test_discontiguous_pages_are_refused_and_freed():
    core = host_core("paged:tokens_per_page=1,bytes_per_token=4096")
    keep = [core.malloc(4096, 0, 0) for _ in range(4)]
    core.free(keep[1], 4096, 0, 0)
    core.free(keep[3], 4096, 0, 0)
    live = core.policy.num_live
    with pytest.raises(PoolError, match="discontiguous"):
        core.malloc(3 * 4096, 0, 0)
    assert core.policy.num_live == live


def test_summary_row_is_the_report_row():
    core = host_core(sample_every=4)
    alloc = TorchPolicyAllocator(core.pool, core, "pluggable", None)
    ptrs = [core.malloc(n, 0, 0) for n in (1000, 2000, 3000)]
    for p in ptrs:
        core.free(p, 0, 0, 0)
    alloc.close()
    row = alloc.summary_row(trace="generate-8x128")
    assert list(row)[:len(SUMMARY_COLUMNS)] == SUMMARY_COLUMNS
    assert row["trace"] == "generate-8x128" and row["backend"] == "torch-pluggable"
    assert row["n_alloc"] == 3 and row["n_free"] == 3 and row["n_failed"] == 0
    assert row["align_extra_bytes"] == core.align_extra_bytes and row["n_live_at_close"] == 0
    assert alloc.stats().num_allocs == 3  # kept after the pool was released
    assert core.pool.closed


def test_a_moving_policy_is_refused():
    with pytest.raises(PoolError, match="move live allocations"):
        host_core("compacting:base=best-fit")


def test_bad_mode_is_one_clear_error():
    with pytest.raises(PoolError, match="mode"):
        with use_policy("best-fit", mode="paged-attention"):
            pass


# ---------------------------------------------------------------------- the compiled trampoline (torch, no GPU)
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
    assert counters["n_calls_malloc"] == 1 and counters["n_calls_free"] == 1 and counters["n_zero_bytes"] == 1
    assert len(shim.samples(0)) == 1 and shim.samples(0)[0] > 0
    shim.bind(None)


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
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s)
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
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(s):
                    with torch.cuda.graph(g):
                        torch.empty(1 << 20, device="cuda")
            except Exception as exc:  # capture_end may raise on top of ours: look down the chain
                chain = [exc, exc.__context__, exc.__cause__]
                assert any("refuses CUDA graph capture" in str(e) for e in chain if e), [str(e) for e in chain]
            else:
                raise AssertionError("capture was not refused") if alloc.capture_check else None
            torch.cuda.current_stream().wait_stream(s)
            n_live = alloc.core.num_live
            del xs, e
        row = alloc.summary_row()
        alloc.check()
        torch.cuda.synchronize()
        print("device_used_delta", reader.used_bytes() - used0, "live_at_close", row["n_live_at_close"],
              "capture_check", alloc.capture_check)
        assert alloc.pool.closed and alloc.pool.device.used_bytes == 0  # every segment went back
        assert row["n_alloc"] >= 6 and row["n_failed"] == 1
        try:
            torch.empty(16, device="cuda")
        except RuntimeError as exc:
            assert "closed" in str(exc)
        else:
            raise AssertionError("allocation after close")
    """)
    assert "device_used_delta" in out


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
