"""The live pointer map of PyTorch's hot path (``realgpu.malloc_path.TorchPath``): pointer ->
allocation, keyed by C 64-bit integers in the compiled build.

A ``dict`` keyed by Python ints costs PyTorch's free ~560 instructions (callgrind, session 18:
the int's hash, CPython's generic lookup with a rich compare of the found key, which is never the
trampoline's own int object, the stored key's dealloc) and its malloc an int made for the key and
a ``setdefault``. ``LiveMap`` is an open-addressing table of the pointers as C integers (linear
probing, Fibonacci hashing of the whole pointer, deletion by shifting the probe run back: no
tombstones), so a lookup is a multiply, a shift and a compare or two, and no key is a Python
object. Compiled (``live_map.pxd``) its arrays are C (an ``array('Q')`` seen through a typed
memoryview) and ``add``/``take`` take the pointer as a C integer.

Interpreted, the same code runs, but slower than a ``dict`` (each probe a bytecode loop):
``new_live_map()`` gives the interpreted build a plain ``dict`` and the compiled build a
``LiveMap``; the hot path calls ``add``/``take`` compiled and ``setdefault``/``pop`` interpreted.
Both answer the same questions the same way (``tests/realgpu/test_live_map.py``: the table
against a ``dict``, run interpreted and compiled); iteration order is the table's, not
insertion order (nothing reads the map in order).

Keys are pointers: ``0 < key < 2**64`` (no pointer is 0: PyTorch's free skips nullptr and a
0-byte request gets 0 with no entry). Another key raises ``KeyError`` where a ``dict`` would have
stored it: the map holds pointers only.
"""

from __future__ import annotations

from array import array
from typing import Any, Iterator

try:
    import cython
except ImportError:  # a pure install: the same names as no-ops (policies/_cython_shim.py)
    from policies._cython_shim import cython

__all__ = ["LiveMap", "new_live_map"]

#: slots of a new table (a power of two); it doubles past half full
MIN_SLOTS = 64
#: 2**64 / the golden ratio, odd: Fibonacci hashing (the top bits of key * this are the slot), so
#: the low bits a 512-aligned pointer has all zero spread over the table like the others
_HASH_MULTIPLIER = 0x9E3779B97F4A7C15
#: a product's low 64 bits (compiled the C multiply wraps there itself; interpreted ints do not)
_MASK64 = (1 << 64) - 1
#: an empty slot's key (no pointer is 0)
_EMPTY = 0
#: ``pop``'s "no default given"
_MISSING = object()


def new_live_map() -> Any:
    """The map ``TorchPath`` keeps: a ``LiveMap`` compiled, a ``dict`` interpreted (see above)."""
    if cython.compiled:
        return LiveMap()
    return {}


