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

- ``VirtualKV`` (``kv_strategy="virtual"``, vAttention): each request's KV is one contiguous
  virtual range per KV tensor, reserved for ``max_model_len`` up front; physical pages are mapped
  into it as it grows, straight onto a page-mapped device (``policies.mapped_device``), with no
  block table and so no prefix sharing. A finished request's pages stay mapped for the next one.

All keep the KV cache within ``budget_bytes`` (what the memory plan leaves for KV), so in a
shared pool the KV cache cannot take the memory of weights or activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Hashable

from policies.base import Allocation
from policies.mapped_device import PageMappedDevice
from policies.units import format_bytes, round_up
from sim.serving.pools import TimedPool
from sim.serving.choices import CONTIGUOUS_STRATEGIES, STRATEGIES, VIRTUAL  # noqa: F401 (moved; importable here too)

#: an allocation's (or page grant's) ``size_bytes``: a C call where a comprehension makes a frame
_size_of = attrgetter("size_bytes")

if TYPE_CHECKING:
    from sim.serving.config import ServerConfig

__all__ = [
    "KVHandle",
    "ContiguousKV",
    "PagedKV",
    "VirtualKV",
    "VirtualKVReadings",
    "STRATEGIES",
    "CONTIGUOUS_STRATEGIES",
    "VIRTUAL",
    "next_pow2",
]


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(slots=True, eq=False)
class KVHandle:
    """The KV memory one request holds.

    Tokens ``[0, prefix_tokens)`` live in prompt blocks named by the hash ids in ``blocks``
    (paged + prefix caching only; the first ``num_computed_blocks`` are computed), the rest in
    the request's own ``allocs`` (one for contiguous managers, page runs for paged).
    ``capacity_tokens`` is how many token slots are held in all. ``hash_ids`` are the block
    cache's keys (the trace's hash ids, namespaced by the manager's ``cache_owner`` when it has
    one); ``prefix_admitted`` says whether the prefix cache has admitted the request before (a
    preempted request's next admission is not its first).
    """

    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[Hashable, ...] = ()
    capacity_tokens: int = 0
    prefix_tokens: int = 0
    num_own_pages: int = 0
    num_computed_blocks: int = 0
    prefix_admitted: bool = False
    slot: int = -1  # VirtualKV: the virtual range (vAttention's reqId) it holds; -1 for none
    #: the request's own allocations in the order made; a paged pool's page grants among them
    #: (``Policy.allocate_pages``: a page that is its own one-page allocation, read the same way)
    allocs: list[Allocation] = field(default_factory=list)
    blocks: list[Hashable] = field(default_factory=list)


