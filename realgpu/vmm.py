"""The page-mapped device on the GPU: ``cuMem*`` through ``cuda.bindings.driver`` (cuda-bindings).

Imported only when a CUDA page-mapped pool or a VMM calibration is built. ``CuMemDriver`` makes
the seven calls of ``realgpu.mapped.VmmDriver`` on one device's primary context (the one CuPy's
runtime calls use, so CuPy kernels can read and write the mapped pages); ``CudaVmmDevice`` is
the ``MappedRealDevice`` over it with CuPy's memory operations (validation's fill and check).

Each binding returns ``(CUresult, value...)``; ``CUDA_ERROR_OUT_OF_MEMORY`` from
``cuMemAddressReserve`` or ``cuMemCreate`` is a refusal (None), any other error a
``VmmDriverError`` naming the call, its arguments and the error.
"""

from __future__ import annotations

from typing import Any

try:
    from cuda.bindings import driver as cu
except ImportError as exc:  # pragma: no cover - exercised only where cuda-bindings is missing
    try:  # cuda-python before 12.6 spelled the module cuda.cuda
        from cuda import cuda as cu  # type: ignore[no-redef]
    except ImportError:
        cu = None
        _IMPORT_ERROR: ImportError | None = exc
    else:
        _IMPORT_ERROR = None
else:
    _IMPORT_ERROR = None

from policies.mapped_device import MAX_VIRTUAL_BYTES
from realgpu.cuda import CudaMemory, require_cuda
from realgpu.errors import GpuUnavailableError, VmmDriverError
from realgpu.mapped import MappedRealDevice

__all__ = ["CuMemDriver", "CudaVmmDevice", "require_vmm"]


def require_vmm(device_id: int = 0) -> None:
    """Raise ``GpuUnavailableError`` (one line) unless CuPy, cuda-bindings and VMM work on
    ``device_id``."""
    require_cuda(device_id)
    if cu is None:
        raise GpuUnavailableError(
            f"cuda-bindings is not importable ({_IMPORT_ERROR}); "
            "install poollab[gpu] (pip install cuda-bindings matching your CUDA major version)"
        )


def _error_name(status: Any) -> str:
    err, name = cu.cuGetErrorName(status)
    if err == cu.CUresult.CUDA_SUCCESS and name:
        return name.decode() if isinstance(name, bytes) else str(name)
    return f"CUresult {int(status)}"


def _check(result: tuple, call: str, args: str = "") -> Any:
    """The value of a binding's ``(CUresult, value)`` answer; ``VmmDriverError`` on failure."""
    status = result[0]
    if status != cu.CUresult.CUDA_SUCCESS:
        name = _error_name(status)
        raise VmmDriverError(f"{call}({args}) failed: {name}", call=call, error=name)
    return result[1] if len(result) > 1 else None


def _out_of_memory(status: Any) -> bool:
    return status == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY


