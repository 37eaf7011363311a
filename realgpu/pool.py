"""``GpuPool``: any registered policy as a real GPU memory pool.

The policy decides where each request lives, in its own address space; the pool's device
backs each policy segment with real memory and turns offsets into addresses: ``cudaMalloc``'d
segments (``realgpu.cuda.CudaDevice``; ``realgpu.host.HostDevice`` on the CPU) or pages mapped
into reserved virtual ranges (``realgpu.vmm.CudaVmmDevice`` through ``cuMem*``;
``realgpu.host_vmm.HostVmmDevice`` on the CPU), the latter chosen by ``backend="cuda-vmm"`` /
``"host-vmm"`` or by a policy whose own device is a ``policies.mapped_device.PageMappedDevice``.
Two ways in:

- ``malloc(nbytes) -> cupy.cuda.MemoryPointer``: CuPy's allocator protocol. Dropping the last
  reference frees the allocation in the policy, so ``cupy.cuda.set_allocator(pool.malloc)``
  runs any CuPy program on the policy. The pointer's owner frees through ``__del__``: the
  cheapest measured way (field notes: about 1.9 us a round trip against 3.1 us through
  ``weakref.finalize``).
- ``allocate(nbytes) -> Allocation`` / ``free(a)`` / ``pointer(a)`` / ``pages(a)`` /
  ``block_table(a)``: the policy's own allocation, for replay and for paged policies.

Validation mode writes a pattern into every allocation and guard bytes around it (the policy
is asked for ``nbytes + 2 * guard_bytes``; the rounding slack joins the trailing guard) and
checks them when the allocation is freed; a difference raises ``CorruptionError`` naming the
offset, the address and, for an overlap, the other allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import policies
from policies.base import Allocation, Policy, PoolStats, _as_size
from policies.device import SEGMENT_ALIGNMENT_BYTES, DeviceInFront
from policies.device_kind import PLATFORMS, DeviceKind
from policies.mapped_device import PageMappedDevice
from realgpu.errors import CorruptionError, PoolError, PoolOutOfMemoryError, oom_message
from realgpu.host import HostDevice, HostMemoryPointer
from realgpu.malloc_path import Lease, MallocPath, extents_are_one_range
from realgpu.mapped import MappedRealDevice
from realgpu.segments import SegmentDevice
from traces.knobs import check_int

__all__ = ["GpuPool", "GUARD_WORD", "data_word", "BACKENDS", "RealDevice"]

#: ``backend=`` names: segments (``cudaMalloc``) or mapped pages (``cuMem*``), on the GPU or the CPU
#: (``DeviceKind.backend``: ``"cuda"``, ``"host"``, ``"cuda-vmm"``, ``"host-vmm"``).
BACKENDS = tuple(kind.backend(platform) for kind in DeviceKind for platform in PLATFORMS)
#: What a pool's device may be.
RealDevice = SegmentDevice | MappedRealDevice

#: What guard bytes hold (top bit clear, so it never equals a data word).
GUARD_WORD = 0x4B1D4B1D
#: Left free on the GPU when capacity comes from the device: CuPy's kernels, cuBLAS workspaces.
DEFAULT_HEADROOM_BYTES = 1 << 30


def data_word(serial: int) -> int:
    """The pattern of the ``serial``-th validated allocation.

    Top bit set (never the guard word); multiplying by an odd constant is a bijection modulo
    2**31, so two allocations alive at once never share a pattern and an overlap always shows.
    """
    return 0x80000000 | ((serial * 0x9E3779B1) & 0x7FFFFFFF)


@dataclass(slots=True)
class _Check:
    """What validation wrote into one allocation."""

    word: int
    guard_bytes: int
    user_nbytes: int
    contents: bool  # whether the data bytes are checked on free (not when the caller writes them)


class GpuPool:
    """A policy driving real memory.

    Args:
        policy: a spec string (``"size-class:classes_per_doubling=4"``) or a fresh ``Policy``
            (it must hold no segment yet). Either way the pool builds its own policy on its own
            device (``policies.create``; for an object, a fresh one from its ``get_params()``,
            wrappers with their bases): ``self.policy`` is that one, and the object given is left
            as it was.
        backend: ``"cuda"`` (segments are ``cudaMalloc``'d), ``"host"`` (numpy arrays, for CI),
            ``"cuda-vmm"`` (pages mapped with ``cuMemCreate``/``cuMemMap``), ``"host-vmm"`` (its
            ``mmap``/``memfd`` stand-in), or a device instance (``HostDevice(limit_bytes=...)`` to
            make the device refuse). A policy that needs a page-mapped device (its declared
            ``device_kind``: ``page-pool``, ``vmm-stitch``, ``expandable``, ``virtual=true``, a
            wrapper over one) gets the page-mapped backend on ``"cuda"``/``"host"``, of the
            granularity and limit of the ``PageMappedDevice`` a policy object was built on.
        capacity_bytes: most bytes the policy may reserve. None: on CUDA, the device's free
            memory (NVML) less ``headroom_bytes``; on the host, no limit. Only for spec strings.
        validate: write and check patterns and guards (slow: one kernel per region and a sync
            per free on CUDA).
        guard_bytes: guard bytes on each side of an allocation in validation mode.
        check_contents: in validation mode, also check on ``free`` that the data bytes still
            hold their pattern (set False when the caller writes into what ``allocate`` gave).
            Pointers from ``malloc`` only ever have their guards checked.
        device_id: the CUDA device.
        headroom_bytes: see ``capacity_bytes``.

    Raises:
        GpuUnavailableError: ``backend="cuda"`` without CuPy or a GPU.
        PolicyError: a bad spec.
        PoolError: a used policy object, or a device instance of a kind the policy cannot run on.
    """

    def __init__(
        self,
        policy: str | Policy,
        *,
        backend: str | SegmentDevice = "cuda",
        capacity_bytes: int | None = None,
        validate: bool = False,
        guard_bytes: int = 256,
        check_contents: bool = True,
        device_id: int = 0,
        headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    ):
        check_int("guard_bytes", guard_bytes, low=0, error=PoolError)
        self.backend = backend
        self.capacity_bytes = capacity_bytes
        self._validate = bool(validate)
        self.guard_bytes = guard_bytes
        self.check_contents = check_contents
        self.device_id = device_id
        self.headroom_bytes = headroom_bytes

        self.device = self._make_device(
            backend, device_id, _device_kind(policy), _page_mapped_model(policy)
        )
        self.is_cuda = self.device.kind == "cupy"
        if self.is_cuda:
            from realgpu.cuda import CudaPoolOutOfMemoryError

            self._oom_class: type[PoolOutOfMemoryError] = CudaPoolOutOfMemoryError
        else:
            self._oom_class = PoolOutOfMemoryError
        self.policy = self._make_policy(policy)
        self._checks: dict[Allocation, _Check] = {}
        self._serial = 0
        self._closed = False
        #: errors found while freeing through a dropped pointer (``__del__`` cannot raise); see
        #: ``check()``
        self.lease_errors: list[BaseException] = []
        self._allocate = self.policy.allocate
        self._address = self.device.address
        #: a layer that may move live allocations while allocating or freeing (compaction): CuPy
        #: pointers could not follow, so ``malloc`` refuses such a policy
        self.moves_on_hot_path = self.policy.moves_while_allocating
        pointer_types = None
        if self.is_cuda:  # bound once: malloc is CuPy's hot path (module lookups cost ~50 ns each)
            from cupy.cuda import MemoryPointer, UnownedMemory

            pointer_types = self._MemoryPointer, self._UnownedMemory = MemoryPointer, UnownedMemory
        #: CuPy's hot path for a pool that neither validates nor moves allocations: an instance
        #: attribute over the ``malloc`` method, so CuPy's call lands on it with no frame between
        starts, bases = self.device.address_tables()
        self._malloc_path = MallocPath(
            self, starts, bases, pointer_types, self.device_id, self.lease_errors
        )
        if not self._validate and not self.moves_on_hot_path:
            self.malloc = self._malloc_path.malloc

    @property
    def validate(self) -> bool:
        """Whether allocations carry patterns and guards (fixed at construction)."""
        return self._validate

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _make_device(
        backend: str | RealDevice,
        device_id: int,
        kind: DeviceKind | None,
        model: PageMappedDevice | None,
    ) -> RealDevice:
        if isinstance(backend, (SegmentDevice, MappedRealDevice)):
            return backend
        if backend not in BACKENDS:
            raise PoolError(
                f"backend(={backend!r}) must be one of {', '.join(map(repr, BACKENDS))} "
                "or a realgpu device"
            )
        platform = DeviceKind.platform_of(backend)
        if kind is DeviceKind.PAGE_MAPPED or model is not None:  # the policy's own kind wins
            kind = DeviceKind.PAGE_MAPPED
        else:
            kind = DeviceKind.of_backend(backend)
        mapped = (
            {}
            if model is None
            else {
                "granularity_bytes": model.granularity_bytes,
                "limit_bytes": model.limit_bytes,
                "virtual_limit_bytes": model.virtual_limit_bytes,
            }
        )
        if platform == "host":
            if kind is DeviceKind.SEGMENT:
                return HostDevice()
            from realgpu.host_vmm import HostVmmDevice

            return HostVmmDevice(**mapped)
        if kind is DeviceKind.PAGE_MAPPED:
            from realgpu.vmm import CudaVmmDevice

            return CudaVmmDevice(device_id=device_id, **mapped)
        from realgpu.cuda import CudaDevice

        return CudaDevice(device_id=device_id)

    def _device_capacity(self) -> int | None:
        if not self.is_cuda:
            return None
        from realgpu.nvml import MemoryReader

        free = MemoryReader(device_id=self.device_id).read().free_bytes
        usable = (free - self.headroom_bytes) // SEGMENT_ALIGNMENT_BYTES * SEGMENT_ALIGNMENT_BYTES
        if usable <= 0:
            raise PoolError(
                f"the GPU has {free:,} B free, less than headroom_bytes(={self.headroom_bytes:,})"
            )
        return usable

    def _make_policy(self, policy: str | Policy) -> Policy:
        """The pool's own policy, built on ``self.device`` (the one way a policy gets a real
        device)."""
        if isinstance(policy, Policy):
            if policy.segments() or policy.num_allocs:
                raise PoolError(
                    f"policy {policy.spec!r} has already been used; "
                    "pass a fresh one (or a spec string)"
                )
            if self.capacity_bytes is not None:
                raise PoolError(
                    "capacity_bytes is the policy's own knob: set it on the policy object, "
                    "or pass a spec string"
                )
            built = policies.create(
                policy, device=self.device
            )  # a fresh one from its knobs, on this device
        elif isinstance(policy, str):
            capacity = (
                self.capacity_bytes if self.capacity_bytes is not None else self._device_capacity()
            )
            built = policies.create(policy, capacity_bytes=capacity, device=self.device)
        else:
            raise PoolError(f"policy(={policy!r}) must be a spec string or a policies.Policy")
        self._check_on_device(built)
        return built

    def _check_on_device(self, policy: Policy) -> None:
        """Refuse a policy whose offsets are not this device's: one that put a device of its own
        in between (a page-mapped model over a segment device hands out virtual offsets that
        the segment device never gave, and a range over two of its segments is memory outside
        any allocation). Devices that stand in front of another (``policies.device.DeviceInFront``:
        a page pool's range) hand out the inner device's offsets and are looked through."""
        device = policy.device
        while device is not self.device and isinstance(device, DeviceInFront):
            device = device.inner
        if device is not self.device:
            kind = _device_kind(policy) or DeviceKind.SEGMENT
            fix = f"{kind} backend ({', '.join(kind.backend(p) for p in PLATFORMS)})"
            raise PoolError(
                f"policy {policy.spec!r} needs a {kind} device and built its own "
                f"over this pool's {type(self.device).__name__}; "
                f"its offsets would not be the device's: give a {fix}"
            )

    # ------------------------------------------------------------------ CuPy allocator protocol
    def malloc(self, nbytes: int):
        """Allocate ``nbytes``: a ``cupy.cuda.MemoryPointer`` (a ``HostMemoryPointer`` on the host).

        The allocation is freed in the policy when the pointer (and every array on it) is gone.
        A pool that neither validates nor moves allocations answers with
        ``realgpu.malloc_path.MallocPath.malloc`` (the instance's ``malloc``: CuPy's hot path).

        Raises:
            PoolOutOfMemoryError: the policy cannot place it (on CUDA also CuPy's OutOfMemoryError).
            PoolError: the pool is closed, the policy's pages for it are not contiguous, or the
                policy may move live allocations on its own (compaction on the allocation path).
        """
        if nbytes == 0:
            return self._null_pointer()
        if self._closed:
            raise PoolError("malloc on a closed pool")
        if self.moves_on_hot_path:
            raise PoolError(
                f"policy {self.policy.spec!r} may move live allocations while allocating; "
                "the raw pointers CuPy holds could not follow: use allocate() handles, "
                "or idle_only=true"
            )
        if not self._validate:
            return self._malloc_path.malloc(nbytes)
        a = self.allocate(nbytes, contents=False)
        if len(a.extents) != 1:
            self._require_contiguous(a)
        offset = a.extents[0][0] + self.guard_bytes
        lease = Lease.__new__(Lease)
        lease.path = self._malloc_path  # frees through self.free: the guards are checked on drop
        lease.allocation = a
        return self._memory_pointer(offset, self._address(offset), nbytes, lease)

    def _memory_pointer(self, offset: int, ptr: int, nbytes: int, lease: Lease):
        if self.is_cuda:
            return self.device.memory_pointer(ptr, nbytes, lease)
        return HostMemoryPointer(ptr, nbytes, self.device.view(offset, nbytes), lease)

    def _null_pointer(self):
        if self.is_cuda:
            return self.device.memory_pointer(0, 0, None)
        return HostMemoryPointer(0, 0, None, None)

    def _require_contiguous(self, a: Allocation) -> None:
        if not extents_are_one_range(a.extents, self._malloc_path.starts):
            self._refuse_discontiguous(a)

    def _refuse_discontiguous(self, a: Allocation) -> None:
        """Free ``a``, whose pages one pointer cannot reach, and say why."""
        self.free(a)
        raise PoolError(
            f"policy {self.policy.spec!r} placed {a.nbytes:,} B "
            f"in {len(a.extents)} discontiguous pages; "
            "a CuPy pointer needs contiguous memory: use pool.allocate() and pool.pages()"
        )

    # ------------------------------------------------------------------ allocations
    def allocate(
        self, nbytes: int, *, stream: int = 0, tag: str | None = None, contents: bool | None = None
    ) -> Allocation:
        """Allocate through the policy; ``pointer``/``pages`` give its addresses.

        In validation mode the policy is asked for ``nbytes + 2 * guard_bytes``; ``contents``
        overrides ``check_contents`` for this allocation.

        Raises:
            PoolOutOfMemoryError: the policy cannot place it.
            PolicyError: ``nbytes`` is not a positive integer.
        """
        if self._closed:
            raise PoolError("allocate on a closed pool")
        if not self._validate:
            a = self._allocate(nbytes, stream=stream, tag=tag)
            if a is None:
                raise self._oom(nbytes)
            return a
        user = _as_size(nbytes)
        if user <= 0:
            raise policies.PolicyError(f"allocation size nbytes(={nbytes}) must be > 0")
        a = self._allocate(user + 2 * self.guard_bytes, stream=stream, tag=tag)
        if a is None:
            raise self._oom(user)
        self._arm(a, user, self.guard_bytes, self.check_contents if contents is None else contents)
        return a

    def free(self, a: Allocation) -> None:
        """Give ``a`` back to the policy (checking its pattern and guards in validation mode).

        Raises:
            CorruptionError: validation found a changed byte (the allocation is freed anyway).
            PolicyError: double or unknown free (nothing changes).
        """
        if self._closed:
            raise PoolError("free on a closed pool")
        rec = self._checks.get(a) if self._validate else None
        problem = self._verify(a, rec) if rec is not None and a.live else None
        self.policy.free(a)
        if rec is not None:
            del self._checks[a]
        if problem is not None:
            raise problem

    def pointer(self, a: Allocation) -> int:
        """Address of the first data byte (of the first page, for a paged allocation)."""
        rec = self._checks.get(a)
        return self._address(a.extents[0][0] + (rec.guard_bytes if rec is not None else 0))

    def pages(self, a: Allocation) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each extent the policy gave ``a``, in order (guards
        included)."""
        address = self._address
        return [(address(offset), length) for offset, length in a.extents]

    def block_table(self, a: Allocation):
        """The page addresses of ``a`` as an ``int64`` device array (numpy on the host)."""
        addresses = [address for address, _ in self.pages(a)]
        if self.is_cuda:
            from realgpu.cuda import device_array

            return device_array(addresses)
        import numpy as np

        return np.asarray(addresses, dtype=np.int64)

    # ------------------------------------------------------------------ replay hooks
    def replay_hooks(self) -> tuple[Callable[[Allocation], None], Callable[[Allocation], None]]:
        """``(on_alloc, on_free)`` for ``sim.replay.trace_replay.replay`` driving ``self.policy``
        directly.

        Without validation each allocation is touched (its first and last bytes written); with
        it, the whole allocation is filled (the rounding slack as guard) and checked before the
        free. No guard bytes are added, so the policy sees exactly what the simulator sees.
        """
        touch = self.device.touch

        def on_alloc(a: Allocation) -> None:
            if self._validate:
                self._arm(a, a.nbytes, 0, True)
                return
            ext = a.extents
            touch(ext[0][0], ext[0][1] if len(ext) > 1 else a.nbytes)
            if len(ext) > 1:
                touch(ext[-1][0], ext[-1][1])

        def on_free(a: Allocation) -> None:
            rec = self._checks.pop(a, None)
            if rec is not None:
                problem = self._verify(a, rec)
                if problem is not None:
                    raise problem

        return on_alloc, on_free

    # ------------------------------------------------------------------ validation
    def _arm(self, a: Allocation, user_nbytes: int, guard: int, contents: bool) -> None:
        self._serial += 1
        rec = _Check(data_word(self._serial), guard, user_nbytes, contents)
        self._checks[a] = rec
        tail = a.size_bytes - guard - user_nbytes
        assert tail >= 0, (
            f"policy gave {a.size_bytes} B for a request of {guard * 2 + user_nbytes} B"
        )
        self._fill(a, 0, guard, GUARD_WORD)
        self._fill(a, guard, user_nbytes, rec.word)
        self._fill(a, guard + user_nbytes, tail, GUARD_WORD)

    def _verify(self, a: Allocation, rec: _Check) -> CorruptionError | None:
        g, n = rec.guard_bytes, rec.user_nbytes
        regions = [("guard-before", 0, g, GUARD_WORD)]
        if rec.contents:
            regions.append(("data", g, n, rec.word))
        regions.append(("guard-after", g + n, a.size_bytes - g - n, GUARD_WORD))
        for region, start, length, word in regions:
            hit = self._first_bad(a, start, length, word)
            if hit is not None:
                return self._corruption(a, rec, region, word, *hit)
        return None

    def _pieces(self, a: Allocation, start: int, length: int):
        """``(pool offset, length, span position)`` of the parts of ``[start, start+length)`` of
        ``a``'s span."""
        pos = 0
        end = start + length
        for offset, ext_len in a.extents:
            lo, hi = max(start, pos), min(end, pos + ext_len)
            if lo < hi:
                yield offset + lo - pos, hi - lo, lo
            pos += ext_len
            if pos >= end:
                break

    def _fill(self, a: Allocation, start: int, length: int, word: int) -> None:
        fill = self.device.fill
        for offset, n, pos in self._pieces(a, start, length):
            fill(offset, n, word, pos % 4)

    def _first_bad(
        self, a: Allocation, start: int, length: int, word: int
    ) -> tuple[int, int] | None:
        check = self.device.first_mismatch
        for offset, n, pos in self._pieces(a, start, length):
            k = check(offset, n, word, pos % 4)
            if k >= 0:
                return offset + k, pos + k
        return None

    def _corruption(
        self, a: Allocation, rec: _Check, region: str, word: int, offset: int, pos: int
    ) -> CorruptionError:
        found = self.device.read_bytes(offset, 1)[0]
        expected = (word >> (8 * (pos % 4))) & 0xFF
        address = self._address(offset)
        other = next(
            (
                b
                for b in self._checks
                if b is not a and any(o <= offset < o + n for o, n in b.extents)
            ),
            None,
        )
        why = (
            f"; that byte also lies in live allocation at offset {other.offset} "
            f"({other.size_bytes:,} B): the policy placed two allocations over the same bytes"
            if other is not None
            else "; something wrote outside its allocation (overrun) or into memory already freed"
        )
        msg = (
            f"memory corruption in the {region} bytes of the allocation at pool offset {a.offset} "
            f"({rec.user_nbytes:,} B asked, {a.size_bytes:,} B placed "
            f"by policy {self.policy.spec!r}): the byte at pool offset {offset} "
            f"(address 0x{address:x}) is 0x{found:02x}, the pool wrote 0x{expected:02x}{why}"
        )
        return CorruptionError(
            msg,
            offset=offset,
            address=address,
            region=region,
            allocation=(a.offset, a.size_bytes, rec.user_nbytes),
        )

    # ------------------------------------------------------------------ state
    def _oom(self, nbytes: int) -> PoolOutOfMemoryError:
        stats = self.policy.stats()
        return self._oom_class(oom_message(self.policy.spec, nbytes, stats), nbytes, stats)

    def stats(self) -> PoolStats:
        return self.policy.stats()

    def trim(self, max_bytes: int | None = None) -> int:
        """Give fully free segments back to the device (``cudaFree``); returns bytes released."""
        return self.policy.trim(max_bytes)

    @property
    def closed(self) -> bool:
        return self._closed

    def check(self) -> None:
        """Raise the first error met while freeing through a dropped ``malloc`` pointer, if any."""
        if self.lease_errors:
            raise self.lease_errors[0]

    def close(self) -> None:
        """Give every segment back to the device; allocations still live become invalid.

        Pointers from ``malloc`` that are dropped later free nothing. Raises what ``check()``
        raises once the memory is released.
        """
        if self._closed:
            return
        self.device.synchronize()  # queued writes into the segments must land before cudaFree
        self._closed = True
        self._malloc_path.closed = True
        self.policy.reset()
        self.device.close()
        self._checks.clear()
        self.check()

    def __enter__(self) -> "GpuPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.policy.num_live} live"
        return f"<GpuPool {self.policy.spec!r} on {self.device.kind} ({state})>"


def _device_kind(policy: str | Policy) -> DeviceKind | None:
    """The device ``policy`` needs, as it declares (``policies.registry.device_kind``; a policy
    object's from its knobs), or None for what the real construction will refuse."""
    try:
        if isinstance(policy, (Policy, str)):
            return policies.registry.device_kind(policy)
    except policies.PolicyError:
        pass  # the real construction reports the bad spec
    return None


def _page_mapped_model(policy: str | Policy) -> PageMappedDevice | None:
    """The modelled page-mapped device a policy object was built on (looking through devices in
    front of it, such as a page pool's range), for the real one to mirror its granularity and
    limits; None for a spec string (built on the real device's defaults) or another device."""
    device = policy.device if isinstance(policy, Policy) else None
    while isinstance(device, DeviceInFront):
        device = device.inner
    return (
        device
        if isinstance(device, PageMappedDevice) and not isinstance(device, MappedRealDevice)
        else None
    )
