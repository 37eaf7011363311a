"""Any poollab policy as PyTorch's CUDA allocator.

``use_policy(policy, mode=...)`` is a context manager that yields a ``TorchPolicyAllocator``:

- ``mode="pluggable"``: every CUDA allocation of the process goes through the policy
  (``torch._C._cuda_customAllocator`` + ``torch.cuda.memory.change_current_allocator``). PyTorch
  allows this only before its first CUDA allocation, and never swaps back: after the block,
  a new CUDA allocation fails with a message saying so; frees of tensors still alive keep going
  to the policy, and its segments are released when the last one is freed.
- ``mode="mempool"``: PyTorch's caching allocator stays, and the policy supplies the segments it
  splits (``torch.cuda.MemPool(allocator)``, routed as ``torch.cuda.use_mem_pool`` routes it), for
  the allocations of the calling thread inside the block. Works at any time and next to PyTorch's
  own pool. PyTorch routes a pool for one thread at a time: ``pause_routing`` hands it to another
  thread (an engine's), ``resume_routing`` takes it back.

Both go through ``realgpu.GpuPool`` (backend ``"cuda"``), so the policy's ``PoolStats``, the
per-call latency samples and validation mode (patterns and guards, checked on every free) are
``GpuPool``'s, and ``summary_row`` is ``sim.replay.schema.summary_row``'s row.

PyTorch calls a compiled trampoline (``realgpu/_torch_shim.cpp``, built at first use with
``torch.utils.cpp_extension.load`` and cached in torch's extension folder), which calls
``AllocatorCore.malloc``/``free`` under the GIL: the methods of ``realgpu.malloc_path.TorchPath``,
C in the compiled build (``POOLLAB_COMPILE=1``), where the trampoline calls their C functions by
address (``TorchPath.entry_addresses``). ``AllocatorCore`` is plain Python over a
``GpuPool`` and imports no torch, so CI tests the callback table on the host backend.

What the core guarantees, whatever the policy:

- every pointer is aligned to ``ALIGNMENT_BYTES`` (512, PyTorch's own guarantee): requests are
  rounded up to it; a policy that still places one off it (a size class that is no multiple of
  512) is asked again for ``ALIGNMENT_BYTES`` more and the pointer moved up (``n_align_padded``;
  the bytes that costs are ``align_extra_bytes`` on top of the rounding);
- a policy whose allocations are pages (``contiguous`` False: paged, page-pool, vmm-stitch, a
  wrapper over one) runs on the page-mapped backend (``cuda-vmm``), and a tensor over pages that
  are not one range gets a virtual range of its own with those pages' physical memory mapped in
  it, in order (kept mapped after the free for the same pages again, ``MAX_IDLE_STITCHED_RANGES``,
  unmapped in batches past that, and at once when the policy refuses a request; a kept range that
  holds a new tensor's pages in adjacent slots, in any order, serves it as it is; a kept range
  over most of a new tensor's pages, its GPU work done, is taken over with only the other pages
  remapped, the shared ones left in their places, one access call per run of remapped pages);
  such a policy is refused up front, in one line, on a segment device, in validation mode, or with
  pages that are no whole number of the device's physical pages;
- a 0-byte request gets a null pointer without calling the policy (as PyTorch's own allocator);
- a pointer already live that the policy hands out again is refused (a policy bug), and a free
  of an unknown pointer (double free) changes nothing and is kept in ``errors`` (a free may
  not raise: PyTorch calls it from destructors);
- once a second stream allocates, a free is deferred until the work queued on the
  allocation's stream is done (a CUDA event), so memory freed on one stream is never handed to
  another stream while the first may still use it; ``Tensor.record_stream`` is not seen by a
  pluggable allocator, so in pluggable mode it raises (use mempool mode for that);
- CUDA graph capture: in mempool mode PyTorch's own graph-pool hooks do the work (a graph captured
  with its own pool, whose memory is PyTorch's, replays correctly: H200 session 12; a capture into
  the policy's pool from inside the block is refused up front, ``MEMPOOL_CAPTURE_REFUSAL``); in
  pluggable mode ``CUDAGraph.capture_begin`` (and ``torch.cuda.graph``) is refused before PyTorch
  allocates anything for the graph, with a message saying to use mempool mode (a malloc during a
  capture begun from C++ is refused by the trampoline);
- a refused request is PyTorch's own ``torch.OutOfMemoryError`` with the policy's reason (in
  mempool mode PyTorch frees its cached blocks and retries first; when the error leaves the
  ``use_policy`` block it carries the policy's reason too);
- teardown: frees that arrive while the interpreter shuts down, or after the pool is gone, do
  nothing and raise nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections import OrderedDict
import functools
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from policies._blocks import Block
from policies.base import Allocation, Policy, PoolStats
from policies.device import SEGMENT_ALIGNMENT_BYTES
from policies.device_kind import DeviceKind
from realgpu.errors import GpuUnavailableError, PoolError, PoolOutOfMemoryError
from realgpu.host import HostDevice
from realgpu.malloc_path import ALIGNMENT_BYTES, TorchPath, extents_are_one_range
from realgpu.pool import GpuPool
from sim.replay.metrics import PoolMonitor

__all__ = [
    "use_policy",
    "TorchPolicyAllocator",
    "AllocatorCore",
    "ALIGNMENT_BYTES",
    "MODES",
    "load_shim",
    "Shim",
    "CudaStreamEvents",
    "AlignedHostDevice",
    "host_allocator_core",
]

MODES = ("pluggable", "mempool")
#: Stitched ranges kept mapped after their allocation is freed (``AllocatorCore._stitch``): address
#: space only (their pages are the policy's, mapped in its segments too), so many are kept. Past it
#: the least recently used ``IDLE_EVICT_BATCH`` go at once: unmapping waits for the GPU's queued
#: work (``MappedRealDevice.unmap``), and in a batch only the first unmap waits (issue 30: one
#: eviction, so one device synchronize, per fresh stitch made ``paged`` 1.3-4x slower)
MAX_IDLE_STITCHED_RANGES = 1024
IDLE_EVICT_BATCH = 256
#: Kept ranges (most recently freed first) looked at for one with most of a new tensor's pages.
TAKE_OVER_CANDIDATES = 64
#: Monitor sample stride, in allocator calls (the summary's fragmentation averages).
DEFAULT_SAMPLE_EVERY = 256
_SHIM_SOURCE = Path(__file__).with_name("_torch_shim.cpp")
_lock = threading.Lock()


class AllocatorCore:
    """The callback table PyTorch's allocator calls, over a ``GpuPool``: no torch here.

    Args:
        pool: the policy's pool (any backend: ``"cuda"`` under PyTorch, ``"host"`` in tests).
        events: what defers frees once several streams allocate (``CudaStreamEvents`` on the
            GPU; tests pass a fake): ``record(stream) -> token``, ``done(token) -> bool``,
            ``wait(token)``.
        sample_every: monitor sample stride in calls.
        on_drained: called once when a closed core's last live allocation is freed.

    ``malloc(size, device, stream) -> int`` and ``free(ptr, size, device, stream)`` are what the
    trampoline calls (``size`` > 0 and ``ptr`` != 0 there: it answers those itself).
    """

    def __init__(
        self,
        pool: GpuPool,
        *,
        events: Any = None,
        sample_every: int = DEFAULT_SAMPLE_EVERY,
        on_drained: Callable[[], None] | None = None,
    ):
        if pool.moves_on_hot_path:
            raise PoolError(
                f"policy {pool.policy.spec!r} may move live allocations while allocating; "
                "PyTorch's tensors hold raw pointers that could not follow (set idle_only=true)"
            )
        self.pool = pool
        self.policy = pool.policy
        self.events = events
        self.monitor = PoolMonitor(pool.policy, sample_every=1)
        self._sample_every = sample_every
        self._event = 0  # the event index of the next sample (calls counted by the sampling stride)
        self._t0_ns = time.perf_counter_ns()
        self.on_drained = on_drained
        #: errors met in free (double or unknown frees, corruption found by validation)
        self.errors: list[BaseException] = []
        self.streams: set[int] = set()
        self._pending: list[tuple[Any, Allocation]] = []
        self.closed = False
        self.last_refusal = ""
        self.n_align_padded = 0
        self.n_deferred_frees = 0
        #: mallocs that left the hot path after the policy's call or without one (``_place``: a
        #: refusal, a realignment, a live pointer, pages to stitch, validation, deferred frees, a
        #: new stream); counted off the hot path, so it costs the common case nothing
        self.n_slow_mallocs = 0
        self.n_zero_bytes = 0
        self.n_stitched_maps = 0  # ranges mapped for tensors over pages that are not one range
        self.n_stitch_reuses = (
            0  # tensors over such pages served by a range kept mapped (no driver call)
        )
        self.n_idle_evictions = 0  # batches of kept ranges unmapped (each waits for the GPU once)
        self.n_stitch_takeovers = (
            0  # tensors served by a kept range with some of its pages remapped
        )
        self.n_stitch_pages_remapped = 0
        #: tensors over such pages served by a kept range that holds them in adjacent slots, in
        #: another order or among more (no driver call)
        self.n_stitch_inside_reuses = 0
        self._defer_frees = False
        self._validate = pool.validate
        self._free_policy = pool.free if pool.validate else pool.policy.free
        #: a policy whose allocations are pages (``contiguous`` False) serves PyTorch on a
        #: page-mapped device only: an allocation whose pages are not one range gets a fresh
        #: virtual range with its pages' physical memory mapped there in order (``_stitch``)
        self._stitched: dict[
            int, tuple[tuple[int, ...], int, int]
        ] = {}  # id(allocation) -> (pages, range, bytes)
        #: ranges whose allocation was freed, kept mapped for a later one over the same pages in the
        #: same order (the policy's LIFO reuse hands those out again: no driver call then), least
        #: recently used first; past ``MAX_IDLE_STITCHED_RANGES`` the oldest ``IDLE_EVICT_BATCH`` go
        self._idle_ranges: OrderedDict[tuple[int, ...], tuple[int, int, Any]] = OrderedDict()
        if not pool.policy.contiguous:
            _check_pages_can_be_stitched(pool)
            self._free_policy = self._free_unstitch
        self._allocate = _validated_allocate(pool) if pool.validate else pool.policy.allocate
        self._address = pool.device.address
        starts, bases = pool.device.address_tables()
        self._starts = starts
        #: the hot path (``realgpu.malloc_path.TorchPath``; C in the compiled build): PyTorch's
        #: two calls are its methods, bound here over the class's, so the trampoline lands on
        #: them with no frame between; it keeps the counters both paths share
        self.path = TorchPath(self, self._allocate, self._free_policy, starts, bases)
        #: pointer -> allocation, for every live pointer handed to PyTorch: the path's map (a
        #: ``dict``'s subset; ``realgpu.live_map.LiveMap`` with C keys in the compiled build)
        self.live = self.path.live
        self.malloc = self.path.malloc
        self.free = self.path.free
        self._update_fast()

    # ------------------------------------------------------------------ the callbacks
    def malloc(self, size: int, device: int, stream: int) -> int:
        """Allocate ``size`` bytes for PyTorch on ``stream``: the pointer (aligned to 512 B).

        The instance's ``malloc`` is ``self.path.malloc`` (this documents it): the common case
        there, the rest in ``_malloc``/``_place``. Calls from other threads wait in the
        trampoline (one call at a time, the GIL let go while waiting).

        Raises:
            PoolOutOfMemoryError: the policy cannot place it (the trampoline makes it PyTorch's).
            PoolError: the pool is closed, or the policy broke a rule a pointer needs.
        """
        return self.path.malloc(size, device, stream)

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        """Give the allocation at ``ptr`` back (deferred while another stream may use it). Never
        raises. The instance's ``free`` is ``self.path.free``; the rest in ``_free``."""
        self.path.free(ptr, size, device, stream)

    def _malloc(self, size: int, stream: int) -> int:
        """``malloc`` off the common case (``path.in_malloc`` is set by the caller)."""
        if size <= 0:
            self.n_zero_bytes += 1
            return 0
        if self.closed:
            raise PoolError(
                f"the poollab allocator for {self.policy.spec!r} is closed "
                "(PyTorch's own allocator cannot be put back in this process once "
                "a pluggable allocator was installed)"
            )
        if stream != self.path.last_stream:
            self._note_stream(stream)
        if self._pending:
            self._drain(wait=False)
        nbytes = (size + ALIGNMENT_BYTES - 1) & -ALIGNMENT_BYTES
        return self._place(self._allocate(nbytes, stream=stream), size, nbytes, stream)

    def _place(self, a: Allocation | None, size: int, nbytes: int, stream: int) -> int:
        """The pointer for the policy's answer ``a`` to a request of ``size`` (asked as ``nbytes``):
        a refusal retried once deferred frees are done, then refused; the pointer aligned; a
        pointer already live refused."""
        self.n_slow_mallocs += 1
        if a is None and self._pending:
            self._drain(wait=True)  # memory that waits for another stream's work: wait, then retry
            a = self._allocate(nbytes, stream=stream)
        if a is None and self._idle_ranges:
            # kept ranges hold the physical pages of segments the policy released meanwhile (its
            # trim on a refusal): unmapped, that memory goes back to the device; then retry
            self._drop_idle_ranges()
            a = self._allocate(nbytes, stream=stream)
        if a is None:
            raise self._refuse(size)
        ptr = self._pointer(a)
        if ptr & (ALIGNMENT_BYTES - 1):
            ptr, a = self._realign(a, nbytes, stream)
        path = self.path
        path.extra_bytes += nbytes - size
        live = self.live
        if ptr in live:
            self._free_policy(a)
            raise PoolError(
                f"policy {self.policy.spec!r} handed out address 0x{ptr:x} again while it is live "
                f"({live[ptr].size_bytes:,} B there): two tensors would share memory"
            )
        live[ptr] = a
        path.countdown -= 1
        if not path.countdown:
            self._sample()
        return ptr

    def _free(self, ptr: int, size: int) -> None:
        """``free`` off the common case (deferred frees, validation, a closed core). Never
        raises."""
        try:
            a = self.live.pop(ptr, None)
            if a is None:
                self._free_unknown(ptr, size)
                return
            if self._defer_frees:
                self.n_deferred_frees += 1
                self._pending.append((self.events.record(a.stream), a))
            elif self._validate:
                self._free_validated(a)
            else:
                self._free_policy(a)
            path = self.path
            path.countdown -= 1
            if not path.countdown:
                self._sample()
            if self.closed and not self.live:
                self._finish()
        except Exception as exc:  # noqa: BLE001 - PyTorch calls this from destructors
            self.errors.append(exc)

    def _free_unknown(self, ptr: int, size: int) -> None:
        self.errors.append(
            PoolError(
                f"free of 0x{ptr:x} ({size:,} B): "
                f"not a live pointer of policy {self.policy.spec!r} "
                "(double free, or never allocated here)"
            )
        )

    def _free_queued(self) -> None:
        path = self.path
        queued, path.queued = path.queued, []
        for ptr, size in queued:
            path.free(ptr, size, 0, 0)

    def _update_fast(self) -> None:
        """Whether the hot path may serve: no validation, no deferred frees, not closed."""
        self.path.fast = not (self._validate or self._defer_frees or self.closed)

    @property
    def align_extra_bytes(self) -> int:
        """Bytes asked beyond the requests, summed over all allocations (rounding and
        realignment)."""
        return self.path.extra_bytes

    # ------------------------------------------------------------------ helpers
    def _pointer(self, a: Allocation) -> int:
        if self._validate:
            if len(a.extents) != 1:
                self._require_contiguous(a)
            return self.pool.pointer(a)
        if type(a) is Block:
            return self._address(a.offset)
        ext = a.extents
        if len(ext) != 1 and not extents_are_one_range(ext, self._starts):
            return self._stitch(a)
        return self._address(ext[0][0])

    def _require_contiguous(self, a: Allocation) -> None:
        if not extents_are_one_range(a.extents, self._starts):
            self._free_policy(a)
            raise PoolError(
                f"policy {self.policy.spec!r} placed {a.nbytes:,} B "
                f"in {len(a.extents)} discontiguous pages; "
                "a PyTorch tensor needs one contiguous range "
                "(in validation mode a paged policy serves PyTorch only requests of one page)"
            )

    def _stitch(self, a: Allocation) -> int:
        """The address of a virtual range with ``a``'s pages mapped in it; its pages stay mapped
        where the policy put them too. A kept range over the same pages in the same order serves
        with no driver call; else a kept range over mostly the same pages (``_take_over``) has only
        the others remapped; else a fresh one (one ``cuMemAddressReserve``, a ``cuMemMap`` per
        physical page, one ``cuMemSetAccess``: the driver calls vmm-stitch models), in order."""
        device = self.pool.device
        handles = []
        for offset, length in a.extents:
            end = offset + length
            while offset < end:  # every page starts a mapping (``_check_pages_can_be_stitched``)
                handle = device.handle_at(offset)
                handles.append(handle)
                offset += device._handles[handle]  # the handle's bytes: the model's own table
        key = tuple(handles)
        idle = self._idle_ranges.pop(key, None)
        at = 0  # where the tensor starts in its range
        if idle is not None:
            start, nbytes, _ = idle
            self.n_stitch_reuses += 1
        elif (inside := self._run_inside_kept(key)) is not None:
            key, start, nbytes, at = inside
            self.n_stitch_inside_reuses += 1
        elif (taken := self._take_over(handles)) is not None:
            key, start, nbytes = taken
        else:
            nbytes = sum(length for _, length in a.extents)
            start = device.address_reserve(nbytes)
            if start is None:
                self._free_policy(a)
                raise self._refuse(nbytes)
            device.map_handles(start, handles)
            self.n_stitched_maps += 1
        self._stitched[id(a)] = (key, start, nbytes)
        return device.address(start + at)

    def _run_inside_kept(
        self, key: tuple[int, ...]
    ) -> tuple[tuple[int, ...], int, int, int] | None:
        """A kept range among the ``TAKE_OVER_CANDIDATES`` most recent that holds ``key``'s pages in
        adjacent slots, in any order, alone or among more: ``(its pages, start, bytes, the
        tensor's offset in it)``, or None. It serves with no driver call and no wait (nothing is
        remapped: its other pages stay mapped there, unused by this tensor), and goes back to the
        kept ranges whole at the free.

        The order of the pages does not matter to PyTorch (a fresh tensor's bytes are undefined;
        only the tensor reads them, through this range), as a take-over already leaves the shared
        pages in their slots. The two cases this serves: a taken-over range holds the tensor's
        pages in another order than the policy hands them out the next time; and the paged
        policy's LIFO stack hands a freed tensor's pages out again first page first, so a smaller
        tensor after a larger one lands on the start of the larger one's pages."""
        n = len(key)
        wanted = set(key)
        sizes = self.pool.device._handles
        for k, (kept, value) in enumerate(reversed(self._idle_ranges.items())):
            if k >= TAKE_OVER_CANDIDATES:
                break
            if len(kept) < n or key[0] not in kept or not wanted.issubset(kept):
                continue
            slots = [i for i, h in enumerate(kept) if h in wanted]  # a page sits once in a range
            if slots[-1] - slots[0] == n - 1:  # adjacent
                self._idle_ranges.pop(kept)
                return kept, value[0], value[1], sum(sizes[h] for h in kept[: slots[0]])
        return None

    def _free_unstitch(self, a: Allocation) -> None:
        """The policy's free; the allocation's own range (if it got one) kept mapped for reuse."""
        stitched = self._stitched.pop(id(a), None)
        if stitched is not None:
            key, start, nbytes = stitched
            idle = self._idle_ranges
            # when the work queued on the range is done, its pages may be remapped (``_take_over``)
            idle[key] = (
                start,
                nbytes,
                self.events.record(a.stream) if self.events is not None else None,
            )
            if len(idle) > MAX_IDLE_STITCHED_RANGES:
                self.n_idle_evictions += 1
                for _ in range(min(IDLE_EVICT_BATCH, len(idle))):
                    self._unmap_range(*idle.popitem(last=False)[1][:2])
        self.policy.free(a)

    def _take_over(self, handles: list[int]) -> tuple[tuple[int, ...], int, int] | None:
        """A kept range of as many pages of one size, most of them ``handles``' and its queued work
        done (its event), remapped so that it holds exactly ``handles``: the pages it shares stay
        in their places, the others are unmapped (no device wait: the event said it is idle) and
        ``handles``' other pages mapped there. ``(slots, start, bytes)``, or None when no kept range
        among the ``TAKE_OVER_CANDIDATES`` most recent shares at least half of the pages.

        The LIFO stack the paged policy reuses pages from is shifted by a small request taken in
        between, so the same tensor comes back over pages that differ from a kept range's by one or
        two (418 of 619 fresh ranges in the bundled generate slice): remapping those costs an
        unmap, a map and an access call a page, where a fresh range costs a map and an access call
        for every page, and an unmap each again when it is evicted."""
        device = self.pool.device
        sizes = device._handles
        page = sizes[handles[0]]
        n = len(handles)
        if any(sizes[h] != page for h in handles):
            return None
        wanted = set(handles)
        best, best_shared = None, n // 2
        for k, (key, value) in enumerate(reversed(self._idle_ranges.items())):
            if k >= TAKE_OVER_CANDIDATES:
                break
            if len(key) != n or any(sizes.get(h) != page for h in key):
                continue
            shared = len(wanted.intersection(key))
            if shared > best_shared and (value[2] is None or self.events.done(value[2])):
                best, best_shared = key, shared
        if best is None:
            return None
        start, nbytes, _ = self._idle_ranges.pop(best)
        incoming = iter([h for h in handles if h not in set(best)])
        slots = list(best)
        replaced = [i for i, h in enumerate(best) if h not in wanted]
        for i in replaced:
            offset = start + i * page
            for gone in device.unmap(offset, page, wait=False):
                if (
                    device._handle_maps[gone] == 0
                ):  # its segment released meanwhile: its memory goes back
                    device.release_handle(gone)
            slots[i] = next(incoming)
            device.map(offset, slots[i])
        # one access call per run of adjacent remapped slots, not one a page (cuMemSetAccess
        # covers many mappings; its time still grows with the mappings it covers)
        run = 0
        for j, i in enumerate(replaced):
            if j + 1 == len(replaced) or replaced[j + 1] != i + 1:
                first = replaced[run]
                device.set_access(start + first * page, (i + 1 - first) * page)
                run = j + 1
        self.n_stitch_takeovers += 1
        self.n_stitch_pages_remapped += n - best_shared
        return tuple(slots), start, nbytes

    def _unmap_range(self, start: int, nbytes: int) -> None:
        # unmap_release: a page whose segment the policy released meanwhile is mapped nowhere
        # else now, and its memory goes back here; the device waits for queued work first
        device = self.pool.device
        device.unmap_release(start, nbytes)
        device.address_free(start, nbytes)

    def _drop_idle_ranges(self) -> None:
        while self._idle_ranges:
            self._unmap_range(*self._idle_ranges.popitem(last=False)[1][:2])

    def _realign(self, a: Allocation, nbytes: int, stream: int) -> tuple[int, Allocation]:
        """Ask again for ``ALIGNMENT_BYTES`` more and move the pointer up to the next boundary."""
        self._free_policy(a)
        padded = nbytes + ALIGNMENT_BYTES
        b = self._allocate(padded, stream=stream)
        if b is None:
            raise self._refuse(padded)
        self.n_align_padded += 1
        self.path.extra_bytes += ALIGNMENT_BYTES
        ptr = self._pointer(b)
        return (ptr + ALIGNMENT_BYTES - 1) & -ALIGNMENT_BYTES, b

    def _refuse(self, nbytes: int) -> PoolOutOfMemoryError:
        exc = self.pool._oom(nbytes)
        self.last_refusal = str(exc)
        return exc

    def _free_validated(self, a: Allocation) -> None:
        if a.stream and self.events is not None:
            self.events.wait(
                self.events.record(a.stream)
            )  # the guard check reads what that stream wrote
        self._free_policy(a)

    def _note_stream(self, stream: int) -> None:
        self.path.last_stream = stream
        self.streams.add(stream)
        # once a second stream allocates, memory freed on one may be handed to another
        self._defer_frees = self.events is not None and len(self.streams) > 1
        self._update_fast()

    def _drain(self, *, wait: bool) -> None:
        """Free the deferred allocations whose stream's work is done (all of them, waiting, if
        ``wait``)."""
        keep = []
        for token, a in self._pending:
            if wait:
                self.events.wait(token)
            elif not self.events.done(token):
                keep.append((token, a))
                continue
            try:
                self._free_policy(a)
            except Exception as exc:  # noqa: BLE001 - a corruption found on a deferred free
                self.errors.append(exc)
        self._pending = keep

    def _sample(self) -> None:
        # the k-th sample is taken at call 1 + k * sample_every: its event index is k * sample_every
        self.path.countdown = self._sample_every
        self.monitor.sample(self._event, (time.perf_counter_ns() - self._t0_ns) // 1000)
        self._event += self._sample_every

    # ------------------------------------------------------------------ state
    @property
    def num_live(self) -> int:
        return len(self.live)

    def check(self) -> None:
        """Raise the first error a free met (double free, corruption), if any."""
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        """Refuse new requests; release the pool now, or when the last live allocation is freed."""
        if self.closed:
            return
        self.closed = True
        self._update_fast()
        if self._pending:
            self._drain(wait=True)
        if not self.live:
            self._finish()

    def _finish(self) -> None:
        # the last call's index: k samples taken, countdown c left since the last => k*S - c
        self.monitor.finish(
            max(0, self._event - self.path.countdown),
            (time.perf_counter_ns() - self._t0_ns) // 1000,
        )
        self._drop_idle_ranges()
        if not self.pool.closed:
            self.pool.close()
        if self.on_drained is not None:
            self.on_drained()
            self.on_drained = None


class AlignedHostDevice(HostDevice):
    """The host backend with segments that start 2 MiB-aligned, as ``cudaMalloc``'s do (numpy's
    arrays start 64-aligned, which would send every request down the realignment path): the CPU
    stand-in for the tests and the per-call benchmark."""

    def _map(self, nbytes: int):
        mapped = super()._map(nbytes + SEGMENT_ALIGNMENT_BYTES)
        if mapped is None:
            return None
        base, buf = mapped
        skip = -base % SEGMENT_ALIGNMENT_BYTES
        return base + skip, buf[skip : skip + nbytes]


def _validated_allocate(pool: GpuPool) -> Callable[..., Allocation | None]:
    """``pool.allocate`` with guards (PyTorch writes the data, so only guards are checked), None
    when refused, as the policy's own ``allocate`` answers."""

    def allocate(nbytes: int, *, stream: int) -> Allocation | None:
        try:
            return pool.allocate(nbytes, stream=stream, contents=False)
        except PoolOutOfMemoryError:
            return None

    return allocate


class CudaStreamEvents:
    """CUDA events through CuPy (which the pool's backend already uses): never through PyTorch,
    whose allocator is the caller."""

    def __init__(self, device_id: int = 0):
        import cupy

        self._cupy = cupy
        self.device_id = device_id

    def record(self, stream: int):
        cp = self._cupy
        with cp.cuda.Device(self.device_id):
            event = cp.cuda.Event(block=False, disable_timing=True)
            event.record(cp.cuda.ExternalStream(stream) if stream else cp.cuda.Stream.null)
        return event

    def done(self, event) -> bool:
        return event.done

    def wait(self, event) -> None:
        event.synchronize()


# ---------------------------------------------------------------------- the compiled trampoline
class Shim:
    """The loaded trampoline library: its function addresses, callbacks, counters and samples."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.PyDLL(
            path
        )  # PyDLL: calls keep the GIL (set_callbacks takes Python objects)
        self.lib.poollab_set_callbacks.argtypes = [ctypes.py_object, ctypes.py_object, ctypes.c_int]
        self.lib.poollab_set_entries.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.poollab_set_capture_check.argtypes = [ctypes.c_void_p]
        self.lib.poollab_samples.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_int64),
            ctypes.c_size_t,
        ]
        self.lib.poollab_samples.restype = ctypes.c_size_t
        self.lib.poollab_counter.argtypes = [ctypes.c_int]
        self.lib.poollab_counter.restype = ctypes.c_uint64
        self.lib.poollab_probe_malloc.argtypes = [
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        self.lib.poollab_time_steps.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
        self.lib.poollab_time_steps.restype = ctypes.c_int64
        raw = ctypes.CDLL(path)  # the hot entry points' addresses, for PyTorch
        # CDLL lets go of the GIL around a call, as PyTorch's Python bindings do before an op runs
        self._probe_released = raw.poollab_probe_malloc
        self._probe_released.argtypes = self.lib.poollab_probe_malloc.argtypes
        self.malloc_address = ctypes.cast(raw.poollab_malloc, ctypes.c_void_p).value
        self.free_address = ctypes.cast(raw.poollab_free, ctypes.c_void_p).value
        self._free = ctypes.CFUNCTYPE(
            None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
        )(self.free_address)

    def bind(self, core: AllocatorCore | None, *, null_on_refusal: bool = False) -> None:
        """Route the trampoline to ``core`` (None: to nothing; frees then do nothing): to its hot
        path's C functions where it has them (the compiled ``TorchPath.entry_addresses``: no
        Python call a malloc or free), else to its ``malloc``/``free`` callables."""
        if core is None:
            self.lib.poollab_set_callbacks(None, None, 0)
            return
        self.lib.poollab_set_callbacks(core.malloc, core.free, int(null_on_refusal))
        path = getattr(core, "path", None)  # a stand-in with callables only (benchmarks) has none
        entries = path.entry_addresses() if path is not None else None
        if entries is not None:
            self.lib.poollab_set_entries(path, *entries)

    def uses_entries(self) -> bool:
        """Whether the trampoline calls the compiled hot path's C functions (else callables)."""
        return bool(self.lib.poollab_uses_entries())

    def set_capture_check(self, address: int | None) -> None:
        self.lib.poollab_set_capture_check(address)

    def reset(self) -> None:
        self.lib.poollab_reset_counters()

    def samples(self, kind: int) -> np.ndarray:
        n = int(self.lib.poollab_samples(kind, None, 0))
        out = np.empty(n, dtype=np.int64)
        self.lib.poollab_samples(kind, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), n)
        return out

    def calls_samples(self, kind: int, n0: int, n1: int) -> tuple[np.ndarray, int]:
        """The kept samples (ns) of calls ``n0`` to ``n1`` (0-based, ``n1`` excluded; kind 0
        malloc, 1 free) and the stride they were kept at (``samples_of_calls``)."""
        name = "malloc" if kind == 0 else "free"
        c = self.counters()
        return samples_of_calls(
            self.samples(kind), c[f"sample_stride_{name}"], c[f"n_calls_{name}"], n0, n1
        )

    def counters(self) -> dict[str, int]:
        c = self.lib.poollab_counter
        return {
            "n_calls_malloc": int(c(0)),
            "n_calls_free": int(c(1)),
            "n_zero_bytes": int(c(2)),
            "n_frees_ignored": int(c(3)),
            # kept sample i of ``samples(kind)`` is call i * stride (thinned past the capacity)
            "sample_stride_malloc": int(c(12)),
            "sample_stride_free": int(c(13)),
        }

    def probe_malloc(
        self, size: int, stream: int = 0, *, release_gil: bool = False
    ) -> tuple[int, int, str]:
        """Call the trampoline's malloc as PyTorch does, catching what it throws (tests without a
        GPU): ``(code, pointer, message)``, code 0 ok, 1 ``c10::OutOfMemoryError``, 2 another
        ``c10::Error``. ``release_gil``: the GIL let go around the call, so that the trampoline
        takes it, as under PyTorch (whose Python bindings let go of it before an op allocates)."""
        out = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(4096)
        probe = self._probe_released if release_gil else self.lib.poollab_probe_malloc
        code = probe(size, stream or None, ctypes.byref(out), buf, len(buf))
        return int(code), int(out.value or 0), buf.value.decode(errors="replace")

    def breakdown(self) -> dict[str, float]:
        """Where a malloc's time went since ``reset``, from the trampoline's split of every 16th
        malloc (mean ns of each step: the capture check, taking the GIL and the one-at-a-time lock,
        the Python call, giving the GIL back), and how many calls arrived without the GIL and how
        many capture checks were made."""
        c = self.lib.poollab_counter
        n_split = int(c(6))
        mean = lambda k: int(c(k)) / n_split if n_split else float("nan")  # noqa: E731
        return {
            "n_calls_without_gil": int(c(4)),
            "n_capture_checks": int(c(5)),
            "n_split": n_split,
            "split_capture_check_ns": mean(7),
            "split_take_gil_ns": mean(8),
            "split_python_call_ns": mean(9),
            "split_release_gil_ns": mean(10),
        }

    def step_costs_ns(self, n: int = 200_000, stream: int = 0) -> dict[str, Any]:
        """What the trampoline's own steps cost on this machine, ns a call: a read of the clock
        calls are timed with (two a call; ``call_clock``: ``"tsc"``, the CPU's time-stamp counter
        where it ticks at a constant rate and reads cheaper, else ``"monotonic"``), a
        ``clock_gettime(CLOCK_MONOTONIC)`` read, and the capture check on ``stream`` (NaN when none
        is set: no CUDA runtime)."""
        steps = self.lib.poollab_time_steps
        check = steps(1, stream or None, n)
        return {
            "call_clock": "tsc" if self.lib.poollab_counter(11) else "monotonic",
            "clock_read_ns": steps(0, None, n) / n,
            "monotonic_read_ns": steps(2, None, n) / n,
            "capture_check_ns": check / n if check >= 0 else float("nan"),
        }

    def call_free(self, ptr: int, size: int, stream: int = 0) -> None:
        """Call the trampoline's free as PyTorch does (tests)."""
        self._free(ptr, size, 0, stream or None)


