"""The allocators' hot paths over a policy, in as few steps as they take: ``GpuPool.malloc``'s
(CuPy's allocator protocol) and ``realgpu.torch_allocator``'s (PyTorch's pluggable allocator).

CuPy calls the allocator for every array it makes, so each step here is paid per array: one
frame for ``malloc`` (the policy's ``allocate`` aside), the segment lookup inlined (a ``bisect``
over the device's segment starts, no frame), the pointer's owner built without an ``__init__``
frame, and the free on drop going from the owner's ``__del__`` to the policy's ``free`` with no
frame between. A pool that validates, or whose policy may move live allocations, never gets this
path (``GpuPool.malloc`` handles those).

``TorchPath`` is PyTorch's side: what the compiled trampoline calls for every tensor.

The compiled build (``POOLLAB_COMPILE=1``) declares the classes ``cdef class``
(``malloc_path.pxd``), as it does for ``policies``: the same source, run as C.
"""

from __future__ import annotations

from typing import Any, Callable

from policies._blocks import Block, bisect_ints
from policies.base import Allocation
from realgpu.errors import PoolError
from realgpu.live_map import new_live_map

try:
    import cython
except ImportError:  # a pure install: the same names as no-ops (policies/_cython_shim.py)
    from policies._cython_shim import cython

__all__ = ["Lease", "MallocPath", "TorchPath", "extents_are_one_range", "ALIGNMENT_BYTES"]

#: What every pointer handed to PyTorch is aligned to: its caching allocator guarantees 512 B.
ALIGNMENT_BYTES = 512
#: the largest pointer or size the C entries take (unsigned 64-bit)
_MAX_U64 = (1 << 64) - 1
#: a module global, not ``cython.compiled`` (an attribute lookup interpreted, on every call)
_COMPILED = cython.compiled


@cython.locals(
    i=cython.longlong,
    end=cython.longlong,
    offset=cython.longlong,
    length=cython.longlong,
    first=cython.longlong,
)
def extents_are_one_range(extents: Any, starts: list) -> bool:
    """Whether ``extents`` lie back to back, in their order, inside one segment (``starts``: the
    device's sorted segment offsets), so that one pointer to the first reaches all of them: what
    a paged policy's multi-page allocation needs before ``malloc`` can hand it to CuPy. Compiled,
    a C loop (offsets are device offsets, below 2**63)."""
    first = end = extents[0][0]
    for i in range(len(extents)):
        extent = extents[i]
        offset = extent[0]
        length = extent[1]
        if offset != end:
            return False
        end = offset + length
    # the same segment: no segment starts after the first page and at or below the last one
    # (``bisect_ints(starts, x + 1)`` is ``bisect_right(starts, x)`` for ints; compiled, in C)
    return bisect_ints(starts, first + 1) == bisect_ints(starts, offset + 1)


class Lease:
    """Owner of a ``malloc``'d pointer: when CuPy drops the memory, this frees the allocation.

    A free that fails (a policy error) cannot raise from ``__del__``: it is kept in the pool's
    ``lease_errors`` for ``GpuPool.check()``. After the pool is closed a drop frees nothing.
    """

    __slots__ = ("path", "allocation")

    path: MallocPath
    allocation: Any

    def __del__(self) -> None:
        path = self.path
        if path.closed:
            return
        try:
            path.free(self.allocation)
        except Exception as exc:  # noqa: BLE001 - __del__ must not raise; GpuPool.check() re-raises
            path.lease_errors.append(exc)


