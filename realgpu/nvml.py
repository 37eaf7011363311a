"""The device's own memory reading (NVML), for capacity and for peak used memory.

NVML sees the whole GPU (every process, the CUDA context, the driver's reserve), which is what
"did the pool give everything back" has to be judged by. Without ``nvidia-ml-py`` the CUDA
runtime's ``cudaMemGetInfo`` gives the same used/free figures for this process's device.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceMemory", "MemoryReader", "PeakWatch"]


@dataclass(slots=True, frozen=True)
class DeviceMemory:
    total_bytes: int
    free_bytes: int
    used_bytes: int
    source: str  # "nvml" or "cudaMemGetInfo"


class MemoryReader:
    """Reads one CUDA device's memory, through NVML when available.

    The NVML handle is looked up by PCI bus id so that ``CUDA_VISIBLE_DEVICES`` renumbering
    cannot make us read another GPU.

    Args:
        device_id: the CUDA device index.
    """

    def __init__(self, *, device_id: int = 0):
        self.device_id = device_id
        self._handle = None
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            import cupy

            bus_id = cupy.cuda.runtime.deviceGetPCIBusId(device_id)
            try:
                self._handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            except pynvml.NVMLError:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_id)
        except Exception:  # no NVML library or bindings: fall back to the runtime's reading
            self._handle = None

    @property
    def source(self) -> str:
        return "nvml" if self._handle is not None else "cudaMemGetInfo"

    def read(self) -> DeviceMemory:
        if self._handle is not None:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            return DeviceMemory(int(info.total), int(info.free), int(info.used), "nvml")
        import cupy

        with cupy.cuda.Device(self.device_id):
            free, total = cupy.cuda.runtime.memGetInfo()
        return DeviceMemory(int(total), int(free), int(total - free), "cudaMemGetInfo")

    def used_bytes(self) -> int:
        return self.read().used_bytes


class PeakWatch:
    """Tracks the peak of a device's used memory, read only when it may have risen.

    Reading NVML costs tens of microseconds, so callers ``poke(level)`` with a cheap level of
    their own (reserved bytes) after each operation and the device is read only when that level
    passes its previous maximum: used memory can only have risen then.
    """

    def __init__(self, reader: MemoryReader):
        self.reader = reader
        self.base_used_bytes = reader.used_bytes()
        self.peak_used_bytes = self.base_used_bytes
        self.num_reads = 1
        self._level = -1

    def poke(self, level: int) -> None:
        if level > self._level:
            self._level = level
            self.sample()

    def sample(self) -> None:
        used = self.reader.used_bytes()
        self.num_reads += 1
        if used > self.peak_used_bytes:
            self.peak_used_bytes = used
