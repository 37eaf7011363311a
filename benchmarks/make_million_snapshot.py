"""A million-event PyTorch snapshot for the replay benchmark, made from the shared 215k-event one.

    PYTHONPATH=. python benchmarks/make_million_snapshot.py [OUT] [--source SNAPSHOT] [--entries
    1500000]

No real snapshot of a million events is at hand here, so this repeats the steps of the shared
recording (``llama1b_generate_mixed.pickle.gz``: six ``generate`` calls): it finds the longest
stretch of trace entries after which the same blocks are live as before it (a whole number of
steps), and plays that stretch again and again, each copy's times shifted past the
previous one's end, until the file holds ``--entries`` trace entries (1.5M entries: about a
million events, an entry of each alloc and of each free's completion making an event). Every copy
allocates and frees the same addresses as the original, so the file is as valid a snapshot as the
source (the same segments, the same blocks live at the end). The output is written where asked
(``/tmp`` by default), never into the repository.
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "traces" / "llama1b_generate_mixed.pickle.gz"

_ALLOC, _FREE = "alloc", "free_completed"


def balanced_stretch(entries: list[dict]) -> tuple[int, int]:
    """``(i, j)``: the longest ``entries[i:j]`` with the same blocks live at ``i`` and at ``j``.

    The live set is tracked by a sum of each live block's fingerprint (exact up to a collision
    of 64-bit hashes), so equal sums mean the same blocks; the widest pair of equal sums wins.
    """
    live_sum, first_at, best = 0, {0: 0}, (0, 0)
    mask = (1 << 64) - 1
    for k, e in enumerate(entries, start=1):
        action = e["action"]
        if action == _ALLOC:
            live_sum = (live_sum + hash((e["addr"], e["size"]))) & mask
        elif action == _FREE:
            live_sum = (live_sum - hash((e["addr"], e["size"]))) & mask
        i = first_at.setdefault(live_sum, k)
        if k - i > best[1] - best[0]:
            best = (i, k)
    return best


def repeat_steps(snap: dict, num_entries: int) -> dict:
    traces = snap["device_traces"]
    dev = max(range(len(traces)), key=lambda d: len(traces[d]))
    entries = traces[dev]
    i, j = balanced_stretch(entries)
    stretch = entries[i:j]
    span_us = stretch[-1]["time_us"] - stretch[0]["time_us"] + 1
    copies = max(1, 1 + -(-(num_entries - len(entries)) // max(1, len(stretch))))
    out = list(entries[:j])
    for c in range(1, copies):
        shift = c * span_us
        out += [{**e, "time_us": e["time_us"] + shift} for e in stretch]
    tail_shift = (copies - 1) * span_us
    out += [{**e, "time_us": e["time_us"] + tail_shift} for e in entries[j:]]
    new_traces = list(traces)
    new_traces[dev] = out
    print(
        f"stretch entries {i:,}..{j:,} of {len(entries):,} "
        f"({j - i:,} entries, {span_us / 1e6:.1f} s), {copies} copies: {len(out):,} entries",
        file=sys.stderr,
    )
    return {**snap, "device_traces": new_traces}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, default=Path("/tmp/llama1b_generate_1m.pickle.gz"))
    ap.add_argument("--source", type=Path, default=SHARED)
    ap.add_argument(
        "--entries", type=int, default=1_500_000, help="trace entries to reach (default 1.5M)"
    )
    args = ap.parse_args(argv)
    with gzip.open(args.source, "rb") as f:
        snap = pickle.load(f)
    with gzip.open(args.out, "wb", compresslevel=6) as f:
        pickle.dump(repeat_steps(snap, args.entries), f, protocol=pickle.HIGHEST_PROTOCOL)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
