"""Where the simulated server's memory lives: weights, KV cache, activations and workspace.

Two layouts, so the cost of mixing lifetimes can be measured:

- ``separate`` (vLLM's layout): the policy under test holds the KV cache alone; weights,
  activations and workspace live in their own pools (built from ``aux_policy``).
- ``shared``: one pool, the policy under test, holds everything: weights and workspace for the
  whole run, activations for one step, KV blocks for one request's life.

Every call goes through a ``TimedPool``, which measures the policy's own bookkeeping time and
collects the driver time its device charges (``sim.replay.engine.TimedCalls``), so a ``cudaMalloc``
on the hot path lands on the step that caused it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from policies.base import Allocation, Policy
from sim.replay.costs import CostModel
from sim.replay.engine import TimedCalls, policy_target
from sim.serving.choices import DEFAULT_WORKSPACE_BYTES, POOL_LAYOUTS  # noqa: F401 (moved; importable here too)
from sim.replay.costed_policy import create_policy  # noqa: F401 (moved; importable here too)

if TYPE_CHECKING:
    from sim.serving.config import ServerConfig

__all__ = [
    "MemoryPlan",
    "plan_memory",
    "TimedPool",
    "ServerPools",
    "create_policy",
    "POOL_LAYOUTS",
    "DEFAULT_WORKSPACE_BYTES",
]


@dataclass(frozen=True)
class MemoryPlan:
    """How a GPU's memory is split before the first request (vLLM's profiling step).

    ``kv_budget_bytes = usable - weights - activation_reserve - workspace`` unless given. Under
    tensor parallelism every figure is one GPU's (each GPU has the same plan and its own KV
    pool holding its share of every token's KV heads).
    """

    gpu_bytes: int
    usable_bytes: int  # gpu_bytes x gpu_memory_utilization
    weight_bytes: int
    activation_reserve_bytes: int  # activations of the largest step (max_num_batched_tokens)
    workspace_bytes: int
    kv_budget_bytes: int
    tensor_parallel: int = 1

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in self.__dataclass_fields__.values()}  # type: ignore[attr-defined]


def plan_memory(
    model: Any,
    gpu: Any,
    *,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    kv_capacity_bytes: int | None = None,
    tensor_parallel: int = 1,
) -> MemoryPlan:
    """Split one ``gpu``'s memory for ``model`` (its shard over ``tensor_parallel`` GPUs) like vLLM
    does; raise ValueError when nothing is left for KV. ``kv_capacity_bytes`` is per GPU too."""
    model = model.shard(tensor_parallel)
    gpu_bytes = int(gpu.memory_bytes)
    usable = int(gpu_bytes * gpu_memory_utilization)
    weights = int(model.weight_bytes)
    activations = int(model.activation_bytes(max_num_batched_tokens))
    if kv_capacity_bytes is None:
        kv = usable - weights - activations - workspace_bytes
        if kv <= 0:
            per = f" per GPU (tensor parallelism {tensor_parallel})" if tensor_parallel > 1 else ""
            raise ValueError(
                "no memory left for the KV cache: "
                f"{gpu.name} x gpu_memory_utilization={gpu_memory_utilization} gives "
                f"{usable / 2**30:.1f} GiB, "
                f"but {model.name} needs {weights / 2**30:.1f} GiB of weights{per}, "
                f"{activations / 2**30:.2f} GiB of activations "
                f"and {workspace_bytes / 2**30:.2f} GiB of workspace"
            )
    else:
        kv = int(kv_capacity_bytes)
        if kv <= 0:
            raise ValueError(f"kv_capacity_bytes(={kv_capacity_bytes!r}) must be > 0")
    return MemoryPlan(gpu_bytes, usable, weights, activations, workspace_bytes, kv, tensor_parallel)


class TimedPool:
    """A policy plus the latency of each call to it.

    ``alloc_ns``/``free_ns`` hold one sample per call, timed by ``sim.replay.engine.TimedCalls``
    (the replay engine's definition: the policy's own bookkeeping time plus the driver time its
    device charged for that call). The driver time also accrues in ``pending_driver_ns`` until the
    server takes it for the current step.
    """

    __slots__ = ("policy", "_calls", "calls", "alloc_ns", "free_ns", "record_latency")

    def __init__(self, policy: Policy, *, record_latency: bool = True):
        self.policy = policy
        # C int64 arrays, as the replay engine keeps them: 8 bytes a sample where a list holds
        # a pointer to an int object kept alive (the Azure hour: 273,396 samples a list), memory
        # a process's first run must fault in
        self.alloc_ns: array = array("q")
        self.free_ns: array = array("q")
        self.record_latency = record_latency
        # construction-time driver calls belong to no step; the latencies land in the arrays above
        self._calls = TimedCalls(
            policy_target(policy),
            alloc_ns=self.alloc_ns if record_latency else None,
            free_ns=self.free_ns if record_latency else None,
        )
        #: the ``TimedCalls`` behind this pool: its ``pending_driver_ns`` is a plain attribute
        #: (read it there on a hot path; this pool's property is the same figure)
        self.calls = self._calls

    @property
    def pending_driver_ns(self) -> int:
        return self._calls.pending_driver_ns

    @pending_driver_ns.setter
    def pending_driver_ns(self, ns: int) -> None:
        self._calls.pending_driver_ns = ns

    def allocate(self, nbytes: int, tag: str | None = None) -> Allocation | None:
        return self._calls.allocate(nbytes, 0, tag)

    def free(self, allocation: Allocation) -> None:
        self._calls.free(allocation)

    def take_driver_ns(self) -> int:
        return self._calls.take_driver_ns()


class ServerPools:
    """The pools of one simulated server, in either layout.

    Args:
        kv_policy: the policy under test (it holds the KV cache, and everything when shared).
        plan: the memory split.
        config: the server's settings; read here: ``pool_layout`` ("separate" or "shared") and
            ``aux_policy`` (spec of the weights/activations/workspace pools when separate).
        costs: driver-time model for the auxiliary pools.
        num_weight_tensors: weights are allocated as this many equal tensors (one per layer).
    """

    def __init__(
        self,
        kv_policy: Policy,
        plan: MemoryPlan,
        config: ServerConfig,
        *,
        costs: CostModel | None,
        num_weight_tensors: int,
    ):
        layout, aux_policy = config.pool_layout, config.aux_policy
        self.plan = plan
        self.layout = layout
        self.kv = TimedPool(kv_policy)
        if layout == "shared":
            self.weights = self.activations = self.workspace = self.kv
            self.distinct: tuple[TimedPool, ...] = (self.kv,)
        else:
            # the auxiliary pools are not under test: no latency samples, but their driver time
            # counts
            self.weights = TimedPool(
                create_policy(aux_policy, capacity_bytes=None, costs=costs), record_latency=False
            )
            self.activations = TimedPool(
                create_policy(aux_policy, capacity_bytes=None, costs=costs), record_latency=False
            )
            self.workspace = TimedPool(
                create_policy(aux_policy, capacity_bytes=None, costs=costs), record_latency=False
            )
            self.distinct = (self.kv, self.weights, self.activations, self.workspace)
        #: bytes the non-KV allocations hold in the KV policy's pool (nonzero only when shared)
        self.aux_allocated_bytes = 0
        self._weights: list[Allocation] = []
        self._workspace: Allocation | None = None
        self._load(num_weight_tensors)

    def _load(self, num_weight_tensors: int) -> None:
        """Weights and workspace, before the first request; their driver time belongs to no step."""
        n = max(1, num_weight_tensors)
        per_tensor = -(-self.plan.weight_bytes // n)
        for _ in range(n):
            a = self.weights.allocate(per_tensor, tag="weights")
            if a is None:
                raise ValueError(
                    f"the weights ({self.plan.weight_bytes / 2**30:.1f} GiB) "
                    f"do not fit in the {self.layout} pool ({self.weights.policy!r})"
                )
            self._weights.append(a)
        if self.plan.workspace_bytes > 0:
            self._workspace = self.workspace.allocate(self.plan.workspace_bytes, tag="workspace")
            if self._workspace is None:
                raise ValueError(
                    f"the workspace ({self.plan.workspace_bytes} B) "
                    f"does not fit in the {self.layout} pool ({self.workspace.policy!r})"
                )
        if self.layout == "shared":
            self.aux_allocated_bytes = self.kv.policy.allocated_bytes
        for pool in self.distinct:
            pool.take_driver_ns()
            del pool.alloc_ns[:]

    def allocate_activations(self, nbytes: int) -> Allocation | None:
        a = self.activations.allocate(nbytes, tag="activations")
        if a is not None and self.layout == "shared":
            self.aux_allocated_bytes += a.size_bytes
        return a

    def free_activations(self, a: Allocation) -> None:
        self.activations.free(a)
        if self.layout == "shared":
            self.aux_allocated_bytes -= a.size_bytes

    def kv_reserved_bytes(self) -> int:
        """Bytes the KV cache holds from the device (in the shared layout: all the pool's but
        non-KV)."""
        return self.kv.policy.reserved_bytes - self.aux_allocated_bytes

    def take_driver_ns(self) -> int:
        """Driver time all pools accrued since the last call."""
        total = 0
        for pool in self.distinct:
            if pool.pending_driver_ns:
                total += pool.take_driver_ns()
        return total

    def aux_peak_reserved_bytes(self) -> int:
        """Peak bytes the auxiliary pools reserved (0 in the shared layout)."""
        if self.layout == "shared":
            return 0
        return sum(
            p.policy.peak_reserved_bytes for p in (self.weights, self.activations, self.workspace)
        )