def samples_of_calls(
    samples: np.ndarray, stride: int, n_seen: int, n0: int, n1: int
) -> tuple[np.ndarray, int]:
    """The samples of calls ``n0`` to ``n1`` (``n1`` excluded) among ``samples``, the shim's
    kept samples of ``n_seen`` calls at ``stride``, and that stride: kept sample i is call
    i * stride (the shim keeps every call below its capacity, stride 1; past it, it drops every
    second sample and doubles the stride), so the window's samples are those of its calls that are
    multiples of the stride, evenly spread over it.

    Raises:
        ValueError: ``samples`` is not what ``n_seen`` calls at ``stride`` leave (a bad reading).
    """
    if stride < 1 or stride & (stride - 1) or samples.size != -(-n_seen // stride):
        raise ValueError(
            f"{samples.size} samples of {n_seen} calls at stride {stride}: "
            f"the shim keeps call i * stride, so {-(-n_seen // max(stride, 1))} were expected"
        )
    return samples[-(-n0 // stride) : -(-n1 // stride)], stride


@functools.lru_cache(maxsize=1)
def load_shim(verbose: bool = False) -> Shim:
    """Build (first use; then torch's extension cache) and load the trampoline.

    Raises:
        GpuUnavailableError: torch is not importable, or the build failed (with the reason).
    """
    try:
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise GpuUnavailableError(
            f"torch is not importable ({exc}); install poollab[engine]"
        ) from None
    try:
        path = cpp_extension.load(
            name="poollab_torch_shim",
            sources=[str(_SHIM_SOURCE)],
            extra_cflags=["-O2"],
            is_python_module=False,
            with_cuda=False,
            verbose=verbose,
        )
    except Exception as exc:  # noqa: BLE001 - a compiler's failure, reported in one line
        raise GpuUnavailableError(
            f"could not build poollab's PyTorch allocator shim ({_SHIM_SOURCE.name}): "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
        ) from None
    if not isinstance(
        path, str
    ):  # torch versions that return nothing: the library sits in the build folder
        path = os.path.join(
            cpp_extension._get_build_directory("poollab_torch_shim", verbose),
            "poollab_torch_shim.so",
        )
    return Shim(path)


def _cudart_capture_check() -> int | None:
    """The address of ``cudaStreamIsCapturing`` in the CUDA runtime PyTorch loaded, or None."""
    return cudart_address("cudaStreamIsCapturing")


def cudart_address(name: str) -> int | None:
    """The address of the CUDA runtime function ``name`` in the libcudart this process loaded
    (PyTorch's own: a second copy of the runtime would have a context of its own), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
        return ctypes.cast(fn, ctypes.c_void_p).value
    return None


# ---------------------------------------------------------------------- what users hold
class TorchPolicyAllocator:
    """A policy serving PyTorch's CUDA allocations: what ``use_policy`` yields.

    Attributes:
        pool: the policy's ``realgpu.GpuPool`` (``PoolStats``, validation, the device).
        core: the callback table (``AllocatorCore``): live pointers, errors, alignment counters.
        mode: ``"pluggable"`` or ``"mempool"``.
        mempool: the ``torch.cuda.MemPool`` in mempool mode (None otherwise).
    """

    def __init__(
        self,
        pool: GpuPool,
        core: AllocatorCore,
        mode: str,
        shim: Shim | None,
        *,
        mempool: Any = None,
        capture_check: bool = False,
    ):
        self.pool = pool
        self.core = core
        self.mode = mode
        self.shim = shim
        self.mempool = mempool
        self.capture_check = capture_check
        self._t0 = time.perf_counter()
        self._wall_s: float | None = None
        self._final_stats: PoolStats | None = None
        self._row: dict[str, Any] | None = None
        self._routing: tuple[Any, int] | None = (
            None  # mempool mode: (torch.cuda.memory, device) while routed
        )
        self._paused: tuple[Any, int] | None = None  # the same while paused

    # ------------------------------------------------------------------ mempool mode's routing
    def pause_routing(self) -> None:
        """Mempool mode: stop routing this thread's allocations to the policy's pool, so that
        another thread (an engine's) can enter it with ``torch.cuda.use_mem_pool``. PyTorch routes a
        pool for one thread at a time ("beginAllocateToPool: already recording to mempool_id", H200
        session 12); ``resume_routing`` routes this thread again, and the block's end copes with
        either."""
        if self._routing is None:
            return
        memory, device = self._routing
        memory._cuda_endAllocateToPool(device, self.mempool.id)  # use_mem_pool's own exit
        memory._cuda_releasePool(device, self.mempool.id)
        self._routing = None
        self._paused = (memory, device)

    def resume_routing(self) -> None:
        """Route this thread's allocations to the policy's pool again (after ``pause_routing``)."""
        paused = self._paused
        if paused is None or self._routing is not None:
            return
        memory, device = paused
        memory._cuda_beginAllocateCurrentThreadToPool(
            device, self.mempool.id
        )  # use_mem_pool's own entry
        self._routing, self._paused = paused, None

    def _route(self, torch: Any, device: int) -> None:
        self._paused = (torch.cuda.memory, device)
        self.resume_routing()

    def _unroute(self) -> None:
        self.pause_routing()
        self._paused = None

    @property
    def routing(self) -> bool:
        """Whether this thread's allocations go to the policy's pool now (mempool mode)."""
        return self._routing is not None

    def stats(self) -> PoolStats:
        """The policy's ``PoolStats`` (as they were at close, once closed)."""
        if self._final_stats is not None:
            return self._final_stats
        return self.pool.stats()

    def summary_row(self, **context: Any) -> dict[str, Any]:
        """``sim.replay.schema.summary_row``'s row for this run; ``context`` (``trace=``,
        ``params=``, or extra columns such as a batch shape) goes in front of the computed
        extras."""
        if self._row is not None:
            return {**self._row, **context}
        from sim.replay.schema import summary_row

        shim = self.shim
        alloc_ns = shim.samples(0) if shim is not None else np.empty(0, dtype=np.int64)
        free_ns = shim.samples(1) if shim is not None else np.empty(0, dtype=np.int64)
        counters = shim.counters() if shim is not None else {}
        ctx = dict(context)
        trace = ctx.pop("trace", "torch")
        params = ctx.pop("params", "")
        core, device = self.core, self.pool.device
        return summary_row(
            trace=trace,
            policy=self.pool.policy.spec,
            backend=f"torch-{self.mode}",
            params=params,
            capacity_bytes=self.pool.policy.capacity_bytes,
            monitor=core.monitor,
            alloc_ns=alloc_ns,
            free_ns=free_ns,
            wall_s=self._wall_s if self._wall_s is not None else time.perf_counter() - self._t0,
            device_calls=device.call_stats(),
            **ctx,
            kind="policy",
            mode=self.mode,
            validate=self.pool.validate,
            device_mallocs=device.num_maps,
            device_frees=device.num_unmaps,
            driver_ns_total=device.driver_ns_total,
            n_align_padded=core.n_align_padded,
            align_extra_bytes=core.align_extra_bytes,
            n_deferred_frees=core.n_deferred_frees,
            n_stitched_maps=core.n_stitched_maps,
            n_stitch_reuses=core.n_stitch_reuses,
            n_stitch_takeovers=core.n_stitch_takeovers,
            n_stitch_inside_reuses=core.n_stitch_inside_reuses,
            n_stitch_pages_remapped=core.n_stitch_pages_remapped,
            n_idle_evictions=core.n_idle_evictions,
            sync_ns_total=getattr(device, "sync_ns_total", 0),
            n_streams=len(core.streams),
            n_free_errors=len(core.errors),
            n_live_at_close=core.num_live,
            **counters,
        )

    def check(self) -> None:
        """Raise the first error a free met (double free, memory corruption found by validation)."""
        self.core.check()

    def close(self) -> None:
        """End the run: the summary row and stats are fixed now; the pool's segments go back now
        or when PyTorch frees the last live allocation (``core.num_live``)."""
        if self._row is not None:
            return
        if self.pool.is_cuda:
            import gc

            import torch

            gc.collect()  # tensors in reference cycles (a model's) are freed now, not at exit
            torch.cuda.synchronize(self.pool.device_id)
            if self.mode == "pluggable" and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                # cuBLAS keeps its workspaces in our pool otherwise
                torch._C._cuda_clearCublasWorkspaces()
            if self.mempool is not None:
                # the pool's cached segments go back to the policy when PyTorch drops the pool
                self.mempool = None
                gc.collect()
                torch.cuda.empty_cache()
        self._wall_s = time.perf_counter() - self._t0
        self._final_stats = self.pool.stats()
        self._row = self.summary_row()
        self.core.close()


def _make_pool(
    policy: str | Policy,
    *,
    validate: bool,
    device: int,
    capacity_bytes: int | None,
    backend: Any = "cuda",
) -> GpuPool:
    """The policy's pool; a policy whose allocations are pages gets the page-mapped backend
    (``cuda-vmm``), so that its pages can be mapped into one range for a tensor (``_stitch``)."""
    pool = GpuPool(
        policy,
        backend=backend,
        capacity_bytes=capacity_bytes,
        validate=validate,
        guard_bytes=ALIGNMENT_BYTES,
        check_contents=False,
        device_id=device,
    )
    if pool.policy.contiguous or pool.device.device_kind is DeviceKind.PAGE_MAPPED:
        return pool
    pool.close()  # nothing was allocated yet: built again on the page-mapped backend
    backend = DeviceKind.PAGE_MAPPED.backend("cuda" if pool.is_cuda else "host")
    return GpuPool(
        policy,
        backend=backend,
        capacity_bytes=capacity_bytes,
        validate=validate,
        guard_bytes=ALIGNMENT_BYTES,
        check_contents=False,
        device_id=device,
    )


def host_allocator_core(policy: str) -> AllocatorCore:
    """The ``AllocatorCore`` that ``use_policy`` builds for ``policy`` (a spec), on the host: its
    segments 2 MiB-aligned as ``cudaMalloc``'s (``AlignedHostDevice``), or mapped pages
    (``host-vmm``) for a policy of pages. The CPU stand-in the per-call benchmarks drive."""
    from policies.registry import device_kind

    segment = device_kind(policy) == "segment"
    pool = _make_pool(
        policy,
        validate=False,
        device=0,
        capacity_bytes=None,
        backend=AlignedHostDevice() if segment else "host-vmm",
    )
    return AllocatorCore(pool)


def _check_pages_can_be_stitched(pool: GpuPool) -> None:
    """Refuse, up front, a policy whose allocations are pages where no range can be made of them:
    a segment device (``cudaMalloc``'d memory cannot be mapped again), validation mode (its
    guards are written around the policy's own extents), or pages that are no whole number of
    the device's physical pages (only whole physical allocations can be mapped elsewhere)."""
    policy, device = pool.policy, pool.device
    spec = policy.spec
    if device.device_kind is not DeviceKind.PAGE_MAPPED:
        raise PoolError(
            f"policy {spec!r} hands out pages that need not be contiguous, "
            "and a PyTorch tensor needs one range: it needs a page-mapped device "
            f"(backend cuda-vmm or host-vmm), not {type(device).__name__}"
        )
    if pool.validate:
        raise PoolError(
            f"policy {spec!r} hands out pages that need not be contiguous: "
            "validation mode cannot guard a tensor over several pages; "
            "validate a contiguous policy, or run this one without validate"
        )
    page = getattr(policy, "page_size_bytes", None) or getattr(policy, "page_bytes", None)
    granularity = device.granularity_bytes
    if isinstance(page, int) and page % granularity:
        knob = getattr(type(policy), "page_size_knob", None) or "its page size"
        raise PoolError(
            f"policy {spec!r} has pages of {page:,} B, "
            f"no whole number of the device's {granularity:,} B physical pages, "
            "so a tensor over several pages cannot be mapped into one range: "
            f"set {knob} to a multiple of {granularity:,}"
        )


class _Routing:
    """Which core the trampoline calls: the serving one, bound straight (the hot path), or, while
    cores served earlier still hold live tensors, this router, which sends each free to the core
    that handed the pointer out (so policies can follow one another in one process)."""

    def __init__(self) -> None:
        self.active: AllocatorCore | None = None
        self.draining: list[AllocatorCore] = []
        self.shim: Shim | None = None
        self.null_on_refusal = False

    def serve(self, shim: Shim, core: AllocatorCore, *, null_on_refusal: bool) -> None:
        with _lock:
            previous = self.active
            if previous is not None and previous is not core and previous.live:
                if not previous.closed:
                    raise PoolError(
                        f"a poollab allocator for {previous.policy.spec!r} is serving PyTorch: "
                        "end its use_policy block before starting another"
                    )
                self.draining.append(previous)
                previous.on_drained = functools.partial(self._drained, previous)
            self.active, self.shim, self.null_on_refusal = core, shim, null_on_refusal
            self._bind()

    def stop(self, core: AllocatorCore) -> None:
        """``core`` never served (its install failed): the trampoline forgets it."""
        with _lock:
            if self.active is core:
                self.active = None
                self._bind()

    def _drained(self, core: AllocatorCore) -> None:
        with _lock:
            if core in self.draining:
                self.draining.remove(core)
                self._bind()

    def _bind(self) -> None:
        if self.shim is None:
            return
        if self.draining:
            self.shim.bind(self, null_on_refusal=self.null_on_refusal)
        else:
            self.shim.bind(self.active, null_on_refusal=self.null_on_refusal)

    def malloc(self, size: int, device: int, stream: int) -> int:
        if self.active is None:
            raise PoolError("no poollab allocator serves PyTorch now")
        return self.active.malloc(size, device, stream)

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        for core in self.draining:
            if ptr in core.live:
                core.free(ptr, size, device, stream)
                return
        if self.active is not None:
            self.active.free(ptr, size, device, stream)


_routing = _Routing()
_pluggable_installed = False


@contextlib.contextmanager
def use_policy(
    policy: str | Policy,
    *,
    mode: str = "pluggable",
    validate: bool = False,
    device: int = 0,
    capacity_bytes: int | None = None,
) -> Iterator[TorchPolicyAllocator]:
    """Let ``policy`` (a spec string or a fresh policy object) serve PyTorch's CUDA memory.

    Args:
        mode: ``"pluggable"`` (every allocation of the process; only before the first CUDA
            allocation) or ``"mempool"`` (the policy supplies the caching allocator's segments,
            for this thread's allocations inside the block).
        validate: ``GpuPool`` validation: guards around every allocation, checked on free.
        device: the CUDA device.
        capacity_bytes: the policy's capacity (None: the GPU's free memory less headroom).

    Raises:
        PoolError: bad mode, pluggable mode after PyTorch's allocator was used, or another
            ``use_policy`` block still open (one that has ended may still hold tensors: their
            frees go to its policy, and its pool is released with the last of them).
        GpuUnavailableError: no torch, no CUDA, or the shim would not build.
        torch.OutOfMemoryError: a request the policy refused (its reason in the message).
    """
    if mode not in MODES:
        raise PoolError(f"mode(={mode!r}) must be one of {', '.join(map(repr, MODES))}")
    try:
        import torch
    except ImportError as exc:
        raise GpuUnavailableError(
            f"torch is not importable ({exc}); install poollab[engine]"
        ) from None
    if not torch.cuda.is_available():
        raise GpuUnavailableError("torch sees no CUDA device (torch.cuda.is_available() is False)")
    shim = load_shim()
    pool = _make_pool(policy, validate=validate, device=device, capacity_bytes=capacity_bytes)
    core = AllocatorCore(pool, events=CudaStreamEvents(device))
    shim.reset()
    allocator = None
    try:
        if mode == "pluggable":
            allocator = _install_pluggable(torch, shim, pool, core)
            with _pluggable_guards(torch):
                yield allocator
        else:
            allocator = _install_mempool(torch, shim, pool, core, device)
            # use_mem_pool's entry and exit, held by the allocator so that it can hand the pool to
            # another thread for a while (pause_routing)
            allocator._route(torch, device)
            try:
                with _mempool_guards(torch, allocator):
                    yield allocator
            finally:
                allocator._unroute()
    except torch.OutOfMemoryError as exc:
        if core.last_refusal and core.last_refusal not in str(exc):
            raise torch.OutOfMemoryError(f"{exc}\n{core.last_refusal}") from exc
        raise
    finally:
        if allocator is None:
            _routing.stop(core)
            core.close()  # nothing was served: the pool goes back now
        else:
            allocator.close()


def _install_pluggable(
    torch: Any, shim: Shim, pool: GpuPool, core: AllocatorCore
) -> TorchPolicyAllocator:
    global _pluggable_installed
    _routing.serve(shim, core, null_on_refusal=False)
    if not _pluggable_installed:
        wrapper = torch.cuda.memory.CUDAPluggableAllocator(
            shim.path, "poollab_malloc", "poollab_free"
        )
        try:
            torch.cuda.memory.change_current_allocator(wrapper)
        except RuntimeError as exc:
            raise PoolError(
                "mode='pluggable' must be installed before the process's first CUDA allocation, "
                f"and PyTorch's allocator has already been used ({exc}); "
                "install use_policy first, or use mode='mempool'"
            ) from None
        _pluggable_installed = True
    torch.cuda.init()
    address = _cudart_capture_check()
    shim.set_capture_check(address)
    return TorchPolicyAllocator(pool, core, "pluggable", shim, capture_check=address is not None)


def _install_mempool(
    torch: Any, shim: Shim, pool: GpuPool, core: AllocatorCore, device: int
) -> TorchPolicyAllocator:
    if _pluggable_installed:
        raise PoolError(
            "mode='mempool' needs PyTorch's caching allocator, "
            "and this process installed a pluggable poollab allocator in its place"
        )
    _routing.serve(shim, core, null_on_refusal=True)
    shim.set_capture_check(
        None
    )  # PyTorch's graph pools handle capture; segments may come during it
    wrapper = torch.cuda.memory.CUDAPluggableAllocator(shim.path, "poollab_malloc", "poollab_free")
    mempool = torch.cuda.MemPool(wrapper.allocator())
    return TorchPolicyAllocator(pool, core, "mempool", shim, mempool=mempool)


#: Why pluggable mode refuses CUDA graph capture (the trampoline's check says the same).
CAPTURE_REFUSAL = (
    "poollab's pluggable allocator refuses CUDA graph capture: "
    "a captured graph keeps its addresses after capture, "
    "and a pluggable allocator gets no begin/end-allocate-to-pool hooks to keep them "
    'from being reused; use realgpu.torch_allocator.use_policy(..., mode="mempool") '
    "and torch.cuda.graph(g, pool=...) for graphs"
)


#: Why mempool mode refuses a capture into the policy's own pool from inside the block.
MEMPOOL_CAPTURE_REFUSAL = (
    "a CUDA graph captured into the policy's MemPool inside use_policy(..., mode='mempool'): "
    "PyTorch routes a pool for one thread at a time, "
    "and this thread's allocations go there already; "
    "capture with the graph's own pool (torch.cuda.graph(g), no pool=), whose memory is PyTorch's"
)


@contextlib.contextmanager
def _mempool_guards(torch: Any, allocator: TorchPolicyAllocator) -> Iterator[None]:
    """Mempool mode: a capture into the policy's own pool while this thread routes to it, refused up
    front. PyTorch refuses it too, but only after ``torch.cuda.graph`` switched streams (not
    switched back) and after counting one more user of the pool, so that the pool's segments never
    went back (H200 session 12: 4 live at close)."""
    graphs = getattr(torch.cuda, "graphs", None)
    if graphs is None:
        yield
        return
    pool_id = allocator.mempool.id

    def ours(pool: Any) -> bool:
        return allocator.routing and (pool == pool_id or getattr(pool, "id", None) == pool_id)

    original_begin, original_enter = graphs.CUDAGraph.capture_begin, graphs.graph.__enter__

    def capture_begin(self, pool=None, *args, **kwargs):
        if ours(pool):
            raise PoolError(MEMPOOL_CAPTURE_REFUSAL)
        return original_begin(self, pool, *args, **kwargs)

    def enter(self):
        if any(ours(p) for p in getattr(self, "pool", ())):
            raise PoolError(MEMPOOL_CAPTURE_REFUSAL)
        return original_enter(self)

    with _patched(
        [(graphs.CUDAGraph, "capture_begin", capture_begin), (graphs.graph, "__enter__", enter)]
    ):
        yield


@contextlib.contextmanager
def _pluggable_guards(torch: Any) -> Iterator[None]:
    """What a pluggable allocator is never told of, refused up front rather than raced.

    - ``Tensor.record_stream``: the allocator could not keep the memory from another stream.
    - CUDA graph capture, at ``CUDAGraph.capture_begin`` and ``torch.cuda.graph``'s ``__enter__``,
      before either does anything: PyTorch's ``capture_begin`` first registers the graph with the
      default CUDA generator, which allocates its graph RNG state (two 1-element int64 tensors,
      ``CUDAGeneratorState::register_graph``) on the current, not yet capturing, stream and keeps
      them until the last registered graph is destroyed; ``torch.cuda.graph`` switches to its
      capture stream before that and does not switch back when ``capture_begin`` raises. Refused
      at the first malloc inside the capture (the trampoline's check), a refused capture left
      those two tensors in the policy for as long as the ``CUDAGraph`` object lived and an
      empty graph behind. The trampoline's check stays for captures begun from C++.
    """
    patches = [
        (
            torch.Tensor,
            "record_stream",
            _refusing(
                "Tensor.record_stream is not seen by PyTorch's pluggable allocator, "
                "so poollab could not keep this memory from another stream: "
                "use use_policy(..., mode='mempool')"
            ),
        )
    ]
    graphs = getattr(torch.cuda, "graphs", None)
    if graphs is not None:
        patches += [
            (graphs.CUDAGraph, "capture_begin", _refusing(CAPTURE_REFUSAL)),
            (graphs.graph, "__enter__", _refusing(CAPTURE_REFUSAL)),
        ]
    with _patched(patches):
        yield


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """``(owner, name, replacement)`` set for the block, each owner's own attribute put back
    after."""
    originals = [
        (owner, name, owner.__dict__[name] if name in owner.__dict__ else None)
        for owner, name, _ in patches
    ]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in originals:
            if original is None:
                delattr(owner, name)  # it was inherited: the base's comes back
            else:
                setattr(owner, name, original)


def _refusing(message: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PoolError(message)

    return refuse
