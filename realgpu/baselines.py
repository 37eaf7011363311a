"""The allocators users would otherwise pick, behind one small interface for the replay harness.

Each baseline exposes its allocation call as it is used in practice (``alloc(nbytes) -> handle``),
how a handle is freed (``free(handle)``, or ``drop = True``: deleting the last reference frees,
as with CuPy pointers and torch tensors), the device address of a handle, and its own reading
of reserved memory:

=====================  ===========================================  ==========================================
name                   allocation                                   reserved bytes read from
=====================  ===========================================  ==========================================
cudaMalloc             ``cudaMalloc`` / ``cudaFree`` every time        sum of live requests (nothing
cached) cupy.MemoryPool        ``cupy.cuda.MemoryPool().malloc``
``MemoryPool.total_bytes()`` cupy.MemoryAsyncPool   ``cupy.cuda.MemoryAsyncPool().malloc``
``cudaMemPoolAttrReservedMem{Current,High}`` torch.cuda             ``torch.empty(n, dtype=uint8,
device=cuda)`` ``torch.cuda.memory_reserved()`` / max
=====================  ===========================================  ==========================================

Streams. A trace records the stream each request was made on; ``use_stream(stream_id)`` makes
that stream current for the allocations that follow (the replay calls it between events, outside
the timed call, only when the next allocation's stream differs from the last one's). Stream 0 is
the stream current when the baseline was built; every other id gets its own stream, made on first
use. A free needs no switch: each allocator below remembers the stream a block was allocated on
and returns it there.

=====================  ======================================================================
name                   what the stream changes
=====================  ======================================================================
cudaMalloc             nothing (``cudaMalloc``/``cudaFree`` are not stream-ordered)
cupy.MemoryPool        free lists are kept per stream (the chunk records its stream): a block
                       freed on one stream is reused only by allocations on that stream
cupy.MemoryAsyncPool   ``cudaMallocAsync`` on the stream; the driver's pool reuses memory freed on
                       another stream only once that free is known complete (opportunistic reuse)
torch.cuda             the caching allocator files each block under its stream (as
                       ``torch-caching`` emulates); reused only by allocations on that stream
=====================  ======================================================================

Names are the APIs', so they never collide with policy names (``torch-caching`` and the like are
emulations of these in ``policies``) and read plainly in reports; lookup ignores case.
``torch.cuda`` is listed only where torch with CUDA is importable.
"""  # noqa: E501

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar

__all__ = ["Baseline", "BASELINES", "available_baselines", "make_baseline", "canonical_name"]

NAN = float("nan")


class Baseline(abc.ABC):
    """One allocator under test.

    Attributes:
        alloc: ``alloc(nbytes) -> handle``; raises one of ``oom_errors`` when out of memory.
        free: ``free(handle)``, or None when ``drop`` (deleting the last reference frees).
        oom_errors: what ``alloc`` raises when the device is full.
        empty_cache: what a recorded ``empty_cache()`` call does (``torch.cuda.empty_cache``);
            None for an allocator with no such call (the event is only counted).
    """

    name: ClassVar[str] = ""
    drop: ClassVar[bool] = True
    #: whether the stream a request is made on changes what the allocator reuses (``use_stream``
    #: matters)
    keys_by_stream: ClassVar[bool] = False

    def __init__(self, *, device_id: int = 0):
        from realgpu.cuda import require_cuda

        require_cuda(device_id)
        self.device_id = device_id
        self.alloc: Callable[[int], Any]
        self.free: Callable[[Any], None] | None = None
        self.oom_errors: tuple[type[BaseException], ...] = (MemoryError,)
        self.empty_cache: Callable[[], None] | None = None

    @abc.abstractmethod
    def pointer(self, handle: Any) -> int:
        """Device address of an allocation."""

    @abc.abstractmethod
    def reserved_bytes(self) -> int:
        """Bytes the allocator holds from the device now (its own reading; cheap enough per
        event)."""

    def allocated_bytes(self) -> float:
        """Bytes handed out now, after the allocator's rounding (NaN when it does not say)."""
        return NAN

    @abc.abstractmethod
    def counters(self) -> dict[str, float]:
        """``peak_allocated_bytes``, ``peak_reserved_bytes``, ``n_grow``, ``n_shrink`` (NaN when
        unknown)."""

    def note_alloc(self) -> None:
        """Called after each successful allocation, outside the timed region (peak upkeep)."""

    def use_stream(self, stream_id: int) -> None:
        """Allocate on the trace's stream ``stream_id`` from now on (0: the stream current when
        the baseline was built). Baselines whose cache ignores streams do nothing."""

    @abc.abstractmethod
    def close(self) -> None:
        """Give every cached byte back to the device (all allocations must be gone) and make the
        stream current at construction current again."""