class MallocPath:
    """``malloc(nbytes)`` for a pool that neither validates nor lets its policy move allocations.

    Args:
        pool: the ``GpuPool`` (for its zero-size pointer, out-of-memory error and page check).
        starts, bases: the device's segment offsets (sorted) and their real base addresses in
            the same order: the live lists the device mutates in place (``SegmentDevice`` and
            ``MappedRealDevice`` keep them), read on every call.
        pointer_types: ``(MemoryPointer, UnownedMemory)`` on CUDA; None on the host, where the
            pool's own pointer builder makes a ``HostMemoryPointer``.
        device_id: the CUDA device of every pointer.
        lease_errors: the pool's list that drop-time free errors go to.
    """

    __slots__ = (
        "pool",
        "allocate",
        "free",
        "starts",
        "bases",
        "pointer_type",
        "memory_type",
        "device_id",
        "closed",
        "lease_errors",
    )

    pool: Any
    allocate: Callable[..., Any]
    free: Callable[[Any], None]
    starts: list
    bases: list
    pointer_type: Any
    memory_type: Any
    device_id: int
    closed: bool
    lease_errors: list

    def __init__(
        self,
        pool: Any,
        starts: list,
        bases: list,
        pointer_types: tuple[Any, Any] | None,
        device_id: int,
        lease_errors: list,
    ):
        self.pool = pool
        self.allocate = pool.policy.allocate
        self.free = (
            pool.free if pool.validate else pool.policy.free
        )  # validating: guards checked on drop
        self.starts = starts
        self.bases = bases
        self.pointer_type, self.memory_type = (
            pointer_types if pointer_types is not None else (None, None)
        )
        self.device_id = device_id
        self.closed = False
        self.lease_errors = lease_errors

    @cython.locals(
        a=Allocation,
        b=Block,
        lease=Lease,
        offset=cython.longlong,
        start=cython.longlong,
        ptr=cython.longlong,
        i=cython.longlong,
    )
    def malloc(self, nbytes: int):
        """What ``GpuPool.malloc`` documents, for the pools this path serves."""
        if nbytes == 0:
            return self.pool._null_pointer()
        if self.closed:
            raise PoolError("malloc on a closed pool")
        a = self.allocate(nbytes)
        if a is None:
            raise self.pool._oom(nbytes)
        kind = type(a)
        if kind is Block:
            b = a
            offset = (
                b.offset
            )  # its own field (compiled, a C read); its ``extents`` are built when read
        else:
            # a plain allocation's stored extents: the slot itself (compiled, a C field read)
            ext = a._extents if kind is Allocation else a.extents
            if len(ext) != 1 and not extents_are_one_range(ext, self.starts):
                self.pool._refuse_discontiguous(a)
            offset = ext[0][0]
        # the segment holding ``offset``: the last start at or below it, its base at the same index
        # (compiled, a C bisect and C arithmetic: offsets, bases and pointers are device addresses,
        # below 2**63)
        starts = self.starts
        i = bisect_ints(starts, offset + 1) - 1
        start = starts[i]
        ptr = self.bases[i]
        ptr += offset - start
        lease = Lease.__new__(
            Lease
        )  # field by field: no __init__ frame (compiled: a direct tp_new)
        lease.path = self
        lease.allocation = a
        if self.pointer_type is None:
            return self.pool._memory_pointer(offset, ptr, nbytes, lease)
        return self.pointer_type(self.memory_type(ptr, nbytes, lease, self.device_id), 0)


