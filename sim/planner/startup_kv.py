"""Which requests of an engine's start-up snapshot are its KV cache: recognised, or named by the
user.

Engines allocate the KV cache once, in one loop: one K and one V tensor per layer (transformers'
``PagedAttentionCache``, SGLang), one tensor per layer or one big tensor (vLLM), right after the
weights (and a profiling run) and before CUDA-graph capture, and never free it. So among the
allocations made in the trace and never freed, the cache is the largest run (by total bytes) of
equal-size allocations on one stream made one right after the other (at most ``BURST_GAP_OPS``
other requests between two of them; weights of one shape recur once a layer with the layer's other
tensors between, so they make runs of one to three). It must hold at least ``CLEAR_WINNER`` times
the bytes of the next such run, else the snapshot does not say which is the cache and the user
names it (``KvSelector``: by size, trace entry or address).

An engine may size other buffers by its KV cache too (transformers' ``paged|sdpa`` attention mask,
``max_batch_tokens x (tokens + max_batch_tokens)``): ``KvLinked`` names those allocations and how
many bytes each grows by per page of KV, so the planner resizes them with the cache. They are named
by the user (``parse_kv_linked``: a selector and the growth, ``entries=655:4MiB``) or recognised
from an engine preset's rule (``recognise_linked``: the allocations whose size is the rule's
formula at the recorded number of KV tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from policies.errors import PolicyError
from policies.units import format_bytes, parse_bytes
from sim.replay.fidelity import ALLOC, FREE, Recording

__all__ = [
    "PlanError",
    "KvSelector",
    "KvCache",
    "KvLinked",
    "LinkedSelector",
    "parse_kv_selector",
    "parse_kv_linked",
    "recognise_kv",
    "select_kv",
    "select_linked",
    "recognise_linked",
    "BURST_GAP_OPS",
    "CLEAR_WINNER",
]

#: Other requests allowed between two KV allocations of one burst (a scale, a small buffer). Small:
#: weights of one shape recur every layer with the layer's other tensors between (Llama: 8).
BURST_GAP_OPS = 2
#: The recognised cache must hold this many times the bytes of the next candidate run.
CLEAR_WINNER = 2


class PlanError(ValueError):
    """The snapshot or the options cannot give a plan (no KV cache found, a bad selector, ...)."""


@dataclass(frozen=True)
class KvSelector:
    """How the user names the KV allocation(s): ``size=32MiB`` (every allocation of that requested
    size made in the trace and never freed), ``entries=120-131,140`` (``device_traces`` indices:
    a range takes the allocations made in it that are never freed, segment entries and freed
    requests between them aside; a single index must be such an allocation) or ``addr=0x7f12...``
    (the allocation made at that address that is never freed)."""

    kind: str  # "size", "entries" or "addr"
    values: tuple  # size: (bytes,); entries: ((first, last), ...); addr: (address, ...)
    text: str


_SELECTOR = re.compile(r"^\s*(size|entries|entry|addr|address)\s*=\s*(.+?)\s*$")


def parse_kv_selector(text: str) -> KvSelector:
    """``"size=32MiB"``, ``"entries=120-131"``, ``"addr=0x7f00"`` as a ``KvSelector``; PlanError
    otherwise."""
    m = _SELECTOR.match(text)
    if m is None:
        raise PlanError(f"--kv {text!r}: expected size=SIZE, entries=I-J,K or addr=0xADDRESS")
    kind, value = m.group(1), m.group(2)
    try:
        if kind == "size":
            return KvSelector("size", (parse_bytes(value),), text)
        if kind in ("entries", "entry"):
            ranges: list[tuple[int, int]] = []
            for part in value.split(","):
                lo, _, hi = part.partition("-")
                first, last = int(lo), int(hi) if hi else int(lo)
                if first < 0 or last < first:
                    raise ValueError(part)
                ranges.append((first, last))
            return KvSelector("entries", tuple(ranges), text)
        return KvSelector("addr", tuple(int(a, 0) for a in value.split(",")), text)
    except (ValueError, PolicyError):
        raise PlanError(f"--kv {text!r}: {value!r} is not a valid {kind} list") from None


@dataclass(frozen=True)
class KvCache:
    """The KV allocations of a recording: ``ops`` (indices into ``Recording.ops``, in order),
    their common requested size, and how they were found (``how``, a sentence)."""

    ops: tuple[int, ...]
    nbytes: int
    how: str

    @property
    def total_bytes(self) -> int:
        return self.nbytes * len(self.ops)


def _never_freed(rec: Recording) -> list[int]:
    """Alloc ops of the trace whose allocation is still live at the end, in order."""
    live: dict[int, int] = {}
    for k, (op, addr) in enumerate(zip(rec.ops, rec.addrs)):
        if op == ALLOC:
            live[addr] = k
        elif op == FREE:
            live.pop(addr, None)
    return sorted(live.values())


def _bursts(rec: Recording, ops: list[int]) -> list[list[int]]:
    """Runs of never-freed alloc ops of one size and stream, at most ``BURST_GAP_OPS`` requests
    apart."""
    open_runs: dict[tuple[int, int], list[int]] = {}
    runs: list[list[int]] = []
    for k in ops:
        key = (rec.sizes[k], rec.streams[k])
        run = open_runs.get(key)
        if run is not None and k - run[-1] - 1 <= BURST_GAP_OPS:
            run.append(k)
        else:
            run = open_runs[key] = [k]
            runs.append(run)
    return runs


def _describe_ops(rec: Recording, ops: Iterable[int]) -> str:
    ops = list(ops)
    first, last = rec.entries[ops[0]], rec.entries[ops[-1]]
    where = f"{rec.entry_unit} {first:,}" + (f"-{last:,}" if last != first else "")
    return f"{len(ops)} x {format_bytes(rec.sizes[ops[0]])} at {where}"


def recognise_kv(rec: Recording) -> KvCache:
    """The KV cache as the largest burst of equal-size, never-freed allocations (module
    docstring)."""
    runs = sorted(_bursts(rec, _never_freed(rec)), key=lambda r: (-len(r) * rec.sizes[r[0]], r[0]))
    if not runs:
        raise PlanError(
            f"{rec.source}: no allocation made in the trace lives to the end, "
            "so none can be the KV cache "
            "(record from before the engine allocates it, or name it with --kv)"
        )
    best = runs[0]
    best_bytes = len(best) * rec.sizes[best[0]]
    if len(runs) > 1:
        second = runs[1]
        if best_bytes < CLEAR_WINNER * len(second) * rec.sizes[second[0]]:
            raise PlanError(
                f"{rec.source}: cannot tell the KV cache apart: "
                f"{_describe_ops(rec, best)} and {_describe_ops(rec, second)} both live to "
                "the end; name it with --kv (size=SIZE, entries=I-J or addr=0xADDRESS)"
            )
    resident = _largest_resident_group(rec)
    if resident is not None and resident[0] * resident[1] >= CLEAR_WINNER * best_bytes:
        count, nbytes = resident
        raise PlanError(
            f"{rec.source}: {count} x {format_bytes(nbytes)} "
            f"({format_bytes(count * nbytes)}) were live before recording began, "
            f"more than the largest candidate allocated in the trace ({_describe_ops(rec, best)}): "
            "if they are the KV cache, record from before the engine allocates it "
            "(or with a larger ring buffer: _record_memory_history(max_entries=...)); "
            "if not, name the cache with --kv"
        )
    return KvCache(
        tuple(best),
        rec.sizes[best[0]],
        f"recognised: {_describe_ops(rec, best)} ({format_bytes(best_bytes)}), "
        f"allocated in one burst on stream {rec.streams[best[0]]} and live to the end",
    )


def _largest_resident_group(rec: Recording) -> tuple[int, int] | None:
    """``(count, requested bytes)`` of the equal-size allocations live before recording began and
    never freed with the most bytes in all (a cache allocated before the ring buffer's first
    entry)."""
    first_op: dict[int, int] = {}
    for op, addr in zip(rec.ops, rec.addrs):
        first_op.setdefault(addr, op)
    sizes: dict[int, int] = {}
    starting = [
        (addr, requested)
        for seg in rec.seed_segments
        for addr, (_, _, requested) in zip(seg.block_addrs, seg.blocks)
    ]
    for addr, requested in starting + [(a, n) for a, n, _ in rec.unplaced]:
        if first_op.get(addr) != FREE:  # freed in the trace: not resident
            sizes[requested] = sizes.get(requested, 0) + 1
    return max(((c, n) for n, c in sizes.items()), key=lambda cn: cn[0] * cn[1], default=None)


def _matching_ops(rec: Recording, sel: KvSelector, *, option: str, live_to_end: bool) -> list[int]:
    """Alloc ops one selector names: among those never freed (``live_to_end``) or all of the
    trace's."""
    candidates = (
        _never_freed(rec) if live_to_end else [k for k, op in enumerate(rec.ops) if op == ALLOC]
    )
    candidate_set = set(candidates)
    kept = "that lives to the end " if live_to_end else ""
    if sel.kind == "size":
        found = [k for k in candidates if rec.sizes[k] == sel.values[0]]
    elif sel.kind == "entries":
        found = []
        for first, last in sel.values:
            if first == last:  # one entry: it must be such an allocation
                k = next(
                    (k for k, op in enumerate(rec.ops) if op == ALLOC and rec.entries[k] == first),
                    None,
                )
                if k is None:
                    raise PlanError(
                        f"{option} {sel.text!r}: {rec.entry_unit} {first} is no alloc of the trace"
                    )
                if k not in candidate_set:
                    raise PlanError(
                        f"{option} {sel.text!r}: "
                        f"the alloc at {rec.entry_unit} {first} is freed during the trace, "
                        "so it is no KV cache (those live to the end)"
                    )
                found.append(k)
            else:
                found.extend(k for k in candidates if first <= rec.entries[k] <= last)
    else:
        at_addr: dict[int, list[int]] = {}
        for k in candidates:
            at_addr.setdefault(rec.addrs[k], []).append(k)
        missing = [a for a in sel.values if a not in at_addr]
        if missing:
            raise PlanError(
                f"{option} {sel.text!r}: no allocation made in the trace at {missing[0]:#x}"
                + (" lives to the end" if live_to_end else "")
            )
        found = [k for a in sel.values for k in at_addr[a]]
    if not found:
        raise PlanError(f"{option} {sel.text!r}: no allocation of the trace {kept}matches")
    return found


