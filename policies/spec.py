"""Policy spec strings: ``name`` or ``name:key=value,key=value``.

A value in square brackets is itself a spec, so wrappers nest:
``elastic:base=[size-class:classes_per_doubling=8],high=0.85,low=0.3``.
Values read as int, float, bool, None, a byte size (``2MiB``) or a plain string, in that order.
"""

from __future__ import annotations

import re
from typing import Any

from policies.errors import PolicyError
from policies.units import parse_bytes

__all__ = ["parse_spec", "format_spec", "parse_value"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside square brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise PolicyError(f"unbalanced ']' in policy spec {text!r}")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise PolicyError(f"unbalanced '[' in policy spec {text!r}")
    parts.append(text[start:])
    return parts


def parse_value(text: str) -> Any:
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return text[1:-1].strip()  # a nested spec, left for the wrapper to build
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    try:
        return int(text.replace("_", ""))
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_bytes(text)
    except PolicyError:
        return text


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"size-class:classes_per_doubling=4" -> ("size-class", {"classes_per_doubling": 4})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(f"policy spec {spec!r} is empty; expected 'name' or 'name:key=value,...'")
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not _NAME_RE.match(name):
        raise PolicyError(f"policy spec {spec!r}: {name!r} is not a policy name")
    params: dict[str, Any] = {}
    if rest.strip():
        for item in _split_top(rest, ","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key.isidentifier():
                raise PolicyError(f"policy spec {spec!r}: {item.strip()!r} is not key=value")
            if key in params:
                raise PolicyError(f"policy spec {spec!r}: {key!r} is given twice")
            params[key] = parse_value(value)
    return name, params


def _format_value(value: Any) -> str:
    if hasattr(value, "spec") and hasattr(value, "allocate"):
        return f"[{value.spec}]"
    if isinstance(value, str) and (":" in value or "," in value):
        return f"[{value}]"
    return str(value)


def format_spec(name: str, params: dict[str, Any]) -> str:
    if not params:
        return name
    return name + ":" + ",".join(f"{k}={_format_value(v)}" for k, v in params.items())