class LiveMap:
    """``pointer -> allocation`` for the pointers handed to PyTorch: a ``dict``'s subset
    (``len``, ``in``, ``[]``, ``[] =``, ``del``, ``get``, ``pop``, ``setdefault``, iteration over
    the keys, ``values``, ``items``) plus ``add`` and ``take``, its hot path's two calls."""

    __slots__ = ("_keys", "_values", "_num_used", "_mask", "_shift")

    _keys: Any  # array('Q'): a slot's pointer, or _EMPTY
    _values: list  # a slot's allocation (None where empty)
    _num_used: int
    _mask: int  # slots - 1
    _shift: int  # 64 - log2(slots)

    def __init__(self) -> None:
        self._reset(MIN_SLOTS)

    @cython.locals(num_slots=cython.Py_ssize_t, bits=cython.Py_ssize_t)
    def _reset(self, num_slots: int) -> None:
        """An empty table of ``num_slots`` slots (a power of two)."""
        bits = num_slots.bit_length() - 1
        self._keys = array("Q", bytes(8 * num_slots))
        self._values = [None] * num_slots
        self._num_used = 0
        self._mask = num_slots - 1
        self._shift = 64 - bits

    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.locals(h=cython.ulonglong, i=cython.Py_ssize_t, k=cython.ulonglong)
    def _find(self, key: int) -> int:
        """The slot holding ``key``, else the empty slot that ends its probe run."""
        if key == _EMPTY:
            raise KeyError(key)  # no pointer is 0: a 0 key would read as an empty slot
        h = ((key * _HASH_MULTIPLIER) & _MASK64) >> self._shift
        i = h
        while True:
            k = self._keys[i]
            if k == key or k == _EMPTY:
                return i
            i = (i + 1) & self._mask

    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.locals(i=cython.Py_ssize_t)
    def add(self, key: int, value: Any) -> bool:
        """Store ``key -> value`` unless ``key`` is live already (the old entry kept): whether it
        was stored (``dict.setdefault`` with the answer "did the map grow")."""
        i = self._find(key)
        if self._keys[i] == key:
            return False
        self._keys[i] = key
        self._values[i] = value
        self._num_used += 1
        if 2 * self._num_used > self._mask + 1:
            self._grow()
        return True

    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.locals(i=cython.Py_ssize_t)
    def take(self, key: int) -> Any:
        """Remove ``key`` and return its value; None (nothing changed) if it is not live."""
        i = self._find(key)
        if self._keys[i] == _EMPTY:
            return None
        value = self._values[i]
        self._remove_at(i)
        return value

    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.locals(
        i=cython.Py_ssize_t,
        j=cython.Py_ssize_t,
        home=cython.Py_ssize_t,
        k=cython.ulonglong,
        mask=cython.Py_ssize_t,
    )
    def _remove_at(self, i: int) -> None:
        """Empty slot ``i``, moving later entries of its probe run back into the hole, so that no
        lookup meets an empty slot before its key (linear probing's deletion, no tombstones)."""
        values = self._values
        mask = self._mask
        j = i
        while True:
            j = (j + 1) & mask
            k = self._keys[j]
            if k == _EMPTY:
                break
            home = ((k * _HASH_MULTIPLIER) & _MASK64) >> self._shift
            # the entry at j may fill the hole at i unless its home lies cyclically in (i, j]
            if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
                self._keys[i] = k
                values[i] = values[j]
                i = j
        self._keys[i] = _EMPTY
        values[i] = None
        self._num_used -= 1

    @cython.locals(j=cython.Py_ssize_t, k=cython.ulonglong)
    def _grow(self) -> None:
        old_keys = self._keys
        old_values = self._values
        self._reset(2 * (self._mask + 1))
        for j in range(len(old_values)):
            k = old_keys[j]
            if k != _EMPTY:
                self.add(k, old_values[j])

    # ------------------------------------------------------------------ a dict's subset
    def __len__(self) -> int:
        return self._num_used

    def __bool__(self) -> bool:
        return self._num_used > 0

    def __contains__(self, key: Any) -> bool:
        return _is_pointer(key) and self._keys[self._find(key)] == key

    def __getitem__(self, key: Any) -> Any:
        if _is_pointer(key):
            i = self._find(key)
            if self._keys[i] == key:
                return self._values[i]
        raise KeyError(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __setitem__(self, key: Any, value: Any) -> None:
        if not _is_pointer(key):
            raise KeyError(f"{key!r}: a live map's keys are pointers, 0 < key < 2**64")
        i = self._find(key)
        if self._keys[i] == key:
            self._values[i] = value
        else:
            self.add(key, value)

    def setdefault(self, key: Any, value: Any) -> Any:
        if key not in self:
            self[key] = value
        return self[key]

    def __delitem__(self, key: Any) -> None:
        if key not in self:
            raise KeyError(key)
        self._remove_at(self._find(key))

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        if key in self:
            i = self._find(key)
            value = self._values[i]
            self._remove_at(i)
            return value
        if default is _MISSING:
            raise KeyError(key)
        return default

    def __iter__(self) -> Iterator[int]:
        return iter([int(k) for k in self._keys if k != _EMPTY])

    def keys(self) -> set[int]:
        return set(self)

    def values(self) -> list[Any]:
        return [v for k, v in zip(self._keys, self._values) if k != _EMPTY]

    def items(self) -> list[tuple[int, Any]]:
        return [(int(k), v) for k, v in zip(self._keys, self._values) if k != _EMPTY]

    def __repr__(self) -> str:
        return f"LiveMap({dict(self.items())!r})"


def _is_pointer(key: Any) -> bool:
    return isinstance(key, int) and 0 < key <= _MASK64
