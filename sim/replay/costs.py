"""What device calls cost: the data behind simulated latency.

The model is a JSON file, not code: the default (``sim/data/costs_h200.json``) holds the H200
figures of the field notes, and ``poollab gpu calibrate --out costs.json`` measures a new one
on any GPU. Latency between measured sizes is interpolated linearly in log(size) / log(time),
and extrapolated along the last segment's slope.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from policies.device import ClockedDriver, Device, DriverClock, VirtualDevice, vmm_stats
from policies.device_kind import DeviceKind
from policies.mapped_device import VMM_CALLS, PageMappedDevice
from traces.knobs import is_finite_number
from traces.source import read_settings_bytes

__all__ = [
    "CostModel",
    "CostedDevice",
    "DEFAULT_COSTS",
    "costed_page_mapped_device",
    "costed_device",
]

DEFAULT_COSTS = "costs_h200.json"


def _bundled_table() -> dict[str, Any]:
    return json.loads(resources.files("sim").joinpath("data", DEFAULT_COSTS).read_text())


@dataclass(frozen=True)
class _Curve:
    """Latency against size, piecewise linear in log-log space."""

    log_sizes: tuple[float, ...]
    log_us: tuple[float, ...]

    @classmethod
    def from_table(cls, table: dict[str, list[float]], where: str) -> "_Curve":
        if not isinstance(table, dict):
            raise ValueError(
                f"{where}: needs an object with 'nbytes' and 'us' lists, got {table!r}"
            )
        sizes, us = table.get("nbytes"), table.get("us")
        if (
            not isinstance(sizes, list)
            or not isinstance(us, list)
            or not sizes
            or len(sizes) != len(us)
        ):
            raise ValueError(f"{where}: needs equally long, non-empty 'nbytes' and 'us' lists")
        bad = next((v for v in sizes + us if not _is_positive_number(v)), None)
        if bad is not None:
            raise ValueError(f"{where}: sizes and times must be finite numbers > 0, got {bad!r}")
        pairs = sorted(zip(sizes, us))
        return cls(tuple(math.log(s) for s, _ in pairs), tuple(math.log(t) for _, t in pairs))

    def us(self, nbytes: int) -> float:
        xs, ys = self.log_sizes, self.log_us
        if len(xs) == 1:
            return math.exp(ys[0])
        x = math.log(max(nbytes, 1))
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        if x < xs[0]:
            return math.exp(ys[0])  # below the smallest measured size the call does not get cheaper
        return math.exp(ys[i] + slope * (x - xs[i]))


def _is_positive_number(value: Any) -> bool:
    """A JSON number that can be a size, a time or a bandwidth: finite and > 0 (not a bool)."""
    return is_finite_number(value) and value > 0


class CostModel:
    """Driver-call latency and copy bandwidths of one GPU.

    Args:
        table: the parsed JSON (see ``sim/data/costs_h200.json`` for the schema).
        source: where it came from, for error messages and reports.
    """

    def __init__(self, table: dict[str, Any], source: str = "<costs>"):
        self.table = table
        self.source = source
        self.device_name = str(table.get("device", "unknown"))
        self._malloc = _Curve.from_table(table.get("malloc_us", {}), f"{source}: malloc_us")
        self._free = _Curve.from_table(table.get("free_us", {}), f"{source}: free_us")
        vmm = table["vmm_us"] if "vmm_us" in table else _bundled_table()["vmm_us"]
        if not isinstance(vmm, dict) or set(vmm) != set(VMM_CALLS):
            raise ValueError(
                f"{source}: vmm_us must have a table for each of {', '.join(VMM_CALLS)}"
            )
        self._vmm = {
            call: _Curve.from_table(vmm[call], f"{source}: vmm_us.{call}") for call in VMM_CALLS
        }
        #: (call, bytes) -> ns, memoised: a page pool asks for the same page size millions of times
        self._vmm_ns: dict[tuple[str, int], int] = {}
        self.vmm_source = source if "vmm_us" in table else f"sim/data/{DEFAULT_COSTS}"
        self.d2d_bytes_per_s = self._positive(table, "d2d_bytes_per_s")
        self.h2d_bytes_per_s = self._positive(table, "h2d_bytes_per_s")
        self.d2h_bytes_per_s = self._positive(table, "d2h_bytes_per_s")

    def _positive(self, table: dict[str, Any], key: str) -> float:
        value = table.get(key)
        if not _is_positive_number(value):
            raise ValueError(f"{self.source}: {key} must be a positive number, got {value!r}")
        return float(value)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "CostModel":
        """Read a cost file; None reads the bundled H200 defaults. A file without a ``vmm_us``
        table (one calibrated before virtual memory was measured) takes the bundled one."""
        if path is None:
            return cls(_bundled_table(), source=f"sim/data/{DEFAULT_COSTS}")
        p = Path(path)
        raw = read_settings_bytes(p)  # read once, whole: a FIFO or /dev/stdin works
        try:
            table = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{p}: not UTF-8 text (byte {exc.start}): not a cost file") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        except RecursionError:  # arrays or objects nested thousands deep: no cost file
            raise ValueError(f"{p}: JSON nested too deep to be a cost file") from None
        except ValueError as exc:  # an integer literal past Python's 4,300 digits
            raise ValueError(f"{p}: not valid JSON: {exc}") from None
        if not isinstance(table, dict):
            raise ValueError(f"{p}: a cost file is a JSON object")
        return cls(table, source=str(p))

    def vmm_call_ns(self, call: str, nbytes: int) -> int:
        """One virtual-memory driver call (``policies.mapped_device.VMM_CALLS``) over ``nbytes``."""
        key = (call, nbytes)
        ns = self._vmm_ns.get(key)
        if ns is None:
            ns = self._vmm_ns[key] = round(self._vmm[call].us(nbytes) * 1e3)
        return ns

    def malloc_ns(self, nbytes: int) -> int:
        return round(self._malloc.us(nbytes) * 1e3)

    def free_ns(self, nbytes: int) -> int:
        return round(self._free.us(nbytes) * 1e3)

    def copy_ns(self, nbytes: int) -> int:
        """A device-to-device copy of ``nbytes``."""
        return int(nbytes / self.d2d_bytes_per_s * 1e9)

    def h2d_ns(self, nbytes: int) -> int:
        return int(nbytes / self.h2d_bytes_per_s * 1e9)

    def d2h_ns(self, nbytes: int) -> int:
        return int(nbytes / self.d2h_bytes_per_s * 1e9)


class CostedDevice(ClockedDriver):
    """A ``Device`` that charges each reserve/release its modelled driver time.

    The time is pending until the caller takes it with ``take_driver_ns()`` (the ``Device``
    protocol, ``ClockedDriver``'s), so it lands on the allocation (or simulated step) that caused
    the driver call.

    Args:
        costs: the cost model (the bundled H200 one by default).
        inner: the device that hands out addresses (a fresh ``VirtualDevice`` by default).
    """

    device_kind = DeviceKind.SEGMENT

    def __init__(self, costs: CostModel | None = None, inner: Device | None = None):
        self.costs = costs if costs is not None else CostModel.load()
        self.inner = inner if inner is not None else VirtualDevice()
        self.clock = DriverClock()
        self.num_reserves = 0
        self.num_releases = 0

    def reserve(self, nbytes: int) -> int | None:
        offset = self.inner.reserve(nbytes)
        self.clock.charge(
            self.costs.malloc_ns(nbytes), pending=True
        )  # a failed cudaMalloc costs a call too
        self.num_reserves += 1
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        self.inner.release(offset, nbytes)
        self.clock.charge(self.costs.free_ns(nbytes), pending=True)
        self.num_releases += 1

    @property
    def max_bytes(self) -> int:
        return self.inner.max_bytes

    def copy_ns(self, nbytes: int) -> int:
        return self.costs.copy_ns(nbytes)

    def call_stats(self) -> dict[str, int]:
        return vmm_stats()  # cudaMalloc/cudaFree: counted as the pool's grows and shrinks


def costed_page_mapped_device(
    costs: CostModel | None = None,
    *,
    granularity_bytes: int = 2 << 20,
    limit_bytes: int | None = None,
) -> PageMappedDevice:
    """A ``PageMappedDevice`` charging each cuMem call its modelled time (bundled H200 table by
    default)."""
    return PageMappedDevice(
        granularity_bytes=granularity_bytes,
        limit_bytes=limit_bytes,
        costs=costs if costs is not None else CostModel.load(),
    )


def costed_device(
    kind: DeviceKind | str, costs: CostModel | None = None, *, granularity_bytes: int | None = None
) -> CostedDevice | PageMappedDevice:
    """The simulator's device of ``kind`` (``DeviceKind``, or a spelling ``DeviceKind.parse``
    reads): a ``CostedDevice`` charging ``costs`` per ``cudaMalloc``/``cudaFree``, or a page-mapped
    one charging them per cuMem call (of ``granularity_bytes``, 2 MiB by default)."""
    if DeviceKind.parse(kind) is DeviceKind.PAGE_MAPPED:
        return costed_page_mapped_device(costs, granularity_bytes=granularity_bytes or 2 << 20)
    return CostedDevice(costs)