def select_kv(rec: Recording, selectors: Iterable[KvSelector]) -> KvCache:
    """The KV allocations the selectors name (their union); PlanError when they name none, a
    request that is freed, or allocations of different sizes."""
    selectors = list(selectors)
    if not selectors:
        return recognise_kv(rec)
    chosen: set[int] = set()
    for sel in selectors:
        chosen.update(_matching_ops(rec, sel, option="--kv", live_to_end=True))
    ops = tuple(sorted(chosen))
    sizes = sorted({rec.sizes[k] for k in ops})
    if len(sizes) > 1:
        raise PlanError(
            "--kv: the named allocations differ in size "
            f"({', '.join(format_bytes(s) for s in sizes)}); "
            "the planner resizes equal-size KV tensors"
        )
    return KvCache(
        ops,
        sizes[0],
        f"named by --kv {', '.join(s.text for s in selectors)}: "
        f"{_describe_ops(rec, ops)} ({format_bytes(sizes[0] * len(ops))})",
    )


# -------------------------------------------------------------------- buffers sized by the KV cache
@dataclass(frozen=True)
class KvLinked:
    """Allocations whose size the engine ties to its KV cache: ``ops`` (indices into
    ``Recording.ops``) each grow by ``bytes_per_page`` for every page of KV beyond the recorded
    size (and shrink below it); ``how`` says how they were found."""

    ops: tuple[int, ...]
    bytes_per_page: int
    how: str


