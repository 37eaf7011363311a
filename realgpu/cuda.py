"""The CUDA backend: segments are real ``cudaMalloc`` allocations made through CuPy.

Imported only when a CUDA pool is built (``realgpu`` itself imports without CuPy). Every
``reserve`` is one ``cudaMalloc`` and every ``release`` one ``cudaFree``; a failed
``cudaMalloc`` (``cudaErrorMemoryAllocation``) is the device refusing, so the policy sees None
and may trim and retry, exactly as it does against the simulator's device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    import cupy
    from cupy.cuda.memory import OutOfMemoryError as _CupyOutOfMemoryError
    from cupy_backends.cuda.api.runtime import CUDARuntimeError
except ImportError as exc:  # pragma: no cover - exercised only where CuPy is missing
    cupy = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

from realgpu.errors import GpuUnavailableError, PoolOutOfMemoryError
from realgpu.segments import SegmentDevice

__all__ = [
    "require_cuda",
    "CudaDevice",
    "CudaMemory",
    "CudaPoolOutOfMemoryError",
    "device_array",
    "touch_pointer",
]

#: cudaErrorMemoryAllocation in ``cudaError_t`` (CUDA runtime API); CuPy does not export the name.
_CUDA_ERROR_MEMORY_ALLOCATION = 2
_TOUCH_BYTES = 64
_NO_MISMATCH = np.uint64(2**64 - 1)


def require_cuda(device_id: int = 0) -> None:
    """Raise ``GpuUnavailableError`` (one line, with what to do) unless CuPy sees ``device_id``."""
    if cupy is None:
        raise GpuUnavailableError(
            f"CuPy is not importable ({_IMPORT_ERROR}); "
            "install poollab[gpu] (CuPy for your CUDA version and nvidia-ml-py)"
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except CUDARuntimeError as exc:
        raise GpuUnavailableError(f"no CUDA device found ({exc})") from None
    if count == 0:
        raise GpuUnavailableError("no CUDA device found (cudaGetDeviceCount returned 0)")
    if not 0 <= device_id < count:
        raise GpuUnavailableError(
            f"CUDA device {device_id} does not exist; this machine has {count} (0..{count - 1})"
        )


if cupy is not None:

    class CudaPoolOutOfMemoryError(PoolOutOfMemoryError, _CupyOutOfMemoryError):
        """Out of memory in a CUDA pool: a ``PoolOutOfMemoryError`` and CuPy's
        ``OutOfMemoryError``."""

        def __init__(self, message: str, nbytes: int = 0, stats: Any = None):
            PoolOutOfMemoryError.__init__(self, message, nbytes, stats)
            # the attributes CuPy's own error carries
            self._size = nbytes
            self._total = stats.reserved_bytes if stats is not None else -1
            self._limit = (stats.capacity_bytes or 0) if stats is not None else 0

        __reduce__ = PoolOutOfMemoryError.__reduce__

    _fill_kernel = cupy.ElementwiseKernel(
        "uint32 word, int64 phase",
        "uint8 y",
        "y = (unsigned char)(word >> (8 * ((i + phase) & 3)));",
        "poollab_pattern_fill",
    )

    _check_kernel = cupy.ElementwiseKernel(
        "uint8 x, uint32 word, int64 phase",
        "raw uint64 first",
        "if (x != (unsigned char)(word >> (8 * "
        "((i + phase) & 3)))) atomicMin(&first[0], (unsigned long long)i);",
        "poollab_pattern_check",
    )
else:  # pragma: no cover
    CudaPoolOutOfMemoryError = PoolOutOfMemoryError  # type: ignore[misc, assignment]


class CudaMemory:
    """The memory operations of a CUDA backend, over ``address(offset)`` (a device pointer): shared
    by the ``cudaMalloc`` segments and the cuMem-mapped pages (``realgpu.vmm``). Call
    ``_init_memory(device_id)`` from ``__init__``."""

    kind = "cupy"

    def _init_memory(self, device_id: int) -> None:
        self.device_id = device_id
        self._device = cupy.cuda.Device(device_id)
        self._answer_word = None

    def view(self, offset: int, nbytes: int):
        """A ``cupy.ndarray`` of ``uint8`` over ``[offset, offset + nbytes)`` (no allocation), which
        must lie in one ``cudaMalloc`` block or be mapped (``check_range``): nothing on the GPU
        stops a kernel from writing past a block into whatever lies next to it."""
        self.check_range(offset, nbytes)
        ptr = self.address(offset)
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, self, self.device_id)
        return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def fill(self, offset: int, nbytes: int, word: int, phase: int) -> None:
        if nbytes > 0:
            with self._device:
                _fill_kernel(
                    np.uint32(word & 0xFFFFFFFF), np.int64(phase), self.view(offset, nbytes)
                )

    def first_mismatch(self, offset: int, nbytes: int, word: int, phase: int) -> int:
        if nbytes <= 0:
            return -1
        with self._device:
            answer = self._answer()
            answer.fill(_NO_MISMATCH)
            _check_kernel(
                self.view(offset, nbytes), np.uint32(word & 0xFFFFFFFF), np.int64(phase), answer
            )
            first = int(answer.get()[0])
        return -1 if first == int(_NO_MISMATCH) else first

    def _answer(self):
        # one word for the check kernel's answer, from cudaMalloc directly so that checking never
        # allocates through the current CuPy allocator (which may be this very pool)
        if self._answer_word is None:
            with self._device:
                self._answer_word = cupy.ndarray(
                    (1,), dtype=cupy.uint64, memptr=cupy.cuda.MemoryPointer(cupy.cuda.Memory(8), 0)
                )
        return self._answer_word

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        with self._device:
            return self.view(offset, nbytes).get().tobytes()

    def touch(self, offset: int, nbytes: int) -> None:
        self.check_range(
            offset, nbytes
        )  # as the host's view checks it, so both backends refuse alike
        touch_pointer(self.address(offset), nbytes)

    def synchronize(self) -> None:
        self._device.synchronize()

    def memory_pointer(self, ptr: int, nbytes: int, owner: Any):
        """``cupy.cuda.MemoryPointer`` to ``nbytes`` at ``ptr``, kept alive by ``owner``."""
        return cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(ptr, nbytes, owner, self.device_id), 0
        )


class CudaDevice(CudaMemory, SegmentDevice):
    """Segments from ``cudaMalloc`` on one GPU.

    Args:
        device_id: the CUDA device.
    """

    def __init__(self, *, device_id: int = 0):
        require_cuda(device_id)
        super().__init__()
        self._init_memory(device_id)

    def _map(self, nbytes: int) -> tuple[int, Any] | None:
        with self._device:
            try:
                ptr = cupy.cuda.runtime.malloc(nbytes)
            except CUDARuntimeError as exc:
                if exc.status == _CUDA_ERROR_MEMORY_ALLOCATION:
                    return None
                raise
        return ptr, ptr

    def _unmap(self, buffer: Any) -> None:
        with self._device:
            cupy.cuda.runtime.free(buffer)

    def close(self) -> None:
        super().close()
        self._answer_word = None  # its 8 bytes go back now, not whenever this object is collected

    def __del__(self) -> None:
        # A pool dropped without close() must not keep its segments for the life of the process.
        # Safe: every CuPy pointer into a segment keeps this device alive through its owner.
        try:
            if self._starts:
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver reclaims the memory anyway
            pass


def touch_pointer(ptr: int, nbytes: int) -> None:
    """Write the first and last 64 bytes at a device address (queued on the current stream).

    Replays touch every allocation so that a pool handing out unmapped or wrong addresses
    faults, and so every allocator under test pays the same small write.
    """
    k = min(nbytes, _TOUCH_BYTES)
    stream = cupy.cuda.get_current_stream().ptr
    cupy.cuda.runtime.memsetAsync(ptr, 0x5A, k, stream)
    if nbytes > k:
        cupy.cuda.runtime.memsetAsync(ptr + nbytes - k, 0x5A, k, stream)


def device_array(values: list[int]):
    """An ``int64`` CuPy array (a block table of page addresses, say)."""
    return cupy.asarray(np.asarray(values, dtype=np.int64))
