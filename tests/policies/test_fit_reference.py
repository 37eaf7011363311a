"""First fit and best fit against a brute-force reference, on random traffic.

Their hot paths keep specialised indexes (first-fit: address-ordered lists scanned in C;
best-fit: sorted keys re-keyed in place); the reference reads the free blocks straight off the
block chains, so a placement that drifts from the rule fails here.
"""

from __future__ import annotations

import random

import pytest

from policies.best_fit import BestFit
from policies.first_fit import FirstFit

KiB = 1 << 10


def _first_fit(blocks, size):
    return min((b.offset for b in blocks if b.size >= size), default=None)


def _best_fit(blocks, size):
    fits = [(b.size, b.offset) for b in blocks if b.size >= size]
    return min(fits)[1] if fits else None


@pytest.mark.parametrize("cls, rule", [(FirstFit, _first_fit), (BestFit, _best_fit)])
@pytest.mark.parametrize("seed", range(4))
def test_placement_follows_the_rule(cls, rule, seed):
    rng = random.Random(seed)
    p = cls(segment_bytes=2 << 20, split_threshold_bytes=rng.choice([None, 4 * KiB]))
    live = []
    for step in range(1500):
        if live and rng.random() < 0.45:
            p.free(live.pop(rng.randrange(len(live))))
        else:
            nbytes = rng.choice(
                [rng.randrange(1, 4 * KiB), rng.randrange(1, 256 * KiB), rng.randrange(1, 3 << 20)]
            )
            stream = rng.randrange(2)
            size = p.rounded_size(nbytes)
            free_blocks = [b for b in p.blocks() if b.free and b.segment.stream == stream]
            expected = rule(free_blocks, size)
            a = p.allocate(nbytes, stream=stream)
            assert a is not None
            if expected is not None:  # else a fresh segment serves it
                assert a.offset == expected, (
                    f"step {step}: {cls.name} put {size} B at {a.offset:#x}, not {expected:#x}"
                )
            live.append(a)
        if step % 50 == 0:
            p.check_invariants()
    p.check_invariants()