class _Streams:
    """The library's stream object for each trace stream id, made on first use.

    A dict because the ids need not be dense (a table trace may carry raw CUDA stream handles).
    """

    def __init__(self, current: Any, make: Callable[[], Any], activate: Callable[[Any], None]):
        self._by_id: dict[int, Any] = {0: current}
        self._make, self._activate = make, activate

    def use(self, stream_id: int) -> None:
        stream = self._by_id.get(stream_id)
        if stream is None:
            stream = self._by_id[stream_id] = self._make()
        self._activate(stream)

    def restore(self) -> None:
        self._activate(self._by_id[0])


def _cupy_streams(device_id: int) -> _Streams:
    """Trace streams as CuPy streams (``Stream.use()`` makes one current for CuPy's allocators)."""
    import cupy

    def make():
        with cupy.cuda.Device(device_id):
            return cupy.cuda.Stream(non_blocking=False)

    return _Streams(cupy.cuda.get_current_stream(), make, lambda stream: stream.use())


class CudaMallocBaseline(Baseline):
    """No pool: every request is a ``cudaMalloc``, every free a ``cudaFree``."""

    name = "cudaMalloc"
    drop = False

    def __init__(self, *, device_id: int = 0):
        super().__init__(device_id=device_id)
        import cupy
        from cupy_backends.cuda.api.runtime import CUDARuntimeError

        from realgpu.cuda import _CUDA_ERROR_MEMORY_ALLOCATION

        runtime = cupy.cuda.runtime
        self._sizes: dict[int, int] = {}
        self._live = 0
        self._peak = 0
        self._n_malloc = 0
        self._n_free = 0

        def alloc(nbytes: int) -> int:
            try:
                ptr = runtime.malloc(nbytes)
            except CUDARuntimeError as exc:
                if exc.status == _CUDA_ERROR_MEMORY_ALLOCATION:
                    raise MemoryError(f"cudaMalloc({nbytes}) failed: out of memory") from None
                raise
            self._sizes[ptr] = nbytes
            self._live += nbytes
            self._n_malloc += 1
            return ptr

        def free(ptr: int) -> None:
            runtime.free(ptr)
            self._live -= self._sizes.pop(ptr)
            self._n_free += 1

        self.alloc, self.free = alloc, free
        self.oom_errors = (MemoryError,)

    def pointer(self, handle: Any) -> int:
        return handle

    def note_alloc(self) -> None:
        if self._live > self._peak:
            self._peak = self._live

    def reserved_bytes(self) -> int:
        return self._live

    def allocated_bytes(self) -> float:
        return self._live

    def counters(self) -> dict[str, float]:
        return {
            "peak_allocated_bytes": self._peak,
            "peak_reserved_bytes": self._peak,
            "n_grow": self._n_malloc,
            "n_shrink": self._n_free,
        }

    def close(self) -> None:
        import cupy

        for ptr in list(self._sizes):
            cupy.cuda.runtime.free(ptr)
        self._sizes.clear()


