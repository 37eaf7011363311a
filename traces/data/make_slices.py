"""Rebuild the bundled slices in this folder from the full traces in ``../shared/data/traces``.

    python traces/data/make_slices.py [--source DIR]

- ``llama1b_generate_slice.pickle.gz``: the trace entries of the first ``generate`` call of
  ``llama1b_generate_mixed.pickle.gz``, same snapshot format and keys, with ``segments`` rebuilt
  for the state at the cut (see ``rebuild_segments``).
- ``azure_code_slice.csv``: the first 10 minutes of ``AzureLLMInferenceTrace_code.csv``, lines
  copied unchanged.
- ``mooncake_conversation_slice.jsonl``: the first 10 minutes of Mooncake's FAST'25
  ``conversation_trace.jsonl`` (from ``--mooncake-source``), lines copied unchanged.

A slice whose source file is absent is skipped (said so), the others are rebuilt.

Output is deterministic (gzip mtime 0), so rerunning reproduces the files byte for byte.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import pickle
from datetime import datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SOURCE = HERE.parents[2] / "shared" / "data" / "traces"

SNAPSHOT_IN = "llama1b_generate_mixed.pickle.gz"
SNAPSHOT_OUT = "llama1b_generate_slice.pickle.gz"
AZURE_IN = "AzureLLMInferenceTrace_code.csv"
AZURE_OUT = "azure_code_slice.csv"
AZURE_MINUTES = 10
DEFAULT_MOONCAKE_SOURCE = HERE.parents[2] / "data" / "mooncake"
MOONCAKE_IN = "conversation_trace.jsonl"
MOONCAKE_OUT = "mooncake_conversation_slice.jsonl"
MOONCAKE_MINUTES = 10

#: Between two ``generate`` calls only a few persistent tensors (about 32 MiB) stay live in the
#: recorded trace; inside a call there is always more. A drop below this ends a call.
BETWEEN_CALLS_LIVE_BYTES = 34_000_000
#: Skip the first entries: before the first call starts, live bytes are low too.
WARMUP_ENTRIES = 1_000
#: PyTorch's caching allocator: block sizes are multiples of 512 B; a remainder is split off as
#: a free block only when >= 512 B (small pool, 2 MiB segments) or > 1 MiB (large pool).
MIN_BLOCK_BYTES = 512
LARGE_SPLIT_MIN_BYTES = (1 << 20) + 1


def first_call_end(entries: list[dict]) -> int:
    """Index one past the last entry of the first ``generate`` call."""
    live: dict[int, int] = {}
    total, low_run = 0, False
    for i, e in enumerate(entries):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
        if i < WARMUP_ENTRIES:
            continue
        if total < BETWEEN_CALLS_LIVE_BYTES:
            low_run = True
        elif low_run:
            return i  # the next call's first allocation
    raise SystemExit("no boundary between generate calls found")


def rebuild_segments(final_segments: list[dict], full: list[dict], cut: int) -> list[dict]:
    """The segment table as it stood after ``full[:cut]``.

    Segments are those of the final table minus the ones whose ``segment_alloc`` comes after the
    cut (the recording frees none). Live blocks are (a) the final table's active blocks whose
    address the whole trace never touches (allocated before recording, never freed) and (b) the
    allocations live at the cut, sized as PyTorch would (rounded up to 512 B, a remainder too
    small to split absorbed). The rest of each segment is listed as inactive blocks.
    """
    if any(e["action"] in ("segment_free", "segment_unmap") for e in full):
        raise SystemExit("the trace releases segments: rebuild_segments does not handle that")
    late = {e["addr"] for e in full[cut:] if e["action"] == "segment_alloc"}
    touched = {
        e["addr"] for e in full if e["action"] in ("alloc", "free_requested", "free_completed")
    }
    live: dict[int, int] = {}
    for e in full[:cut]:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    out = []
    for seg in final_segments:
        if seg["address"] in late:
            continue
        start, end = seg["address"], seg["address"] + seg["total_size"]
        small = seg["segment_type"] == "small"
        blocks = [
            b
            for b in _blocks_with_address(seg)
            if b["state"] == "active_allocated" and b["address"] not in touched
        ]
        blocks += [
            {
                "address": a,
                "size": -(-n // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES,
                "requested_size": n,
                "state": "active_allocated",
                "frames": [],
            }
            for a, n in live.items()
            if start <= a < end
        ]
        blocks.sort(key=lambda b: b["address"])
        tiled, cursor = [], start
        for b in blocks:
            _add_gap(tiled, cursor, b["address"], small)
            tiled.append(dict(b))
            cursor = b["address"] + b["size"]
        _add_gap(tiled, cursor, end, small)
        assert sum(b["size"] for b in tiled) == seg["total_size"], "blocks tile the segment"
        active = [b for b in tiled if b["state"] == "active_allocated"]
        new = dict(seg)
        active_bytes = sum(b["size"] for b in active)
        new.update(
            blocks=tiled,
            allocated_size=active_bytes,
            active_size=active_bytes,
            requested_size=sum(b["requested_size"] for b in active),
        )
        out.append(new)
    placed = {b["address"] for s in out for b in s["blocks"] if b["state"] == "active_allocated"}
    assert set(live) <= placed, "every allocation live at the cut lies in a segment"
    return out


def _blocks_with_address(seg: dict) -> list[dict]:
    addr, out = seg["address"], []
    for b in seg["blocks"]:
        b = dict(b)
        b.setdefault("address", addr)
        addr = b["address"] + b["size"]
        out.append(b)
    return out


def _add_gap(tiled: list[dict], start: int, end: int, small: bool) -> None:
    gap = end - start
    assert gap >= 0, f"blocks overlap at {start:#x}"
    if gap == 0:
        return
    splittable = gap >= MIN_BLOCK_BYTES if small else gap >= LARGE_SPLIT_MIN_BYTES
    if not splittable and tiled and tiled[-1]["state"] == "active_allocated":
        tiled[-1]["size"] += gap  # the allocator would not have split this remainder off
        return
    tiled.append(
        {"address": start, "size": gap, "requested_size": 0, "state": "inactive", "frames": []}
    )


def slice_snapshot(src: Path, dst: Path) -> int:
    with gzip.open(src, "rb") as f:
        snap = pickle.load(f)  # our own recording: trusted
    full = snap["device_traces"][0]
    cut = first_call_end(full)
    sliced = dict(snap)
    sliced["device_traces"] = [full[:cut]] + [[] for _ in snap["device_traces"][1:]]
    sliced["segments"] = rebuild_segments(snap["segments"], full, cut)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0) as gz:
        pickle.dump(sliced, gz, protocol=4)
    dst.write_bytes(buf.getvalue())
    return cut


def slice_azure(src: Path, dst: Path, minutes: int = AZURE_MINUTES) -> int:
    lines = src.read_text().splitlines(keepends=True)
    header, rows = lines[0], lines[1:]
    t0 = _azure_time(rows[0])
    kept = [r for r in rows if _azure_time(r) - t0 < timedelta(minutes=minutes)]
    text = header + "".join(kept)
    dst.write_text(text if text.endswith("\n") else text + "\n")
    return len(kept)


def slice_mooncake(src: Path, dst: Path, minutes: int = MOONCAKE_MINUTES) -> int:
    """Lines of a Mooncake JSONL trace (``timestamp`` in ms from the trace's start) before
    ``minutes``."""
    kept = [
        line
        for line in src.read_text().splitlines(keepends=True)
        if line.strip() and json.loads(line)["timestamp"] < minutes * 60_000
    ]
    text = "".join(kept)
    dst.write_text(text if text.endswith("\n") else text + "\n")
    return len(kept)


def _azure_time(row: str) -> datetime:
    stamp = row.split(",", 1)[0]
    day, clock = stamp.split(" ")
    hms, _, frac = clock.partition(".")
    return datetime.fromisoformat(f"{day} {hms}") + timedelta(
        microseconds=int((frac + "000000")[:6])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--source", type=Path, default=DEFAULT_SOURCE, help="folder with the full traces"
    )
    parser.add_argument(
        "--mooncake-source",
        type=Path,
        default=DEFAULT_MOONCAKE_SOURCE,
        help="folder with Mooncake's FAST'25 traces (its traces/ folder)",
    )
    args = parser.parse_args()
    for src, out, make, unit in (
        (args.source / SNAPSHOT_IN, SNAPSHOT_OUT, slice_snapshot, "trace entries"),
        (args.source / AZURE_IN, AZURE_OUT, slice_azure, "requests"),
        (args.mooncake_source / MOONCAKE_IN, MOONCAKE_OUT, slice_mooncake, "requests"),
    ):
        if not src.is_file():
            print(f"{out}: skipped, no {src}")
            continue
        n = make(src, HERE / out)
        print(f"{out}: {n:,} {unit}, {(HERE / out).stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
