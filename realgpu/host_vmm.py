"""The page-mapped device's host stand-in: Linux ``mmap`` and ``memfd`` playing ``cuMem*``.

Faithful where it matters to a pool: a reserved range is address space with nothing behind it
(touching it faults), a physical allocation is a ``memfd`` of the page's size that exists apart
from any address, mapping puts it at a fixed address inside the range (so pages mapped at
different times sit back to back and a block may span them), access is granted apart from the
mapping (``mprotect``), and one allocation mapped at two addresses shows the same bytes there
(GMLake's stitching). CI runs every page-mapped policy on it with validation, as the CUDA device
(``realgpu.vmm``) does on the GPU.

Linux only (``os.memfd_create``); the calls go through ``ctypes`` because Python's ``mmap``
module cannot map at a fixed address.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os

import numpy as np

from policies.mapped_device import MAX_VIRTUAL_BYTES
from realgpu.errors import GpuUnavailableError, VmmDriverError
from realgpu.host import HostMemory
from realgpu.mapped import MappedRealDevice

__all__ = ["HostMmapDriver", "HostVmmDevice", "DEFAULT_HOST_GRANULARITY_BYTES"]

#: The stand-in's granularity: the H200's 2 MiB, so page counts match the GPU's.
DEFAULT_HOST_GRANULARITY_BYTES = 2 << 20

_PROT_NONE = 0
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # Linux, every architecture; the mmap module does not export it
_MAP_NORESERVE = 0x4000  # Linux x86-64 and arm64: address space without swap accounting
_MAP_FAILED = ctypes.c_void_p(-1).value
_OUT_OF_MEMORY = (errno.ENOMEM, errno.ENOSPC, errno.EMFILE, errno.ENFILE)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.restype = ctypes.c_int
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class HostMmapDriver:
    """The seven calls of ``realgpu.mapped.VmmDriver`` on this process's address space.

    Args:
        granularity_bytes: every reserve, create and map is a multiple of it, and ranges are
            aligned to it (as ``cuMemAddressReserve`` aligns to the granularity); a multiple
            of the OS page size.
    """

    def __init__(self, granularity_bytes: int = DEFAULT_HOST_GRANULARITY_BYTES):
        if not hasattr(os, "memfd_create"):
            raise GpuUnavailableError("the host page-mapped device needs Linux (os.memfd_create)")
        if granularity_bytes <= 0 or granularity_bytes % mmap.PAGESIZE:
            raise ValueError(
                f"granularity_bytes(={granularity_bytes}) "
                f"must be a positive multiple of the {mmap.PAGESIZE} B page size"
            )
        self.granularity_bytes = granularity_bytes
        self._libc = _libc()

    def _fail(self, call: str, args: str) -> VmmDriverError:
        code = ctypes.get_errno()
        name = errno.errorcode.get(code, str(code))
        return VmmDriverError(
            f"{call}({args}) failed: {name} ({os.strerror(code)})", call=call, error=name
        )

    def _mmap(
        self, address: int, nbytes: int, prot: int, flags: int, fd: int, call: str
    ) -> int | None:
        got = self._libc.mmap(address or None, nbytes, prot, flags, fd, 0)
        if got is None or got == _MAP_FAILED:
            if ctypes.get_errno() == errno.ENOMEM:
                return None
            raise self._fail(call, f"0x{address:x}, {nbytes}")
        return got

    def address_reserve(self, nbytes: int) -> int | None:
        g = self.granularity_bytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        raw = self._mmap(0, nbytes + g, _PROT_NONE, flags, -1, "mmap (reserve)")
        if raw is None:
            return None
        base = (
            -(-raw // g) * g
        )  # aligned as the driver aligns a reservation; the slack is given back
        if base > raw:
            self._munmap(raw, base - raw)
        if raw + nbytes + g > base + nbytes:
            self._munmap(base + nbytes, raw + nbytes + g - (base + nbytes))
        return base

    def _munmap(self, address: int, nbytes: int) -> None:
        if self._libc.munmap(address, nbytes) != 0:
            raise self._fail("munmap", f"0x{address:x}, {nbytes}")

    def address_free(self, address: int, nbytes: int) -> None:
        self._munmap(address, nbytes)

    def create(self, nbytes: int) -> int | None:
        try:
            fd = os.memfd_create("poollab-page", os.MFD_CLOEXEC)
        except OSError as exc:
            if exc.errno in _OUT_OF_MEMORY:
                return None
            raise VmmDriverError(
                f"memfd_create failed: {exc}",
                call="memfd_create",
                error=errno.errorcode.get(exc.errno, ""),
            ) from None
        try:
            os.ftruncate(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            if exc.errno in _OUT_OF_MEMORY:
                return None
            raise VmmDriverError(
                f"ftruncate(memfd, {nbytes}) failed: {exc}",
                call="ftruncate",
                error=errno.errorcode.get(exc.errno, ""),
            ) from None
        return fd

    def map(self, address: int, nbytes: int, handle: int) -> None:
        got = self._mmap(
            address, nbytes, _PROT_NONE, mmap.MAP_SHARED | _MAP_FIXED, handle, "mmap (map)"
        )
        if got != address:
            raise VmmDriverError(
                f"mmap (map) of memfd {handle} at 0x{address:x} landed at {got!r}", call="mmap"
            )

    def set_access(self, address: int, nbytes: int) -> None:
        if self._libc.mprotect(address, nbytes, _PROT_RW) != 0:
            raise self._fail("mprotect", f"0x{address:x}, {nbytes}, PROT_READ|PROT_WRITE")

    def unmap(self, address: int, nbytes: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        if self._mmap(address, nbytes, _PROT_NONE, flags, -1, "mmap (unmap)") != address:
            raise VmmDriverError(f"mmap (unmap) at 0x{address:x} did not land there", call="mmap")

    def release(self, handle: int) -> None:
        os.close(handle)

    def close(self) -> None:
        """Nothing is held past the calls."""


class HostVmmDevice(HostMemory, MappedRealDevice):
    """The page-mapped device on host memory (see the module docstring).

    Args:
        granularity_bytes: page granularity (2 MiB, the H200's, by default).
        limit_bytes: physical bytes that may be created; None for no limit.
        virtual_limit_bytes: address space the model hands out.
    """

    def __init__(
        self,
        *,
        granularity_bytes: int = DEFAULT_HOST_GRANULARITY_BYTES,
        limit_bytes: int | None = None,
        virtual_limit_bytes: int = MAX_VIRTUAL_BYTES,
    ):
        super().__init__(
            HostMmapDriver(granularity_bytes),
            granularity_bytes=granularity_bytes,
            limit_bytes=limit_bytes,
            virtual_limit_bytes=virtual_limit_bytes,
        )

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable ``uint8`` array over ``[offset, offset + nbytes)``, across page boundaries."""
        self.check_range(offset, nbytes)
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(
            (ctypes.c_ubyte * nbytes).from_address(self.address(offset)), dtype=np.uint8
        )