@dataclass(frozen=True)
class LinkedSelector:
    """``--kv-linked SELECTOR:BYTES_PER_PAGE``: which allocations (a ``KvSelector``, any alloc of
    the trace, freed or not) and how many bytes each grows by per page of KV."""

    selector: KvSelector
    bytes_per_page: int
    text: str


def parse_kv_linked(text: str) -> LinkedSelector:
    """``"entries=655:4MiB"``, ``"size=12GiB:4MiB"``, ``"addr=0x7f00:4194304"``; PlanError
    otherwise."""
    where, sep, growth = text.rpartition(":")
    if not sep or not where:
        raise PlanError(
            f"--kv-linked {text!r}: expected SELECTOR:BYTES_PER_PAGE (e.g. entries=655:4MiB, "
            "size=12GiB:4MiB)"
        )
    try:
        per_page = parse_bytes(growth)
    except PolicyError:
        raise PlanError(f"--kv-linked {text!r}: {growth!r} is no size of bytes per page") from None
    if per_page < 1:
        raise PlanError(f"--kv-linked {text!r}: the growth per page must be > 0 B")
    try:
        sel = parse_kv_selector(where)
    except PlanError as exc:
        raise PlanError(str(exc).replace("--kv ", "--kv-linked ", 1)) from None
    return LinkedSelector(KvSelector(sel.kind, sel.values, text), per_page, text)


