"""GPU presets: memory, HBM bandwidth, dense matrix rate and host link of one accelerator.

Presets live in ``sim/data/gpus.json`` with the vendor datasheet each number comes from. A
user's own GPU is a JSON file with the same fields::

    {"name": "my-gpu", "memory_bytes": 85899345920, "hbm_bandwidth_bytes_per_s": 3.35e12,
     "bf16_flops_per_s": 989.4e12, "pcie_bandwidth_bytes_per_s": 50e9}

``load_gpu("h200")`` or ``load_gpu("path/to/my-gpu.json")``; names are case-insensitive and
presets also answer to the name ``nvidia-smi`` prints (``"NVIDIA H100 80GB HBM3"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The preset-file machinery is shared with the model presets; it lives beside them.
from sim.replay.models import _PresetTable
from traces.knobs import check_int


__all__ = ["GpuSpec", "DEFAULT_GPU", "load_gpu", "available_gpus"]

#: The GPU every command, sweep and library call simulates when none is named (a preset).
DEFAULT_GPU = "H200"


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator, as the step-time model and the server see it.

    Attributes:
        name: preset or user name (for reports).
        memory_bytes: device memory the driver reports (``nvidia-smi`` / pynvml total), which
            is what a server can size its pools from; not the marketing figure.
        hbm_bandwidth_bytes_per_s: peak device-memory bandwidth (datasheet).
        bf16_flops_per_s: peak dense (no sparsity) bf16/fp16 tensor-core rate (datasheet).
        pcie_bandwidth_bytes_per_s: host<->device bandwidth per direction, an *achievable*
            figure for pinned copies (not the link's theoretical rate).
        fp32_flops_per_s: dense rate for fp32 models (TF32 tensor cores); None means half
            the bf16 rate, the ratio of every preset here.
        interconnect_bandwidth_bytes_per_s: GPU-to-GPU rate per direction (NVLink, else PCIe)
            that tensor parallelism's all-reduces use; None: the PCIe rate.
        interconnect_latency_s: fixed time of one all-reduce (0 when a file does not say).
    """

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    bf16_flops_per_s: float
    pcie_bandwidth_bytes_per_s: float
    fp32_flops_per_s: float | None = None
    interconnect_bandwidth_bytes_per_s: float | None = None
    interconnect_latency_s: float = 0.0

    def __post_init__(self) -> None:
        where = f"GpuSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GpuSpec: field 'name' must be a non-empty string, got {self.name!r}")
        check_int("memory_bytes", self.memory_bytes, where=f"{where}: ")
        for f in (
            "hbm_bandwidth_bytes_per_s",
            "bf16_flops_per_s",
            "pcie_bandwidth_bytes_per_s",
            "fp32_flops_per_s",
            "interconnect_bandwidth_bytes_per_s",
        ):
            value = getattr(self, f)
            if value is None and f in ("fp32_flops_per_s", "interconnect_bandwidth_bytes_per_s"):
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"{where}: field {f!r} must be a positive number, got {value!r}")
        lat = self.interconnect_latency_s
        if (
            isinstance(lat, bool)
            or not isinstance(lat, (int, float))
            or not (math.isfinite(lat) and lat >= 0)
        ):
            raise ValueError(
                f"{where}: field 'interconnect_latency_s' must be a number >= 0, got {lat!r}"
            )

    @property
    def link_bytes_per_s(self) -> float:
        """GPU-to-GPU bandwidth per direction: the interconnect's, else PCIe's."""
        bw = self.interconnect_bandwidth_bytes_per_s
        return float(bw if bw is not None else self.pcie_bandwidth_bytes_per_s)

    def flops_per_s(self, dtype: str) -> float:
        """Peak dense matrix rate for a model stored in ``dtype`` (``"bf16"``, ``"fp16"``,
        ``"fp32"``)."""
        if dtype in ("bf16", "fp16"):
            return float(self.bf16_flops_per_s)
        if dtype == "fp32":
            return float(
                self.fp32_flops_per_s
                if self.fp32_flops_per_s is not None
                else self.bf16_flops_per_s / 2
            )
        raise ValueError(f"GpuSpec {self.name!r}: no matrix rate for dtype {dtype!r}")

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity (bf16 FLOPs per HBM byte) above which work is compute-bound."""
        return self.bf16_flops_per_s / self.hbm_bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


_GPUS = _PresetTable(GpuSpec, "gpus.json", "gpus", "GPU")


def available_gpus() -> list[str]:
    """Names of the bundled GPU presets, in file order."""
    return _GPUS.names()


def load_gpu(name_or_path: str | Path | GpuSpec) -> GpuSpec:
    """A preset by name (case-insensitive, ``nvidia-smi`` names too) or a GPU from a JSON file.

    Raises ValueError listing the known names for an unknown name, or naming the file and the
    field for a bad file. A ``GpuSpec`` is returned as it is.
    """
    return _GPUS.load(name_or_path)
