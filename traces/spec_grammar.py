"""The one ``key=value,key=value`` grammar: policy specs, ``tag-limits``' limits, length
distributions and prefix sharing all read their text here.

A text is items separated by commas; an item is ``key=value``; a value in square brackets may
hold commas (and, nested, a whole spec): ``base=[size-class:classes_per_doubling=8],high=0.85``.
``check_text`` bounds a text's length and bracket nesting before anything reads it (each level
of a policy spec builds a policy, so thousands of levels would exhaust Python's stack);
``parse_items`` splits it and ``format_items`` writes items back, so that
``parse_items(format_items(items)) == items`` (tests/traces/test_spec_grammar.py).

Why here: ``policies`` and ``traces`` both read such texts, and ``traces`` may import no policy,
so the grammar cannot live in ``policies``; ``traces/__init__`` imports only
``traces.errors`` (standard library), so ``policies`` importing this module pulls in no pandas
(tests/policies/test_isolation.py blocks it). This module imports nothing but the standard
library. Each caller keeps its own words: the errors are built by the caller's callbacks (a
``PolicyError`` for policies, a ``ValueError`` for the generators), naming the text and the item.
"""

from __future__ import annotations

import re
from typing import Callable

__all__ = [
    "MAX_SPEC_CHARS",
    "MAX_SPEC_DEPTH",
    "check_text",
    "split_top",
    "parse_items",
    "unbracket",
    "format_value",
    "format_items",
]

#: Longest text read: the longest in the docs is under 100 characters, so more is a runaway (a
#: generated or pasted text) that every error message would repeat. Below Python's 4,300-digit
#: limit on int conversion, so no value in a spec can reach that limit.
MAX_SPEC_CHARS = 4096
#: Deepest nesting of bracketed values (a wrapper's base, its base, ...): stacks in use are 1-3
#: deep, and each level builds a policy.
MAX_SPEC_DEPTH = 16

_BRACKET_RE = re.compile(r"[\[\]]")
Error = Callable[[str], Exception]


def check_text(
    text: str,
    what: str,
    *,
    error: Error = ValueError,
    max_chars: int = MAX_SPEC_CHARS,
    max_depth: int | None = MAX_SPEC_DEPTH,
) -> None:
    """Raise ``error(message)`` unless ``text`` is at most ``max_chars`` long, with its square
    brackets balanced and nested at most ``max_depth`` deep; ``what`` names the text.
    ``max_depth=None`` checks the length only (for a caller whose own rule on brackets says
    more)."""
    if len(text) > max_chars:
        raise error(
            f"{what} {text[:40]!r}... is {len(text):,} characters long; at most {max_chars:,}"
        )
    if max_depth is None:
        return
    depth = deepest = 0
    for ch in _BRACKET_RE.findall(text):
        depth += 1 if ch == "[" else -1
        if depth < 0:
            raise error(f"unbalanced ']' in {what} {text!r}")
        deepest = max(deepest, depth)
    if depth:
        raise error(f"unbalanced '[' in {what} {text!r}")
    if deepest > max_depth:
        raise error(
            f"{what} {text[:40]!r}... nests [...] {deepest:,} levels deep; at most {max_depth}"
        )


def split_top(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside square brackets (balanced: ``check_text`` has looked)."""
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


def parse_items(
    text: str,
    *,
    bad_item: Callable[[str], Exception] | None,
    twice: Callable[[str], Exception] | None = None,
    valid_key: Callable[[str], bool] = str.isidentifier,
    skip_empty: bool = True,
    need_value: bool = False,
    assign: str = "=",
) -> dict[str, str]:
    """``"a=1, b=[x:c=2,d=3]" -> {"a": "1", "b": "[x:c=2,d=3]"}``: keys and values stripped,
    brackets kept (``unbracket`` takes them off), in the text's order.

    Args:
        bad_item: the error for an item that is not ``key=value`` (given the stripped item);
            None skips such items (reading someone else's text, e.g. ``PYTORCH_CUDA_ALLOC_CONF``).
        twice: the error for a key given twice (given the key); None: the last one wins.
        valid_key: which keys are keys (identifiers by default).
        skip_empty: empty items (``a=1,,b=2``) are skipped; False: they are bad items.
        need_value: ``key=`` (an empty value) is a bad item.
        assign: what separates a key from its value (PyTorch's allocator settings use ``:``).
    """
    items: dict[str, str] = {}
    for raw in split_top(text):
        item = raw.strip()
        if not item and skip_empty:
            continue
        key, eq, value = item.partition(assign)
        key, value = key.strip(), value.strip()
        if not eq or not key or not valid_key(key) or (need_value and not value):
            if bad_item is None:
                continue
            raise bad_item(item)
        if key in items and twice is not None:
            raise twice(key)
        items[key] = value
    return items


def unbracket(value: str) -> str:
    """``"[x:a=1]" -> "x:a=1"``; a value not in brackets is returned as it is."""
    return value[1:-1].strip() if value.startswith("[") and value.endswith("]") else value


def format_value(value: object) -> str:
    """A value as an item writes it: in brackets when it holds a separator (``,`` or a spec's
    ``:``) or starts with ``[`` (so that ``unbracket`` gives it back whole)."""
    text = str(value)
    return f"[{text}]" if ":" in text or "," in text or text.startswith("[") else text


def format_items(items: dict[str, object]) -> str:
    """``{"a": 1, "b": "x:c=2"} -> "a=1,b=[x:c=2]"``, the inverse of ``parse_items``."""
    return ",".join(f"{key}={format_value(value)}" for key, value in items.items())