class CupyPoolBaseline(Baseline):
    """CuPy's default kind of pool: best fit with splitting and merging, 512 B rounding."""

    name = "cupy.MemoryPool"
    keys_by_stream = True

    def __init__(self, *, device_id: int = 0):
        super().__init__(device_id=device_id)
        import cupy

        self._streams = _cupy_streams(device_id)
        self._pool = cupy.cuda.MemoryPool()
        self.alloc = self._pool.malloc
        self.oom_errors = (cupy.cuda.memory.OutOfMemoryError,)
        self._peak_reserved = 0
        self._peak_used = 0

    def pointer(self, handle: Any) -> int:
        return handle.ptr

    def note_alloc(self) -> None:
        total, used = self._pool.total_bytes(), self._pool.used_bytes()
        if total > self._peak_reserved:
            self._peak_reserved = total
        if used > self._peak_used:
            self._peak_used = used

    def reserved_bytes(self) -> int:
        return self._pool.total_bytes()

    def allocated_bytes(self) -> float:
        return self._pool.used_bytes()

    def counters(self) -> dict[str, float]:
        return {
            "peak_allocated_bytes": self._peak_used,
            "peak_reserved_bytes": self._peak_reserved,
            "n_grow": NAN,
            "n_shrink": NAN,
        }

    def use_stream(self, stream_id: int) -> None:
        self._streams.use(stream_id)

    def close(self) -> None:
        import cupy

        cupy.cuda.Device(
            self.device_id
        ).synchronize()  # blocks freed on side streams may still be in use
        self._streams.restore()
        self._pool.free_all_blocks()


class CupyAsyncBaseline(Baseline):
    """``cudaMallocAsync`` on the device's default memory pool, through CuPy.

    The pool's release threshold is raised to the device's size, so freed memory stays cached
    across synchronisations, as with the other pools (the driver's default, 0, hands memory back
    at every sync and would make this a different allocator). ``close`` restores it and trims.
    """

    name = "cupy.MemoryAsyncPool"
    keys_by_stream = True

    def __init__(self, *, device_id: int = 0):
        super().__init__(device_id=device_id)
        import cupy

        self._streams = _cupy_streams(device_id)
        rt = cupy.cuda.runtime
        self._rt = rt
        with cupy.cuda.Device(device_id):
            self._pool = cupy.cuda.MemoryAsyncPool()
            self._handle = rt.deviceGetMemPool(device_id)
            self._old_threshold = rt.memPoolGetAttribute(
                self._handle, rt.cudaMemPoolAttrReleaseThreshold
            )
            _, total = rt.memGetInfo()
            rt.memPoolSetAttribute(self._handle, rt.cudaMemPoolAttrReleaseThreshold, total)
            # the high-water marks can only be reset to 0 (they then track from now on)
            rt.memPoolSetAttribute(self._handle, rt.cudaMemPoolAttrReservedMemHigh, 0)
            rt.memPoolSetAttribute(self._handle, rt.cudaMemPoolAttrUsedMemHigh, 0)
        self.alloc = self._pool.malloc
        self.oom_errors = (cupy.cuda.memory.OutOfMemoryError,)

    def pointer(self, handle: Any) -> int:
        return handle.ptr

    def reserved_bytes(self) -> int:
        return self._rt.memPoolGetAttribute(
            self._handle, self._rt.cudaMemPoolAttrReservedMemCurrent
        )

    def allocated_bytes(self) -> float:
        return self._rt.memPoolGetAttribute(self._handle, self._rt.cudaMemPoolAttrUsedMemCurrent)

    def counters(self) -> dict[str, float]:
        rt = self._rt
        return {
            "peak_allocated_bytes": rt.memPoolGetAttribute(
                self._handle, rt.cudaMemPoolAttrUsedMemHigh
            ),
            "peak_reserved_bytes": rt.memPoolGetAttribute(
                self._handle, rt.cudaMemPoolAttrReservedMemHigh
            ),
            "n_grow": NAN,
            "n_shrink": NAN,
        }

    def use_stream(self, stream_id: int) -> None:
        self._streams.use(stream_id)

    def close(self) -> None:
        import cupy

        self._streams.restore()
        device = cupy.cuda.Device(self.device_id)
        with device:
            device.synchronize()  # the frees queued on every stream
            self._rt.memPoolSetAttribute(
                self._handle, self._rt.cudaMemPoolAttrReleaseThreshold, self._old_threshold
            )
            self._rt.memPoolTrimTo(self._handle, 0)