def select_linked(
    rec: Recording, kv: KvCache, selectors: Iterable[LinkedSelector]
) -> list[KvLinked]:
    """The buffers ``--kv-linked`` names, one ``KvLinked`` per option; PlanError when one names
    nothing or a KV allocation itself."""
    out = []
    for sel in selectors:
        ops = tuple(
            sorted(set(_matching_ops(rec, sel.selector, option="--kv-linked", live_to_end=False)))
        )
        overlap = set(ops) & set(kv.ops)
        if overlap:
            raise PlanError(
                f"--kv-linked {sel.text!r}: names a KV allocation "
                f"({rec.entry_unit} {rec.entries[min(overlap)]:,}), "
                "which grows as the cache already"
            )
        out.append(
            KvLinked(
                ops,
                sel.bytes_per_page,
                f"named by --kv-linked {sel.text}: {_describe_ops(rec, ops)}, "
                f"+{format_bytes(sel.bytes_per_page)} a page",
            )
        )
    return out


def recognise_linked(
    rec: Recording,
    kv: KvCache,
    *,
    name: str,
    recorded_tokens: int,
    bytes_per_token: int,
    fixed_bytes: int,
    block_tokens: int,
) -> KvLinked | None:
    """The allocations of the trace whose requested size is ``bytes_per_token x recorded_tokens +
    fixed_bytes`` (an engine preset's rule, ``sim.serving.engines.KvLinkedRule``), each growing by
    ``bytes_per_token x block_tokens`` a page; None when the trace has none."""
    expected = bytes_per_token * recorded_tokens + fixed_bytes
    kv_ops = set(kv.ops)
    ops = tuple(
        k
        for k, op in enumerate(rec.ops)
        if op == ALLOC and rec.sizes[k] == expected and k not in kv_ops
    )
    if not ops:
        return None
    return KvLinked(
        ops,
        bytes_per_token * block_tokens,
        f"{name}: {_describe_ops(rec, ops)}, "
        f"the size the engine's rule gives at the recorded {recorded_tokens:,} KV tokens, "
        f"+{format_bytes(bytes_per_token * block_tokens)} a page",
    )
