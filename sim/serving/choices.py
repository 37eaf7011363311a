"""The serving room's choice lists and defaults, in a leaf module: ``config`` (the settings)
and the modules that implement each choice (``kv``, ``kv_groups``, ``pools``, ``scheduler``)
both import them from here, so neither imports the other to know what may be chosen."""

from __future__ import annotations

#: Reservation strategies of ``ContiguousKV``.
CONTIGUOUS_STRATEGIES = ("max", "oracle", "pow2", "pow2-oracle", "grow")

#: The strategy that maps pages into per-request virtual ranges (``VirtualKV``).
VIRTUAL = "virtual"

STRATEGIES = CONTIGUOUS_STRATEGIES + (VIRTUAL,)

HYBRID_LAYOUTS = ("padded", "lcm", "two-level", "per-group")

POOL_LAYOUTS = ("separate", "shared")

#: cuBLAS/cuDNN workspaces, sampler buffers and CUDA-graph pools; vLLM leaves a few hundred MiB
#: outside its KV cache for these.
DEFAULT_WORKSPACE_BYTES = 512 << 20

PREEMPTION_MODES = ("recompute", "swap")
