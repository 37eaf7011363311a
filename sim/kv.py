"""The KV cache of a simulated server, kept in a pool policy.

The scheduler asks for token slots; a manager turns them into policy allocations:

- ``ContiguousKV`` (first-fit, best-fit, size-class, elastic over them): each request holds one
  allocation sized by a reservation strategy, reallocated and copied when it overflows:

  ===============  ======================================================================
  ``max``          prompt + the most it may generate (up to ``max_model_len``), up front
  ``oracle``       prompt + the true output length, up front (knows the future)
  ``pow2``         the next power of two of the tokens needed; doubles, with a copy, on overflow
  ``pow2-oracle``  prompt + the next power of two of the true output, up front (the vLLM paper's
                   "Orca (Pow2)")
  ``grow``         ``grow_tokens`` chunks; one more chunk, with a copy, on overflow
  ===============  ======================================================================

- ``PagedKV`` (a policy whose allocations are pages): a request grows one page at a time; with
  prefix caching, prompt blocks named by ``hash_ids`` are shared by reference count and freed
  blocks stay cached until evicted, least recently used first (vLLM's prefix cache; LFU and
  cost-aware orders too: ``prefix_eviction``). The
  reference counts, the hash map and the evictable queue are the ``paged`` policy's
  (``Paged.cache_block`` and friends); the manager decides what to cache and when.

Both keep the KV cache within ``budget_bytes`` (what the memory plan leaves for KV), so in a
shared pool the KV cache cannot take the memory of weights or activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from policies.base import Allocation
from policies.units import round_up
from sim.pools import TimedPool

if TYPE_CHECKING:
    from sim.config import ServerConfig

__all__ = ["KVHandle", "ContiguousKV", "PagedKV", "STRATEGIES", "next_pow2"]

STRATEGIES = ("max", "oracle", "pow2", "pow2-oracle", "grow")


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(slots=True, eq=False)
class KVHandle:
    """The KV memory one request holds.

    Tokens ``[0, prefix_tokens)`` live in prompt blocks named by the hash ids in ``blocks``
    (paged + prefix caching only; the first ``num_computed_blocks`` are computed), the rest in
    the request's own ``allocs`` (one for contiguous managers, page runs for paged).
    ``capacity_tokens`` is how many token slots are held in all.
    """

    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    capacity_tokens: int = 0
    prefix_tokens: int = 0
    num_own_pages: int = 0
    num_computed_blocks: int = 0
    allocs: list[Allocation] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


class _KVBase:
    """What both managers share: the budget, the byte counters and the pending copy time."""

    paged = False
    evictable_bytes = 0  # cached KV nobody holds (a prefix cache's)
    evictable_tokens = 0  # the tokens in them

    def __init__(self, pool: TimedPool, *, bytes_per_token: int, budget_bytes: int):
        self.pool = pool
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = budget_bytes
        self.allocated_bytes = 0  # KV allocations' size_bytes, shared blocks counted once
        self.copy_bytes_pending = 0  # bytes to copy on the device, charged to the current step
        self.num_reallocs = 0
        self.copied_bytes = 0
        # prefix-cache figures (stay 0 without a prefix cache)
        self.cached_tokens = 0
        self.prefix_lookup_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_saved_bytes = 0
        self.num_evictions = 0

    def _allocate(self, nbytes: int) -> Allocation | None:
        """Allocate within the KV budget, evicting cached blocks while that helps."""
        while True:
            if self.allocated_bytes + nbytes <= self.budget_bytes:
                a = self.pool.allocate(nbytes, tag="kv")
                if a is not None:
                    if self.allocated_bytes + a.size_bytes <= self.budget_bytes:
                        self.allocated_bytes += a.size_bytes
                        return a
                    self.pool.free(a)  # the policy rounded it past the budget
            if not self._evict_one():
                return None

    def _release(self, a: Allocation) -> None:
        self.allocated_bytes -= a.size_bytes
        self.pool.free(a)

    def _evict_one(self) -> bool:
        return False

    def free_bytes(self) -> int:
        """KV budget not held by live requests (evictable cached blocks count as free)."""
        return self.budget_bytes - self.allocated_bytes + self.evictable_bytes

    def held_elsewhere(self) -> bool:
        """Whether KV memory this manager could use is held by someone else (another tenant of a
        shared pool, ``sim.tenants``): then a request that does not fit waits instead of being rejected."""
        return False

    def take_copy_bytes(self) -> int:
        n, self.copy_bytes_pending = self.copy_bytes_pending, 0
        return n

    def new_handle(self, prompt_tokens: int, output_tokens: int, hash_ids: tuple[int, ...] = ()) -> KVHandle:
        return KVHandle(prompt_tokens, output_tokens, hash_ids)

    # prefix caching hooks, no-ops here
    def match_prefix(self, h: KVHandle) -> int:
        return 0

    def mark_computed(self, h: KVHandle, num_computed: int) -> None:
        pass


class ContiguousKV(_KVBase):
    """One allocation per request, sized by ``strategy`` (see the module docstring).

    Args:
        pool: the KV pool.
        config: the server's settings; read here: ``kv_strategy``, ``max_model_len`` (resolved:
            the longest sequence the model serves, which ``max`` reserves) and ``grow_tokens``.
        bytes_per_token: KV bytes of one token (all layers, K and V).
        budget_bytes: most bytes the KV cache may hold.
    """

    def __init__(self, pool: TimedPool, config: ServerConfig, *, bytes_per_token: int, budget_bytes: int):
        assert config.max_model_len is not None, "simulate() resolves max_model_len"
        super().__init__(pool, bytes_per_token=bytes_per_token, budget_bytes=budget_bytes)
        self.config = config

    def target_tokens(self, h: KVHandle, needed: int) -> int:
        """Token slots to reserve when ``h`` must hold ``needed`` and holds fewer."""
        cfg = self.config
        s = cfg.kv_strategy
        final = h.prompt_tokens + h.output_tokens
        if s == "max":
            return max(needed, cfg.max_model_len, final)
        if s == "oracle":
            return max(needed, final)
        if s == "pow2-oracle":
            return max(needed, h.prompt_tokens + next_pow2(h.output_tokens))
        if not h.allocs:  # the first reservation covers the whole prompt, so prefill never copies
            needed = max(needed, h.prompt_tokens + 1)
        if s == "pow2":
            return next_pow2(needed)
        return round_up(needed, cfg.grow_tokens)  # grow

    def peak_bytes(self, prompt_tokens: int, output_tokens: int) -> int:
        """The largest reservation the request will ever need (the admission test for 'can never fit')."""
        h = KVHandle(prompt_tokens, output_tokens)
        return self.target_tokens(h, prompt_tokens + output_tokens - 1) * self.bytes_per_token

    def estimate_bytes(self, h: KVHandle, num_tokens: int) -> int:
        if num_tokens <= h.capacity_tokens:
            return 0
        return self.target_tokens(h, num_tokens) * self.bytes_per_token

    def grow(self, h: KVHandle, num_tokens: int, num_valid_tokens: int) -> bool:
        """Make ``h`` hold ``num_tokens`` slots; the ``num_valid_tokens`` already written are copied
        to a new allocation on overflow. False (nothing changed) when memory cannot be found."""
        if num_tokens <= h.capacity_tokens:
            return True
        target = self.target_tokens(h, num_tokens)
        a = self._allocate(target * self.bytes_per_token)
        if a is None:
            return False
        if h.allocs:
            old = h.allocs[0]
            copied = num_valid_tokens * self.bytes_per_token
            self.copy_bytes_pending += copied
            self.copied_bytes += copied
            self.num_reallocs += 1
            self._release(old)
            h.allocs[0] = a
        else:
            h.allocs.append(a)
        h.capacity_tokens = target
        return True

    def admit(self, h: KVHandle, num_tokens: int) -> bool:
        return self.grow(h, num_tokens, 0)

    def free(self, h: KVHandle) -> None:
        for a in h.allocs:
            self._release(a)
        h.allocs.clear()
        h.capacity_tokens = 0


class PagedKV(_KVBase):
    """Pages of ``tokens_per_page`` tokens; prompt blocks shared through a prefix cache.

    Args:
        pool: the KV pool (a paged policy: allocations are runs of pages).
        config: the server's settings; read here: ``prefix_caching`` (share prompt blocks named
            by the trace's ``hash_ids``), ``prefix_block_tokens`` (resolved: tokens per
            ``hash_ids`` block, 512 in Mooncake traces) and ``prefix_eviction`` (the cache's
            eviction order, ``policies.eviction``).
        bytes_per_token: KV bytes of one token.
        budget_bytes: most bytes the KV cache may hold.
        tokens_per_page: tokens per page (vLLM's block size, 16).
        page_bytes: bytes per page (None: ``tokens_per_page x bytes_per_token``; a policy's page
            may be larger than the tokens it holds).
        block_recompute_s: seconds to recompute the prompt block at a position (0, 1, ...), for
            the ``cost`` eviction order (None: every block costs the same).

    A request takes all its cacheable prompt blocks when it is admitted (hits by reference,
    misses as fresh blocks of ``block_tokens``), even when chunked prefill computes them over
    several steps; its other tokens live in pages it adds as it needs them. Only whole blocks
    are cached, and only once the request has computed them (vLLM caches a block once it is
    full): a fresh block is "pending" until then, held by the request that allocated it alone.
    Cached blocks live in the paged policy's prefix cache (hash map, page reference counts,
    evictable LRU queue); without a paged layer in the pool's stack there is no prefix caching.
    """

    paged = True

    def __init__(self, pool: TimedPool, config: ServerConfig, *, bytes_per_token: int, budget_bytes: int,
                 tokens_per_page: int, page_bytes: int | None = None,
                 block_recompute_s: Callable[[int], float] | None = None):
        assert config.prefix_block_tokens is not None, "simulate() resolves prefix_block_tokens"
        prefix_caching, block_tokens = config.prefix_caching, config.prefix_block_tokens
        super().__init__(pool, bytes_per_token=bytes_per_token, budget_bytes=budget_bytes)
        self.tokens_per_page = tokens_per_page
        self.page_bytes = page_bytes if page_bytes is not None else tokens_per_page * bytes_per_token
        assert self.page_bytes >= tokens_per_page * bytes_per_token, "a page holds its tokens"
        #: the layer of the pool's stack that keeps cached blocks (the paged policy)
        self.block_cache = pool.policy.block_cache
        self.prefix_caching = prefix_caching and self.block_cache is not None
        if self.prefix_caching:
            self.block_cache.set_eviction_order(config.prefix_eviction)
        self._block_recompute_s = block_recompute_s
        self.block_tokens = block_tokens
        pages_per_block = -(-block_tokens // tokens_per_page)
        self.block_bytes = pages_per_block * self.page_bytes
        # fresh blocks not computed yet, by hash id: each held by the request that allocated it
        self._pending: dict[int, Allocation] = {}

    @property
    def evictable_bytes(self) -> int:
        return self.block_cache.evictable_bytes if self.block_cache is not None else 0

    @property
    def evictable_tokens(self) -> int:
        """Tokens in cached blocks nobody holds (every cached block is ``block_bytes``)."""
        return self.evictable_bytes // self.block_bytes * self.block_tokens

    def new_handle(self, prompt_tokens: int, output_tokens: int, hash_ids: tuple[int, ...] = ()) -> KVHandle:
        if not self.prefix_caching:
            hash_ids = ()
        else:  # only whole blocks are cacheable
            hash_ids = tuple(hash_ids[: prompt_tokens // self.block_tokens])
        return KVHandle(prompt_tokens, output_tokens, hash_ids)

    def peak_bytes(self, prompt_tokens: int, output_tokens: int) -> int:
        return -(-(prompt_tokens + output_tokens - 1) // self.tokens_per_page) * self.page_bytes

    def estimate_bytes(self, h: KVHandle, num_tokens: int) -> int:
        if num_tokens <= h.capacity_tokens:
            return 0
        return -(-(num_tokens - h.capacity_tokens) // self.tokens_per_page) * self.page_bytes

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, h: KVHandle) -> int:
        """Tokens of ``h``'s prompt already cached and computed (at most prompt - 1: the last
        token is always recomputed to produce the first output). Changes nothing."""
        if not h.hash_ids or h.blocks:
            return 0
        n = 0
        cached = self.block_cache.cached_block
        for hid in h.hash_ids:
            if cached(hid) is None:
                break
            n += 1
        return min(n * self.block_tokens, h.prompt_tokens - 1)

    def admit(self, h: KVHandle, num_tokens: int) -> bool:
        """Take ``h``'s prefix blocks (hits by reference, misses freshly allocated and cached) and
        pages up to ``num_tokens``; all or nothing."""
        if not h.hash_ids:
            return self.grow(h, num_tokens, 0)
        cache, pending, taken = self.block_cache, self._pending, []
        hits = 0
        for hid in h.hash_ids:
            cached = cache.cached_block(hid) is not None
            if cached and len(taken) == hits:
                cache.share_block(hid)
                taken.append(hid)
                hits += 1
                continue
            if cached or hid in pending:  # after a miss, or not computed yet (maybe repeated in this prompt)
                break
            a = self._allocate(self.block_bytes)
            if a is None:
                break  # the rest of the prompt goes into the request's own pages
            pending[hid] = a
            taken.append(hid)
        h.blocks = taken
        h.prefix_tokens = len(taken) * self.block_tokens
        h.capacity_tokens = h.prefix_tokens
        h.num_computed_blocks = hits
        if not self.grow(h, num_tokens, 0):
            self.free(h)
            return False
        lookup = len(h.hash_ids) * self.block_tokens
        self.prefix_lookup_tokens += lookup
        self.prefix_hit_tokens += hits * self.block_tokens
        self.prefix_saved_bytes += hits * self.block_bytes
        return True

    def mark_computed(self, h: KVHandle, num_computed: int) -> None:
        """Prefill of ``h`` has reached ``num_computed`` tokens: its blocks below that are hittable."""
        i = h.num_computed_blocks
        blocks = h.blocks
        pending = self._pending
        while i < len(blocks) and (i + 1) * self.block_tokens <= num_computed:
            hid = blocks[i]
            if hid in pending:  # computed now: hittable by others
                cost = self._block_recompute_s(i) if self._block_recompute_s is not None else 1.0
                self.block_cache.cache_block(hid, pending.pop(hid), cost)
                self.cached_tokens += self.block_tokens
            i += 1
        h.num_computed_blocks = i

    def _evict_one(self) -> bool:
        a = self.block_cache.evict_block() if self.block_cache is not None else None
        if a is None:
            return False
        self.cached_tokens -= self.block_tokens
        self.num_evictions += 1
        self._release(a)
        return True

    # ------------------------------------------------------------------ pages
    def grow(self, h: KVHandle, num_tokens: int, num_valid_tokens: int = 0) -> bool:
        """Make ``h`` hold ``num_tokens`` slots by adding pages (never copies)."""
        if num_tokens <= h.capacity_tokens:
            return True
        tpp = self.tokens_per_page
        num_pages = -(-(num_tokens - h.capacity_tokens) // tpp)
        a = self._allocate(num_pages * self.page_bytes)
        if a is None:
            return False
        h.allocs.append(a)
        h.num_own_pages += num_pages
        h.capacity_tokens += num_pages * tpp
        return True

    def free(self, h: KVHandle) -> None:
        for a in h.allocs:
            self._release(a)
        h.allocs.clear()
        pending = self._pending
        for hid in h.blocks:
            a = pending.pop(hid, None)
            if a is not None:  # never filled: nothing worth keeping
                self._release(a)
            else:  # the cache keeps it, evictable (most recently used last) once nobody holds it
                self.block_cache.release_block(hid)
        h.blocks = []
        h.prefix_tokens = 0
        h.num_own_pages = 0
        h.num_computed_blocks = 0
        h.capacity_tokens = 0
