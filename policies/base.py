"""The contract every memory-pool policy implements.

A policy owns bytes, nothing else: it decides where in its pool's address space each request
lives, when to reserve another *segment* from the upstream device (the expensive ``cudaMalloc``
in reality) and when to give a fully free one back. Time, traces and devices belong to the
layers above (``sim``, ``realgpu``), which drive the same policy object.

Subclasses implement five hooks:

- ``_allocate(nbytes, stream, tag) -> Allocation | None``
- ``_free(allocation)``
- ``_release_free_segments(max_bytes) -> int`` (give fully free segments back)
- ``_add_segment(segment)`` (take a freshly reserved segment as free space; used by ``grow``)
- ``_reset_state()`` (build derived state; called by ``__init__`` and ``reset``)

and may override ``free_extents()`` and ``largest_free_bytes()``, and ``gauges()`` where the levels
a monitor samples are counted otherwise (``stats()`` reads them from it; the battery checks both
agree). They reserve segments only through ``_reserve_segment`` and release them only through
``_release_segment`` so that capacity, counters and the device stay consistent.

Knobs are explicit keyword arguments of ``__init__``, stored unchanged under the same name
(the scikit-learn convention), so ``get_params()`` can list, print and clone them.

What else a pool can be asked is *declared* on ``Policy`` (the "declared capabilities" block:
``moves_allocations``, ``can_reserve``/``reserve``, ``can_compact``/``compact``, ``empty_cache``,
``seed_segment``, ``page_size_bytes``, ``counts_free_pages``/``num_free_pages``,
``grants_pages``/``allocate_pages``, ``block_cache``,
``base_policy``, ``can_hold_kv``, ``device_kind``): a policy that offers
more sets the flag and overrides the method, a wrapper (``policies.wrapper``) forwards both to
its base, and callers read the flag, never the presence of an attribute.

The device behind the pool (``policies.device.Device``: reserve/release, driver time, per-call
stats) is ``VirtualDevice`` by default; ``sim`` gives it a cost model and ``realgpu`` a real GPU.
``policies.mapped_device.PageMappedDevice`` is the virtual-memory (cuMem) device.

A failed ``allocate`` returns None and changes no live allocation; it may release fully free
cached segments first, as PyTorch's caching allocator does before it gives up.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Iterable

from policies.device import Device, VirtualDevice
from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from traces.knobs import check_int
from policies.units import round_up

try:
    import cython
except ImportError:  # a pure install: the same names as no-ops (policies/_cython_shim.py)
    from policies._cython_shim import cython

__all__ = [
    "Allocation",
    "Segment",
    "PoolStats",
    "Policy",
    "frag_ext",
    "gauges_mismatch",
    "round_up",
]


class Allocation:
    """One live request, as handed to the caller.

    Attributes:
        nbytes: the size the caller asked for.
        size_bytes: what the policy set aside for it after rounding (>= nbytes).
        extents: ``(offset, length)`` ranges it occupies in the pool's address space: one for
            contiguous policies, one per page for paged ones. Lengths add up to ``size_bytes``.
        stream: the stream it was allocated on.
        tag: the caller's label (``"kv"``, ``"weights"``, ...), or None.
        handle: policy-private bookkeeping (a block, a page list); callers must not touch it.
        owner: token of the pool that handed it out while it is live; None once freed.

    Slots, compared by identity, built by position or keyword (what ``@dataclass(slots=True,
    eq=False)`` gave, written out so that the compiled build can declare it a ``cdef class``
    in ``base.pxd``, where ``nbytes`` and ``size_bytes`` are 64-bit integers).

    ``extents`` is a property over the slot ``_extents`` so that a subclass can compute it
    instead of storing it: a contiguous policy's block (``policies._blocks.Block``) builds it
    from its offset only when asked, which spares two tuples and two ints per request on the
    replay's hot path, where nothing reads it. Code that builds an allocation field by field
    on a hot path sets ``_extents`` (paged, size-class), and buddy's ``_free`` reads it from its own
    allocations; everything else reads and sets ``extents``.
    """

    __slots__ = ("nbytes", "size_bytes", "_extents", "stream", "tag", "handle", "owner")
    __match_args__ = ("nbytes", "size_bytes", "extents", "stream", "tag", "handle", "owner")

    nbytes: int
    size_bytes: int
    _extents: tuple[tuple[int, int], ...]
    stream: int
    tag: str | None
    handle: Any
    owner: Any

    def __init__(
        self,
        nbytes: int,
        size_bytes: int,
        extents: tuple[tuple[int, int], ...],
        stream: int = 0,
        tag: str | None = None,
        handle: Any = None,
        owner: Any = None,
    ):
        self.nbytes = nbytes
        self.size_bytes = size_bytes
        self._extents = extents
        self.stream = stream
        self.tag = tag
        self.handle = handle
        self.owner = owner

    def __repr__(self) -> str:
        return (
            f"{type(self).__qualname__}(nbytes={self.nbytes!r}, size_bytes={self.size_bytes!r}, "
            f"extents={self.extents!r}, stream={self.stream!r}, tag={self.tag!r}, "
            f"handle={self.handle!r}, "
            f"owner={self.owner!r})"
        )

    @property
    def extents(self) -> tuple[tuple[int, int], ...]:
        """``(offset, length)`` ranges it occupies in the pool's address space (class docstring)."""
        return self._extents

    @extents.setter
    def extents(self, extents: tuple[tuple[int, int], ...]) -> None:
        self._extents = extents

    @property
    def offset(self) -> int:
        """Start of the first extent (the address of a contiguous allocation)."""
        return self.extents[0][0]

    @property
    def live(self) -> bool:
        return self.owner is not None


