"""Session 22 (h1): hostile inputs of issue 1-3, each run through ``python -m poollab`` of one
tree; prints one row per case: whether the one error line names what and where.

    python benchmarks/results/s22_h1/survey.py TREE   (TREE: a source tree, e.g. /work/main/.s22)
"""

from __future__ import annotations

import gzip
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TREE = Path(sys.argv[1]).resolve()
ALLOC = "time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,0,4096,0,\n5,free,0,4096,0,\n"
REQ = "arrival_s,prompt_tokens,output_tokens\n0,100,10\n0.5,200,20\n"
RMM = "Thread,Time,Action,Pointer,Size,Stream\n"
OUT = ["--out", "out", "--no-progress"]


def snap(t):
    e = {"action": "alloc", "addr": 4096, "size": 4096, "stream": 0, "time_us": t}
    d = {"segments": [], "device_traces": [[e]], "allocator_settings": {}}
    return gzip.compress(pickle.dumps(d, protocol=4), mtime=0)


def parquet(d: Path):
    cols = {"time_us": [-7, 5], "op": ["alloc", "free"], "alloc_id": [0, 0]}
    cols |= {"nbytes": [4096, 4096], "stream": [0, 0], "tag": ["", ""]}
    pq.write_table(pa.table(cols), d / "a.parquet")


def replay_p(spec):
    return (["replay", "a.csv", "-p", "first-fit", "-p", spec, *OUT], None, [spec])


SWEEP = "traces: [a.csv]\npolicies:\n  - first-fit\n  - {}\n"
# (id, argv, stdin, needles in the error line; None: must succeed), files
CASES = [
    ("p-bad-value", *replay_p("best-fit:alignment_bytes=-5")),
    ("p-unknown-knob", *replay_p("best-fit:nope=1")),
    ("p-unknown-policy", *replay_p("no-such-policy:x=1")),
    ("p-malformed", *replay_p("best-fit:alignment_bytes")),
    ("p-base-bad-value", *replay_p("elastic:base=[best-fit:alignment_bytes=-5]")),
    ("p-base-unknown", *replay_p("elastic:base=[nope]")),
    ("p-wrapper-knob", *replay_p("elastic:base=[best-fit],high=2")),
    ("p-tag-limits", *replay_p("tag-limits:limits=[x]")),
    (
        "simulate-p",
        ["simulate", "q.csv", "-p", "paged", "-p", "paged:page_bytes=-1", "--out", "out"],
        None,
        ["paged:page_bytes=-1"],
    ),
    (
        "sweep-bad-value",
        ["sweep", "s1.yaml", "--dry-run", "--out", "out"],
        None,
        ["s1.yaml", "line 4", "best-fit:alignment_bytes=-5"],
    ),
    (
        "sweep-combo",
        ["sweep", "s2.yaml", "--dry-run", "--out", "out"],
        None,
        ["s2.yaml", "line 4", "size-class", "classes_per_doubling=0"],
    ),
    ("csv-neg-time", ["replay", "n.csv", "-p", "first-fit", *OUT], None, ["n.csv:2", "time_us"]),
    (
        "pq-neg-time",
        ["replay", "a.parquet", "-p", "first-fit", *OUT],
        None,
        ["a.parquet (record 1)", "time_us"],
    ),
    ("rmm-neg-epoch", ["replay", "r1.csv", "-p", "first-fit", *OUT], None, ["r1.csv:2", "Time"]),
    ("rmm-neg-clock", ["replay", "r2.csv", "-p", "first-fit", *OUT], None, ["r2.csv:2", "Time"]),
    (
        "snap-neg-time",
        ["replay", "s.pickle.gz", "-p", "first-fit", *OUT],
        None,
        ["s.pickle.gz", "index 0", "time_us"],
    ),
    (
        "sweep-stdin-ok",
        ["sweep", "/dev/stdin", "--dry-run", "--out", "out"],
        "traces: [a.csv]\npolicies: [first-fit]\n",
        None,
    ),
    (
        "sweep-stdin-missing",
        ["sweep", "/dev/stdin", "--dry-run", "--out", "out"],
        "traces: [a.csv]\npolicies: [first-fit]\ncosts: nope.json\n",
        ["/dev/stdin", "line 3", "{d}/nope.json"],
    ),
]


def main() -> None:
    good = 0
    for cid, argv, stdin, needles in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            (d / "a.csv").write_text(ALLOC)
            (d / "q.csv").write_text(REQ)
            (d / "n.csv").write_text(ALLOC.replace("\n0,alloc", "\n-10,alloc"))
            (d / "r1.csv").write_text(RMM + "1,-2.5,allocate,0x1000,4096,0\n")
            (d / "r2.csv").write_text(RMM + "1,-00:00:01.000000,allocate,0x1000,4096,0\n")
            (d / "s.pickle.gz").write_bytes(snap(-3))
            (d / "s1.yaml").write_text(SWEEP.format("'best-fit:alignment_bytes=-5'"))
            (d / "s2.yaml").write_text(
                SWEEP.format("{policy: size-class, params: {classes_per_doubling: [2, 0]}}")
            )
            parquet(d)
            env = {**os.environ, "PYTHONPATH": str(TREE), "PYTHONWARNINGS": "ignore"}
            proc = subprocess.run(
                [sys.executable, "-m", "poollab", *argv],
                cwd=d,
                env=env,
                input=stdin or "",
                capture_output=True,
                text=True,
                timeout=300,
            )
            err = proc.stderr.strip().splitlines()
            line = err[-1] if err else ""
            if needles is None:
                ok = proc.returncode == 0
            else:
                want = [n.replace("{d}", str(d)) for n in needles]
                ok = proc.returncode == 2 and len(err) == 1 and all(n in line for n in want)
            good += ok
            shown = line.replace(str(d), "{d}")[:150] if proc.returncode else "(ran, exit 0)"
            print(f"{cid:22s} {'yes' if ok else 'NO ':3s} rc={proc.returncode} {shown}")
    print(f"{good} of {len(CASES)} name what and where ({TREE})")


if __name__ == "__main__":
    main()
