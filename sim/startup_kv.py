"""Which requests of an engine's start-up snapshot are its KV cache: recognised, or named by the user.

Engines allocate the KV cache once, in one loop: one K and one V tensor per layer (transformers'
``PagedAttentionCache``, SGLang), one tensor per layer or one big tensor (vLLM), right after the
weights (and a profiling run) and before CUDA-graph capture, and never free it. So among the
allocations made in the trace and never freed, the cache is the largest run (by total bytes) of
equal-size allocations on one stream made one right after the other (at most ``BURST_GAP_OPS``
other requests between two of them; weights of one shape recur once a layer with the layer's other
tensors between, so they make runs of one to three). It must hold at least ``CLEAR_WINNER`` times
the bytes of the next such run, else the snapshot does not say which is the cache and the user
names it (``KvSelector``: by size, trace entry or address).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from policies.errors import PolicyError
from policies.units import format_bytes, parse_bytes
from sim.fidelity import ALLOC, FREE, Recording

__all__ = ["PlanError", "KvSelector", "KvCache", "parse_kv_selector", "recognise_kv", "select_kv", "BURST_GAP_OPS",
           "CLEAR_WINNER"]

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
    """``"size=32MiB"``, ``"entries=120-131"``, ``"addr=0x7f00"`` as a ``KvSelector``; PlanError otherwise."""
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
    """Runs of never-freed alloc ops of one size and stream, at most ``BURST_GAP_OPS`` requests apart."""
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
    """The KV cache as the largest burst of equal-size, never-freed allocations (module docstring)."""
    runs = sorted(_bursts(rec, _never_freed(rec)), key=lambda r: (-len(r) * rec.sizes[r[0]], r[0]))
    if not runs:
        raise PlanError(f"{rec.source}: no allocation made in the trace lives to the end, so none can be the KV "
                        "cache (record from before the engine allocates it, or name it with --kv)")
    best = runs[0]
    best_bytes = len(best) * rec.sizes[best[0]]
    if len(runs) > 1:
        second = runs[1]
        if best_bytes < CLEAR_WINNER * len(second) * rec.sizes[second[0]]:
            raise PlanError(f"{rec.source}: cannot tell the KV cache apart: {_describe_ops(rec, best)} and "
                            f"{_describe_ops(rec, second)} both live to the end; name it with --kv "
                            "(size=SIZE, entries=I-J or addr=0xADDRESS)")
    resident = _largest_resident_group(rec)
    if resident is not None and resident[0] * resident[1] >= CLEAR_WINNER * best_bytes:
        count, nbytes = resident
        raise PlanError(f"{rec.source}: {count} x {format_bytes(nbytes)} ({format_bytes(count * nbytes)}) were live "
                        f"before recording began, more than the largest candidate allocated in the trace "
                        f"({_describe_ops(rec, best)}): if they are the KV cache, record from before the engine "
                        "allocates it (or with a larger ring buffer: _record_memory_history(max_entries=...)); "
                        "if not, name the cache with --kv")
    return KvCache(tuple(best), rec.sizes[best[0]],
                   f"recognised: {_describe_ops(rec, best)} ({format_bytes(best_bytes)}), allocated in one burst "
                   f"on stream {rec.streams[best[0]]} and live to the end")


def _largest_resident_group(rec: Recording) -> tuple[int, int] | None:
    """``(count, requested bytes)`` of the equal-size allocations live before recording began and
    never freed with the most bytes in all (a cache allocated before the ring buffer's first entry)."""
    first_op: dict[int, int] = {}
    for op, addr in zip(rec.ops, rec.addrs):
        first_op.setdefault(addr, op)
    sizes: dict[int, int] = {}
    starting = [(addr, requested) for seg in rec.seed_segments
                for addr, (_, _, requested) in zip(seg.block_addrs, seg.blocks)]
    for addr, requested in starting + [(a, n) for a, n, _ in rec.unplaced]:
        if first_op.get(addr) != FREE:  # freed in the trace: not resident
            sizes[requested] = sizes.get(requested, 0) + 1
    return max(((c, n) for n, c in sizes.items()), key=lambda cn: cn[0] * cn[1], default=None)


def select_kv(rec: Recording, selectors: Iterable[KvSelector]) -> KvCache:
    """The KV allocations the selectors name (their union); PlanError when they name none, a
    request that is freed, or allocations of different sizes."""
    selectors = list(selectors)
    if not selectors:
        return recognise_kv(rec)
    never = _never_freed(rec)
    never_set = set(never)
    chosen: set[int] = set()
    for sel in selectors:
        if sel.kind == "size":
            found = [k for k in never if rec.sizes[k] == sel.values[0]]
        elif sel.kind == "entries":
            found = []
            for first, last in sel.values:
                if first == last:  # one entry: it must be an allocation that lives to the end
                    k = next((k for k, op in enumerate(rec.ops) if op == ALLOC and rec.entries[k] == first), None)
                    if k is None:
                        raise PlanError(f"--kv {sel.text!r}: {rec.entry_unit} {first} is no alloc of the trace")
                    if k not in never_set:
                        raise PlanError(f"--kv {sel.text!r}: the alloc at {rec.entry_unit} {first} is freed during "
                                        "the trace, so it is no KV cache (those live to the end)")
                    found.append(k)
                else:
                    found.extend(k for k in never if first <= rec.entries[k] <= last)
        else:
            at_addr = {rec.addrs[k]: k for k in never}
            found = [at_addr[a] for a in sel.values if a in at_addr]
            if len(found) < len(sel.values):
                raise PlanError(f"--kv {sel.text!r}: no allocation made in the trace at "
                                f"{next(a for a in sel.values if a not in at_addr):#x} lives to the end")
        if not found:
            raise PlanError(f"--kv {sel.text!r}: no allocation of the trace that lives to the end matches")
        chosen.update(found)
    ops = tuple(sorted(chosen))
    sizes = sorted({rec.sizes[k] for k in ops})
    if len(sizes) > 1:
        raise PlanError(f"--kv: the named allocations differ in size ({', '.join(format_bytes(s) for s in sizes)}); "
                        "the planner resizes equal-size KV tensors")
    return KvCache(ops, sizes[0], f"named by --kv {', '.join(s.text for s in selectors)}: "
                                  f"{_describe_ops(rec, ops)} ({format_bytes(sizes[0] * len(ops))})")