class Segment:
    """One chunk reserved from the upstream device, ``[offset, offset + nbytes)``.

    ``num_live`` counts the policy's live allocations (or pages) inside it, so a fully free
    segment is found in O(1); ``handle`` is policy-private. Slots, compared by identity, built
    by position or keyword (written out, as ``Allocation`` is, for its ``cdef class`` in
    ``base.pxd``).
    """

    __slots__ = ("offset", "nbytes", "stream", "num_live", "handle")
    __match_args__ = __slots__

    offset: int
    nbytes: int
    stream: int
    num_live: int
    handle: Any

    def __init__(
        self, offset: int, nbytes: int, stream: int = 0, num_live: int = 0, handle: Any = None
    ):
        self.offset = offset
        self.nbytes = nbytes
        self.stream = stream
        self.num_live = num_live
        self.handle = handle

    def __repr__(self) -> str:
        return (
            f"{type(self).__qualname__}(offset={self.offset!r}, nbytes={self.nbytes!r}, "
            f"stream={self.stream!r}, "
            f"num_live={self.num_live!r}, handle={self.handle!r})"
        )

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def frag_ext(free_bytes: int, largest_free_bytes: int) -> float:
    """External fragmentation ``1 - largest_free / free`` (0 when nothing is free): the one
    definition, for ``PoolStats.frag_ext`` and the monitors that read ``Policy.gauges``."""
    if free_bytes <= 0:
        return 0.0
    return 1.0 - largest_free_bytes / free_bytes


def gauges_mismatch(policy: "Policy", stats: "PoolStats") -> str | None:
    """What ``policy.gauges()`` says that ``stats`` (its ``stats()``) does not, or None when they
    agree. A monitor charts the gauges and the summary reports ``stats()``: a policy that
    overrides ``stats()`` alone would chart numbers its own summary contradicts. The one check,
    for the battery (``check_invariants``) and for every replay's monitor
    (``sim.replay.metrics``)."""
    gauges = tuple(policy.gauges())
    levels = (
        stats.live_bytes,
        stats.allocated_bytes,
        stats.reserved_bytes,
        stats.largest_free_bytes,
        stats.num_segments,
    )
    if gauges == levels:
        return None
    return (
        f"gauges() (live, allocated, reserved, largest free, segments) = {gauges} but stats() "
        f"says {levels}: a policy that counts these its own way overrides gauges(), "
        "which stats() reads"
    )


@dataclass(slots=True)
class PoolStats:
    """A snapshot of a pool's accounting. Bytes are exact; peaks are since the last reset."""

    live_bytes: int  # as asked, summed over live allocations
    allocated_bytes: int  # after rounding (what live allocations hold; shared pages once)
    reserved_bytes: int  # held from the device in segments
    free_bytes: int  # reserved - allocated
    largest_free_bytes: int  # largest request servable from reserved memory without growing
    num_segments: int
    num_live: int
    num_allocs: int
    num_frees: int
    num_failures: int
    num_grows: int
    num_shrinks: int
    grown_bytes: int  # bytes mapped from the device in total
    shrunk_bytes: int  # bytes unmapped back to the device in total
    peak_live_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    capacity_bytes: int | None
    num_frozen_failures: int = (
        0  # failures of requests that needed a segment while frozen (``Policy.freeze``)
    )

    @property
    def frag_ext(self) -> float:
        """External fragmentation ``1 - largest_free / free`` (0 when nothing is free)."""
        return frag_ext(self.free_bytes, self.largest_free_bytes)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["frag_ext"] = self.frag_ext
        return d