class TorchPath:
    """PyTorch's two calls for an ``AllocatorCore`` (``realgpu.torch_allocator``), the common case
    in one frame.

    ``malloc(size, device, stream) -> int`` and ``free(ptr, size, device, stream)`` are what the
    trampoline calls (they are the core's ``malloc``/``free``). The common case: a pool that
    neither validates nor defers frees (``fast``), the stream of the last call, a request the
    policy places in one range whose address is 512-aligned and not live: the policy's call, a
    C bisect for the segment and one dict store (compiled: C arithmetic, one int made for the
    pointer, ``dict.setdefault``'s one lookup to store it unless live). Everything else goes to the
    core's general methods (``_malloc``, ``_place``, ``_free``), which share this object's state:
    ``countdown`` (calls to the next monitor sample), ``extra_bytes`` (bytes asked beyond the
    requests), ``last_stream``, ``in_malloc`` and ``queued`` (frees a finalizer set off inside a
    malloc, done once the policy is through with the request).

    Compiled, both calls are also C functions (``torch_malloc``/``torch_free``, whose addresses
    ``entry_addresses`` gives the trampoline: no Python call between PyTorch and this code). The
    policy is called through its ``allocate``/``free`` as given: a C entry into ``Policy``'s
    bookkeeping would save ~150 instructions a malloc compiled, but splitting ``allocate`` for it
    cost the interpreted build a frame on every call (+4 % instructions an alloc/free pair for
    size-class and best-fit, callgrind; benchmarks/RESULTS.md, session 15).
    """

    __slots__ = (
        "core",
        "allocate",
        "free_policy",
        "starts",
        "bases",
        "live",
        "queued",
        "last_stream",
        "countdown",
        "extra_bytes",
        "in_malloc",
        "fast",
        "align_mask",
        "segment_index",
    )

    core: Any
    allocate: Callable[..., Any]
    free_policy: Callable[[Any], None]
    starts: list
    bases: list
    live: Any  # LiveMap compiled, dict interpreted
    queued: list
    last_stream: Any
    countdown: int
    extra_bytes: int
    in_malloc: bool
    fast: bool
    align_mask: int
    segment_index: int

    def __init__(
        self,
        core: Any,
        allocate: Callable[..., Any],
        free_policy: Callable[[Any], None],
        starts: list,
        bases: list,
    ):
        self.core = core
        self.allocate = allocate
        self.free_policy = free_policy
        self.starts = starts
        self.bases = bases
        #: pointer -> allocation for every pointer live in PyTorch (``AllocatorCore.live``): a
        #: ``LiveMap`` compiled (C keys), a ``dict`` interpreted (``realgpu.live_map``)
        self.live = new_live_map()
        self.queued = []
        self.last_stream = None
        self.countdown = 1
        self.extra_bytes = 0
        self.in_malloc = False
        self.fast = False
        # a C field in the compiled build: ALIGNMENT_BYTES read as a module global is a Python int,
        # and the rounding and alignment test around it Python arithmetic (14 % of this method's
        # own time on the generate trace: perf, session 13)
        self.align_mask = ALIGNMENT_BYTES - 1
        self.segment_index = -1  # the segment of the last fast malloc (none yet)

    def malloc(self, size: int, device: int, stream: int) -> int:
        """Allocate ``size`` bytes for PyTorch on ``stream``: the pointer (what
        ``AllocatorCore.malloc`` documents). ``device`` is not read (one device a pool)."""
        return torch_malloc(self, size, stream)

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        """Give the allocation at ``ptr`` back (what ``AllocatorCore.free`` documents). Never
        raises."""
        if _COMPILED and not (0 < ptr <= _MAX_U64 and 0 <= size <= _MAX_U64):
            # not what the C entry takes (the trampoline's pointers and sizes always are)
            self.core._free_unknown(ptr, size)
            return
        torch_free(self, ptr, size)

    def entry_addresses(self) -> tuple[int, int] | None:
        """The C addresses of ``torch_malloc`` and ``torch_free`` (compiled; None interpreted), for
        the trampoline to call with this object, without a Python call:
        ``unsigned long long (PyObject* path, PyObject* size, PyObject* stream)`` (the pointer, or
        0 with the error set) and ``PyObject* (PyObject* path, unsigned long long ptr, unsigned
        long long size)`` (None, a new reference, or NULL with the error set: a free's pointer and
        size come as C integers, so no int is made for them unless a slow path needs one)."""
        if cython.compiled:
            return (
                cython.cast(cython.Py_ssize_t, cython.cast(cython.p_void, torch_malloc)),
                cython.cast(cython.Py_ssize_t, cython.cast(cython.p_void, torch_free)),
            )
        return None

    def _general(self, size: int, stream: int) -> int:
        self.in_malloc = True
        try:
            return self.core._malloc(size, stream)
        finally:
            self.in_malloc = False
            if self.queued:
                self.core._free_queued()


