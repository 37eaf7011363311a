"""``compacting``: defragmentation by moving live allocations, over any block policy.

Callers hold handles (``Allocation`` objects), never raw offsets, so the pool may move a live
allocation: it updates ``allocation.extents`` in place and reports the move to ``on_move``
(``realgpu.compaction`` copies the bytes on the device and checks them). A compaction pass:

1. **evacuates** sparse segments: sparsest first, a segment whose live blocks all fit in the
   free space the other segments of its stream will have is emptied into them (best fit,
   largest block first);
2. **slides** the live blocks of every other segment down to its start, in address order, so
   its free space becomes one range at its end, where the evacuated blocks land;
3. **releases** the segments it emptied (kept as free space while the pool is frozen).

A block stays in its stream's segments (blocks serve only their own stream). Moves are reported
slides first, each segment in address order, so copying each move when it is reported is safe
with memmove semantics (a slide's ranges may overlap; nothing is read after being overwritten).

When it runs:

- on a **failure**: a request the base cannot place is retried after a compaction when it would
  then fit. The cheapest way first: sliding the one segment that frees a large enough range for
  the fewest moved bytes; failing that, a full pass over the request's stream, when it leaves a
  large enough range or releases segments that make room under capacity. A failure turned into
  a success counts in ``num_rescues``;
- on a **threshold**: every ``check_every`` frees, when external fragmentation
  (``1 - largest_free / free``) exceeds ``threshold`` and at least ``min_free_bytes`` are free;
- on **demand**: ``compact()`` (the simulator calls it between steps or when idle).

``idle_only=True`` turns the first two off: nothing moves on the allocation path.

Cost: each move is modelled as a device copy: ``copy_ns(nbytes)`` when set (wiring, not a knob:
by default the device's own ``copy_ns``: ``sim.replay.costs.CostedDevice`` models it, other devices
say 0). Each pass is recorded as a ``Compaction`` row (bytes moved, modelled time, fragmentation and
largest free range before and after, bytes released).

The base must be a block policy (``policies._blocks.ContiguousPolicy``: first-fit, best-fit,
worst-fit or a third-party one): compaction rewrites its block chains directly. To combine it
with other wrappers, wrap it: ``elastic:base=[compacting:base=[best-fit]]``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from policies._blocks import Block, ContiguousPolicy
from policies.base import Allocation, Policy, Segment, check_positive_int
from policies.device import Device
from policies.errors import PolicyError
from traces.knobs import check_flag
from policies.wrapper import WrapperPolicy

__all__ = ["Compacting", "Compaction"]

TRIGGERS = ("failure", "threshold", "explicit")


@dataclass(slots=True)
class Compaction:
    """One compaction pass (one row of ``Compacting.compactions``)."""

    trigger: str  # "failure", "threshold" or "explicit"
    frag_before: float  # external fragmentation, 1 - largest_free / free
    frag_after: float
    largest_free_before_bytes: int
    largest_free_after_bytes: int
    free_before_bytes: int
    num_moves: int
    moved_bytes: int
    num_released_segments: int
    released_bytes: int
    time_ns: int  # modelled copy time of the moves

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Plan:
    """What a pass will do: ``moves`` in a safe copy order; the new chain of each changed
    segment."""

    moves: list[tuple[Block, Segment, int]] = field(
        default_factory=list
    )  # (block, to segment, new offset)
    layouts: dict[Segment, list[Block]] = field(
        default_factory=dict
    )  # live blocks, new address order
    evacuated: list[Segment] = field(default_factory=list)
    tail_bytes: dict[Segment, int] = field(
        default_factory=dict
    )  # free bytes at each live segment's end


def _check_fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise PolicyError(f"{name}(={value!r}) must be a number between 0 and 1")


class Compacting(WrapperPolicy):
    """Moves live allocations of a block policy to merge free space and release segments.

    Args:
        base: spec string of the wrapped block policy (``"best-fit"``, ``"first-fit:..."``).
        threshold: external fragmentation above which ``compact()`` and the periodic check run
            a pass.
        idle_only: never compact on the allocation path (no failure or threshold trigger);
            only ``compact()`` calls move anything.
        check_every: frees between two threshold checks on the allocation path (0: never
            check; failures still trigger).
        min_free_bytes: the threshold trigger (and ``compact()`` unless forced) ignores pools
            with less free than this: a few small holes make any pool look fragmented, and
            moving data for them buys nothing. 16 MiB: half the default 32 MiB segment.
        capacity_bytes, device: see ``Policy``.

    Attributes:
        on_move: ``on_move(allocation, old_offset, new_offset, nbytes)`` for every move.
        copy_ns: ``copy_ns(nbytes) -> ns``, the modelled time of one move (None: not modelled).
        compactions: one ``Compaction`` per pass, in order.
    """

    name = "compacting"
    moves_allocations = True
    can_compact = True

    def __init__(
        self,
        *,
        base: str = "best-fit",
        threshold: float = 0.5,
        idle_only: bool = False,
        check_every: int = 64,
        min_free_bytes: int = 16 << 20,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        _check_fraction("threshold", threshold)
        check_flag("idle_only", idle_only, error=PolicyError)
        check_positive_int("check_every", check_every, minimum=0)
        check_positive_int("min_free_bytes", min_free_bytes, minimum=0)
        self.threshold = threshold
        self.idle_only = idle_only
        self.check_every = check_every
        self.min_free_bytes = min_free_bytes
        super().__init__(base=base, capacity_bytes=capacity_bytes, device=device)
        self.copy_ns: Callable[[int], int] | None = self.device.copy_ns

    @property
    def moves_while_allocating(self) -> bool:
        return not self.idle_only

    def _check_base(self, base_policy: Policy) -> None:
        if not isinstance(base_policy, ContiguousPolicy):
            raise PolicyError(
                "compacting base must be a block policy (first-fit, best-fit, worst-fit, ...), "
                f"not {base_policy.name!r}: compaction rewrites the base's blocks. "
                "Wrap compacting instead, e.g. elastic:base=[compacting:base=[best-fit]]"
            )

    # ----------------------------------------------------------------- public
    def compact(self, *, force: bool = False) -> Compaction | None:
        """Run a pass now when the pool is fragmented (or always, with ``force``).

        Returns:
            The pass's record, or None when nothing was done (not fragmented enough, or
            nothing could move).
        """
        if not force and not self._fragmented():
            return None
        return self._run(self._plan(None), "explicit")

    def take_compaction_ns(self) -> int:
        """Modelled copy time of the passes since the last call (the simulator charges it to a
        step)."""
        ns, self.pending_ns = self.pending_ns, 0
        return ns

    def compaction_stats(self) -> dict[str, Any]:
        """Totals since the last reset."""
        # kept as the passes run (``_count_pass``): a replay reads these at every monitor sample,
        # and summing the rows each time cost O(passes) a read (a quarter of a long replay)
        return {
            "num_compactions": len(self.compactions),
            **self._pass_totals,
            "num_rescues": self.num_rescues,
            **self._trigger_counts,
        }

    def _count_pass(self, rec: Compaction) -> None:
        totals = self._pass_totals
        for name in totals:
            totals[name] += getattr(rec, name)
        self._trigger_counts[f"num_{rec.trigger}_compactions"] += 1

    # ----------------------------------------------------------------- Policy hooks
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        b = self.base_policy
        inner = b.allocate(nbytes, stream=stream, tag=tag)
        if inner is None:
            if self.idle_only or (inner := self._rescue(nbytes, stream, tag)) is None:
                self._note_failure()
                return None
        a = Allocation(nbytes, inner.size_bytes, inner.extents, stream, tag, inner)
        self._by_block[inner.handle] = a
        self._mirror()
        return a

    def _free(self, allocation: Allocation) -> None:
        inner = allocation.handle
        del self._by_block[inner.handle]
        self.base_policy.free(inner)
        if self.check_every and not self.idle_only:
            self._frees_to_check -= 1
            if self._frees_to_check <= 0:
                self._frees_to_check = self.check_every
                if self._fragmented():
                    self._run(self._plan(None), "threshold")
        self._mirror()

    def _reset_state(self) -> None:
        # block -> this layer's allocation: a move finds the handle to update from the block
        self._by_block: dict[Block, Allocation] = {}
        self._frees_to_check = self.check_every
        self.compactions: list[Compaction] = []
        self._pass_totals = dict.fromkeys(
            ("num_moves", "moved_bytes", "released_bytes", "num_released_segments", "time_ns"), 0
        )
        self._trigger_counts = {f"num_{t}_compactions": 0 for t in TRIGGERS}
        self.num_rescues = 0
        self.pending_ns = 0
        super()._reset_state()

    # ----------------------------------------------------------------- triggers
    def _fragmented(self) -> bool:
        b = self.base_policy
        free = b.reserved_bytes - b.allocated_bytes
        return (
            free > 0
            and free >= self.min_free_bytes
            and 1 - b.largest_free_bytes() / free > self.threshold
        )

    def _rescue(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        """Compact for a failed request and retry it, when the plan says it will then fit."""
        plan = self._cheapest_slide(self.base_policy.rounded_size(nbytes), stream)
        if plan is None:
            plan = self._plan(stream)
            if not (plan.moves or plan.evacuated) or not self._fits_after(plan, nbytes, stream):
                return None
        self._run(plan, "failure")
        inner = self.base_policy.allocate(nbytes, stream=stream, tag=tag)
        self.num_rescues += inner is not None
        return inner

    def _cheapest_slide(self, size: int, stream: int) -> _Plan | None:
        """A plan that slides the one segment of ``stream`` whose free bytes hold ``size`` once
        merged, moving the fewest bytes (the live blocks above its first hole); None if none."""
        best, best_moved = None, 0
        for seg in self.base_policy.segments():
            if seg.stream != stream:
                continue
            used = moved = 0
            seen_free = False
            block = seg.handle
            while block is not None:
                if block.free:
                    seen_free = True
                else:
                    used += block.size
                    if seen_free:
                        moved += block.size
                block = block.next
            if moved and seg.nbytes - used >= size and (best is None or moved < best_moved):
                best, best_moved = seg, moved
        if best is None:
            return None
        plan = _Plan()
        self._plan_stream([best], plan)  # one segment: nothing to evacuate into, so a slide
        return plan

    def _fits_after(self, plan: _Plan, nbytes: int, stream: int) -> bool:
        b = self.base_policy
        size = b.rounded_size(nbytes)
        fully_free = [s for s in b.segments() if s.num_live == 0]
        if any(t >= size for t in plan.tail_bytes.values()) or any(
            s.nbytes >= size and s.stream == stream for s in fully_free
        ):
            return True
        if not plan.evacuated or b.frozen:
            return False
        if b.capacity_bytes is None:
            return True  # the device refused: released segments may let it accept
        # the base's retry releases fully free segments too before it asks for a new one
        held = (
            b.reserved_bytes
            - sum(s.nbytes for s in plan.evacuated)
            - sum(s.nbytes for s in fully_free)
        )
        return held + b._segment_size_for(size) <= b.capacity_bytes

    # ----------------------------------------------------------------- planning
    def _plan(self, stream: int | None) -> _Plan:
        """Plan a pass over one stream's segments (every stream when None). Changes nothing."""
        by_stream: dict[int, list[Segment]] = {}
        for seg in self.base_policy.segments():
            if stream is None or seg.stream == stream:
                by_stream.setdefault(seg.stream, []).append(seg)
        plan = _Plan()
        for segs in by_stream.values():
            self._plan_stream(segs, plan)
        return plan

    @staticmethod
    def _plan_stream(segs: list[Segment], plan: _Plan) -> None:
        live: dict[Segment, list[Block]] = {}
        live_bytes: dict[Segment, int] = {}
        for seg in segs:
            blocks, used = [], 0
            block = seg.handle
            while block is not None:
                if not block.free:
                    blocks.append(block)
                    used += block.size
                block = block.next
            if blocks:  # fully free segments are neither emptied nor filled: trim's business
                live[seg], live_bytes[seg] = blocks, used
        # 1. evacuate, sparsest first, into the free space the others will have after sliding
        tails = {seg: seg.nbytes - used for seg, used in live_bytes.items()}
        incoming: dict[Segment, list[Block]] = {}
        evacuated: set[Segment] = set()
        for cand in sorted(live, key=lambda s: (live_bytes[s], s.offset)):
            if cand in incoming:  # already receives blocks: it stays
                continue
            trial = {s: t for s, t in tails.items() if s is not cand}
            placed = []
            for block in sorted(live[cand], key=lambda b: -b.size):
                fits = [s for s, t in trial.items() if t >= block.size]
                if not fits:
                    break
                target = min(fits, key=lambda s: (trial[s], s.offset))  # best fit among the tails
                trial[target] -= block.size
                placed.append((block, target))
            else:
                tails = trial
                evacuated.add(cand)
                plan.evacuated.append(cand)
                for block, target in placed:
                    incoming.setdefault(target, []).append(block)
        # 2. slide each remaining segment's blocks down, then append what moves in
        for seg in segs:
            if seg not in live or seg in evacuated:
                continue
            blocks = live[seg] + incoming.get(seg, [])
            cursor, changed = seg.offset, False
            for block in blocks:
                if block.offset != cursor:
                    plan.moves.append((block, seg, cursor))
                    changed = True
                cursor += block.size
            if changed:
                plan.layouts[seg] = blocks
            plan.tail_bytes[seg] = seg.end - cursor

    # ----------------------------------------------------------------- moving
    def _run(self, plan: _Plan, trigger: str) -> Compaction | None:
        if not plan.moves and not plan.evacuated:
            return None
        b = self.base_policy
        free = b.reserved_bytes - b.allocated_bytes
        largest_before = b.largest_free_bytes()
        moved = self._apply(plan)
        self._sync()
        # the bookkeeping is complete and consistent before anyone copies a byte, and the
        # emptied segments are released only once their bytes have been copied out
        for a, old, new, n in moved:
            self._report_move(a, old, new, n)
        released = self._release(plan.evacuated)
        copy_ns = self.copy_ns
        time_ns = sum(copy_ns(n) for _, _, _, n in moved) if copy_ns is not None else 0
        self.pending_ns += time_ns
        free_after = b.reserved_bytes - b.allocated_bytes
        largest_after = b.largest_free_bytes()
        rec = Compaction(
            trigger=trigger,
            frag_before=1 - largest_before / free if free else 0.0,
            frag_after=1 - largest_after / free_after if free_after else 0.0,
            largest_free_before_bytes=largest_before,
            largest_free_after_bytes=largest_after,
            free_before_bytes=free,
            num_moves=len(moved),
            moved_bytes=sum(n for *_, n in moved),
            num_released_segments=len(released),
            released_bytes=sum(released),
            time_ns=time_ns,
        )
        self.compactions.append(rec)
        self._count_pass(rec)
        self._sync()
        return rec

    def _apply(self, plan: _Plan) -> list[tuple[Allocation, int, int, int]]:
        """Rewrite the base's blocks as planned (an emptied segment becomes one free block);
        returns ``(allocation, old, new, nbytes)`` per move."""
        b = self.base_policy
        for seg in [*plan.layouts, *plan.evacuated]:  # their free blocks leave the index, for good
            block = seg.handle
            while block is not None:
                if block.free:
                    b._index_remove(block)
                block = block.next
        moved = []
        by_block = self._by_block
        for block, seg, new_offset in plan.moves:
            old_offset = block.offset
            if block.segment is not seg:
                block.segment.num_live -= 1
                seg.num_live += 1
                block.segment = seg
            block.offset = new_offset
            a = by_block[block]
            a.extents = ((new_offset, block.size),)  # the block's own follow its ``offset``
            moved.append((a, old_offset, new_offset, block.size))
        for seg, blocks in plan.layouts.items():
            prev = None
            for block in blocks:
                block.prev = prev
                if prev is not None:
                    prev.next = block
                prev = block
            end = prev.end
            prev.next = None
            if end < seg.end:
                tail = Block(end, seg.end - end, seg, prev)
                prev.next = tail
                b._index_add(tail)
            seg.handle = blocks[0]
        for seg in plan.evacuated:
            assert seg.num_live == 0, "an evacuated segment still holds live blocks"
            seg.handle = Block(seg.offset, seg.nbytes, seg)
            b._index_add(seg.handle)
        return moved

    def _release(self, segments: list[Segment]) -> list[int]:
        """Give the emptied segments back (a frozen pool keeps them as free space)."""
        b = self.base_policy
        if b.frozen:
            return []
        released = []
        for seg in segments:
            b._index_remove(seg.handle)
            b._release_segment(seg)
            released.append(seg.nbytes)
        return released
