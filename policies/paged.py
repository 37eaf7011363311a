"""``paged``: fixed-size pages that need not be contiguous, shared by reference count.

The vLLM PagedAttention pool: memory is cut into equal pages (one KV-cache block of
``tokens_per_page`` tokens by default), a request of ``nbytes`` gets ``ceil(nbytes / page)`` pages
wherever they are free, and pages are shared between requests (a fork for beam search or
parallel sampling, a common prompt prefix) by counting references.

The pool also keeps vLLM's prefix cache (``BlockPool``): allocations named by a hash key, shared
by reference count, and kept (evictable) when nobody holds them, evicted in a chosen order
(``policies.eviction``: least recently released first by default). Each block has an owner
(None unless the caller names one): owners are the colocated instances of one shared pool, each
with its own evictable queue, so an owner evicts its own blocks and counts its own evictable bytes.
The page reference counts, the hash map and the evictable queue live together here, so there is
one owner of "who holds this page".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable

from policies.base import Allocation, Policy, Segment, check_positive_int
from policies.device import Device
from policies.errors import PolicyError
from traces.knobs import check_int
from policies.eviction import EvictableQueue, make_queue
from policies.units import round_up

try:
    import cython
except ImportError:  # a pure install: the same names as no-ops (policies/_cython_shim.py)
    from policies._cython_shim import cython

__all__ = ["Paged", "PAGE_ALIGNMENT_BYTES"]

#: Pages are whole multiples of this, the alignment ``cudaMalloc`` guarantees, so every page
#: handed to a GPU kernel is as aligned as a fresh ``cudaMalloc`` pointer.
PAGE_ALIGNMENT_BYTES = 256


class _Page:
    """One page, reused as is (vLLM's ``KVCacheBlock``): ``ref_cnt`` live holders, 0 when free
    (or cached and evictable); ``cache_key`` names the cached block it belongs to (None: none).
    Slots (a ``cdef class`` in the compiled build, ``paged.pxd``), compared by identity.

    A page is also its own one-page allocation when ``allocate_pages`` grants it (a page grant,
    no ``Allocation`` made): ``size_bytes`` is what it holds (the pool's page), ``nbytes`` what
    the grant asked for (kept until the page is granted again), so a caller that sums an
    allocation's ``size_bytes`` reads a grant the same way; ``pool_token`` is the token of the
    pool it belongs to (``Policy._token``), which a grant handed back is checked against."""

    __slots__ = (
        "offset",
        "segment",
        "extents",
        "handle",
        "ref_cnt",
        "cache_key",
        "size_bytes",
        "nbytes",
        "pool_token",
    )

    offset: int
    segment: Segment
    extents: tuple[tuple[int, int], ...]  # ((offset, page_size_bytes),), built once
    handle: tuple[
        _Page
    ]  # (self,): a one-page allocation's handle, built once (not a tuple per request)
    ref_cnt: int
    cache_key: Hashable | None
    size_bytes: int
    nbytes: int
    pool_token: object

    def __init__(
        self,
        offset: int,
        segment: Segment,
        extents: tuple[tuple[int, int], ...],
        ref_cnt: int = 0,
        cache_key: Hashable | None = None,
        pool_token: object = None,
    ):
        self.offset = offset
        self.segment = segment
        self.extents = extents
        self.handle = (self,)
        self.ref_cnt = ref_cnt
        self.cache_key = cache_key
        self.size_bytes = extents[0][1]
        self.nbytes = 0
        self.pool_token = pool_token


@dataclass(slots=True, eq=False)
class _CachedBlock:
    """A cached allocation: the caller's handle (to hand back on eviction), its pages, and what
    eviction orders weigh: uses (caching it is the first, each hit one more) and recompute cost;
    ``owner`` names the evictable queue it joins when nobody holds it."""

    allocation: Allocation
    pages: tuple[_Page, ...]
    size_bytes: int
    owner: Hashable
    recompute_cost: float = 1.0
    num_uses: int = 1


class _PagedAllocation(Allocation):
    """An allocation of ``Paged`` from a run of pages (``handle``: the pages, in allocation
    order): its ``extents``, one ``(offset, page_size_bytes)`` a page, are built from the pages
    when first read, not when it is made, where nothing reads them (a served prompt's dozens
    of pages: the tuple of tuples was a fifth of its allocation and free). An ``Allocation``
    in every other way (a ``cdef class`` over its fields in the compiled build, ``paged.pxd``)."""

    __slots__ = ()

    @property
    def extents(self) -> tuple[tuple[int, int], ...]:
        """``(offset, length)`` ranges it occupies, one a page (``Allocation``'s docstring)."""
        extents = self._extents
        if extents is None:
            extents = self._extents = tuple([pg.extents[0] for pg in self.handle])
        return extents

    @extents.setter
    def extents(self, extents: tuple[tuple[int, int], ...]) -> None:
        self._extents = extents


class _PagedCore(Policy):
    """The hot path of ``Paged`` (its ``_allocate`` and ``_free``), apart from its knobs.

    The compiled build makes this a ``cdef class`` (``paged.pxd``) with typed page state;
    ``Paged`` stays a Python class so that its ``__init__`` keeps the signature ``get_params``
    reads (a ``cdef class``'s ``__init__`` shows only ``*args, **kwargs``). Interpreted, one
    more class in the MRO and nothing else.
    """

    __slots__ = ()

    page_size_bytes: int
    _free_pages: list[_Page]
    _blocks: dict[Hashable, _CachedBlock]

    @cython.locals(
        pg=_Page,
        a=Allocation,
        n=cython.longlong,
        page=cython.longlong,
        num_pages=cython.longlong,
        size=cython.longlong,
    )
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        # compiled: a C integer (``allocate`` passed at most the device's bytes), so no boxing below
        n = nbytes
        page = self.page_size_bytes
        free = self._free_pages
        if n <= page and free:  # the hot path: one KV block
            pg = free.pop()
            pg.ref_cnt = 1
            size = page
            extents = pg.extents
            handle = pg.handle
            a = Allocation.__new__(Allocation)  # no __init__ frame; compiled, a direct allocation
        else:
            num_pages = -(-n // page)
            if num_pages <= len(free):
                # the top num_pages, in pop order (top of the stack first): one slice, not a pop
                # each (a prompt's dozens of pages)
                handle = free[-num_pages:]
                del free[-num_pages:]
                handle.reverse()
                for pg in handle:  # compiled, a C loop
                    pg.ref_cnt = 1
            else:
                handle = self._take_pages(num_pages, stream)
                if handle is None:
                    return None
                for pg in handle:
                    pg.ref_cnt = 1
            size = num_pages * page
            extents = None  # built from the pages when read (``_PagedAllocation``)
            a = _PagedAllocation.__new__(_PagedAllocation)
        self.allocated_bytes += size
        a.nbytes = n
        a.size_bytes = size
        a._extents = extents  # the slot behind ``extents``: no property call on the hot path
        a.stream = stream
        a.tag = tag
        a.handle = handle
        return a

    @cython.locals(a=Allocation, pg=_Page, num_released=cython.longlong)
    def _free(self, allocation: Allocation) -> None:
        a = allocation  # compiled: a C-typed local (Policy.free hands over only an Allocation)
        pages = a.handle
        if self._blocks:  # nothing may leave the cache by the back door
            for pg in pages:
                if pg.cache_key is not None and pg.ref_cnt <= 1:
                    raise PolicyError(
                        f"free: the page at offset {pg.offset} belongs to "
                        f"the cached block {pg.cache_key!r}; "
                        "release_block and evict_block it instead"
                    )
        if len(pages) == 1:
            pg = pages[0]
            if pg.ref_cnt == 1:
                pg.ref_cnt = 0
                self._free_pages.append(pg)
                self.allocated_bytes -= self.page_size_bytes
            else:
                pg.ref_cnt -= 1
            return
        free = self._free_pages
        num_released = len(free)
        # from the last page: the first one ends on top, as before allocation; a ``for`` over
        # ``reversed`` and the count from the stack's length (interpreted, no index arithmetic
        # per page)
        for pg in reversed(pages):
            if pg.ref_cnt == 1:
                pg.ref_cnt = 0
                free.append(pg)
            else:
                pg.ref_cnt -= 1
        num_released = len(free) - num_released
        self.allocated_bytes -= num_released * self.page_size_bytes

    @cython.locals(
        pg=_Page,
        n=cython.longlong,
        page=cython.longlong,
        live=cython.longlong,
        allocated=cython.longlong,
    )
    def allocate_pages(self, nbytes: int, num_calls: int) -> list[_Page] | None:
        """``allocate_each(nbytes, num_calls)``'s fused path, handing back the pages themselves
        (page grants) instead of an ``Allocation`` each: the same pages in the same order, and
        the same counters (``num_allocs``, ``live_bytes``, ``allocated_bytes``, the peaks), each
        page counted as the one-page allocation of ``nbytes`` it stands for. A grant goes back
        through ``free_each`` (alone or among allocations), freed as that allocation would be.
        None, with nothing done, unless the free stack covers ``num_calls`` requests of at most
        a page (``allocate_each`` then makes its calls). For a caller that keeps each grant
        until it frees it once, in this pool (the serving simulator's KV pages: a decode step's
        page grows without an object each)."""
        free = self._free_pages
        if (
            type(nbytes) is not int
            or not 0 < nbytes <= self.page_size_bytes
            or nbytes > self._max_request_bytes
            or not 0 < num_calls <= len(free)
            or not self._fused_calls
        ):
            return None
        n, page = nbytes, self.page_size_bytes
        # the top num_calls pages, in pop order (top of the stack first): one slice, reversed
        taken = free[-num_calls:]
        del free[-num_calls:]
        taken.reverse()
        for pg in taken:  # ``_allocate``'s hot path; ``allocate``'s counters after the loop
            pg.ref_cnt = 1
            pg.nbytes = n
        self.num_allocs += num_calls
        allocated = self.allocated_bytes + num_calls * page
        self.allocated_bytes = allocated
        live = self.live_bytes + num_calls * n
        self.live_bytes = live
        if live > self.peak_live_bytes:
            self.peak_live_bytes = live
        if allocated > self.peak_allocated_bytes:
            self.peak_allocated_bytes = allocated
        return taken

    @cython.locals(pg=_Page, a=Allocation, page=cython.longlong)
    def allocate_each(
        self, nbytes: int, num_calls: int, *, stream: int = 0, tag: str | None = None
    ) -> list[Allocation | None]:
        """``Policy.allocate_each``: one-page requests that the free stack covers, fused into
        one loop (``allocate_pages``, each page then given its ``Allocation``); anything else is
        the loop of ``allocate``. The same pages, allocations and counters as the loop: each
        call's counter updates only add, so the peaks after the last one are the loop's."""
        pages = self.allocate_pages(nbytes, num_calls)
        if pages is None:
            return Policy.allocate_each(self, nbytes, num_calls, stream=stream, tag=tag)
        page, token = self.page_size_bytes, self._token
        out = []
        for pg in pages:
            a = Allocation.__new__(Allocation)
            a.nbytes = nbytes
            a.size_bytes = page
            a._extents = pg.extents
            a.stream = stream
            a.tag = tag
            a.handle = pg.handle
            a.owner = token
            out.append(a)
        return out

    @cython.locals(
        a=Allocation,
        pg=_Page,
        page=cython.longlong,
        i=cython.longlong,
        num=cython.longlong,
        num_free_before=cython.longlong,
        freed_nbytes=cython.longlong,
    )
    def free_each(self, allocations: Iterable[Allocation | _Page]) -> None:
        """``Policy.free_each``: the allocations handed back in one loop (a finished request's
        pages), each page as ``_free`` returns it, a page grant (``allocate_pages``) as the
        one-page allocation it stands for; from the first argument that is neither this pool's
        live allocation nor its granted page on (it raises there), and while blocks are cached
        (a free must not take a cached page), the loop of ``free`` (``_free_one``). The counters
        are written once, after the loop: a free only subtracts, so no peak moves, and the
        released bytes are the free stack's growth (a page returns to it when its last holder
        lets go)."""
        if type(allocations) is not list:
            allocations = list(allocations)
        if self._blocks or not self._fused_calls:
            for item in allocations:
                self._free_one(item)
            return
        token, free, page = self._token, self._free_pages, self.page_size_bytes
        shared = self._pages_shared
        num = len(allocations)
        num_free_before = len(free)
        freed_nbytes = 0
        i = 0
        while i < num:
            item = allocations[i]  # untyped: an Allocation or a granted page
            if type(item) is _Page:  # a page grant: held, and this pool's
                pg = item
                if pg.ref_cnt < 1 or pg.pool_token is not token:
                    break  # ``_free_one`` raises for it, after the frees before it
                if pg.ref_cnt == 1:
                    pg.ref_cnt = 0
                    free.append(pg)
                else:
                    pg.ref_cnt -= 1
                freed_nbytes += pg.nbytes
                i += 1
                continue
            if getattr(item, "owner", None) is not token or (
                type(item) is not Allocation and type(item) is not _PagedAllocation
            ):
                break  # ``free`` raises for it, after the frees before it (the loop's order)
            a = item
            pages = a.handle
            if len(pages) == 1:
                pg = pages[0]
                if pg.ref_cnt == 1:
                    pg.ref_cnt = 0
                    free.append(pg)
                else:
                    pg.ref_cnt -= 1
            elif shared:  # ``_free``'s loop: from the last page, so the first one ends on top
                for pg in reversed(pages):
                    if pg.ref_cnt == 1:
                        pg.ref_cnt = 0
                        free.append(pg)
                    else:
                        pg.ref_cnt -= 1
            else:  # the same when no page was ever shared: each page's one holder lets go
                for pg in pages:
                    pg.ref_cnt = 0
                free.extend(reversed(pages))
            a.owner = None
            freed_nbytes += a.nbytes
            i += 1
        self.allocated_bytes -= (len(free) - num_free_before) * page
        self.num_frees = self.num_frees + i
        self.live_bytes = self.live_bytes - freed_nbytes
        for item in allocations[i:]:
            self._free_one(item)

    @cython.locals(pg=_Page, a=Allocation)
    def _free_one(self, item: Allocation | _Page) -> None:
        """``free(item)``; a page grant (``allocate_pages``) is freed as the one-page allocation
        it stands for: that ``Allocation`` made back and handed to ``free`` (``_free``'s checks
        and page update, ``free``'s counters: one place for both).

        Raises:
            PolicyError: the page is free already, not this pool's, or cached (nothing changes).
        """
        if type(item) is not _Page:
            self.free(item)
            return
        pg = item
        if pg.ref_cnt < 1 or pg.pool_token is not self._token:
            raise PolicyError(
                f"free: the page at offset {pg.offset} is not a page this pool granted and "
                "still holds (freed already, or another pool's)"
            )
        a = Allocation.__new__(Allocation)
        a.nbytes = pg.nbytes
        a.size_bytes = self.page_size_bytes
        a._extents = pg.extents
        a.stream = 0
        a.tag = None
        a.handle = pg.handle
        a.owner = self._token
        self.free(a)


class Paged(_PagedCore):
    """Fixed-size pages, LIFO reuse, reference-counted sharing.

    Behaviour:

    - The page is ``page_bytes`` or, when that is None, ``tokens_per_page * bytes_per_token``
      (16 tokens x 128 KiB = 2 MiB: a vLLM block of Llama-3-8B in bf16, field notes). It must be
      a multiple of 256 B. The effective size is ``page_size_bytes``.
    - A request of ``nbytes`` takes ``ceil(nbytes / page_size_bytes)`` pages, anywhere.
      ``Allocation.extents`` holds one ``(offset, page_size_bytes)`` per page in allocation
      order; ``Allocation.handle`` is the sequence of page records (private, never mutated).
    - Free pages sit in a LIFO stack: the page freed last is handed out first, and freeing an
      allocation pushes its pages back in reverse so an allocate-then-free leaves the stack as
      it was. Fresh pages of a new segment go to the bottom (used only after every page freed
      before them), in address order, so a segment grown in advance stays fully free, and
      trimmable, for as long as reused pages suffice.
    - Growth: when too few pages are free, all free pages are taken and one segment covering the
      shortfall is reserved, rounded up to whole ``segment_bytes`` (which is itself rounded up to
      whole pages). Near ``capacity_bytes`` it falls back to as many pages as fit, then to the
      exact shortfall. Trimming never helps a paged pool grow (every free page is already
      usable), and since a growing request has taken every free page there is nothing for the
      base class's trim-and-retry to release: a refused request leaves the pool exactly as it
      was.
    - Sharing: ``fork`` and ``allocate_shared`` hand out allocations whose pages are already
      held by another; each page has a reference count and returns to the stack when it drops
      to 0. ``allocated_bytes`` (and ``Segment.num_live``) count each physical page once;
      ``live_bytes`` is summed over allocations as the base class defines it, so a page shared
      by two allocations counts twice there and ``live_bytes`` may exceed ``allocated_bytes``.
    - Prefix cache (vLLM's ``BlockPool``): ``cache_block(key, allocation)`` names a live
      allocation's pages ``key``; ``cached_block`` finds them; ``share_block`` adds a holder
      (page reference counts +1, no new bytes), ``release_block`` removes one. A block whose
      pages drop to 0 holders stays allocated and cached, in the evictable queue
      (``evictable_bytes``); ``share_block`` takes it back out, ``evict_block`` hands the queue's
      first one (least recently released, or as ``set_eviction_order`` chose) back to the caller
      (forgotten by the cache, one holder: the caller)
      to ``free``. An ``owner`` (``cache_block``'s argument) gets its own evictable queue
      (``evict_block(owner)``, ``evictable_bytes_of(owner)``); ``evictable_bytes`` is all
      owners'. Freeing an allocation that would return a cached page to the free stack is
      refused: a cached block leaves through ``evict_block``. The allocation may be a wrapper's
      (its extents name this pool's pages), so the cache works under ``elastic`` and friends.
    - Streams are recorded on allocations but pages are not segregated by stream (one stack
      serves all; the caller orders cross-stream reuse, as vLLM's single-stream cache does).
    - ``largest_free_bytes`` is free pages x page size (pages need not be contiguous), so a
      paged pool has no external fragmentation; its waste is the unused tail of each last page.

    Args:
        page_bytes: page size in bytes; None to use ``tokens_per_page * bytes_per_token``.
        tokens_per_page: tokens per page (vLLM's block size) when ``page_bytes`` is None.
        bytes_per_token: KV bytes per token when ``page_bytes`` is None
            (2 x layers x kv_heads x head_dim x dtype bytes; 131072 for Llama-3-8B bf16).
        segment_bytes: bytes reserved per growth step, rounded up to whole pages.
        capacity_bytes: see ``Policy``.
    """

    #: ``allocate_each``/``free_each`` fuse ``allocate`` with ``_allocate`` and ``free`` with
    #: ``_free``; a subclass that overrides one of them gets the loop, which makes its calls. A
    #: class flag, not a method identity test: compiled, a ``cpdef`` method read off the class is
    #: a new wrapper each time.
    _fused_calls = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if any(name in cls.__dict__ for name in ("allocate", "_allocate", "free", "_free")):
            cls._fused_calls = False

    name = "paged"
    contiguous = False
    coalesces = False
    page_size_knob = "page_bytes"
    #: a request of at most one page pops a free page when there is one (``_allocate``'s hot path)
    counts_free_pages = True
    #: ``allocate_pages`` hands out free pages as page grants (``free_each`` takes them back)
    grants_pages = True

    @property
    def block_cache(self) -> "Paged":
        """This pool keeps the prefix cache itself (``cache_block`` and friends)."""
        return self

    def __init__(
        self,
        *,
        page_bytes: int | None = None,
        tokens_per_page: int = 16,
        bytes_per_token: int = 131072,
        segment_bytes: int = 64 << 20,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        check_positive_int("tokens_per_page", tokens_per_page)
        check_positive_int("bytes_per_token", bytes_per_token)
        check_positive_int("segment_bytes", segment_bytes)
        if page_bytes is not None:
            check_positive_int("page_bytes", page_bytes)
            page, where = page_bytes, f"page_bytes(={page_bytes})"
        else:
            page = tokens_per_page * bytes_per_token
            where = (
                f"page size {page} B (tokens_per_page={tokens_per_page} x "
                f"bytes_per_token={bytes_per_token})"
            )
        if page % PAGE_ALIGNMENT_BYTES:
            raise PolicyError(f"{where} must be a multiple of {PAGE_ALIGNMENT_BYTES} B")
        self.page_bytes = page_bytes
        self.tokens_per_page = tokens_per_page
        self.bytes_per_token = bytes_per_token
        self.segment_bytes = segment_bytes
        self.eviction_order = "lru"  # of the prefix cache; set_eviction_order changes it
        super().__init__(capacity_bytes=capacity_bytes, device=device)

    def _reset_state(self) -> None:
        page = (
            self.page_bytes
            if self.page_bytes is not None
            else self.tokens_per_page * self.bytes_per_token
        )
        self.page_size_bytes: int = page
        self.pages_per_segment: int = -(-self.segment_bytes // page)
        # A list as a LIFO stack: append/pop at the end are O(1) and the cheapest ops Python has.
        self._free_pages: list[_Page] = []
        # Every page of every segment by offset: for lookups by address, never on the hot path.
        self._pages: dict[int, _Page] = {}
        # The prefix cache: key -> block (O(1) lookup), and per owner the blocks nobody holds in
        # eviction order (policies.eviction; LRU until set_eviction_order says otherwise). A dict
        # of queues: owners are few (one per colocated instance), looked up once per cache call.
        self._blocks: dict[Hashable, _CachedBlock] = {}
        self._queues: dict[Hashable, EvictableQueue] = {}
        self.evictable_bytes: int = 0
        #: whether a page ever had a second holder (``fork``, ``allocate_shared``,
        #: ``share_block``): until then every held page has ``ref_cnt`` 1, so ``free_each``
        #: hands a run of pages back without testing each (never reset but here)
        self._pages_shared: bool = False

    def _take_pages(self, num_pages: int, stream: int) -> list[_Page] | None:
        """Pop ``num_pages`` pages (``ref_cnt`` is the caller's).

        Grows when too few are free; None (and nothing changed) when that is refused.
        """
        free = self._free_pages
        if num_pages <= len(free):
            pages = free[-num_pages:]
            del free[-num_pages:]
            pages.reverse()  # pop order: top of the stack first
            return pages
        # Take every free page first: they are ours whatever happens, and with no fully free
        # segment left a refused reservation cannot trim anything from under us.
        pages = free[::-1]
        free.clear()
        if not self._grow_pages(num_pages - len(pages), stream):
            free.extend(reversed(pages))
            return None
        short = num_pages - len(pages)
        more = free[-short:]
        del free[-short:]
        more.reverse()
        return pages + more

    def _grow_pages(self, num_pages: int, stream: int) -> bool:
        """Reserve one segment of at least ``num_pages`` pages; its pages land on the (empty)
        stack."""
        page, per_segment = self.page_size_bytes, self.pages_per_segment
        tries = [round_up(num_pages, per_segment)]
        if self.capacity_bytes is not None:  # near capacity: as many pages as still fit
            room = (self.capacity_bytes - self.reserved_bytes) // page
            if num_pages <= room < tries[0]:
                tries.append(room)
        if tries[-1] != num_pages:
            tries.append(num_pages)
        for n in tries:
            seg = self._reserve_segment(n * page, stream)
            if seg is not None:
                self._add_segment(seg)
                return True
        return False

    # ----------------------------------------------------------------- sharing
    def fork(self, allocation: Allocation) -> Allocation:
        """A new allocation holding the same pages as ``allocation`` (same size, stream and tag).

        Each page's reference count goes up by one; no bytes are allocated. Free the fork with
        ``free`` like any allocation; pages return to the pool only when every holder is freed.

        Raises:
            PolicyError: ``allocation`` is not live in this pool.
        """
        self._check_live(allocation, "fork")
        pages = allocation.handle  # never mutated, so the fork can hold the same sequence
        self._pages_shared = True
        for pg in pages:
            pg.ref_cnt += 1
        return self._hand_out(
            Allocation(
                allocation.nbytes,
                allocation.size_bytes,
                allocation.extents,
                allocation.stream,
                allocation.tag,
                pages,
            )
        )

    def allocate_shared(
        self,
        shared: Allocation | Iterable[int],
        extra_nbytes: int = 0,
        *,
        stream: int = 0,
        tag: str | None = None,
    ) -> Allocation | None:
        """Allocate a request whose first pages are shared with another allocation.

        The result holds the shared pages first (reference counts +1, no new bytes), then
        ``ceil(extra_nbytes / page_size_bytes)`` fresh pages. Its ``nbytes`` is
        ``len(shared pages) * page_size_bytes + extra_nbytes``: shared pages count whole, as
        prefix caches share only full blocks. For a common prompt prefix pass the first pages
        of the allocation holding it: ``[off for off, _ in prefix.extents[:k]]``.

        Args:
            shared: a live allocation of this pool (all its pages) or page offsets, each live in
                this pool and given once.
            extra_nbytes: bytes needed beyond the shared pages (>= 0).
            stream, tag: as for ``allocate``.

        Returns:
            The allocation, or None when the fresh pages cannot be had (a failure, as for
            ``allocate``; nothing changes).

        Raises:
            PolicyError: a shared page is not live here or is given twice, ``extra_nbytes`` is
                not an integer >= 0, or the request would be empty (nothing changes).
        """
        if isinstance(shared, Allocation):
            self._check_live(shared, "allocate_shared")
            shared_pages = list(shared.handle)
        else:
            offsets = list(shared)
            shared_pages = []
            for off in offsets:
                pg = self._pages.get(off) if off.__class__ is int else None
                if pg is None or pg.ref_cnt == 0:
                    raise PolicyError(
                        f"allocate_shared: page offset {off!r} is not a live page of this pool"
                    )
                shared_pages.append(pg)
            if len(set(offsets)) != len(offsets):
                raise PolicyError(
                    f"allocate_shared: page offsets {offsets!r} name a page more than once"
                )
        check_int("extra_nbytes", extra_nbytes, low=0, error=PolicyError, where="allocate_shared: ")
        if not shared_pages and extra_nbytes == 0:
            raise PolicyError(
                "allocate_shared: no shared pages and extra_nbytes=0 make an empty request"
            )
        page = self.page_size_bytes
        fresh: list[_Page] = []
        if extra_nbytes > self._max_request_bytes:  # no device holds it (see Policy.allocate)
            self.num_failures += 1
            return None
        if extra_nbytes:
            taken = self._take_pages(-(-extra_nbytes // page), stream)
            if taken is None:
                self.num_failures += 1
                return None
            fresh = taken
            for pg in fresh:
                pg.ref_cnt = 1
            self.allocated_bytes += len(fresh) * page
        if shared_pages:
            self._pages_shared = True
        for pg in shared_pages:
            pg.ref_cnt += 1
        pages = shared_pages + fresh
        return self._hand_out(
            Allocation(
                len(shared_pages) * page + extra_nbytes,
                len(pages) * page,
                tuple([pg.extents[0] for pg in pages]),
                stream,
                tag,
                pages,
            )
        )

    # ----------------------------------------------------------------- prefix cache
    def set_eviction_order(self, order: str) -> None:
        """Evict cached blocks in ``order`` (``policies.eviction.EVICTION_ORDERS``) from now on.

        Raises:
            PolicyError: an unknown order, or blocks are evictable already (nothing changes).
        """
        try:
            make_queue(order)
        except ValueError as e:
            raise PolicyError(f"set_eviction_order: {e}") from None
        if any(len(q) for q in self._queues.values()):
            raise PolicyError(
                "set_eviction_order: blocks are evictable already; choose the order before caching"
            )
        self.eviction_order = order  # kept across reset(), which rebuilds the queues
        self._queues = {owner: make_queue(order) for owner in self._queues}

    def cache_block(
        self,
        key: Hashable,
        allocation: Allocation,
        recompute_cost: float = 1.0,
        owner: Hashable = None,
    ) -> None:
        """Name ``allocation``'s pages ``key``, so that later requests can find and share them.

        Its current holders keep holding it (nothing is counted again). ``allocation`` is one
        this pool handed out, or a wrapper's allocation over one (its extents are pages here).
        ``recompute_cost`` (> 0, any one unit) is what rebuilding the block would cost; the
        ``cost`` eviction order weighs it. ``owner`` names whose evictable queue the block joins
        when nobody holds it (the keys are one space: owners that may collide namespace them).

        Raises:
            PolicyError: ``key`` is cached already, or a page is not live here or is cached
                under another key (nothing changes).
        """
        if key in self._blocks:
            raise PolicyError(f"cache_block: key {key!r} is cached already")
        if not recompute_cost > 0:
            raise PolicyError(f"cache_block: recompute_cost(={recompute_cost!r}) must be > 0")
        pages = []
        for off, length in allocation.extents:
            pg = self._pages.get(off)
            if pg is None or pg.ref_cnt == 0 or length != self.page_size_bytes:
                raise PolicyError(
                    f"cache_block: extent ({off!r}, {length!r}) is not a live page of this pool"
                )
            if pg.cache_key is not None:
                raise PolicyError(
                    f"cache_block: the page at offset {off} is cached as {pg.cache_key!r} already"
                )
            pages.append(pg)
        for pg in pages:
            pg.cache_key = key
        self._blocks[key] = _CachedBlock(
            allocation,
            tuple(pages),
            len(pages) * self.page_size_bytes,
            owner,
            float(recompute_cost),
        )
        if owner not in self._queues:
            self._queues[owner] = make_queue(self.eviction_order)

    def cached_block(self, key: Hashable) -> Allocation | None:
        """The allocation cached as ``key`` (held or evictable), or None. Changes nothing."""
        b = self._blocks.get(key)
        return b.allocation if b is not None else None

    def share_block(self, key: Hashable) -> Allocation:
        """One more holder of the block cached as ``key`` (a prefix-cache hit); an evictable
        block leaves the evictable queue. Returns its allocation.

        Raises:
            PolicyError: nothing is cached as ``key``.
        """
        b = self._blocks.get(key)
        if b is None:
            raise PolicyError(f"share_block: nothing is cached as {key!r}")
        q = self._queues[b.owner]
        if key in q:
            q.remove(key)
            self.evictable_bytes -= b.size_bytes
        b.num_uses += 1
        self._pages_shared = True
        for pg in b.pages:
            pg.ref_cnt += 1
        return b.allocation

    def release_block(self, key: Hashable) -> bool:
        """One holder fewer of the block cached as ``key``. True when nobody holds it any more:
        it stays allocated and cached, last in the evictable queue.

        Raises:
            PolicyError: nothing is cached as ``key``, or nobody holds it (nothing changes).
        """
        b = self._blocks.get(key)
        if b is None:
            raise PolicyError(f"release_block: nothing is cached as {key!r}")
        q = self._queues[b.owner]
        if key in q or any(pg.ref_cnt == 0 for pg in b.pages):
            raise PolicyError(f"release_block: nobody holds the block cached as {key!r}")
        num_unheld = 0
        for pg in b.pages:
            pg.ref_cnt -= 1
            num_unheld += pg.ref_cnt == 0
        if num_unheld < len(b.pages):  # still held (whole, or some pages through a fork)
            return False
        q.push(key, b)
        self.evictable_bytes += b.size_bytes
        return True

    def evict_block(self, owner: Hashable = None) -> Allocation | None:
        """Forget ``owner``'s evictable queue's first block (least recently released, or as the
        eviction order says) and hand its allocation back with one holder, the caller, who frees
        it (through the pool that handed it out). None when no block of ``owner`` is evictable."""
        q = self._queues.get(owner)
        if q is None or not len(q):
            return None
        key, b = q.pop()
        del self._blocks[key]
        self.evictable_bytes -= b.size_bytes
        for pg in b.pages:
            pg.ref_cnt = 1
            pg.cache_key = None
        return b.allocation

    def evictable_bytes_of(self, owner: Hashable = None) -> int:
        """Bytes of ``owner``'s cached blocks that nobody holds."""
        q = self._queues.get(owner)
        return q.size_bytes if q is not None else 0

    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or evictable."""
        return len(self._blocks)

    def page_refcount(self, offset: int) -> int:
        """How many live allocations hold the page at ``offset`` (0 when it is free).

        Raises:
            PolicyError: ``offset`` is not the start of a page of this pool.
        """
        pg = self._pages.get(offset)
        if pg is None:
            raise PolicyError(f"offset {offset!r} is not the start of a page of this pool")
        return pg.ref_cnt

    def shared_extents(self) -> list[tuple[int, int]]:
        """Pages held by more than one live allocation, as ``(offset, page_size_bytes)``, address
        order.

        The hook ``policies.testing.check_invariants`` uses to allow overlap there (O(pages)).
        """
        page = self.page_size_bytes
        return [(off, page) for off, pg in sorted(self._pages.items()) if pg.ref_cnt > 1]

    def num_free_pages(self) -> int:
        """Pages on the free stack: the next this many one-page requests pop one each
        (``counts_free_pages``)."""
        return len(self._free_pages)

    def num_total_pages(self) -> int:
        return len(self._pages)

    def _check_live(self, allocation: Allocation, what: str) -> None:
        if getattr(allocation, "owner", None) is not self._token:
            raise PolicyError(f"{what}: {self._bad_free_reason(allocation)}")

    # ----------------------------------------------------------------- segments
    def _count_live_pages(self) -> None:
        """Bring each segment's ``num_live`` up to date: its pages off the free stack (held, or
        cached and evictable), its pages less its free ones.

        The page paths leave ``num_live`` alone (one load and store of a page's segment, per page,
        on every grow and free, for a count read only here): every reader goes through
        ``segments()`` or ``_free_segments_to_release``, which count first, O(segments + free
        pages)."""
        page = self.page_size_bytes
        for seg in self._segments.values():
            seg.num_live = seg.nbytes // page
        for pg in self._free_pages:
            pg.segment.num_live -= 1

    def segments(self) -> list[Segment]:
        self._count_live_pages()
        return super().segments()

    def _free_segments_to_release(self, max_bytes: int | None) -> list[Segment]:
        self._count_live_pages()
        return super()._free_segments_to_release(max_bytes)

    def _segment_size_for(self, nbytes: int) -> int:
        num_pages = -(-nbytes // self.page_size_bytes)
        per_segment = self.pages_per_segment
        return round_up(num_pages, per_segment) * self.page_size_bytes

    def _add_segment(self, segment: Segment) -> None:
        page = self.page_size_bytes
        assert segment.nbytes % page == 0, "a paged segment holds whole pages"
        fresh = [
            _Page(off, segment, ((off, page),), pool_token=self._token)
            for off in range(segment.end - page, segment.offset - page, -page)
        ]
        pages = self._pages
        for pg in fresh:
            pages[pg.offset] = pg
        self._free_pages[:0] = (
            fresh  # bottom of the stack, highest first: reused pages go first, then ascending
        )

    def _release_free_segments(self, max_bytes: int | None) -> int:
        """Release fully free segments, largest first, until ``max_bytes`` (None: all) is
        reached."""
        gone = set(self._free_segments_to_release(max_bytes))
        if not gone:
            return 0
        pages = self._pages
        for seg in gone:
            for off in range(seg.offset, seg.end, self.page_size_bytes):
                del pages[off]
            self._release_segment(seg)
        self._free_pages[:] = [
            pg for pg in self._free_pages if pg.segment not in gone
        ]  # in place: callers hold it
        return sum(seg.nbytes for seg in gone)

    # ----------------------------------------------------------------- free space
    def free_extents(self) -> list[tuple[int, int]]:
        page = self.page_size_bytes
        return [(off, page) for off in sorted(pg.offset for pg in self._free_pages)]

    def largest_free_bytes(self) -> int:
        return len(self._free_pages) * self.page_size_bytes
