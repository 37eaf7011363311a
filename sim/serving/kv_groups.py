"""A hybrid model's KV cache: one manager per layer group, pages laid out four ways.

A model's ``kv_groups`` (``sim.replay.models.LayerGroup``) say what each kind of layer keeps per
request: full attention the K and V of every token, a sliding window those of the last W
tokens (pages wholly out of the window are freed as the request advances, as vLLM's
``SlidingWindowManager`` does), Mamba layers one fixed state whatever the length (vLLM's
``MambaManager``: one page per request). How those pages share the KV budget is the layout
(``HYBRID_LAYOUTS``, the ``hybrid_kv_layout`` knob):

==============  ==========================================================================
``padded``      vLLM's hybrid allocator: one pool of equal pages. Per layer, a page is the
                largest group's; when Mamba states are larger than an attention page the
                attention block grows to the smallest multiple of ``tokens_per_page`` whose
                page holds a state (vLLM ``unify_hybrid_kv_cache_specs``), and smaller pages
                are padded up to it.
``lcm``         one pool of pages of the least common multiple of every group's natural
                per-layer page: attention blocks grow to fill it (no padding, long tails);
                Mamba states are padded to it.
``two-level``   Jenga (SOSP'25): large pages of the LCM of the groups' natural small pages
                drawn from one pool, each cut into small pages of one group; a group takes a
                large page when its small pages run out and gives it back when all its small
                pages are free. When the LCM exceeds ``budget / MIN_LARGE_PAGES`` the large
                page is the largest small page and what whole small pages leave of it counts
                as waste.
``per-group``   a pool per group, natural pages, the budget split in proportion to what one
                ``max_model_len`` request holds in each group (a static partition).
==============  ==========================================================================

Layouts are fixed when the manager is built (``plan_layout``); the manager charges every page
to its group and keeps, per group, the bytes held, the padding inside them and the bytes
really needed (tokens in the window, one state), so ``group_table`` can say where the memory
went at the moment the cache held the most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from policies.base import Allocation
from policies.units import round_up
from sim.serving.kv import KVHandle, _KVBase
from sim.serving.pools import TimedPool
from sim.serving.choices import HYBRID_LAYOUTS  # noqa: F401 (moved; importable here too)

if TYPE_CHECKING:
    from sim.serving.config import ServerConfig
    from sim.replay.models import ModelSpec

__all__ = [
    "HYBRID_LAYOUTS",
    "GroupPages",
    "KVLayout",
    "plan_layout",
    "HybridKV",
    "GroupHandle",
    "GROUP_TABLE_COLUMNS",
]

#: Two-level pages fall back from the LCM when fewer than this many large pages fit the budget.
MIN_LARGE_PAGES = 64

#: A pool granule (the KV policy's page) is the gcd of the layout's page sizes unless that is
#: smaller than the smallest page / this; then the smallest page, and larger pages round up to it.
MAX_PAGES_PER_GRANULE_PAGE = 64


@dataclass(frozen=True, slots=True)
class GroupPages:
    """How one layer group's KV is cut into pages under a layout.

    Attributes:
        name: ``"full"``, ``"sliding-4096"``, ``"mamba"`` (kind, window), for reports.
        kind: the group's ``LayerGroup.kind``.
        num_layers: layers of the group.
        token_bytes: K and V bytes of one token in all the group's layers (0 for Mamba).
        state_bytes: one request's state in all the group's layers (0 for attention).
        window_tokens: a sliding group's window, else None.
        tokens_per_page: tokens one page covers (attention); 0 for Mamba (one page per request).
        page_bytes: bytes a page takes from the pool (all the group's layers).
        data_bytes_per_page: bytes of KV or state a full page holds; ``page_bytes`` minus it is
            padding.
    """

    name: str
    kind: str
    num_layers: int
    token_bytes: int
    state_bytes: int
    window_tokens: int | None
    tokens_per_page: int
    page_bytes: int
    data_bytes_per_page: int

    @property
    def padding_bytes_per_page(self) -> int:
        return self.page_bytes - self.data_bytes_per_page

    def first_live_page(self, num_valid_tokens: int) -> int:
        """Index of the first page a sliding group still needs once ``num_valid_tokens`` are
        computed (every page before it lies wholly out of the window); 0 for other groups."""
        if self.window_tokens is None:
            return 0
        return max(0, num_valid_tokens - self.window_tokens) // self.tokens_per_page

    def end_page(self, num_tokens: int) -> int:
        """One past the last page holding ``num_tokens`` tokens (Mamba: 1 for any length)."""
        if self.kind == "mamba":
            return 1 if num_tokens > 0 else 0
        return -(-num_tokens // self.tokens_per_page)

    def data_bytes(self, num_tokens: int) -> int:
        """Bytes a request of ``num_tokens`` tokens really needs here: every token, the window, one
        state."""
        if self.kind == "mamba":
            return self.state_bytes if num_tokens > 0 else 0
        if self.window_tokens is not None:
            num_tokens = min(num_tokens, self.window_tokens)
        return num_tokens * self.token_bytes


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The pages of every group under one layout, and how they share the budget.

    Attributes:
        layout: one of ``HYBRID_LAYOUTS``.
        groups: one ``GroupPages`` per layer group, in the model's order.
        granule_bytes: the KV policy's page: every pool allocation is a whole number of them.
        group_budget_bytes: per-group pool sizes (``per-group``), else None (one shared pool).
        large_page_bytes: the large page (``two-level``), else 0.
    """

    layout: str
    groups: tuple[GroupPages, ...]
    granule_bytes: int
    group_budget_bytes: tuple[int, ...] | None = None
    large_page_bytes: int = 0

    def small_pages_per_large(self, g: int) -> int:
        return self.large_page_bytes // self.groups[g].page_bytes


def _natural_layer_page(grp: Any, dtype_bytes: int, tokens_per_page: int) -> int:
    """One layer's page of ``tokens_per_page`` tokens, or one layer's state."""
    if grp.is_attention:
        return tokens_per_page * grp.token_bytes(dtype_bytes) // grp.num_layers
    return grp.state_bytes(dtype_bytes) // grp.num_layers


def plan_layout(
    model: ModelSpec, layout: str, *, tokens_per_page: int, budget_bytes: int, max_model_len: int
) -> KVLayout:
    """Cut ``model``'s layer groups (one GPU's shard) into pages under ``layout``.

    Raises ValueError for an unknown layout, or when a page is larger than the budget.
    """
    if layout not in HYBRID_LAYOUTS:
        raise ValueError(
            f"hybrid_kv_layout(={layout!r}) must be one of {', '.join(HYBRID_LAYOUTS)}"
        )
    dtype = model.dtype_bytes
    raw = model.kv_groups
    natural = [_natural_layer_page(g, dtype, tokens_per_page) for g in raw]
    states = [p for g, p in zip(raw, natural) if not g.is_attention]
    # tokens per attention page: vLLM grows the block until its page holds a Mamba state
    grown = {
        i: tokens_per_page * -(-max(states) // natural[i])
        if states and layout == "padded"
        else tokens_per_page
        for i, g in enumerate(raw)
        if g.is_attention
    }
    padded_page = max([grown[i] * natural[i] // tokens_per_page for i in grown] + states)
    groups = []
    for i, (g, nat) in enumerate(zip(raw, natural)):
        tb, sb = g.token_bytes(dtype), g.state_bytes(dtype)
        tpp = 0
        if layout == "padded":
            layer_page = padded_page
            tpp = grown.get(i, 0)
        elif layout == "lcm":
            layer_page = math.lcm(*natural)
            if g.is_attention:
                tpp = layer_page // (tb // g.num_layers)
        else:  # two-level and per-group: natural pages
            layer_page = nat
            tpp = tokens_per_page if g.is_attention else 0
        data = tpp * tb if g.is_attention else sb
        name = g.kind + (f"-{g.sliding_window}" if g.kind == "sliding" else "")
        groups.append(
            GroupPages(
                name,
                g.kind,
                g.num_layers,
                tb,
                sb,
                g.sliding_window if g.kind == "sliding" else None,
                tpp,
                layer_page * g.num_layers,
                data,
            )
        )
    large = 0
    if layout == "two-level":
        large = math.lcm(*(p.page_bytes for p in groups))
        if large > budget_bytes // MIN_LARGE_PAGES:
            large = max(p.page_bytes for p in groups)
        granule = large
    else:
        granule = _granule([p.page_bytes for p in groups])
        # a page the pool cannot cut exactly pays the rounding as padding
        groups = [_with_page(p, round_up(p.page_bytes, granule)) for p in groups]
    budgets = None
    if layout == "per-group":
        weights = [p.end_page(max_model_len) * p.page_bytes for p in groups]
        shares = [budget_bytes * w // sum(weights) // granule * granule for w in weights[:-1]]
        budgets = (
            *shares,
            budget_bytes - sum(shares),
        )  # the rounding goes to the last pool: they add up
    kv_layout = KVLayout(layout, tuple(groups), granule, budgets, large)
    biggest = max(large, *(p.page_bytes for p in groups))
    if biggest > budget_bytes:
        raise ValueError(
            f"{model.name}: a {layout} KV page of {biggest:,} B is larger than the KV budget "
            f"({budget_bytes:,} B)"
        )
    return kv_layout


def _granule(page_sizes: list[int]) -> int:
    g = math.gcd(*page_sizes)
    smallest = min(page_sizes)
    return g if g * MAX_PAGES_PER_GRANULE_PAGE >= smallest else smallest


def _with_page(p: GroupPages, page_bytes: int) -> GroupPages:
    return GroupPages(
        p.name,
        p.kind,
        p.num_layers,
        p.token_bytes,
        p.state_bytes,
        p.window_tokens,
        p.tokens_per_page,
        page_bytes,
        p.data_bytes_per_page,
    )


@dataclass(slots=True, eq=False)
class _LargePage:
    """A two-level large page lent to one group: its pool allocation and free small slots."""

    allocation: Allocation
    num_free: int
    released: bool = False


@dataclass(slots=True, eq=False)
class GroupHandle(KVHandle):
    """A request's KV in a hybrid cache: per group, the pages it holds by index.

    ``pages[g]`` maps a page index (token position // tokens_per_page; 0 for a Mamba state) to
    what backs it: a pool allocation, or a large page for ``two-level``. Dicts because sliding
    groups drop pages from the front as the window moves.
    """

    pages: list[dict[int, Any]] = field(default_factory=list)
    end_pages: list[int] = field(
        default_factory=list
    )  # one past the last page allocated, per group
    data_tokens: int = 0  # tokens the last grow reserved (for the groups' data bytes)


@dataclass(slots=True)
class _GroupState:
    """One group's counters: pages held, data they hold, and the same at the cache's peak."""

    num_pages: int = 0
    data_bytes: int = 0
    large_pages: int = 0  # two-level only
    num_free_slots: int = 0  # two-level: free small pages in the group's large pages
    free_slots: list[_LargePage] = field(
        default_factory=list
    )  # two-level: LIFO, stale entries skipped


class HybridKV(_KVBase):
    """The KV cache of a hybrid model: one page manager per layer group over a ``KVLayout``.

    Args:
        pool: the KV pool (a paged policy whose page is ``layout.granule_bytes``).
        config: the server's settings (read: nothing beyond what ``_KVBase`` keeps; prefix
            caching is not modelled for hybrid models).
        layout: the page plan (``plan_layout``).
        bytes_per_token: attention KV of one token as if every window were unbounded (the
            model's ``kv_bytes_per_token``: what a swap moves and the token-utilisation figures
            use).
        budget_bytes: most bytes the KV cache may hold (all groups).

    A request's pages are allocated all or nothing across groups: ``grow`` either gives every
    group what it needs or changes nothing (beyond freeing sliding pages that fell out of the
    window, which nobody needs again).
    """

    paged = True
    prefix_caching = False
    block_cache = None

    def __init__(
        self,
        pool: TimedPool,
        config: ServerConfig,
        *,
        layout: KVLayout,
        bytes_per_token: int,
        budget_bytes: int,
    ):
        super().__init__(pool, bytes_per_token=bytes_per_token, budget_bytes=budget_bytes)
        self.layout = layout
        self.page_bytes = layout.granule_bytes
        self.groups = layout.groups
        self._state = [_GroupState() for _ in layout.groups]
        attention = [p.tokens_per_page for p in layout.groups if p.kind != "mamba"]
        self.tokens_per_page = min(attention)
        self.peak_held_bytes = 0
        self._peak: list[tuple[int, int, int]] = [(0, 0, 0)] * len(
            layout.groups
        )  # held, padding, data

    # ------------------------------------------------------------------ sizes
    def _held_bytes(self, g: int) -> int:
        s, p = self._state[g], self.groups[g]
        if self.layout.large_page_bytes:
            return s.large_pages * self.layout.large_page_bytes
        return s.num_pages * p.page_bytes

    def group_used_bytes(self, g: int) -> int:
        """Pool bytes group ``g`` holds now (two-level: its large pages)."""
        return self._held_bytes(g)

    def _group_free_bytes(self, g: int) -> int:
        budgets = self.layout.group_budget_bytes
        if budgets is None:
            return self.budget_bytes - self.allocated_bytes
        return budgets[g] - self._held_bytes(g)

    def _pages_needed(
        self, h: GroupHandle | None, num_tokens: int, num_valid_tokens: int
    ) -> list[tuple[int, int]]:
        """Per group, the page index range ``[first, end)`` to add for ``num_tokens`` tokens."""
        out = []
        for g, p in enumerate(self.groups):
            held_end = h.end_pages[g] if h is not None and h.end_pages else 0
            end = p.end_page(num_tokens)
            first = max(held_end, p.first_live_page(num_valid_tokens))
            out.append((first, max(first, end)))
        return out

    def _new_bytes(self, g: int, num_pages: int) -> int:
        """Pool bytes ``num_pages`` new pages of group ``g`` take (two-level: free slots first)."""
        if not self.layout.large_page_bytes:
            return num_pages * self.groups[g].page_bytes
        short = max(0, num_pages - self._state[g].num_free_slots)
        per = self.layout.small_pages_per_large(g)
        return -(-short // per) * self.layout.large_page_bytes

    def peak_bytes(self, prompt_tokens: int, output_tokens: int) -> int:
        """Pool bytes at the request's largest (the whole prompt in one step, then the window);
        a peak that overflows one group's own pool is reported as over the whole budget."""
        total = prompt_tokens + output_tokens - 1
        out = 0
        for g, p in enumerate(self.groups):
            n = (
                p.end_page(total) - p.first_live_page(total - 1) + 1
                if p.window_tokens
                else p.end_page(total)
            )
            n = min(p.end_page(total), max(n, p.end_page(prompt_tokens)))
            nbytes = n * p.page_bytes
            if self.layout.large_page_bytes:
                nbytes = (
                    -(-n // self.layout.small_pages_per_large(g)) * self.layout.large_page_bytes
                )
            budgets = self.layout.group_budget_bytes
            if budgets is not None and nbytes > budgets[g]:
                return self.budget_bytes + 1
            out += nbytes
        return out

    def estimate_bytes(self, h: GroupHandle, num_tokens: int) -> int:
        if num_tokens <= h.capacity_tokens:
            return 0
        return sum(
            self._new_bytes(g, end - first)
            for g, (first, end) in enumerate(self._pages_needed(h, num_tokens, 0))
        )

    def free_bytes(self) -> int:
        return (
            sum(self._group_free_bytes(g) for g in range(len(self.groups)))
            if self.layout.group_budget_bytes is not None
            else self.budget_bytes - self.allocated_bytes
        )

    # ------------------------------------------------------------------ requests
    def new_handle(
        self, prompt_tokens: int, output_tokens: int, hash_ids: tuple[int, ...] = ()
    ) -> GroupHandle:
        n = len(self.groups)
        return GroupHandle(
            prompt_tokens, output_tokens, pages=[{} for _ in range(n)], end_pages=[0] * n
        )

    def admit(self, h: GroupHandle, num_tokens: int) -> bool:
        return self.grow(h, num_tokens, 0)

    def grow(self, h: GroupHandle, num_tokens: int, num_valid_tokens: int = 0) -> bool:
        """Hold ``num_tokens`` tokens: drop sliding pages out of the window of the
        ``num_valid_tokens`` computed ones, then add every group's new pages, all or nothing."""
        if num_tokens <= h.capacity_tokens:
            return True
        self._drop_out_of_window(h, num_valid_tokens)
        added: list[tuple[int, int, Any]] = []
        for g, (first, end) in enumerate(self._pages_needed(h, num_tokens, num_valid_tokens)):
            for i in range(first, end):
                backing = self._take_page(g)
                if backing is None:
                    for g2, i2, b2 in reversed(added):
                        del h.pages[g2][i2]
                        self._give_page(g2, b2)
                    return False
                h.pages[g][i] = backing
                added.append((g, i, backing))
            h.end_pages[g] = max(h.end_pages[g], end)
        self._set_data(h, num_tokens)
        h.capacity_tokens = min(
            (
                h.end_pages[g] * p.tokens_per_page
                for g, p in enumerate(self.groups)
                if p.kind != "mamba"
            )
        )
        h.num_own_pages = sum(len(d) for d in h.pages)
        self._note_peak()
        return True

    def free(self, h: GroupHandle) -> None:
        for g, pages in enumerate(h.pages):
            for backing in pages.values():
                self._give_page(g, backing)
            pages.clear()
            h.end_pages[g] = 0
        self._set_data(h, 0)
        h.capacity_tokens = 0
        h.num_own_pages = 0

    def _drop_out_of_window(self, h: GroupHandle, num_valid_tokens: int) -> None:
        for g, p in enumerate(self.groups):
            if p.window_tokens is None:
                continue
            first = p.first_live_page(num_valid_tokens)
            pages = h.pages[g]
            for i in [i for i in pages if i < first]:
                self._give_page(g, pages.pop(i))

    def _set_data(self, h: GroupHandle, num_tokens: int) -> None:
        for g, p in enumerate(self.groups):
            self._state[g].data_bytes += p.data_bytes(num_tokens) - p.data_bytes(h.data_tokens)
        h.data_tokens = num_tokens

    # ------------------------------------------------------------------ pages
    def _take_page(self, g: int) -> Any:
        """One page of group ``g`` from its pool: an allocation, or a two-level small slot."""
        s, lay = self._state[g], self.layout
        if not lay.large_page_bytes:
            budgets = lay.group_budget_bytes
            page = self.groups[g].page_bytes
            if budgets is not None and self._held_bytes(g) + page > budgets[g]:
                return None
            a = self._allocate(page)
            if a is not None:
                s.num_pages += 1
            return a
        slots = s.free_slots
        while slots and slots[-1].released:
            slots.pop()
        if not slots:
            a = self._allocate(lay.large_page_bytes)
            if a is None:
                return None
            per = lay.small_pages_per_large(g)
            lp = _LargePage(a, per)
            s.large_pages += 1
            s.num_free_slots += per
            slots.extend([lp] * per)
        lp = slots.pop()
        lp.num_free -= 1
        s.num_free_slots -= 1
        s.num_pages += 1
        return lp

    def _give_page(self, g: int, backing: Any) -> None:
        s, lay = self._state[g], self.layout
        s.num_pages -= 1
        if not lay.large_page_bytes:
            self._release(backing)
            return
        backing.num_free += 1
        per = lay.small_pages_per_large(g)
        if backing.num_free == per:  # the whole large page is free: give it back
            backing.released = True  # its slots still in free_slots are skipped
            s.large_pages -= 1
            s.num_free_slots -= per - 1
            self._release(backing.allocation)
        else:
            s.free_slots.append(backing)
            s.num_free_slots += 1

    # ------------------------------------------------------------------ report
    def _note_peak(self) -> None:
        held = self.allocated_bytes
        if held > self.peak_held_bytes:
            self.peak_held_bytes = held
            self._peak = [
                (
                    self._held_bytes(g),
                    self._state[g].num_pages * p.padding_bytes_per_page,
                    self._state[g].data_bytes,
                )
                for g, p in enumerate(self.groups)
            ]

    def group_rows(self) -> list[dict[str, Any]]:
        """One row per group (``GROUP_TABLE_COLUMNS``): its pages, its pool, and at the moment the
        cache held the most, the bytes it held, the padding in them, the bytes really needed and
        the rest (partly filled pages, free two-level slots): ``held = padding + data + other``."""
        rows = []
        budgets = self.layout.group_budget_bytes
        for g, p in enumerate(self.groups):
            held, padding, data = self._peak[g]
            rows.append(
                {
                    "group": p.name,
                    "kind": p.kind,
                    "num_layers": p.num_layers,
                    "kv_layout": self.layout.layout,
                    "tokens_per_page": p.tokens_per_page,
                    "page_bytes": p.page_bytes,
                    "padding_bytes_per_page": p.padding_bytes_per_page,
                    "large_page_bytes": self.layout.large_page_bytes,
                    "capacity_bytes": budgets[g] if budgets is not None else self.budget_bytes,
                    "peak_held_bytes": held,
                    "peak_padding_bytes": padding,
                    "peak_data_bytes": data,
                    "peak_other_waste_bytes": held - padding - data,
                    "peak_waste_bytes": held - data,
                }
            )
        return rows


#: Columns of ``HybridKV.group_rows`` (``capacity_bytes``: the group's own pool, or the shared
#: budget).
GROUP_TABLE_COLUMNS = [
    "group",
    "kind",
    "num_layers",
    "kv_layout",
    "tokens_per_page",
    "page_bytes",
    "padding_bytes_per_page",
    "large_page_bytes",
    "capacity_bytes",
    "peak_held_bytes",
    "peak_padding_bytes",
    "peak_data_bytes",
    "peak_other_waste_bytes",
    "peak_waste_bytes",
]
