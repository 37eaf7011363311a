"""``tlsf``: two-level segregated fit (Masmano, Ripoll, Crespo and Real, ECRTS 2004).

Free blocks sit in size classes of two levels: the first level is the power of two of the size
(``fl``), the second splits each power of two into ``2 ** second_level_log2`` equal ranges
(``sl``). Two bit maps say which classes hold a block, so finding one takes a few bit
operations whatever the number of free blocks (O(1)):

- a free block is filed in the class its size rounds *down* to (``mapping_insert``);
- ``allocate`` rounds the request *up* to the next class boundary (``mapping_search``), so any
  block of that class or above fits (a *good fit*, not the best one), finds the first
  non-empty class at or above it with the bit maps, takes a block, splits off the remainder
  and files it in its own class;
- ``free`` merges the block with its free address neighbours at once (the shared block
  machinery of ``policies._blocks``) and files the result.

As in Masmano's implementation (``MAPPING_SEARCH`` rounds the size it is given, and
``malloc_ex`` allocates that size), the block handed out is the request rounded up to its class
boundary. That is what makes a freed block findable again: its size is a class's lower bound,
so a later request of the same size searches exactly that class. (Handing out only the
aligned request would file the freed block one class below the one its size searches, so
every reuse of a buffer would reserve a new segment.)

Bounded waste: rounding to the class boundary adds less than ``1 / 2 ** second_level_log2`` of
the request (6.25 % at the default 4), and a block skipped as possibly too small is less than
that much larger than the request. Below ``2 ** second_level_log2`` alignment units the
classes are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies._blocks import Block, ContiguousPolicy
from policies.base import check_positive_int
from policies.device import Device
from policies.errors import PolicyError

__all__ = ["TLSF"]

_DEFAULT_SEGMENT_BYTES = 32 << 20  # as first-fit and best-fit


@dataclass(slots=True)
class _Classes:
    """One stream's free blocks: ``lists[(fl, sl)]`` (an insertion-ordered dict used as a set,
    O(1) add and remove, newest block taken first), bit ``fl`` of ``fl_map`` set when level
    ``fl`` has a non-empty class, bit ``sl`` of ``sl_maps[fl]`` when class ``(fl, sl)`` does."""

    lists: dict[tuple[int, int], dict[int, Block]] = field(default_factory=dict)
    fl_map: int = 0
    sl_maps: dict[int, int] = field(default_factory=dict)


def _lowest_bit(x: int) -> int:
    return (x & -x).bit_length() - 1


class TLSF(ContiguousPolicy):
    """Two-level segregated fit: O(1) good-fit search over size classes, immediate coalescing.

    Args:
        second_level_log2: log2 of the number of classes per power of two (1-8; TLSF uses 4 or 5).
        segment_bytes, alignment_bytes, split_threshold_bytes, capacity_bytes, device: see
            ``ContiguousPolicy``.
    """

    name = "tlsf"

    def __init__(
        self,
        *,
        second_level_log2: int = 4,
        segment_bytes: int = _DEFAULT_SEGMENT_BYTES,
        alignment_bytes: int = 512,
        split_threshold_bytes: int | None = None,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        check_positive_int("second_level_log2", second_level_log2)
        if second_level_log2 > 8:
            raise PolicyError(f"second_level_log2(={second_level_log2}) must be between 1 and 8")
        self.second_level_log2 = second_level_log2
        super().__init__(
            segment_bytes=segment_bytes,
            alignment_bytes=alignment_bytes,
            split_threshold_bytes=split_threshold_bytes,
            capacity_bytes=capacity_bytes,
            device=device,
        )

    # ------------------------------------------------------------------ the class mapping
    def _class_of(self, size: int) -> tuple[int, int]:
        """``mapping_insert``: the class a free block of ``size`` bytes is filed in."""
        units = size >> self._align_log2
        sl_log2 = self.second_level_log2
        if units < self._num_sl:
            return 0, units
        f = units.bit_length() - 1
        return f - sl_log2 + 1, (units >> (f - sl_log2)) - self._num_sl

    def _search_class(self, size: int) -> tuple[int, int]:
        """``mapping_search``: the lowest class whose every block holds ``size`` bytes."""
        units = size >> self._align_log2
        if units >= self._num_sl:
            units += (1 << (units.bit_length() - 1 - self.second_level_log2)) - 1
        return self._class_of(units << self._align_log2)

    def rounded_size(self, nbytes: int) -> int:
        """The request rounded up to alignment, then to its class boundary (``mapping_search``)."""
        units = -(-nbytes >> self._align_log2)
        if units >= self._num_sl:
            step_mask = (1 << (units.bit_length() - 1 - self.second_level_log2)) - 1
            units = (units + step_mask) & ~step_mask
        return units << self._align_log2

    # ------------------------------------------------------------------ ContiguousPolicy index
    def _index_reset(self) -> None:
        self._align_log2 = self.alignment_bytes.bit_length() - 1
        self._num_sl = 1 << self.second_level_log2
        self._round_mask = (
            None  # sizes round to class boundaries: ContiguousPolicy calls rounded_size
        )
        self._streams: dict[int, _Classes] = {}

    def _index_add(self, block: Block) -> None:
        classes = self._streams.get(block.segment.stream)
        if classes is None:
            classes = self._streams[block.segment.stream] = _Classes()
        fl, sl = self._class_of(block.size)
        blocks = classes.lists.get((fl, sl))
        if blocks is None:
            blocks = classes.lists[(fl, sl)] = {}
        blocks[block.offset] = block
        classes.fl_map |= 1 << fl
        classes.sl_maps[fl] = classes.sl_maps.get(fl, 0) | (1 << sl)

    def _index_remove(self, block: Block) -> None:
        classes = self._streams[block.segment.stream]
        fl, sl = self._class_of(block.size)
        blocks = classes.lists[(fl, sl)]
        del blocks[block.offset]
        if not blocks:
            sl_map = classes.sl_maps[fl] & ~(1 << sl)
            classes.sl_maps[fl] = sl_map
            if not sl_map:
                classes.fl_map &= ~(1 << fl)

    def _find(self, size: int, stream: int) -> Block | None:
        classes = self._streams.get(stream)
        if classes is None:
            return None
        fl, sl = self._search_class(size)
        sl_map = classes.sl_maps.get(fl, 0) & (-1 << sl)
        if not sl_map:
            fl_map = classes.fl_map & (-1 << (fl + 1))
            if not fl_map:
                return None
            fl = _lowest_bit(fl_map)
            sl_map = classes.sl_maps[fl]
        blocks = classes.lists[(fl, _lowest_bit(sl_map))]
        return blocks[next(reversed(blocks))]  # the newest block of the class, as TLSF's list head

    def _index_largest_bytes(self) -> int:
        largest = 0
        for classes in self._streams.values():
            if classes.fl_map:
                fl = classes.fl_map.bit_length() - 1
                blocks = classes.lists[(fl, classes.sl_maps[fl].bit_length() - 1)]
                largest = max(largest, max(b.size for b in blocks.values()))
        return largest
