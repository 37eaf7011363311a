"""What the checks share: the factory type, bad sizes, and how a check fails."""

from __future__ import annotations

from typing import Any, Callable

from policies.base import Policy

PolicyFactory = Callable[..., Policy]
MiB = 1 << 20

#: sizes a request may have that every policy must refuse with PolicyError
BAD_SIZES: tuple[Any, ...] = (0, -1, -4096, 1.5, 4096.0, "10", True, False, None, b"1", [8])


def fail(message: str) -> None:
    """Raise AssertionError (not ``assert``, so the checks survive ``python -O``)."""
    raise AssertionError(message)
