"""The one validator of numeric and on/off knobs: ``name(=value) must be <what>``.

Every constructor knob (a policy's ``segment_bytes``, a pool's ``guard_bytes``, a generator's
``num_requests``, a preset's fields) is checked here, so that each refusal reads the same way
and names the knob (simpy's ``amount(=-3) must be > 0``): ``check_int("segment_bytes", 0)``
raises ``ValueError("segment_bytes(=0) must be an integer >= 1")``. A bool is not a number
here, although Python says it is an int.

Why here: ``policies``, ``traces``, ``sim`` and ``realgpu`` all check knobs, and ``traces``
may import no policy, so the one validator lives in ``traces`` with only the standard library
beneath it (``policies`` imports it without pulling in pandas, as it does
``traces.spec_grammar``). Each caller passes its own error class (``PolicyError``,
``PoolError``, ``ValueError``) and, for a file, where the value came from (``where``).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

__all__ = ["check_int", "check_flag", "describe_int", "is_finite_number"]

Error = Callable[[str], Exception]


def describe_int(
    low: int | None = 1,
    high: int | None = None,
    multiple_of: int | None = None,
    none_ok: bool = False,
) -> str:
    """What ``check_int`` accepts, in words: ``"an integer >= 1"``, ``"a positive multiple of
    512"``."""
    what = f"a multiple of {multiple_of:,}" if multiple_of else "an integer"
    if multiple_of and low == multiple_of:  # the smallest multiple: "positive" says it
        what, low = f"a positive multiple of {multiple_of:,}", None
    if low is not None and high is not None:
        what += f" in [{low:,}, {high:,}]"
    elif low is not None:
        what += f" >= {low:,}" if abs(low) >= 10_000 else f" >= {low}"
    elif high is not None:
        what += f" <= {high:,}"
    return what + (" or None" if none_ok else "")


def check_int(
    name: str,
    value: Any,
    *,
    low: int | None = 1,
    high: int | None = None,
    multiple_of: int | None = None,
    none_ok: bool = False,
    error: Error = ValueError,
    where: str = "",
) -> Any:
    """``value`` as a plain int when it is a whole number (numpy's too, not a bool) in
    ``[low, high]`` and a multiple of ``multiple_of``; None when ``none_ok`` and it is None.

    Raises:
        error: ``"{where}{name}(={value!r}) must be {describe_int(...)}"``.
    """
    if value is None and none_ok:
        return None
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if (
        number is None
        or (low is not None and number < low)
        or (high is not None and number > high)
        or (multiple_of and number % multiple_of)
    ):
        raise error(
            f"{where}{name}(={_shown(value)}) "
            f"must be {describe_int(low, high, multiple_of, none_ok)}"
        )
    return number


def is_finite_number(value: Any) -> bool:
    """``value`` is an int or a float (not a bool) that a float can hold, and finite: JSON's
    ``NaN`` and ``Infinity`` are not, nor an integer literal past a float's range (``10**400``,
    on which ``math.isfinite`` raises OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_flag(name: str, value: Any, *, error: Error = ValueError, where: str = "") -> bool:
    """``value`` when it is True or False (numpy's bool too), else ``error`` naming the knob."""
    if isinstance(value, bool) or (getattr(value, "ndim", None) == 0 and value.dtype.kind == "b"):
        return bool(value)
    raise error(f"{where}{name}(={_shown(value)}) must be true or false")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."