@cython.locals(
    a=Allocation,
    b=Block,
    n=cython.longlong,
    nbytes=cython.longlong,
    offset=cython.longlong,
    start=cython.longlong,
    end=cython.longlong,
    ptr=cython.longlong,
    i=cython.Py_ssize_t,
    num_segments=cython.Py_ssize_t,
    mask=cython.longlong,
    request=object,
    num_live=cython.Py_ssize_t,
)
def torch_malloc(path: TorchPath, size: int, stream: Any) -> int:
    """``TorchPath.malloc``, the one place of it (compiled, a C function the trampoline calls)."""
    last = path.last_stream
    # the trampoline hands the same stream object while the stream stays: an identity test first
    if size <= 0 or not path.fast or (stream is not last and stream != last):
        return path._general(size, stream)
    mask = path.align_mask
    n = size
    nbytes = (n + mask) & ~mask
    # a free that the garbage collector sets off inside the policy's call (a tensor's
    # finalizer) is queued by ``free`` and done once the policy is through with this request
    path.in_malloc = True
    try:
        # already a multiple of 512 B: PyTorch's own int, no new one made
        request = size if nbytes == n else nbytes
        found = path.allocate(request, stream=stream)
        if found is None:
            return path.core._place(None, size, nbytes, stream)
        kind = type(found)
        if kind is Block:
            b = found
            offset = b.offset  # its own field (compiled, a C read)
        elif kind is Allocation:
            a = found
            ext = a._extents  # the slot behind ``extents`` (compiled, a C field read)
            if len(ext) != 1:
                return path.core._place(found, size, nbytes, stream)
            offset = ext[0][0]
        else:
            return path.core._place(found, size, nbytes, stream)
        # the segment holding ``offset``: the last call's when it still holds it (half to two
        # thirds of generate's requests; the lists change in place as segments come and go, so
        # the index is checked, never trusted), else a C bisect
        starts = path.starts
        i = path.segment_index
        num_segments = len(starts)
        if 0 <= i < num_segments:
            start = starts[i]
            if start > offset:
                i = -1
            elif i + 1 < num_segments:
                end = starts[i + 1]
                if offset >= end:
                    i = -1
        else:
            i = -1
        if i < 0:
            i = bisect_ints(starts, offset + 1) - 1
            path.segment_index = i
            start = starts[i]
        ptr = path.bases[i]
        ptr += offset - start
        if ptr & mask:
            return path.core._place(found, size, nbytes, stream)
        # stored unless live already, in one lookup: a policy that hands a live pointer out
        # again (the map did not grow) is refused by ``_place``, the first tensor's entry kept
        if _COMPILED:  # a LiveMap: the pointer as a C integer, no int made for a key
            if not path.live.add(ptr, found):
                return path.core._place(found, size, nbytes, stream)
        else:  # a dict
            live = path.live
            num_live = len(live)
            live.setdefault(ptr, found)
            if len(live) == num_live:
                return path.core._place(found, size, nbytes, stream)
        path.extra_bytes += nbytes - n
        path.countdown -= 1
        if not path.countdown:
            path.core._sample()
        return ptr
    finally:
        path.in_malloc = False
        if path.queued:
            path.core._free_queued()


def torch_free(path: TorchPath, ptr: int, size: int) -> None:
    """``TorchPath.free``, the one place of it (compiled, a C function the trampoline calls, the
    pointer and size C integers: ints are made of them only off the hot path)."""
    if path.in_malloc:  # set off inside our own malloc (a finalizer): the policy is mid-request
        path.queued.append((ptr, size))
        return
    if not path.fast:
        path.core._free(ptr, size)
        return
    if _COMPILED:  # a LiveMap (see ``TorchPath``): the pointer as a C integer
        a = path.live.take(ptr)
    else:  # a dict
        a = path.live.pop(ptr, None)
    if a is None:
        path.core._free_unknown(ptr, size)
        return
    try:
        path.free_policy(a)
    except Exception as exc:  # noqa: BLE001 - PyTorch calls this from destructors
        path.core.errors.append(exc)
    path.countdown -= 1
    if not path.countdown:
        path.core._sample()
