"""What kind of device a pool runs on: the one vocabulary of ``policies``, ``sim``, ``realgpu`` and
the reports.

- ``DeviceKind.SEGMENT`` (``"segment"``): the device hands out ranges that are memory from the
  start, reserved and released whole (``cudaMalloc``/``cudaFree``; ``policies.device``).
- ``DeviceKind.PAGE_MAPPED`` (``"page-mapped"``): the device maps physical pages into reserved
  virtual ranges (``cuMemCreate``/``cuMemMap``; ``policies.mapped_device``).

A policy declares the kind it needs (``Policy.device_kind``, ``Policy.device_kind_for``), a device
the kind it is (``device_kind``), a report row the kind it ran on (the ``device_kind`` column),
and ``poollab gpu replay --device-kind`` takes one. The values are what users type and see. The
spellings ``poollab gpu`` used before (``"segments"``, ``"vmm"``) are read here, once
(``DeviceKind.parse``); anything else is an error that names the accepted values.

A ``realgpu`` backend names a platform and a kind: ``"cuda"``/``"host"`` for segments,
``"cuda-vmm"``/``"host-vmm"`` for mapped pages (``DeviceKind.backend``, ``DeviceKind.of_backend``).

A leaf module: ``policies`` owns it and imports nothing else here (no simpy, CuPy or pandas).
"""

from __future__ import annotations

import enum

__all__ = ["DeviceKind", "PLATFORMS"]

#: the platforms a ``realgpu`` backend runs on: the GPU, or host memory standing in for it
PLATFORMS = ("cuda", "host")

#: old spellings -> the kind they meant (``poollab gpu replay --device-kind`` and its report column)
_OLD_SPELLINGS = {"segments": "segment", "vmm": "page-mapped"}
#: what a backend name adds to its platform's for mapped pages
_PAGE_MAPPED_SUFFIX = "-vmm"


class DeviceKind(enum.StrEnum):
    """The kind of device: ``str`` subclass whose value is its name in reports and options."""

    SEGMENT = "segment"
    PAGE_MAPPED = "page-mapped"

    @classmethod
    def parse(cls, value: "str | DeviceKind", *, where: str = "device kind") -> "DeviceKind":
        """The kind ``value`` names: a member, its value, or an old spelling (``segments``,
        ``vmm``). Raises ValueError naming ``where`` and the accepted values for anything else."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            try:
                return cls(_OLD_SPELLINGS.get(text, text))
            except ValueError:
                pass
        accepted = ", ".join([k.value for k in cls] + list(_OLD_SPELLINGS))
        raise ValueError(f"{where}: unknown device kind {value!r}; one of {accepted}")

    def backend(self, platform: str) -> str:
        """The ``realgpu`` backend of this kind on ``platform`` (``"cuda"`` or ``"host"``)."""
        if platform not in PLATFORMS:
            raise ValueError(f"platform(={platform!r}) must be one of {', '.join(PLATFORMS)}")
        return platform + _PAGE_MAPPED_SUFFIX if self is DeviceKind.PAGE_MAPPED else platform

    @classmethod
    def of_backend(cls, backend: str) -> "DeviceKind":
        """The kind a backend name (``"cuda"``, ``"host-vmm"``, ...) stands for."""
        return cls.PAGE_MAPPED if backend.endswith(_PAGE_MAPPED_SUFFIX) else cls.SEGMENT

    @staticmethod
    def platform_of(backend: str) -> str:
        """The platform of a backend name: ``"cuda-vmm"`` -> ``"cuda"``."""
        return backend.removesuffix(_PAGE_MAPPED_SUFFIX)
