"""Orders of a prefix cache's evictable queue: which cached block nobody holds goes first.

A block enters the queue when its last holder releases it (``push``), leaves on a hit
(``remove``) or when evicted (``pop``). Three orders:

- ``lru`` (vLLM's ``FreeKVCacheBlockQueue``): least recently released first.
- ``lfu``: fewest uses first (a use is the allocation that cached the block or a hit on it),
  least recently released among equals. A shared system prompt hit by thousands of requests
  outlives a one-off document released a moment ago.
- ``cost``: GreedyDual-Size-Frequency (Cherkasova, 1998): a block's priority is
  ``clock + uses x recompute_cost / size_bytes`` when it is released, the lowest goes first and
  the clock rises to the evicted priority, so blocks that are cheap to rebuild (a prompt's first
  blocks: their prefill attends to little context) and rarely used go first, and a block not
  used for long ages out as the clock passes it. ``recompute_cost`` is the caller's (seconds of
  prefill in the simulator; any unit works as long as it is one unit).

Each queue sums its blocks' ``size_bytes`` (``size_bytes``): a pool with one queue per owner
(colocated instances) reads each owner's evictable bytes there.

``lru`` is an ``OrderedDict`` (O(1) removal on a hit, O(1) pop from its front). The other two
are a binary heap with lazy deletion (O(log n) push and pop; a hit only forgets the key, its
stale heap entry is skipped when it surfaces), since their priorities are not release order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Any, Hashable, Protocol

__all__ = ["EVICTION_ORDERS", "Evictable", "EvictableQueue", "make_queue"]

EVICTION_ORDERS = ("lru", "lfu", "cost")


class Evictable(Protocol):
    """What a queue reads from a block: its size, uses and recompute cost."""

    size_bytes: int
    num_uses: int
    recompute_cost: float


class EvictableQueue:
    """Least recently released first (``lru``); the base of the other orders' interface."""

    order = "lru"

    def __init__(self) -> None:
        self._blocks: OrderedDict[Hashable, Any] = OrderedDict()
        self.size_bytes = 0  # of the blocks in the queue

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def push(self, key: Hashable, block: Evictable) -> None:
        """``block`` (cached as ``key``) has no holder any more: it may be evicted from now on."""
        self._blocks[key] = block
        self.size_bytes += block.size_bytes

    def remove(self, key: Hashable) -> None:
        """``key`` is held again (a hit): it leaves the queue."""
        self.size_bytes -= self._blocks.pop(key).size_bytes

    def pop(self) -> tuple[Hashable, Any]:
        """The next victim, out of the queue. KeyError when empty."""
        key, block = self._blocks.popitem(last=False)
        self.size_bytes -= block.size_bytes
        return key, block


class _PriorityQueue(EvictableQueue):
    """Lowest ``_priority`` first, ties in release order: a heap with lazy deletion."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[float, int, Hashable]] = []
        self._stamp: dict[Hashable, int] = {}  # key -> sequence number of its live heap entry
        self._seq = itertools.count()

    def _priority(self, block: Evictable) -> float:
        raise NotImplementedError

    def push(self, key: Hashable, block: Evictable) -> None:
        super().push(key, block)
        seq = next(self._seq)
        self._stamp[key] = seq
        heapq.heappush(self._heap, (self._priority(block), seq, key))

    def remove(self, key: Hashable) -> None:
        super().remove(key)
        del self._stamp[key]

    def pop(self) -> tuple[Hashable, Any]:
        heap, stamp = self._heap, self._stamp
        while heap:
            priority, seq, key = heapq.heappop(heap)
            if stamp.get(key) == seq:
                del stamp[key]
                self._evicted(priority)
                block = self._blocks.pop(key)
                self.size_bytes -= block.size_bytes
                return key, block
        raise KeyError("pop from an empty evictable queue")

    def _evicted(self, priority: float) -> None:
        pass


class LFUQueue(_PriorityQueue):
    order = "lfu"

    def _priority(self, block: Evictable) -> float:
        return block.num_uses


class CostAwareQueue(_PriorityQueue):
    """GreedyDual-Size-Frequency: ``clock + uses x recompute_cost / size_bytes``."""

    order = "cost"

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0

    def _priority(self, block: Evictable) -> float:
        return self.clock + block.num_uses * block.recompute_cost / block.size_bytes

    def _evicted(self, priority: float) -> None:
        self.clock = priority  # never falls: the heap's minimum only rises past evictions


_QUEUES = {q.order: q for q in (EvictableQueue, LFUQueue, CostAwareQueue)}


def make_queue(order: str) -> EvictableQueue:
    """An empty queue of ``order`` (one of ``EVICTION_ORDERS``); ValueError naming the choices
    otherwise."""
    try:
        return _QUEUES[order]()
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown eviction order {order!r}; choose one of {', '.join(EVICTION_ORDERS)}"
        ) from None
