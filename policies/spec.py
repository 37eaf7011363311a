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
from traces.spec_grammar import MAX_SPEC_CHARS, MAX_SPEC_DEPTH, check_text, parse_items, unbracket
from traces.spec_grammar import format_value as _format_text

__all__ = [
    "parse_spec",
    "format_spec",
    "parse_value",
    "check_spec_text",
    "MAX_SPEC_CHARS",
    "MAX_SPEC_DEPTH",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def check_spec_text(text: str, what: str = "policy spec") -> None:
    """Raise PolicyError unless ``text`` is at most ``MAX_SPEC_CHARS`` long, with its square
    brackets balanced and nested at most ``MAX_SPEC_DEPTH`` deep. ``what`` names the text in the
    message."""
    check_text(text, what, error=PolicyError)


def parse_value(text: str) -> Any:
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return unbracket(text)  # a nested spec, left for the wrapper to build
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
        raise PolicyError(
            f"policy spec {spec!r} is empty; expected 'name' or 'name:key=value,...'",
            spec=spec.strip() if isinstance(spec, str) else None,
            spec_in_reason=True,
        )
    spec = spec.strip()
    try:
        check_spec_text(spec)
    except PolicyError as exc:  # the message quotes the spec (cut short when it is too long)
        raise PolicyError(exc.reason, spec=spec, spec_in_reason=True) from None
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not _NAME_RE.match(name):
        raise PolicyError(f"{name!r} is not a policy name", spec=spec)
    if not rest.strip():
        return name, {}
    items = parse_items(
        rest,
        skip_empty=False,
        bad_item=lambda item: PolicyError(f"{item!r} is not key=value", spec=spec),
        twice=lambda key: PolicyError(f"{key!r} is given twice", spec=spec),
    )
    return name, {key: parse_value(value) for key, value in items.items()}


def _format_value(value: Any) -> str:
    if hasattr(value, "spec") and hasattr(value, "allocate"):
        return f"[{value.spec}]"
    return _format_text(value) if isinstance(value, str) else str(value)


def format_spec(name: str, params: dict[str, Any]) -> str:
    if not params:
        return name
    return name + ":" + ",".join(f"{k}={_format_value(v)}" for k, v in params.items())