class _KVBase:
    """What both managers share: the budget, the byte counters and the pending copy time."""

    paged = False
    evictable_bytes = 0  # cached KV nobody holds (a prefix cache's)
    evictable_tokens = 0  # the tokens in them
    #: a decode step of a request needs a new slot exactly when its ``num_computed`` reaches
    #: ``capacity_tokens`` (``grow`` is called then and changes nothing else before): what the
    #: scheduler's closed form of decode runs (``sim.serving.scheduler.DecodeRun``) relies on. False
    #: for a manager whose decode steps touch memory otherwise (a hybrid layout's sliding windows)
    decode_grows_at_capacity = False

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
        self.peak_cached_tokens = 0
        self.prefix_lookup_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_saved_bytes = 0
        # the same two at first admissions only (hits there are on blocks other requests cached)
        self.prefix_first_lookup_tokens = 0
        self.prefix_first_hit_tokens = 0
        self.num_evictions = 0

    def _allocate(self, nbytes: int) -> Allocation | None:
        """Allocate within the KV budget, evicting cached blocks while that helps."""
        # the pool's ``TimedCalls`` straight (``TimedPool.allocate``'s and ``free``'s own calls,
        # without their frame: an admission's or a grow's one allocation)
        calls = self.pool.calls
        while True:
            if self.allocated_bytes + nbytes <= self.budget_bytes:
                a = calls.allocate(nbytes, 0, "kv")
                if a is not None:
                    if self.allocated_bytes + a.size_bytes <= self.budget_bytes:
                        self.allocated_bytes += a.size_bytes
                        return a
                    calls.free(a)  # the policy rounded it past the budget
            if not self._evict_one():
                return None

    def _release(self, a: Allocation) -> None:
        self.allocated_bytes -= a.size_bytes
        self.pool.calls.free(a)

    def _evict_one(self) -> bool:
        return False

    def free_bytes(self) -> int:
        """KV budget not held by live requests (evictable cached blocks count as free)."""
        return self.budget_bytes - self.allocated_bytes + self.evictable_bytes

    def cached_bytes(self, num_cached_tokens: int) -> int:
        """Pool bytes of ``num_cached_tokens`` tokens of cached prefix blocks (0 without a prefix
        cache)."""
        return num_cached_tokens * self.bytes_per_token

    def held_elsewhere(self) -> bool:
        """Whether KV memory this manager could use is held by someone else (another tenant of a
        shared pool, ``sim.serving.tenants``): then a request that does not fit waits instead of
        being rejected."""
        return False

    def call_when_freed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when memory held elsewhere is freed (only a manager whose
        ``held_elsewhere`` can be true, a tenant's of a shared pool, has anything to wait for)."""
        raise NotImplementedError(
            f"{type(self).__name__} shares no pool: no memory is held elsewhere"
        )

    def grow_from_free_pages(
        self, handles: list[KVHandle], page_source, sizes: list[int] | None = None
    ) -> bool:
        """Grow each of ``handles`` (whose slots have run out: ``capacity_tokens`` is its tokens
        so far) by the one slot its next token needs, in order, as ``grow(h, capacity_tokens +
        1, capacity_tokens)`` would, when every grow surely takes one free page of
        ``page_source`` at once; False, with nothing done, when that is not sure. Only a paged
        manager grows so (``PagedKV``). ``sizes``: where the bytes each grow added to
        ``allocated_bytes`` go, in order (a caller that grows several steps at once)."""
        return False

    def take_copy_bytes(self) -> int:
        n, self.copy_bytes_pending = self.copy_bytes_pending, 0
        return n

    def take_map_ns(self) -> int:
        """Driver time of page mapping since the last call (only ``VirtualKV`` maps pages)."""
        return 0

    @property
    def pending_map_ns(self) -> int:
        """What ``take_map_ns`` would take now, left in place."""
        return 0

    def pool_readings(self) -> VirtualKVReadings | None:
        """What the server's pool monitor reads; None: the KV policy's own stats."""
        return None

    def new_handle(
        self, prompt_tokens: int, output_tokens: int, hash_ids: tuple[int, ...] = ()
    ) -> KVHandle:
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

    decode_grows_at_capacity = True

    def __init__(
        self, pool: TimedPool, config: ServerConfig, *, bytes_per_token: int, budget_bytes: int
    ):
        assert config.max_model_len is not None, "simulate() resolves max_model_len"
        assert config.kv_strategy in CONTIGUOUS_STRATEGIES, "'virtual' is VirtualKV's"
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
        """The largest reservation the request will ever need (the admission test for 'can never
        fit')."""
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
    Managers sharing one block cache (tenants of one pool, ``sim.serving.tenants``) each set their
    own ``cache_owner``: their keys are ``(cache_owner, hash id)`` and their evictable queue their
    own, so colocated instances keep separate prefix caches over shared memory, as vLLM instances
    do.
    """

    paged = True
    decode_grows_at_capacity = True
    #: whose blocks these are in a block cache shared with other managers (None: not shared)
    cache_owner: Hashable = None

    def __init__(
        self,
        pool: TimedPool,
        config: ServerConfig,
        *,
        bytes_per_token: int,
        budget_bytes: int,
        tokens_per_page: int,
        page_bytes: int | None = None,
        block_recompute_s: Callable[[int], float] | None = None,
    ):
        assert config.prefix_block_tokens is not None, "simulate() resolves prefix_block_tokens"
        prefix_caching, block_tokens = config.prefix_caching, config.prefix_block_tokens
        super().__init__(pool, bytes_per_token=bytes_per_token, budget_bytes=budget_bytes)
        self.tokens_per_page = tokens_per_page
        self.page_bytes = (
            page_bytes if page_bytes is not None else tokens_per_page * bytes_per_token
        )
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
        self._pending: dict[Hashable, Allocation] = {}

    @property
    def evictable_bytes(self) -> int:
        return (
            self.block_cache.evictable_bytes_of(self.cache_owner)
            if self.block_cache is not None
            else 0
        )

    @property
    def evictable_tokens(self) -> int:
        """Tokens in cached blocks nobody holds (every cached block is ``block_bytes``)."""
        return self.evictable_bytes // self.block_bytes * self.block_tokens

    def cached_bytes(self, num_cached_tokens: int) -> int:
        """Pool bytes of ``num_cached_tokens`` tokens of cached blocks (held or evictable)."""
        return num_cached_tokens // self.block_tokens * self.block_bytes

    def new_handle(
        self, prompt_tokens: int, output_tokens: int, hash_ids: tuple[int, ...] = ()
    ) -> KVHandle:
        if not self.prefix_caching:
            hash_ids = ()
        else:  # only whole blocks are cacheable
            hash_ids = tuple(hash_ids[: prompt_tokens // self.block_tokens])
            if self.cache_owner is not None:
                hash_ids = tuple([(self.cache_owner, hid) for hid in hash_ids])
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
            if (
                cached or hid in pending
            ):  # after a miss, or not computed yet (maybe repeated in this prompt)
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
        if not h.prefix_admitted:
            h.prefix_admitted = True
            self.prefix_first_lookup_tokens += lookup
            self.prefix_first_hit_tokens += hits * self.block_tokens
        return True

    def mark_computed(self, h: KVHandle, num_computed: int) -> None:
        """Prefill of ``h`` has reached ``num_computed`` tokens: its blocks below that are
        hittable."""
        i = h.num_computed_blocks
        blocks = h.blocks
        pending = self._pending
        while i < len(blocks) and (i + 1) * self.block_tokens <= num_computed:
            hid = blocks[i]
            if hid in pending:  # computed now: hittable by others
                cost = self._block_recompute_s(i) if self._block_recompute_s is not None else 1.0
                self.block_cache.cache_block(hid, pending.pop(hid), cost, self.cache_owner)
                self.cached_tokens += self.block_tokens
                if self.cached_tokens > self.peak_cached_tokens:
                    self.peak_cached_tokens = self.cached_tokens
            i += 1
        h.num_computed_blocks = i

    def _evict_one(self) -> bool:
        a = self.block_cache.evict_block(self.cache_owner) if self.block_cache is not None else None
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

    def grow_from_free_pages(
        self, handles: list[KVHandle], page_source, sizes: list[int] | None = None
    ) -> bool:
        """``_KVBase.grow_from_free_pages`` for pages: each grow is one page (a page holds at
        least one token), sure when ``page_source`` (the KV policy, which counts its free pages)
        has a free page for each and they fit the budget, so no grow evicts, refuses, reserves
        or calls the driver."""
        k, page = len(handles), self.page_bytes
        held = max(
            page, page_source.page_size_bytes
        )  # what a page takes from the budget (the pool may round up)
        if page_source.num_free_pages() < k or self.allocated_bytes + k * held > self.budget_bytes:
            return False
        tpp, calls = self.tokens_per_page, self.pool.calls
        driver_ns = calls.pending_driver_ns
        # one timed call per page, in grow order, as grow(h, c + 1, c) for each would make them:
        # the pool's page grants (``Paged.allocate_pages``: the pages themselves, each counted
        # as its one-page allocation, ``free`` hands them back) when the page source is the
        # KV pool's own policy, else its allocations
        pages = calls.allocate_pages(page, k) if page_source is self.pool.policy else None
        if pages is not None:
            # a grant is one of the pool's pages, whose size is the pool's page
            # (``Paged.allocate_pages``): k of them, within ``held`` by its definition
            sized = [page_source.page_size_bytes] * k
        else:
            pages = calls.allocate_each(page, k, "kv")
            # every page's size at once, once none was refused (a C scan of the list)
            assert None not in pages, "a free page within the budget was refused"
            sized = list(map(_size_of, pages))
            assert not sized or max(sized) <= held, "a free page within the budget was refused"
        for h, a in zip(handles, pages):  # grow(h, c + 1, c), c = capacity: one page, in budget
            h.allocs.append(a)
            h.num_own_pages += 1
            h.capacity_tokens += tpp
        if sizes is not None:
            sizes.extend(sized)
        self.allocated_bytes += sum(sized)
        assert calls.pending_driver_ns == driver_ns, "a free page cost driver time"
        return True

    def free(self, h: KVHandle) -> None:
        allocs = h.allocs
        if allocs:  # _release of each, in order: a request frees a page per tokens_per_page tokens
            self.allocated_bytes -= sum(map(_size_of, allocs))
            self.pool.calls.free_each(allocs)
            allocs.clear()
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


class VirtualKV(_KVBase):
    """vAttention's KV cache: one virtual range per request, physical pages mapped as it grows.

    Args:
        pool: the KV pool. Its policy's device must be a ``PageMappedDevice`` whose granularity
            is the page size (``simulate`` builds it so); the policy itself holds no KV, the
            pages are mapped straight onto the device, as vAttention does without an allocator.
        config: the server's settings; read here: ``max_model_len`` (resolved: each range holds
            this many tokens), ``max_num_seqs`` (number of ranges), ``virtual_page_bytes`` and
            ``map_cache``.
        bytes_per_token: KV bytes of one token (all layers, K and V).
        budget_bytes: physical bytes the KV pages may hold, cached pages included.
        num_kv_tensors: tensors the KV lives in (K and V of every layer: 2 x layers). Each maps
            its own pages, so one page of tokens is ``num_kv_tensors`` pages on the device, and a
            page holds ``page_bytes / (bytes_per_token / num_kv_tensors)`` tokens (1,024 for
            Llama-3-8B with 2 MiB pages, 32 with 64 KiB ones).

    Layout (vAttention): one virtual tensor per (layer, K|V) holding ``max_num_seqs`` ranges of
    ``max_model_len`` tokens, reserved once at start-up (that driver time is charged to no
    step). A request takes a free range (a "slot", vAttention's reqId); growing it by one page
    of tokens creates and maps one page in every tensor, with one set-access per tensor and
    grow. Here the tensors lie end to end in one reserved range: the calls and bytes are the
    same, and finding the range of an address stays O(1).

    Deferred reclamation (``map_cache``, vAttention's reuse of mapped pages): a finished or
    preempted request's slot keeps its pages mapped, and a new request takes the free slot
    whose pages fit its first chunk best (the fewest that cover it, else the most), so it maps
    only what is missing. Mapped pages no token needs yet (a free slot's, or those past a live
    request's length) are the cache: they count as free KV, and when a grow needs physical
    memory they are given back (unmap and release; free slots first, the largest first, last
    pages first) before the grow fails. Without the cache a slot is unmapped when its request
    ends. Slots are a plain list: at most ``max_num_seqs`` (hundreds), scanned per admission.

    ``capacity_tokens`` of a handle covers the pages its tokens need, not the cached ones past
    them, so crossing into a cached page still calls ``grow`` (which then maps nothing) and the
    held/cached split stays exact.

    There is no block table, so nothing is shared between requests: no prefix caching.
    """

    decode_grows_at_capacity = True

    def __init__(
        self,
        pool: TimedPool,
        config: ServerConfig,
        *,
        bytes_per_token: int,
        budget_bytes: int,
        num_kv_tensors: int,
    ):
        assert config.max_model_len is not None, "simulate() resolves max_model_len"
        super().__init__(pool, bytes_per_token=bytes_per_token, budget_bytes=budget_bytes)
        device = pool.policy.device
        page = config.virtual_page_bytes
        if not isinstance(device, PageMappedDevice) or device.granularity_bytes != page:
            raise ValueError(
                "kv_strategy=virtual needs the KV pool on a page-mapped device "
                f"of {format_bytes(page)} pages, not {device!r}"
            )
        if num_kv_tensors < 1 or bytes_per_token % num_kv_tensors:
            raise ValueError(
                f"bytes_per_token={bytes_per_token} does not split into {num_kv_tensors} KV tensors"
            )
        tensor_bytes_per_token = bytes_per_token // num_kv_tensors
        if page < tensor_bytes_per_token:
            raise ValueError(
                f"a {format_bytes(page)} page holds less than one token of one KV tensor "
                f"({tensor_bytes_per_token} B)"
            )
        self.device = device
        self.page_bytes = page
        self.num_kv_tensors = num_kv_tensors
        self.tokens_per_page = page // tensor_bytes_per_token
        self.group_bytes = (
            page * num_kv_tensors
        )  # physical bytes of one page of tokens, all tensors
        self.map_cache = config.map_cache
        self.num_slots = config.max_num_seqs
        self.slot_span_bytes = round_up(config.max_model_len * tensor_bytes_per_token, page)
        self.max_slot_pages = self.slot_span_bytes // page
        total_span = self.slot_span_bytes * self.num_slots * num_kv_tensors
        base = device.address_reserve(total_span)
        if base is None:
            raise ValueError(
                f"kv_strategy=virtual: {self.num_slots} ranges of {config.max_model_len} tokens "
                f"({format_bytes(total_span)}) exceed the device's address space"
            )
        self._base = base
        device.take_driver_ns()  # the start-up reservation belongs to no step
        n = self.num_slots
        self._slot_pages = [0] * n  # pages mapped per tensor, by slot
        self._slot_need = [0] * n  # pages its holder's tokens need (0: free slot)
        self._slot_tokens = [0] * n  # tokens its holder asked for
        self._free_slots = set(range(n))
        self.cached_bytes = 0  # mapped bytes no token needs: the reuse cache
        self.live_bytes = 0  # tokens asked for x bytes_per_token, over live requests
        self.peak_live_bytes = self.peak_held_bytes = self.peak_mapped_bytes = 0
        self.num_grow_calls = self.num_failures = self.num_frees = 0
        self.num_maps = self.num_unmaps = (
            0  # page-run maps and unmaps (one call per tensor and page on the device)
        )
        self.grown_bytes = self.shrunk_bytes = 0
        self.num_reused_pages = 0  # pages of tokens that were found mapped (cached) when needed
        self._map_ns = 0

    @property
    def evictable_bytes(self) -> int:
        return self.cached_bytes

    @property
    def held_bytes(self) -> int:
        """Physical bytes mapped for live requests' tokens."""
        return self.allocated_bytes - self.cached_bytes

    @property
    def pending_map_ns(self) -> int:
        return self._map_ns

    def take_map_ns(self) -> int:
        ns, self._map_ns = self._map_ns, 0
        return ns

    def pool_readings(self) -> VirtualKVReadings:
        return VirtualKVReadings(self)

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_page)

    def peak_bytes(self, prompt_tokens: int, output_tokens: int) -> int:
        return self._pages(prompt_tokens + output_tokens - 1) * self.group_bytes

    def estimate_bytes(self, h: KVHandle, num_tokens: int) -> int:
        if num_tokens <= h.capacity_tokens:
            return 0
        return (self._pages(num_tokens) - self._pages(h.capacity_tokens)) * self.group_bytes

    def mapped_pages(self, h: KVHandle) -> int:
        """Pages (per tensor) mapped in ``h``'s slot, cached ones past its tokens included."""
        return self._slot_pages[h.slot] if h.slot >= 0 else 0

    # ------------------------------------------------------------------ slots
    def admit(self, h: KVHandle, num_tokens: int) -> bool:
        """Give ``h`` a free slot (the cached pages that fit it best) and grow it to
        ``num_tokens``."""
        assert h.slot < 0, "a request holds one slot"
        assert self._free_slots, "the scheduler runs at most max_num_seqs requests"
        need, pages = self._pages(num_tokens), self._slot_pages
        covering = [s for s in self._free_slots if pages[s] >= need]
        if covering:
            slot = min(covering, key=lambda s: (pages[s], s))
        else:
            slot = min(self._free_slots, key=lambda s: (-pages[s], s))
        self._free_slots.remove(slot)
        h.slot = slot
        if not self.grow(h, num_tokens, 0):
            self._vacate(h)
            return False
        return True

    def grow(self, h: KVHandle, num_tokens: int, num_valid_tokens: int = 0) -> bool:
        """Make ``h`` hold ``num_tokens``: take its slot's cached pages, then map what is missing
        (never copies). False, with nothing of ``h`` changed, when live requests leave too little
        of the budget; cached pages are given back first when they are what stands in the way."""
        s = h.slot
        assert s >= 0, "admit() gives the request its slot"
        if num_tokens > h.capacity_tokens:
            old, need, have = self._slot_need[s], self._pages(num_tokens), self._slot_pages[s]
            assert need <= self.max_slot_pages, "the scheduler keeps sequences within max_model_len"
            group = self.group_bytes
            self.num_grow_calls += 1
            if self.held_bytes + (need - old) * group > self.budget_bytes:
                self.num_failures += 1
                return False
            reused = min(need, have) - old
            if reused > 0:  # cached pages past its tokens (or left by the slot's last holder)
                self.cached_bytes -= reused * group
                self.num_reused_pages += reused
            self._slot_need[s] = need
            if need > have:
                nbytes = (need - have) * group
                self._reclaim(self.allocated_bytes + nbytes - self.budget_bytes)
                page, count = self.page_bytes, need - have
                for t in range(self.num_kv_tensors):
                    mapped = self.device.map_new(self._offset(t, s, have), count * page, page)
                    assert mapped, "the device holds the KV budget"
                self._slot_pages[s] = need
                self.allocated_bytes += nbytes
                self.num_maps += 1
                self.grown_bytes += nbytes
                self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.allocated_bytes)
                self._sample_driver(self.pool.alloc_ns)
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            h.capacity_tokens = need * self.tokens_per_page
        asked = self._slot_tokens[s]
        if num_tokens > asked:
            self.live_bytes += (num_tokens - asked) * self.bytes_per_token
            self._slot_tokens[s] = num_tokens
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return True

    def free(self, h: KVHandle) -> None:
        """The request is done or preempted: its slot goes back, its pages cached or unmapped."""
        if h.slot < 0:
            return
        s = h.slot
        self._vacate(h)
        self.num_frees += 1
        if not self.map_cache and self._slot_pages[s]:
            self._unmap_tail(s, self._slot_pages[s])
            self._sample_driver(self.pool.free_ns)

    def _vacate(self, h: KVHandle) -> None:
        s = h.slot
        self.live_bytes -= self._slot_tokens[s] * self.bytes_per_token
        self.cached_bytes += self._slot_need[s] * self.group_bytes
        self._slot_tokens[s] = self._slot_need[s] = 0
        self._free_slots.add(s)
        h.slot = -1
        h.capacity_tokens = 0

    def _reclaim(self, nbytes: int) -> None:
        """Unmap at least ``nbytes`` of cached pages: free slots first (most pages first), then
        the pages past live requests' tokens (most first)."""
        pages, need, free = self._slot_pages, self._slot_need, self._free_slots
        while nbytes > 0:
            s = min(
                (s for s in range(self.num_slots) if pages[s] > need[s]),
                key=lambda s: (s not in free, need[s] - pages[s], s),
            )  # empty: the caller checked
            excess = pages[s] - need[s]
            count = min(excess, -(-nbytes // self.group_bytes))
            self._unmap_tail(s, count)
            nbytes -= count * self.group_bytes

    def _unmap_tail(self, s: int, count: int) -> None:
        """Unmap and release the last ``count`` pages of slot ``s`` (cached ones) in every
        tensor."""
        first = self._slot_pages[s] - count
        for t in range(self.num_kv_tensors):
            self.device.unmap_release(self._offset(t, s, first), count * self.page_bytes)
        nbytes = count * self.group_bytes
        self._slot_pages[s] = first
        self.allocated_bytes -= nbytes
        self.cached_bytes -= nbytes
        self.num_unmaps += 1
        self.shrunk_bytes += nbytes

    def _offset(self, tensor: int, slot: int, page_index: int) -> int:
        return (
            self._base
            + (tensor * self.num_slots + slot) * self.slot_span_bytes
            + page_index * self.page_bytes
        )

    def _sample_driver(self, samples: list[int]) -> None:
        """The driver time of the call just made: one latency sample, and pending for the step."""
        ns = self.device.take_driver_ns()
        self._map_ns += ns
        if self.pool.record_latency:
            samples.append(ns)

    @property
    def num_mapped_slots(self) -> int:
        return sum(1 for p in self._slot_pages if p)


class VirtualKVReadings:
    """What the pool monitor reads off a ``VirtualKV`` (``sim.replay.metrics.PoolMonitor``'s
    readings).

    live = tokens asked for, allocated = pages mapped for live requests, reserved = all pages
    mapped (the reuse cache too). Any free physical page can be mapped into any range, so there
    is no external fragmentation: ``largest_free`` is the whole cache and ``frag_ext`` is 0.
    """

    __slots__ = ("kv",)

    def __init__(self, kv: VirtualKV):
        self.kv = kv

    def reserved_bytes(self) -> int:
        return self.kv.allocated_bytes

    def sample(self) -> tuple:
        kv = self.kv
        return (
            kv.live_bytes,
            kv.held_bytes,
            kv.allocated_bytes,
            kv.cached_bytes,
            0.0,
            kv.num_mapped_slots,
        )

    def totals(self) -> dict[str, int]:
        kv = self.kv
        return {
            "n_alloc": kv.num_grow_calls,
            "n_free": kv.num_frees,
            "n_failed": kv.num_failures,
            "peak_live_bytes": kv.peak_live_bytes,
            "peak_allocated_bytes": kv.peak_held_bytes,
            "peak_reserved_bytes": kv.peak_mapped_bytes,
            "n_grow": kv.num_maps,
            "n_shrink": kv.num_unmaps,
            "grown_bytes": kv.grown_bytes,
            "shrunk_bytes": kv.shrunk_bytes,
        }
