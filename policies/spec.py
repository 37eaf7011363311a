"""Policy spec strings: ``name`` or ``name:key=value,key=value``.

A value in square brackets is itself a spec, so wrappers nest:
``elastic:base=[size-class:classes_per_doubling=8],high=0.85,low=0.3``.
Values read as int, float, bool, None, a byte size (``2MiB``) or a plain string, in that order.

``check_spec_text`` bounds a spec's length and nesting before it is read (every bracketed base
builds a policy, so a spec thousands deep would exhaust Python's stack); ``tag-limits``' limits
and the sweep file's policy entries go through it too.
"""

from __future__ import annotations

import re
from typing import Any

from policies.errors import PolicyError
from policies.units import parse_bytes

__all__ = ["parse_spec", "format_spec", "parse_value", "check_spec_text", "MAX_SPEC_CHARS", "MAX_SPEC_DEPTH"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_BRACKET_RE = re.compile(r"[\[\]]")
#: Longest spec read: the longest in the docs is under 100 characters, so more is a runaway (a
#: generated or pasted text) that every error message would repeat. Below Python's 4,300-digit
#: limit on int conversion, so no value in a spec can reach that limit.
MAX_SPEC_CHARS = 4096
#: Deepest nesting of bracketed values (a wrapper's base, its base, ...): stacks in use are 1-3
#: deep, and each level builds a policy.
MAX_SPEC_DEPTH = 16


def check_spec_text(text: str, what: str = "policy spec") -> None:
    """Raise PolicyError unless ``text`` is at most ``MAX_SPEC_CHARS`` long, with its square brackets
    balanced and nested at most ``MAX_SPEC_DEPTH`` deep. ``what`` names the text in the message."""
    if len(text) > MAX_SPEC_CHARS:
        raise PolicyError(f"{what} {text[:40]!r}... is {len(text):,} characters long; at most {MAX_SPEC_CHARS:,}")
    depth = deepest = 0
    for ch in _BRACKET_RE.findall(text):
        depth += 1 if ch == "[" else -1
        if depth < 0:
            raise PolicyError(f"unbalanced ']' in {what} {text!r}")
        deepest = max(deepest, depth)
    if depth:
        raise PolicyError(f"unbalanced '[' in {what} {text!r}")
    if deepest > MAX_SPEC_DEPTH:
        raise PolicyError(f"{what} {text[:40]!r}... nests [...] {deepest:,} levels deep; at most {MAX_SPEC_DEPTH}")


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside square brackets (balanced: ``check_spec_text`` has looked)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
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
    check_spec_text(spec)
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
