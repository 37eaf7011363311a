"""Worst fit: the largest free block (ties: lowest address), split and coalesced.

The classic foil: carving every request out of the biggest hole leaves remainders large enough
to be useful, but it breaks up the large ranges large requests need, so it usually fragments
more than first or best fit (Johnstone & Wilson). Kept as a baseline and for workloads of
near-equal sizes, where it spreads wear evenly.
"""

from __future__ import annotations

from policies._blocks import OFFSET_BITS, Block
from policies.base import Segment
from policies.device import MAX_DEVICE_BYTES
from policies.best_fit import BestFit

__all__ = ["WorstFit"]

_OFFSET_MASK = (1 << OFFSET_BITS) - 1


def _key(size: int, offset: int) -> int:
    """Largest size last; among equal sizes the lowest offset last (its low bits are inverted)."""
    return size << OFFSET_BITS | (_OFFSET_MASK ^ offset)


class WorstFit(BestFit):
    """Serve each request from the largest free block of its stream; lowest address on ties.

    Free blocks serve only requests on the stream their segment was reserved for (as in
    PyTorch and CuPy). Knobs: see ``ContiguousPolicy``.

    Index: ``BestFit``'s per-stream sorted key lists (with their parallel block lists) with keys
    ``size << 64 | ~offset`` (its ``_key``), so the worst fit is the last key (O(1) to find and to
    pop); adding, removing and resizing entries, and the checks, are ``BestFit``'s.
    """

    name = "worst-fit"

    _key = staticmethod(_key)

    def _fit_keys(self, segment: Segment) -> None:
        """Nothing to re-key: the offset field is a fixed ``OFFSET_BITS`` wide (inverted offsets
        could not be widened by the shift ``BestFit`` re-keys with), which holds any segment;
        recorded so that ``_index_add`` does not ask again."""
        self._offset_bits = OFFSET_BITS
        self._keys_end = 1 << OFFSET_BITS
        self._max_segment_bytes = MAX_DEVICE_BYTES

    def _find(self, size: int, stream: int) -> Block | None:
        keys = self._keys_by_stream.get(stream)
        if not keys or keys[-1] >> OFFSET_BITS < size:
            return None
        return self._blocks_by_stream[stream][-1]

    def _take(self, size: int, stream: int) -> Block | None:
        keys = self._keys_by_stream.get(stream)
        if not keys or keys[-1] >> OFFSET_BITS < size:
            return None
        keys.pop()
        return self._blocks_by_stream[stream].pop()

    def _index_largest_bytes(self) -> int:
        return max(
            (keys[-1] >> OFFSET_BITS for keys in self._keys_by_stream.values() if keys), default=0
        )