class CuMemDriver:
    """The seven VMM calls on one GPU (``realgpu.mapped.VmmDriver``).

    Args:
        device_id: the CUDA device (the runtime's and the driver's ordinals agree).

    Attributes:
        granularity_bytes: ``cuMemGetAllocationGranularity`` (minimum; 2 MiB on the H200).
        recommended_granularity_bytes: the same with the RECOMMENDED flag.

    Raises:
        GpuUnavailableError: no CuPy, no cuda-bindings, no such device, or no VMM support on it.
    """

    def __init__(self, device_id: int = 0):
        require_vmm(device_id)
        import cupy

        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            cupy.cuda.runtime.free(
                0
            )  # makes the runtime create (and make current) the primary context
        _check(cu.cuInit(0), "cuInit", "0")
        self._cu_device = _check(cu.cuDeviceGet(device_id), "cuDeviceGet", str(device_id))
        attrs = cu.CUdevice_attribute  # CUDA 12 and 13 name attribute 102 differently
        vmm_attr = getattr(attrs, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", None)
        if vmm_attr is None:
            vmm_attr = attrs.CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED
        vmm = _check(
            cu.cuDeviceGetAttribute(vmm_attr, self._cu_device),
            "cuDeviceGetAttribute",
            "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
        )
        if not vmm:
            raise GpuUnavailableError(
                f"CUDA device {device_id} does not support virtual memory management "
                "(cuMemCreate/cuMemMap)"
            )
        # the primary context is the runtime's (CuPy's): pages mapped here are CuPy-addressable
        self._context = _check(
            cu.cuDevicePrimaryCtxRetain(self._cu_device), "cuDevicePrimaryCtxRetain"
        )
        self._closed = False
        _check(cu.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_id
        self._prop = prop
        flags = cu.CUmemAllocationGranularity_flags
        self.granularity_bytes = int(
            _check(
                cu.cuMemGetAllocationGranularity(prop, flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity",
                "MINIMUM",
            )
        )
        self.recommended_granularity_bytes = int(
            _check(
                cu.cuMemGetAllocationGranularity(prop, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity",
                "RECOMMENDED",
            )
        )
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_id
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]

    def address_reserve(self, nbytes: int) -> int | None:
        result = cu.cuMemAddressReserve(nbytes, self.granularity_bytes, cu.CUdeviceptr(0), 0)
        if _out_of_memory(result[0]):
            return None
        return int(
            _check(result, "cuMemAddressReserve", f"{nbytes}, {self.granularity_bytes}, 0, 0")
        )

    def address_free(self, address: int, nbytes: int) -> None:
        _check(cu.cuMemAddressFree(address, nbytes), "cuMemAddressFree", f"0x{address:x}, {nbytes}")

    def create(self, nbytes: int) -> Any:
        result = cu.cuMemCreate(nbytes, self._prop, 0)
        if _out_of_memory(result[0]):
            return None
        return _check(result, "cuMemCreate", f"{nbytes}, device {self.device_id}, 0")

    def map(self, address: int, nbytes: int, handle: Any) -> None:
        _check(
            cu.cuMemMap(address, nbytes, 0, handle, 0),
            "cuMemMap",
            f"0x{address:x}, {nbytes}, 0, handle {int(handle)}, 0",
        )

    def set_access(self, address: int, nbytes: int) -> None:
        _check(
            cu.cuMemSetAccess(address, nbytes, self._access, 1),
            "cuMemSetAccess",
            f"0x{address:x}, {nbytes}, device {self.device_id} read-write",
        )

    def unmap(self, address: int, nbytes: int) -> None:
        _check(cu.cuMemUnmap(address, nbytes), "cuMemUnmap", f"0x{address:x}, {nbytes}")

    def release(self, handle: Any) -> None:
        _check(cu.cuMemRelease(handle), "cuMemRelease", f"handle {int(handle)}")

    def close(self) -> None:
        """Drop this driver's hold on the primary context (the runtime keeps its own)."""
        if not self._closed:
            self._closed = True
            _check(cu.cuDevicePrimaryCtxRelease(self._cu_device), "cuDevicePrimaryCtxRelease")


class CudaVmmDevice(CudaMemory, MappedRealDevice):
    """The page-mapped device on a GPU (``cuMem*``; see ``realgpu.mapped``).

    Args:
        device_id: the CUDA device.
        granularity_bytes: page granularity; a multiple of the driver's minimum (default: it).
        limit_bytes: physical bytes the model lets be created (None: what the GPU gives).
        virtual_limit_bytes: address space the model hands out.
    """

    def __init__(
        self,
        *,
        device_id: int = 0,
        granularity_bytes: int | None = None,
        limit_bytes: int | None = None,
        virtual_limit_bytes: int = MAX_VIRTUAL_BYTES,
    ):
        super().__init__(
            CuMemDriver(device_id),
            granularity_bytes=granularity_bytes,
            limit_bytes=limit_bytes,
            virtual_limit_bytes=virtual_limit_bytes,
        )
        self._init_memory(device_id)

    def close(self) -> None:
        self.synchronize()  # queued writes into the pages must land before they are unmapped
        super().close()
        self._answer_word = None

    def __del__(self) -> None:
        # A pool dropped without close() must not keep its pages for the life of the process.
        try:
            if self._handles or self._starts:
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver reclaims the memory anyway
            pass