class TorchCachingBaseline(Baseline):
    """PyTorch's CUDA caching allocator, through ``torch.empty`` (the stock configuration)."""

    name = "torch.cuda"
    keys_by_stream = True

    def __init__(self, *, device_id: int = 0):
        super().__init__(device_id=device_id)
        import torch

        self._torch = torch
        device = torch.device("cuda", device_id)
        self._device = device
        torch.cuda.init()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        stats = torch.cuda.memory_stats(device)
        self._grow0 = stats.get("segment.all.allocated", 0)
        self._shrink0 = stats.get("segment.all.freed", 0)
        empty, uint8 = torch.empty, torch.uint8
        # torch.cuda.set_stream is what ``with torch.cuda.stream(s)`` does on entry; the replay
        # switches between events, so the context manager's enter/exit would sit in no timed call
        self._streams = _Streams(
            torch.cuda.current_stream(device),
            lambda: torch.cuda.Stream(device=device),
            torch.cuda.set_stream,
        )

        def alloc(nbytes: int):
            return empty(nbytes, dtype=uint8, device=device)

        self.alloc = alloc
        self.oom_errors = (torch.cuda.OutOfMemoryError,)
        self.empty_cache = torch.cuda.empty_cache
        # the raw nested stats skip the flattening memory_reserved() does on every call
        raw = getattr(torch._C, "_cuda_memoryStats", None)
        self._raw_stats = (lambda: raw(device_id)) if raw is not None else None

    def pointer(self, handle: Any) -> int:
        return handle.data_ptr()

    def reserved_bytes(self) -> int:
        if self._raw_stats is not None:
            return self._raw_stats()["reserved_bytes"]["all"]["current"]
        return self._torch.cuda.memory_reserved(self._device)

    def allocated_bytes(self) -> float:
        if self._raw_stats is not None:
            return self._raw_stats()["allocated_bytes"]["all"]["current"]
        return self._torch.cuda.memory_allocated(self._device)

    def counters(self) -> dict[str, float]:
        cuda = self._torch.cuda
        stats = cuda.memory_stats(self._device)
        return {
            "peak_allocated_bytes": cuda.max_memory_allocated(self._device),
            "peak_reserved_bytes": cuda.max_memory_reserved(self._device),
            "n_grow": stats.get("segment.all.allocated", 0) - self._grow0,
            "n_shrink": stats.get("segment.all.freed", 0) - self._shrink0,
        }

    def use_stream(self, stream_id: int) -> None:
        self._streams.use(stream_id)

    def close(self) -> None:
        self._torch.cuda.synchronize(self._device)
        self._streams.restore()
        self._torch.cuda.empty_cache()


BASELINES: dict[str, type[Baseline]] = {
    cls.name: cls
    for cls in (CudaMallocBaseline, CupyPoolBaseline, CupyAsyncBaseline, TorchCachingBaseline)
}


def _torch_cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def available_baselines() -> list[str]:
    """Baselines that can run here (torch.cuda only with a CUDA build of torch)."""
    return [
        name for name in BASELINES if name != TorchCachingBaseline.name or _torch_cuda_available()
    ]


def make_baseline(name: str, *, device_id: int = 0) -> Baseline:
    """Build a baseline by name, any case (``PoolError`` for an unknown one)."""
    from realgpu.errors import PoolError

    cls = BASELINES.get(canonical_name(name) or "")
    if cls is None:
        raise PoolError(f"unknown baseline {name!r}; available: {', '.join(BASELINES)}")
    if cls is TorchCachingBaseline and not _torch_cuda_available():
        raise PoolError(
            f"baseline {cls.name!r} needs PyTorch with CUDA, which is not importable here"
        )
    return cls(device_id=device_id)


def canonical_name(name: str) -> str | None:
    """The registered spelling of a baseline name given in any case, or None."""
    return {n.lower(): n for n in BASELINES}.get(name.lower())
