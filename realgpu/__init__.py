"""Run poollab policies as real GPU memory pools (CuPy), and measure the allocators people use.

Importable without CuPy: the CUDA backend (``realgpu.cuda``) is imported only when a CUDA pool,
baseline or calibration is built. The host backend runs everywhere (CI).

- ``GpuPool(policy, backend="cuda"|"host"|"cuda-vmm"|"host-vmm", ...)``: a policy driving real
  memory (``cudaMalloc`` segments, or pages mapped with ``cuMem*``; the host stand-ins for CI)
  (``malloc`` for ``cupy.cuda.set_allocator``; ``allocate``/``free``/``pages`` for replay).
- ``gpu_replay`` / ``baseline_replay``: replay a trace on the device, in the report schema.
- ``realgpu.calibrate.calibrate``: measure the driver's costs into the simulator's cost-file schema.
- ``pool_roundtrip`` / ``baseline_roundtrip``: allocate+free round trips at one size.
- ``use_policy(policy, mode="pluggable"|"mempool")``: a policy as PyTorch's CUDA allocator
  (``realgpu.torch_allocator``; needs the ``engine`` extra).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "GpuPool",
    "CudaDevice",
    "HostDevice",
    "SegmentDevice",
    "GpuUnavailableError",
    "PoolOutOfMemoryError",
    "CorruptionError",
    "PoolError",
    "gpu_replay",
    "baseline_replay",
    "BASELINES",
    "require_cuda",
    "pool_roundtrip",
    "baseline_roundtrip",
    "MappedRealDevice",
    "CudaVmmDevice",
    "HostVmmDevice",
    "VmmDriverError",
    "use_policy",
    "TorchPolicyAllocator",
]

_EXPORTS = {
    "GpuPool": "realgpu.pool",
    "CudaDevice": "realgpu.cuda",
    "require_cuda": "realgpu.cuda",
    "HostDevice": "realgpu.host",
    "SegmentDevice": "realgpu.segments",
    "MappedRealDevice": "realgpu.mapped",
    "CudaVmmDevice": "realgpu.vmm",
    "HostVmmDevice": "realgpu.host_vmm",
    "VmmDriverError": "realgpu.errors",
    "GpuUnavailableError": "realgpu.errors",
    "PoolOutOfMemoryError": "realgpu.errors",
    "CorruptionError": "realgpu.errors",
    "PoolError": "realgpu.errors",
    "gpu_replay": "realgpu.replay",
    "baseline_replay": "realgpu.replay",
    "BASELINES": "realgpu.baselines",
    "pool_roundtrip": "realgpu.roundtrip",
    "baseline_roundtrip": "realgpu.roundtrip",
    "use_policy": "realgpu.torch_allocator",
    "TorchPolicyAllocator": "realgpu.torch_allocator",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'realgpu' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