class Policy:
    """Abstract memory-pool policy. See the module docstring for the subclass hooks.

    Args (common to every built-in policy):
        capacity_bytes: most bytes the pool may reserve from the device; None for no limit.
        device: the upstream that hands out segments (a ``VirtualDevice`` by default). Not a
            knob: it is how ``sim`` adds costs and ``realgpu`` real ``cudaMalloc`` calls.
    """

    # The state every pool has, in slots: the counters are read and written on every call, and
    # a slot is one pointer away while a subclass's other attributes (in its ``__dict__``, which
    # subclasses keep) would push an instance past CPython's 30 shared dict keys.
    __slots__ = (
        "capacity_bytes",
        "device",
        "_max_request_bytes",
        "_segments",
        "_token",
        "_frozen",
        "live_bytes",
        "allocated_bytes",
        "reserved_bytes",
        "num_allocs",
        "num_frees",
        "num_failures",
        "num_grows",
        "num_shrinks",
        "grown_bytes",
        "shrunk_bytes",
        "peak_live_bytes",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "num_frozen_failures",
        "_frozen_refusal_at",
    )

    capacity_bytes: int | None
    device: Device
    live_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    num_allocs: int
    num_frees: int
    num_failures: int
    num_grows: int
    num_shrinks: int
    grown_bytes: int
    shrunk_bytes: int
    peak_live_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_frozen_failures: int

    #: registry name; set by subclasses
    name: ClassVar[str] = ""
    #: True when every allocation is one extent
    contiguous: ClassVar[bool] = True
    #: True when free neighbours are always merged, so no two free extents touch
    coalesces: ClassVar[bool] = False

    # ----------------------------------------------------------------- declared capabilities
    # What any pool can be asked. A policy that offers more sets the flag and overrides the
    # method; a wrapper forwards both to its base (``policies.wrapper``). Callers read the flag,
    # never the presence of an attribute.
    #: live allocations may move (compaction): handles' ``extents`` are updated in place and
    #: ``on_move`` is called for each move
    moves_allocations: ClassVar[bool] = False
    #: ... inside ``allocate``/``free`` too, not only in an explicit ``compact()``
    moves_while_allocating: ClassVar[bool] = False
    #: ``reserve(nbytes)`` pre-grows the pool ahead of a burst (elastic)
    can_reserve: ClassVar[bool] = False
    #: ``compact()`` runs a compaction pass
    can_compact: ClassVar[bool] = False
    #: ``seed_segment()`` rebuilds a segment that existed before a trace began (torch-caching)
    can_seed_segments: ClassVar[bool] = False
    #: routes requests to private pools (``begin_allocate_to_pool`` / ``end_allocate_to_pool`` /
    #: ``release_pool``: PyTorch's CUDA-graph and ``MemPool`` pools)
    has_private_pools: ClassVar[bool] = False
    #: the unit a paged pool hands out; None for a pool that places bytes
    page_size_bytes: int | None = None
    #: the policy a wrapper wraps; None for a policy that reserves its own segments
    base_policy: "Policy | None" = None
    #: the pool that keeps cached prefix blocks with their reference counts (``cache_block``,
    #: ``share_block``, ``release_block``, ``evict_block``: vLLM's ``BlockPool``); None if none
    block_cache: "Policy | None" = None
    #: the device a spec-built policy needs (``policies.device_kind.DeviceKind``): segments
    #: (``policies.device``, cudaMalloc) or mapped pages (``policies.mapped_device``, cuMem); the
    #: factory that builds a policy picks the device by it (``registry.device_kind``), and a knob
    #: may change it (``device_kind_for``). A plain ``"segment"``/``"page-mapped"`` reads the same.
    device_kind: ClassVar[DeviceKind] = DeviceKind.SEGMENT
    #: ``num_free_pages()`` counts free pages the pool holds, and each of the next that many
    #: allocations of at most ``page_size_bytes`` is served from one of them at once: no device
    #: call, no eviction, no move, nothing refused. What lets a caller know a page is there
    #: without asking for it (the serving simulator's quiet decode runs take pages by it). A
    #: wrapper does not forward it: its own rules (a tag's limit, a reservation) may refuse what
    #: its base would serve
    counts_free_pages: ClassVar[bool] = False
    #: ``allocate_pages(nbytes, num_calls)`` makes ``allocate_each``'s one-page requests that
    #: free pages cover and hands back the pages themselves (page grants, no ``Allocation``
    #: each), which ``free_each`` takes back as the allocations they stand for (the serving
    #: simulator's KV page grows). A wrapper does not forward it (its own counters would miss
    #: the grants)
    grants_pages: ClassVar[bool] = False
    #: a simulated server can keep its KV cache in it (``sim.serving.simulate``): each allocation is
    #: one range (``contiguous``) or whole pages of ``page_size_bytes``; False for a pool whose
    #: allocations are neither (vmm-stitch's chunks of several ranges). A spec's answer, without
    #: building it: ``registry.can_hold_kv`` (``can_hold_kv_for``); wrappers answer for their base
    can_hold_kv: ClassVar[bool] = True
    #: the knob that sets ``page_size_bytes`` (what an error tells the user to change); None if none
    page_size_knob: ClassVar[str | None] = None
    #: ``on_move(allocation, old_offset, new_offset, nbytes)`` for a pool that moves allocations
    #: (wiring set by the caller, e.g. ``realgpu`` copying the bytes; see ``policies.wrapper``)
    on_move: Any = None

    def __init__(self, *, capacity_bytes: int | None = None, device: Device | None = None):
        abstract = _abstract_methods(type(self))
        if abstract:  # what abc.ABC said, for a class that leaves a hook unimplemented
            raise TypeError(
                f"Can't instantiate abstract class {type(self).__name__} "
                f"with abstract method{'s' if len(abstract) > 1 else ''} "
                f"{', '.join(sorted(abstract))}"
            )
        check_int("capacity_bytes", capacity_bytes, none_ok=True, error=PolicyError)
        self.capacity_bytes = capacity_bytes
        self.device = device if device is not None else VirtualDevice()
        #: larger requests are refused before any work: no device could ever hold them
        self._max_request_bytes: int = self.device.max_bytes
        self._segments: dict[int, Segment] = {}
        self._token: object = object()
        self._frozen = False
        self._init_counters()
        self._reset_state()

    # ----------------------------------------------------------------- parameters
    @classmethod
    def _param_names(cls) -> list[str]:
        names: list[str] = []
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            for p in inspect.signature(init).parameters.values():
                if p.kind is p.KEYWORD_ONLY and p.name not in ("device",) and p.name not in names:
                    names.append(p.name)
        return names

    @classmethod
    def device_kind_for(cls, params: dict[str, Any]) -> DeviceKind:
        """The ``device_kind`` a policy built with the knobs ``params`` needs."""
        return cls.device_kind

    @classmethod
    def can_hold_kv_for(cls, params: dict[str, Any]) -> bool:
        """Whether a policy built with the knobs ``params`` can hold a KV cache
        (``can_hold_kv``)."""
        return cls.can_hold_kv

    @classmethod
    def param_defaults(cls) -> dict[str, Any]:
        """Default of every knob in ``_param_names()`` (the most derived ``__init__`` wins)."""
        names = set(cls._param_names())
        out: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            for p in inspect.signature(init).parameters.values():
                if p.kind is p.KEYWORD_ONLY and p.name in names:
                    out[p.name] = p.default
        return out

    def get_params(self) -> dict[str, Any]:
        """The knobs this policy was built with, by name (scikit-learn style)."""
        return {n: getattr(self, n) for n in self._param_names()}

    @property
    def spec(self) -> str:
        """A spec string that ``policies.create`` turns back into an equal policy.

        Only knobs that differ from their defaults are listed; ``capacity_bytes`` is left out
        since it is passed on its own.
        """
        from policies.spec import format_spec

        defaults = self.param_defaults()
        params = {
            k: v
            for k, v in self.get_params().items()
            if k != "capacity_bytes" and (k not in defaults or defaults[k] != v)
        }
        return format_spec(self.name, params)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec!r} capacity_bytes={self.capacity_bytes}>"

    # ----------------------------------------------------------------- public API
    @cython.locals(
        a=Allocation, size=cython.longlong, live=cython.longlong, allocated=cython.longlong
    )
    def allocate(
        self, nbytes: int, *, stream: int = 0, tag: str | None = None
    ) -> Allocation | None:
        """Serve a request of ``nbytes`` bytes.

        Returns:
            The allocation, or None when the request cannot be met within ``capacity_bytes``
            or by the device. A failure is counted in ``num_failures`` and leaves every live
            allocation, and the live and allocated byte counters, unchanged; it may release
            fully free cached segments first (as PyTorch's allocator does before it reports
            out of memory), but never reserves one. A request larger than the device's
            ``max_bytes`` (``policies.device.MAX_DEVICE_BYTES``) fails before any work.

        Raises:
            PolicyError: ``nbytes`` is not a positive integer (nothing changes).
        """
        if (
            type(nbytes) is not int
        ):  # compiled: one pointer compare (``__class__`` would be a lookup)
            nbytes = _as_size(nbytes)
        if not 0 < nbytes <= self._max_request_bytes:  # one chained test on the hot path
            if nbytes <= 0:
                raise PolicyError(f"allocation size nbytes(={nbytes}) must be > 0")
            self.num_failures += 1  # no device holds it: refuse before any work
            return None
        a = self._allocate(nbytes, stream, tag)
        if a is None:
            if (
                self._frozen_refusal_at == self.num_allocs + self.num_failures
            ):  # a grow was refused in this call
                self.num_frozen_failures += 1
            self.num_failures += 1
            return None
        a.owner = self._token
        self.num_allocs += 1
        # counters kept in locals and compared once: this is the hottest path of every replay
        size = nbytes  # compiled: a C integer from here (served, so within any device's bytes)
        live = self.live_bytes + size
        self.live_bytes = live
        if live > self.peak_live_bytes:
            self.peak_live_bytes = live
        allocated = self.allocated_bytes
        if allocated > self.peak_allocated_bytes:
            self.peak_allocated_bytes = allocated
        return a

    @cython.locals(a=Allocation)
    def free(self, allocation: Allocation) -> None:
        """Give ``allocation`` back to the pool.

        Raises:
            PolicyError: it was already freed, or this pool did not hand it out (nothing
                changes).
        """
        # a C type test: a try block would save and restore the thread's exception state every call
        if cython.compiled:
            live = (
                isinstance(allocation, Allocation)
                and cython.cast(Allocation, allocation).owner is self._token
            )
        # interpreted, a try costs nothing until it catches (3.11+), where isinstance is a call
        else:
            try:
                live = allocation.owner is self._token
            except AttributeError:
                live = False
        if not live:
            raise PolicyError(self._bad_free_reason(allocation))
        a = allocation  # compiled: a C-typed local (base.pxd)
        self._free(a)
        a.owner = None
        # not ``+=``: compiled, that holds a reference to self around the add, and on 3.12 the
        # 32-bit increment then 64-bit load of its count stalls the CPU (benchmarks/RESULTS.md)
        self.num_frees = self.num_frees + 1
        self.live_bytes = self.live_bytes - a.nbytes

    def allocate_each(
        self, nbytes: int, num_calls: int, *, stream: int = 0, tag: str | None = None
    ) -> list[Allocation | None]:
        """``[allocate(nbytes, stream=stream, tag=tag) for _ in range(num_calls)]``, the contract.

        A policy may override it with a faster path (the serving simulator grows a step's KV
        pages through it) whose every effect is the loop's: the same allocations in the same
        order, the same counters, refusals and device calls. ``policies.testing``'s
        ``check_batched_calls`` checks an override against this loop. Callers that time calls
        (``sim.replay.engine.TimedCalls``) time an overridden one as a whole.
        """
        allocate = self.allocate
        return [allocate(nbytes, stream=stream, tag=tag) for _ in range(num_calls)]

    def free_each(self, allocations: Iterable[Allocation]) -> None:
        """``free(a)`` for each of ``allocations`` in order, the contract; an override (a
        finished request's pages) must have exactly the loop's effects, as ``allocate_each``'s."""
        free = self.free
        for a in allocations:
            free(a)

    def _hand_out(self, a: Allocation) -> Allocation:
        """Count ``a`` as handed out, as ``allocate`` does, for allocations a policy makes
        outside it (a fork, a shared prefix). ``allocated_bytes`` must already include it."""
        a.owner = self._token
        self.num_allocs += 1
        live = self.live_bytes + a.nbytes
        self.live_bytes = live
        if live > self.peak_live_bytes:
            self.peak_live_bytes = live
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return a

    @property
    def num_live(self) -> int:
        """Live allocations (allocs minus frees)."""
        return self.num_allocs - self.num_frees

    def _bad_free_reason(self, allocation: Any) -> str:
        if not isinstance(allocation, Allocation):
            return f"free() takes an Allocation, got {type(allocation).__name__}"
        where = (
            f"allocation of {allocation.nbytes} B "
            f"at offset {allocation.extents[0][0] if allocation.extents else '?'}"
        )
        if allocation.owner is None:
            return f"double free: {where} was already freed"
        return (
            f"unknown allocation: {where} was not handed out by this pool "
            "(or predates its last reset)"
        )

    def gauges(self) -> tuple[int, int, int, int, int]:
        """``(live_bytes, allocated_bytes, reserved_bytes, largest_free_bytes, num_segments)`` now:
        the levels in ``stats()``, without the snapshot around them (a monitor reads them
        thousands of times a replay, where building the ``PoolStats`` cost more than the reads).
        ``stats()`` takes them from here, so a policy that counts differently overrides this."""
        return (
            self.live_bytes,
            self.allocated_bytes,
            self.reserved_bytes,
            self.largest_free_bytes(),
            len(self._segments),
        )

    def stats(self) -> PoolStats:
        """Current accounting (O(free ranges) at most, for ``largest_free_bytes``)."""
        live, allocated, reserved, largest_free, num_segments = self.gauges()
        return PoolStats(
            live_bytes=live,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            free_bytes=reserved - allocated,
            largest_free_bytes=largest_free,
            num_segments=num_segments,
            num_live=self.num_live,
            num_allocs=self.num_allocs,
            num_frees=self.num_frees,
            num_failures=self.num_failures,
            num_grows=self.num_grows,
            num_shrinks=self.num_shrinks,
            grown_bytes=self.grown_bytes,
            shrunk_bytes=self.shrunk_bytes,
            peak_live_bytes=self.peak_live_bytes,
            peak_allocated_bytes=self.peak_allocated_bytes,
            peak_reserved_bytes=self.peak_reserved_bytes,
            capacity_bytes=self.capacity_bytes,
            num_frozen_failures=self.num_frozen_failures,
        )

    def reset(self) -> None:
        """Release every segment and start over; allocations handed out before become unknown."""
        for seg in list(self._segments.values()):
            self.device.release(seg.offset, seg.nbytes)
        self._segments.clear()
        self._token = object()
        self._frozen = False
        self._init_counters()
        self._reset_state()

    def trim(self, max_bytes: int | None = None) -> int:
        """Release fully free segments until at least ``max_bytes`` are released (all when None).

        Returns the bytes released (may overshoot ``max_bytes`` by up to one segment).
        """
        return self._release_free_segments(max_bytes)

    def grow(self, nbytes: int) -> bool:
        """Reserve a segment of at least ``nbytes`` now and keep it as free space.

        The pre-growth hook elastic pools use before a prefill. Returns False when capacity or
        the device refuses.
        """
        if nbytes > self._max_request_bytes:
            return False
        # retry=False: freeing cached segments to pre-grow would trade free memory for free memory
        seg = self._reserve_segment(self._segment_size_for(nbytes), stream=0, retry=False)
        if seg is None:
            self._frozen_refusal_at = -1  # a refused grow() is no allocation's failure
            return False
        self._add_segment(seg)
        return True

    def freeze(self) -> None:
        """Refuse every segment grow from now on (growth freeze).

        What CUDA Graph capture needs: captured addresses must not change, so after a warm-up
        the pool serves only from memory it already holds. An allocation that would need a new
        segment fails and is counted in ``num_frozen_failures``; ``grow()`` returns False.
        Releasing segments (``trim``) stays allowed. ``reset()`` unfreezes.
        """
        self._frozen = True

    def unfreeze(self) -> None:
        """Allow segment grows again."""
        self._frozen = False

    @property
    def frozen(self) -> bool:
        return self._frozen

    # ----------------------------------------------------------------- optional abilities
    def reserve(self, nbytes: int) -> bool:
        """Pre-grow so that at least ``nbytes`` are free (only where ``can_reserve``)."""
        raise PolicyError(
            f"policy {self.spec!r} cannot reserve ahead; wrap it, e.g. elastic:base=[{self.spec}]"
        )

    def compact(self, *, force: bool = False) -> Any:
        """Run a compaction pass (only where ``can_compact``); see ``policies.compacting``."""
        raise PolicyError(
            f"policy {self.spec!r} cannot compact; wrap it, e.g. compacting:base=[{self.spec}]"
        )

    def compaction_stats(self) -> dict[str, Any]:
        """Compaction totals since the last reset (empty for a pool that never compacts)."""
        return {}

    def take_compaction_ns(self) -> int:
        """Modelled copy time of the compaction passes since the last call (0 when none)."""
        return 0

    def num_free_pages(self) -> int:
        """Free pages the pool holds, each one allocation away (only where
        ``counts_free_pages``)."""
        raise PolicyError(
            f"policy {self.spec!r} does not count free pages (counts_free_pages is False)"
        )

    def allocate_pages(self, nbytes: int, num_calls: int) -> list[Any] | None:
        """``num_calls`` one-page requests of ``nbytes`` as page grants, or None with nothing
        done (only where ``grants_pages``; ``policies.paged.Paged.allocate_pages``)."""
        raise PolicyError(f"policy {self.spec!r} does not grant pages (grants_pages is False)")

    def seed_segment(
        self, nbytes: int, *, small: bool, stream: int = 0, blocks: Any = ()
    ) -> list[Allocation]:
        """Rebuild a pre-existing segment with its live blocks (only where
        ``can_seed_segments``)."""
        raise PolicyError(f"policy {self.spec!r} cannot seed segments")

    def begin_allocate_to_pool(self, pool_id: Any, stream: int) -> None:
        """Serve requests on ``stream`` from private pool ``pool_id`` (only where
        ``has_private_pools``)."""
        raise PolicyError(f"policy {self.spec!r} has no private pools")

    def end_allocate_to_pool(self, pool_id: Any) -> None:
        """Stop routing requests to ``pool_id`` (only where ``has_private_pools``)."""
        raise PolicyError(f"policy {self.spec!r} has no private pools")

    def release_pool(self, pool_id: Any) -> None:
        """One user of private pool ``pool_id`` is gone (only where ``has_private_pools``)."""
        raise PolicyError(f"policy {self.spec!r} has no private pools")

    def empty_cache(self) -> int:
        """Give every cached free segment back to the device (``torch.cuda.empty_cache()``);
        returns the bytes released. ``trim()`` unless the policy has its own rule."""
        return self.trim()

    def shared_extents(self) -> list[tuple[int, int]]:
        """Extents held by more than one live allocation (a paged pool's shared pages); none
        here."""
        return []

    def segments(self) -> list[Segment]:
        """Reserved segments, in address order."""
        return sorted(self._segments.values(), key=lambda s: s.offset)

    def free_extents(self) -> list[tuple[int, int]]:
        """Free ``(offset, length)`` ranges inside reserved segments, address order.

        Policies that do not track free space by range may leave this unimplemented; the
        default ``largest_free_bytes`` and the coalescing checks rely on it.
        """
        raise NotImplementedError

    def largest_free_bytes(self) -> int:
        """Largest request the pool could serve from memory it already holds."""
        return max((length for _, length in self.free_extents()), default=0)

    # ----------------------------------------------------------------- subclass hooks
    # Abstract: a subclass that leaves one of them as it is here cannot be instantiated (see
    # ``_abstract_methods``; ``abc.ABC`` cannot be the base of the compiled ``cdef class``).
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        raise NotImplementedError

    def _free(self, allocation: Allocation) -> None:
        raise NotImplementedError

    def _release_free_segments(self, max_bytes: int | None) -> int:
        raise NotImplementedError

    def _add_segment(self, segment: Segment) -> None:
        raise NotImplementedError

    def _reset_state(self) -> None:
        raise NotImplementedError

    def _segment_size_for(self, nbytes: int) -> int:
        """Bytes to reserve so that a request of ``nbytes`` fits; policies override."""
        return nbytes

    # ----------------------------------------------------------------- segments
    def _init_counters(self) -> None:
        self.live_bytes = 0
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.num_allocs = 0
        self.num_frees = 0
        self.num_failures = 0
        self.num_grows = 0
        self.num_shrinks = 0
        self.grown_bytes = 0
        self.shrunk_bytes = 0
        self.peak_live_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_frozen_failures = 0
        self._frozen_refusal_at = (
            -1
        )  # attempt number (allocs + failures) of the last refusal by freeze

    def _reserve_segment(
        self, nbytes: int, stream: int = 0, *, retry: bool = True
    ) -> Segment | None:
        """Reserve ``nbytes`` from the device, within capacity.

        When capacity or the device refuses and ``retry`` is set, fully free segments are
        released first and the reservation is tried once more (what PyTorch and CuPy do before
        raising OOM). Emulations with their own retry chain pass ``retry=False``. A frozen pool
        refuses at once, without releasing anything (memory given back could not come back).
        """
        if self._frozen:
            self._frozen_refusal_at = self.num_allocs + self.num_failures
            return None
        if nbytes > self._max_request_bytes:  # rounding took a request past what any device holds
            return None
        for attempt in range(
            0 if retry else 1, 2
        ):  # range: Cython mistypes a conditional of tuple literals
            if self.capacity_bytes is None or self.reserved_bytes + nbytes <= self.capacity_bytes:
                offset = self.device.reserve(nbytes)
                if offset is not None:
                    seg = Segment(offset, nbytes, stream)
                    self._segments[offset] = seg
                    self.reserved_bytes += nbytes
                    self.num_grows += 1
                    self.grown_bytes += nbytes
                    if self.reserved_bytes > self.peak_reserved_bytes:
                        self.peak_reserved_bytes = self.reserved_bytes
                    return seg
            if attempt == 0 and self._release_free_segments(None) == 0:
                return None
        return None

    def _free_segments_to_release(self, max_bytes: int | None) -> list[Segment]:
        """Fully free segments, largest first (highest address on ties), until their bytes reach
        ``max_bytes`` (all of them when None): what a policy's ``_release_free_segments`` gives
        back."""
        candidates = sorted(
            (s for s in self._segments.values() if s.num_live == 0),
            key=lambda s: (-s.nbytes, -s.offset),
        )
        chosen: list[Segment] = []
        released_bytes = 0
        for seg in candidates:
            if max_bytes is not None and released_bytes >= max_bytes:
                break
            chosen.append(seg)
            released_bytes += seg.nbytes
        return chosen

    def _release_segment(self, seg: Segment) -> None:
        assert seg.num_live == 0, "releasing a segment that still holds live allocations"
        del self._segments[seg.offset]
        self.device.release(seg.offset, seg.nbytes)
        self.reserved_bytes -= seg.nbytes
        self.num_shrinks += 1
        self.shrunk_bytes += seg.nbytes


