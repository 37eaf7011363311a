"""Memory-pool policies for LLM inference: the contract, the registry and the built-ins.

Pure Python: no simpy, CuPy or pandas here, so the same policy object runs in replay, in the
serving simulator and on a real GPU.
"""

from policies.base import Allocation, PoolStats, Policy, Segment
from policies.device import Device, VirtualDevice
from policies.errors import PolicyError
from policies.registry import ENTRY_POINT_GROUP, available, create, get, register
from policies.spec import format_spec, parse_spec
from policies.units import format_bytes, parse_bytes

__all__ = [
    "Allocation",
    "PoolStats",
    "Policy",
    "Segment",
    "Device",
    "VirtualDevice",
    "PolicyError",
    "ENTRY_POINT_GROUP",
    "available",
    "create",
    "get",
    "register",
    "format_spec",
    "parse_spec",
    "format_bytes",
    "parse_bytes",
]
