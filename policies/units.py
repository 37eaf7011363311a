"""Byte sizes written the way people write them: ``80GiB``, ``2MiB``, ``512``, ``1.5GB``."""

from __future__ import annotations

import re

from policies.errors import PolicyError

__all__ = ["parse_bytes", "format_bytes", "round_up"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def round_up(nbytes: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``nbytes`` (bytes, pages, tokens alike)."""
    return -(-nbytes // multiple) * multiple


def parse_bytes(text: str | int) -> int:
    """``"80GiB" -> 85899345920``. Raises PolicyError naming the text when it is no size."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise PolicyError(f"size {text!r} must not be negative")
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise PolicyError(f"cannot read {text!r} as a size in bytes (examples: 4096, 2MiB, 80GiB)")
    digits, unit = m.group(1).replace("_", ""), _UNITS[m.group(2).lower()]
    if (
        len(digits) > 30
    ):  # past any memory; float() would make it inf, int() may pass Python's digit limit
        raise PolicyError(
            f"size {str(text)[:40]!r}... "
            f"({len(digits):,} digits) is too large to be a number of bytes"
        )
    value = (
        int(digits) * unit if "." not in digits else float(digits) * unit
    )  # whole numbers stay exact
    if value != int(value):
        raise PolicyError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_bytes(nbytes: float) -> str:
    """``85899345920 -> '80.0 GiB'`` (binary units, for tables people read)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