#: the hooks every subclass implements (``Policy`` raises NotImplementedError in each)
_HOOKS = ("_allocate", "_free", "_release_free_segments", "_add_segment", "_reset_state")
#: class -> its abstract methods, computed once per class (``_abstract_methods``); weak, so a
#: class made on the fly (tests, notebooks) is not kept alive by it
_abstract_by_class: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _abstract_methods(cls: type) -> frozenset[str]:
    """The hooks ``cls`` leaves as ``Policy`` has them, and its methods marked
    ``@abc.abstractmethod``.

    ``abc.ABC`` did this for ``Policy`` until the compiled build made it a ``cdef class``, which
    takes no metaclass: the check runs in ``Policy.__init__`` instead, once per class. Identity
    of the class attribute tells an inherited hook in both builds (a function, or Cython's method).
    """
    abstract = _abstract_by_class.get(cls)
    if abstract is None:
        names = {name for name in _HOOKS if getattr(cls, name) is getattr(Policy, name)}
        names.update(
            name
            for name in dir(cls)
            if getattr(getattr(cls, name, None), "__isabstractmethod__", False)
        )
        abstract = _abstract_by_class[cls] = frozenset(names)
    return abstract


def _as_size(nbytes: Any) -> int:
    """Accept integral numbers (numpy ints included); refuse everything else clearly."""
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
        raise PolicyError(f"allocation size nbytes(={nbytes!r}) must be an integer number of bytes")
    return nbytes.__index__()


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """Validate an integer knob at construction, naming it in the error (``traces.knobs``)."""
    check_int(name, value, low=minimum, error=PolicyError)
    return value
