"""A generated fuzz corpus of malformed inputs, and the test that every one is one line, exit 2,
nothing damaged.

One case per way a file or option can be wrong, over every reader (our CSV and Parquet, RMM logs,
PyTorch snapshots, Azure, BurstGPT, Mooncake, Vidur, SWEEP.yaml, cost, calibration, model and GPU
JSON, result folders) and every command that reads or writes. Each case writes its files into an
empty folder (nothing binary is checked in: pickles, gzip, Parquet and invalid UTF-8 are made
here) and returns the command line. Of each the test expects: exit status 2, exactly one line on
stderr holding every string in ``expect`` (the file, and its line or record where there is one),
no traceback, and the folder exactly as it was (the existing ``out/`` untouched, no new files,
no temporary ones left behind).

The corpus runs in-process (click's ``CliRunner`` isolation around ``poollab.cli.main``, the code
path of the real entry point) for speed; a handful of cases also run through a real ``poollab``
subprocess, which checks the exit status and stderr the user sees.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from poollab.cli import main

#: One case: ``build(folder) -> argv``; ``expect`` are substrings of the one error line, with
#: ``{d}`` standing for the case's folder.
Build = Callable[[Path], list[str]]


@dataclass(frozen=True)
class Case:
    id: str
    build: Build
    expect: tuple[str, ...]


ALLOC_HEADER = "time_us,op,alloc_id,nbytes,stream,tag"
GOOD_ALLOC = f"{ALLOC_HEADER}\n0,alloc,0,4096,0,\n5,free,0,4096,0,\n"
RMM_HEADER = "Thread,Time,Action,Pointer,Size,Stream"
GOOD_REQUESTS = "arrival_s,prompt_tokens,output_tokens\n0,100,10\n0.5,200,20\n"
BIG = str(2**70)  # an integer beyond int64
NOT_UTF8 = b"\xff\xfe\x80\x81 not text \xc3\x28\n"
GOOD_SWEEP = "mode: replay\ntraces: [a.csv]\npolicies: [first-fit]\n"
OUT = (
    "out"  # every command that writes a folder writes here; it exists beforehand, with an old file
)


def _write(d: Path, name: str, data: str | bytes) -> Path:
    p = d / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def _truncated_gzip(text: str) -> bytes:
    data = gzip.compress((text * 200).encode(), mtime=0)
    return data[: len(data) // 2]


def _snapshot(
    entries: list, segments: list | None = None, *, raw: object | None = None, gz: bool = True
) -> bytes:
    snap = (
        raw
        if raw is not None
        else {"segments": segments or [], "device_traces": [entries], "allocator_settings": {}}
    )
    data = pickle.dumps(snap, protocol=4)
    return gzip.compress(data, mtime=0) if gz else data


def _entry(
    action: str, addr: int = 0x1000, size: object = 4096, time_us: object = 1, stream: int = 0
) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us}


def _parquet(d: Path, name: str, columns: dict[str, pa.Array]) -> Path:
    p = d / name
    pq.write_table(pa.table(columns), p)
    return p


def _alloc_columns(**override) -> dict[str, pa.Array]:
    cols = {
        "time_us": pa.array([0, 5], pa.int64()),
        "op": pa.array(["alloc", "free"]),
        "alloc_id": pa.array([0, 0], pa.int64()),
        "nbytes": pa.array([4096, 4096], pa.int64()),
        "stream": pa.array([0, 0], pa.int64()),
        "tag": pa.array(["", ""]),
    }
    cols.update(override)
    return cols


# -- command lines -----------------------------------------------------------------------------


def replay(trace: str, *extra: str) -> Build:
    def build(d: Path) -> list[str]:
        return [
            "replay",
            str(d / trace),
            "-p",
            "first-fit",
            "--out",
            str(d / OUT),
            "--no-progress",
            *extra,
        ]

    return build


def simulate(trace: str, *extra: str) -> Build:
    def build(d: Path) -> list[str]:
        return [
            "simulate",
            str(d / trace),
            "-p",
            "paged",
            "--model",
            "Llama-3.2-1B",
            "--out",
            str(d / OUT),
            *extra,
        ]

    return build


def _with_files(files: dict[str, str | bytes | Callable[[Path], object]], command: Build) -> Build:
    def build(d: Path) -> list[str]:
        for name, data in files.items():
            if callable(data):
                data(d)
            else:
                _write(d, name, data)
        return [a.replace("{d}", str(d)) for a in command(d)]

    return build


def alloc_case(
    id: str, name: str, data: str | bytes, expect: tuple[str, ...], command=replay
) -> Case:
    return Case(id, _with_files({name: data}, command(name)), expect)


def request_case(id: str, name: str, data: str | bytes, expect: tuple[str, ...]) -> Case:
    return Case(id, _with_files({name: data}, simulate(name)), expect)


def _rmm(*rows: str) -> str:
    return RMM_HEADER + "\n" + "".join(r + "\n" for r in rows)


def _csv(*rows: str) -> str:
    return ALLOC_HEADER + "\n" + "".join(r + "\n" for r in rows)


def _args(*argv: str) -> Build:
    return lambda d: list(argv)


def _blocker(d: Path) -> None:
    """A file where a folder is wanted: ``--out blocker/out`` then fails with NotADirectoryError."""
    _write(d, "blocker", "a file, not a folder\n")


# -- the corpus --------------------------------------------------------------------------------

CASES: list[Case] = []
add = CASES.append

# our allocation CSV (replay)
add(
    alloc_case(
        "csv-unknown-op", "a.csv", _csv("0,alloc,0,4096,0,", "5,explode,1,7,0,"), ("a.csv:3", "op")
    )
)
add(
    alloc_case(
        "csv-fractional-size",
        "a.csv",
        _csv("0,alloc,0,1000.7,0,", "5,free,0,1000.7,0,"),
        ("a.csv:2", "1000.7"),
    )
)
add(alloc_case("csv-size-1e30", "a.csv", _csv("0,alloc,0,1e30,0,"), ("a.csv:2", "nbytes")))
add(alloc_case("csv-size-2**70", "a.csv", _csv(f"0,alloc,0,{BIG},0,"), ("a.csv:2", "nbytes")))
add(
    alloc_case(
        "csv-time-2**70",
        "a.csv",
        _csv("0,alloc,0,4096,0,", f"{BIG},free,0,4096,0,"),
        ("a.csv:3", "time_us"),
    )
)
add(
    alloc_case(
        "csv-negative-alloc-id",
        "a.csv",
        _csv("0,alloc,-1,4096,0,", "5,free,-1,4096,0,"),
        ("a.csv:2", "alloc_id"),
    )
)
add(alloc_case("csv-negative-size", "a.csv", _csv("0,alloc,0,-4096,0,"), ("a.csv:2", "size")))
add(
    alloc_case(
        "csv-double-free",
        "a.csv",
        _csv("0,alloc,0,4096,0,", "1,free,0,4096,0,", "2,free,0,4096,0,"),
        ("a.csv:4", "double free"),
    )
)
add(
    alloc_case(
        "csv-time-goes-back",
        "a.csv",
        _csv("9,alloc,0,4096,0,", "5,free,0,4096,0,"),
        ("a.csv:3", "back in time"),
    )
)
add(alloc_case("csv-empty-cell", "a.csv", _csv("0,alloc,,4096,0,"), ("a.csv:2", "alloc_id")))
add(
    alloc_case(
        "csv-ragged-row",
        "a.csv",
        _csv("0,alloc,0,4096,0,", "5,free,0,4096,0,,extra,more"),
        ("a.csv:3",),
    )
)
add(alloc_case("csv-truncated-gzip", "a.csv.gz", _truncated_gzip(GOOD_ALLOC), ("a.csv.gz",)))
add(alloc_case("csv-not-utf8", "a.csv", ALLOC_HEADER.encode() + b"\n" + NOT_UTF8, ("a.csv",)))
add(alloc_case("alloc-unknown-format", "a.csv", "what,is,this\n1,2,3\n", ("a.csv:1",)))
add(alloc_case("alloc-empty-file", "a.csv", "", ("a.csv", "empty")))
add(
    alloc_case(
        "info-csv-fractional-size",
        "a.csv",
        _csv("0,alloc,0,1000.7,0,"),
        ("a.csv:2",),
        command=lambda name: lambda d: ["traces", "info", str(d / name)],
    )
)
add(
    alloc_case(
        "info-not-utf8",
        "a.txt",
        NOT_UTF8 * 3,
        ("a.txt",),
        command=lambda name: lambda d: ["traces", "info", str(d / name)],
    )
)

# our allocation Parquet (replay)
add(
    Case(
        "pq-garbage",
        _with_files({"a.parquet": b"PAR1" + b"\x00garbage" * 20}, replay("a.parquet")),
        ("a.parquet",),
    )
)
add(
    Case(
        "pq-missing-column",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", {k: v for k, v in _alloc_columns().items() if k != "nbytes"}
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet", "nbytes"),
    )
)
add(
    Case(
        "pq-fractional-size",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", _alloc_columns(nbytes=pa.array([1000.7, 1000.7]))
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet (record 1)", "nbytes"),
    )
)
add(
    Case(
        "pq-size-1e30",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", _alloc_columns(nbytes=pa.array([1e30, 1e30]))
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet (record 1)", "nbytes"),
    )
)
add(
    Case(
        "pq-negative-alloc-id",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", _alloc_columns(alloc_id=pa.array([-3, -3], pa.int64()))
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet (record 1)", "alloc_id"),
    )
)
add(
    Case(
        "pq-null-op",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", _alloc_columns(op=pa.array(["alloc", None]))
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet (record 2)", "op"),
    )
)
add(
    Case(
        "pq-op-not-text",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", _alloc_columns(op=pa.array([1, 2], pa.int64()))
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet", "op"),
    )
)

# RMM logs (replay)
T = "10:00:00.000001"
add(
    alloc_case(
        "rmm-size-2**70", "r.csv", _rmm(f"1,{T},allocate,0x10,{BIG},0x0"), ("r.csv:2", "Size")
    )
)
add(
    alloc_case(
        "rmm-fractional-size", "r.csv", _rmm(f"1,{T},allocate,0x10,1000.7,0x0"), ("r.csv:2", "Size")
    )
)
add(
    alloc_case(
        "rmm-negative-size",
        "r.csv",
        _rmm(f"1,{T},allocate,0x10,4096,0x0", f"1,{T},allocate,0x20,-5,0x0"),
        ("r.csv:3", "Size"),
    )
)
add(
    alloc_case(
        "rmm-bad-action",
        "r.csv",
        _rmm(f"1,{T},allocate,0x10,4096,0x0", f"1,{T},explode,0x10,4096,0x0"),
        ("r.csv:3", "Action"),
    )
)
add(
    alloc_case(
        "rmm-bad-pointer", "r.csv", _rmm(f"1,{T},allocate,0xZZ,4096,0x0"), ("r.csv:2", "Pointer")
    )
)
add(
    alloc_case(
        "rmm-free-not-live", "r.csv", _rmm(f"1,{T},free,0x10,4096,0x0"), ("r.csv:2", "not live")
    )
)
add(
    alloc_case(
        "rmm-bad-time", "r.csv", _rmm("1,yesterday,allocate,0x10,4096,0x0"), ("r.csv:2", "Time")
    )
)
add(
    alloc_case("rmm-time-1e30", "r.csv", _rmm("1,1e30,allocate,0x10,4096,0x0"), ("r.csv:2", "Time"))
)
add(
    alloc_case(
        "rmm-truncated-gzip",
        "r.csv.gz",
        _truncated_gzip(_rmm(f"1,{T},allocate,0x10,4096,0x0", f"1,{T},free,0x10,4096,0x0")),
        ("r.csv.gz",),
    )
)
add(
    alloc_case(
        "rmm-ragged-row",
        "r.csv",
        _rmm(f"1,{T},allocate,0x10,4096,0x0", f"1,{T},free"),
        ("r.csv:3",),
    )
)

# PyTorch snapshots (replay; a few through fidelity)
S = "s.pickle.gz"
add(
    alloc_case(
        "snap-size-2**70", S, _snapshot([_entry("alloc", size=2**70)]), (S, "index 0", "size")
    )
)
add(
    alloc_case(
        "snap-size-inf", S, _snapshot([_entry("alloc", size=float("inf"))]), (S, "index 0", "size")
    )
)
add(
    alloc_case(
        "snap-size-nan", S, _snapshot([_entry("alloc", size=float("nan"))]), (S, "index 0", "size")
    )
)
add(
    alloc_case(
        "snap-fractional-size", S, _snapshot([_entry("alloc", size=1000.7)]), (S, "index 0", "size")
    )
)
add(
    alloc_case("snap-size-bool", S, _snapshot([_entry("alloc", size=True)]), (S, "index 0", "size"))
)
add(
    alloc_case(
        "snap-time-2**70",
        S,
        _snapshot([_entry("alloc"), _entry("free_completed", time_us=2**70)]),
        (S, "index 1", "time_us"),
    )
)
add(
    alloc_case(
        "snap-time-inf",
        S,
        _snapshot([_entry("alloc", time_us=float("inf"))]),
        (S, "index 0", "time_us"),
    )
)
add(
    alloc_case(
        "snap-time-text",
        S,
        _snapshot([_entry("alloc"), _entry("free_completed", time_us="soon")]),
        (S, "index 1", "time_us"),
    )
)
add(alloc_case("snap-addr-text", S, _snapshot([_entry("alloc", addr="here")]), (S, "index 0")))
add(
    alloc_case(
        "snap-missing-key",
        S,
        _snapshot([{"action": "alloc", "addr": 16, "stream": 0, "time_us": 0}]),
        (S, "index 0", "size"),
    )
)
add(
    alloc_case(
        "snap-entry-not-dict", S, _snapshot([_entry("alloc"), ["alloc", 1, 2]]), (S, "index 1")
    )
)
add(
    alloc_case(
        "snap-segment-malformed",
        S,
        _snapshot([_entry("alloc")], [{"device": 0, "stream": 0}]),
        (S, "segments index 0"),
    )
)
add(
    alloc_case(
        "snap-segment-size-2**70",
        S,
        _snapshot(
            [],
            [
                {
                    "device": 0,
                    "stream": 0,
                    "address": 0,
                    "total_size": 2**70,
                    "blocks": [{"size": 2**70, "state": "active_allocated"}],
                }
            ],
        ),
        (S, "segments index 0"),
    )
)
add(
    alloc_case(
        "snap-not-a-snapshot", S, _snapshot([], raw=[1, 2, 3]), (S, "not a PyTorch memory snapshot")
    )
)
add(alloc_case("snap-truncated-gzip", S, _snapshot([_entry("alloc")] * 200)[:60], (S,)))
add(
    alloc_case(
        "snap-forbidden-global",
        "s.pickle",
        b"\x80\x04cos\nsystem\n(S'true'\ntR.",
        ("s.pickle", "os.system"),
    )
)
add(
    alloc_case(
        "fidelity-truncated-gzip",
        S,
        _snapshot([_entry("alloc")] * 200)[:60],
        (S,),
        command=lambda name: lambda d: ["fidelity", str(d / name), "--out", str(d / OUT)],
    )
)
add(
    alloc_case(
        "fidelity-not-a-snapshot",
        S,
        _snapshot([], raw={"x": 1}),
        (S,),
        command=lambda name: lambda d: ["fidelity", str(d / name), "--out", str(d / OUT)],
    )
)
add(
    alloc_case(
        "fidelity-no-such-device",
        S,
        _snapshot([_entry("alloc")]),
        (S, "device 7"),
        command=lambda name: (
            lambda d: ["fidelity", str(d / name), "--device", "7", "--out", str(d / OUT)]
        ),
    )
)

# Azure, BurstGPT, Mooncake, Vidur, our request CSV and Parquet (simulate)
AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
add(
    request_case(
        "azure-bad-date",
        "az.csv",
        AZ + "2023-11-16 18:17:03.9799600,100,10\nnot a date,100,10\n",
        ("az.csv:3", "TIMESTAMP"),
    )
)
add(
    request_case(
        "azure-tokens-1e30",
        "az.csv",
        AZ + "2023-11-16 18:17:03.9799600,1e30,10\n",
        ("az.csv:2", "ContextTokens"),
    )
)
add(
    request_case(
        "azure-tokens-2**70",
        "az.csv",
        AZ + f"2023-11-16 18:17:03.9799600,{BIG},10\n",
        ("az.csv:2", "ContextTokens"),
    )
)
add(
    request_case(
        "azure-negative-tokens",
        "az.csv",
        AZ + "2023-11-16 18:17:03.9799600,100,-10\n",
        ("az.csv:2", "GeneratedTokens"),
    )
)
add(
    request_case(
        "azure-fractional-tokens",
        "az.csv",
        AZ + "2023-11-16 18:17:03.9799600,100.5,10\n",
        ("az.csv:2", "ContextTokens"),
    )
)
add(
    request_case(
        "azure-missing-value",
        "az.csv",
        AZ + "2023-11-16 18:17:03.9799600,,10\n",
        ("az.csv:2", "ContextTokens"),
    )
)
BG = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
add(
    request_case(
        "burstgpt-timestamp-text",
        "b.csv",
        BG + "5,ChatGPT,100,10,110,Conversation log\nlater,ChatGPT,1,1,2,x\n",
        ("b.csv:3", "Timestamp"),
    )
)
add(
    request_case(
        "burstgpt-tokens-1e30",
        "b.csv",
        BG + "5,ChatGPT,1e30,10,110,Conversation log\n",
        ("b.csv:2", "Request tokens"),
    )
)
add(
    request_case(
        "burstgpt-ragged-row",
        "b.csv",
        BG + "5,ChatGPT,100,10,110,Conversation log,extra\n",
        ("b.csv:2",),
    )
)
MC = '{"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1]}\n'
add(
    request_case(
        "mooncake-bad-json",
        "m.jsonl",
        MC + '{"timestamp": 5, "input_length": \n',
        ("m.jsonl:2", "JSON"),
    )
)
add(
    request_case(
        "mooncake-input-1e30",
        "m.jsonl",
        MC + '{"timestamp": 5, "input_length": 1e30, "output_length": 10}\n',
        ("m.jsonl:2", "input_length"),
    )
)
add(
    request_case(
        "mooncake-input-2**70",
        "m.jsonl",
        MC + f'{{"timestamp": 5, "input_length": {BIG}, "output_length": 10}}\n',
        ("m.jsonl:2", "input_length"),
    )
)
add(
    request_case(
        "mooncake-timestamp-1e300",
        "m.jsonl",
        MC + '{"timestamp": 1e300, "input_length": 10, "output_length": 10}\n',
        ("m.jsonl:2", "timestamp"),
    )
)
add(
    request_case(
        "mooncake-not-utf8",
        "m.jsonl",
        MC.encode() + b'{"timestamp": 5, "x": "\xff\xfe"}\n',
        ("m.jsonl",),
    )
)
add(
    request_case(
        "mooncake-missing-key",
        "m.jsonl",
        MC + '{"timestamp": 5, "input_length": 10}\n',
        ("m.jsonl:2", "output_length"),
    )
)
add(request_case("mooncake-not-object", "m.jsonl", MC + "[1, 2, 3]\n", ("m.jsonl:2",)))
add(
    request_case(
        "mooncake-bad-hash-ids",
        "m.jsonl",
        MC + '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}\n',
        ("m.jsonl:2", "hash_ids"),
    )
)
add(request_case("mooncake-truncated-gzip", "m.jsonl.gz", _truncated_gzip(MC), ("m.jsonl.gz",)))
VD = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
add(
    request_case(
        "vidur-negative-time", "v.csv", VD + "0,100,10\n-5,100,10\n", ("v.csv:3", "arrived_at")
    )
)
add(
    request_case(
        "vidur-prefill-1e30", "v.csv", VD + "0,1e30,10\n", ("v.csv:2", "num_prefill_tokens")
    )
)
RQ = "arrival_s,prompt_tokens,output_tokens,session_id,hash_ids\n"
add(
    request_case(
        "requests-tokens-1e30", "q.csv", RQ + "0,1e30,10,,\n", ("q.csv:2", "prompt_tokens")
    )
)
add(
    request_case(
        "requests-prompt-zero", "q.csv", RQ + "0,100,10,,\n1,0,10,,\n", ("q.csv:3", "prompt_tokens")
    )
)
add(
    request_case(
        "requests-hash-ids-text", "q.csv", RQ + "0,100,10,,1 x 3\n", ("q.csv:2", "hash_ids")
    )
)
add(
    request_case(
        "requests-hash-ids-2**70", "q.csv", RQ + f"0,100,10,,1 {BIG}\n", ("q.csv:2", "hash_ids")
    )
)
add(request_case("requests-time-inf", "q.csv", RQ + "inf,100,10,,\n", ("q.csv:2", "arrival_s")))
add(
    request_case(
        "requests-truncated-gzip", "q.csv.gz", _truncated_gzip(GOOD_REQUESTS), ("q.csv.gz",)
    )
)
add(request_case("requests-not-utf8", "q.csv", RQ.encode() + b"0,100,10,\xff\xfe,\n", ("q.csv",)))
add(request_case("requests-empty-file", "q.csv", "", ("q.csv", "empty")))
add(
    Case(
        "requests-pq-garbage",
        _with_files({"q.parquet": b"PAR1" + b"\x01junk" * 30}, simulate("q.parquet")),
        ("q.parquet",),
    )
)
add(
    Case(
        "requests-pq-tokens-1e30",
        _with_files(
            {
                "q.parquet": lambda d: _parquet(
                    d,
                    "q.parquet",
                    {
                        "arrival_s": pa.array([0.0, 1.0]),
                        "prompt_tokens": pa.array([1e30, 5.0]),
                        "output_tokens": pa.array([1, 2]),
                    },
                )
            },
            simulate("q.parquet"),
        ),
        ("q.parquet (row 1)", "prompt_tokens"),
    )
)
add(
    Case(
        "requests-pq-missing-column",
        _with_files(
            {
                "q.parquet": lambda d: _parquet(
                    d,
                    "q.parquet",
                    {"arrival_s": pa.array([0.0, 1.0]), "prompt_tokens": pa.array([1, 2])},
                )
            },
            simulate("q.parquet"),
        ),
        ("q.parquet", "output_tokens"),
    )
)


# sweep YAML
def sweep(name: str = "sw.yaml") -> Build:
    return lambda d: [
        "sweep",
        str(d / name),
        "--out",
        str(d / OUT),
        "--scheduler",
        "serial",
        "--no-progress",
    ]


def sweep_case(id: str, text: str | bytes, expect: tuple[str, ...]) -> Case:
    return Case(id, _with_files({"a.csv": GOOD_ALLOC, "sw.yaml": text}, sweep()), expect)


add(sweep_case("sweep-yaml-syntax", GOOD_SWEEP + "capacities: [1GiB\n", ("sw.yaml", "line")))
add(sweep_case("sweep-yaml-not-utf8", GOOD_SWEEP.encode() + b"name: \xff\xfe\n", ("sw.yaml",)))
add(
    sweep_case("sweep-unknown-key", GOOD_SWEEP + "polices: [x]\n", ("sw.yaml", "line 4", "polices"))
)
add(sweep_case("sweep-bad-capacity", GOOD_SWEEP + "capacities: [lots]\n", ("sw.yaml", "line 4")))
add(
    sweep_case(
        "sweep-missing-trace",
        "mode: replay\ntraces: [nope.csv]\npolicies: [first-fit]\n",
        ("sw.yaml", "nope.csv"),
    )
)
add(sweep_case("sweep-empty", "", ("sw.yaml",)))
add(sweep_case("sweep-not-a-mapping", "- just\n- a list\n", ("sw.yaml",)))


# -- session 22: a policy spec's error names the spec (of several -p, which one), a sweep's its
# file and line too; a negative time in each reader that has times
_BAD_KNOB = "best-fit:alignment_bytes=-5"
for _id, _spec, _why in [
    ("replay-second-policy-bad-knob", _BAD_KNOB, "alignment_bytes(=-5)"),
    ("replay-second-policy-unknown-knob", "best-fit:nope=1", "no parameter 'nope'"),
    ("replay-second-policy-unknown", "no-such-policy", "unknown policy"),
    ("replay-second-policy-bad-base", "elastic:base=[best-fit:nope=1]", "elastic base("),
]:
    add(
        alloc_case(
            _id,
            "a.csv",
            GOOD_ALLOC,
            (f"policy spec {_spec!r}: ", _why),
            command=lambda name, spec=_spec: replay(name, "-p", spec),
        )
    )
add(
    sweep_case(
        "sweep-policy-bad-knob",
        f"mode: replay\ntraces: [a.csv]\npolicies:\n  - first-fit\n  - '{_BAD_KNOB}'\n",
        ("sw.yaml", "line 5", "policies[1]", f"policy spec {_BAD_KNOB!r}: alignment_bytes(=-5)"),
    )
)
add(alloc_case("csv-negative-time", "a.csv", _csv("-10,alloc,0,4096,0,"), ("a.csv:2", "time_us")))
add(
    Case(
        "pq-negative-time",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", _alloc_columns(time_us=pa.array([-7, 5], pa.int64()))
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet (record 1)", "time_us -7 must be >= 0"),
    )
)
add(
    alloc_case(
        "rmm-negative-time", "r.csv", _rmm("1,-2.5,allocate,0x1000,4096,0"), ("r.csv:2", "Time")
    )
)
add(
    alloc_case(
        "snap-negative-time",
        "s.pickle.gz",
        _snapshot([_entry("alloc", time_us=-3)]),
        ("s.pickle.gz", "index 0", "time_us -3 must be >= 0"),
    )
)


# NaN, infinity and out-of-range values in each reader's numeric columns (where no case above
# has them): the file and line, and the column
_NAN_CASES = [
    ("csv-size-nan", "a.csv", _csv("0,alloc,0,nan,0,", "5,free,0,nan,0,"), "a.csv:2", "nbytes"),
    ("csv-time-nan", "a.csv", _csv("nan,alloc,0,4096,0,"), "a.csv:2", "time_us"),
    (
        "csv-time-inf",
        "a.csv",
        _csv("0,alloc,0,4096,0,", "inf,free,0,4096,0,"),
        "a.csv:3",
        "time_us",
    ),
    ("rmm-size-nan", "r.csv", _rmm("1,0.0,allocate,0x1000,nan,0"), "r.csv:2", "Size"),
    ("rmm-time-nan", "r.csv", _rmm("1,nan,allocate,0x1000,4096,0"), "r.csv:2", "Time"),
]
for _id, _name, _data, _line, _column in _NAN_CASES:
    add(alloc_case(_id, _name, _data, (_line, _column)))
_STAMP = "2023-11-16 18:17:03.9799600"
for _id, _name, _data, _line, _column in [
    ("azure-tokens-nan", "z.csv", AZ + f"{_STAMP},nan,10\n", "z.csv:2", "ContextTokens"),
    ("azure-tokens-inf", "z.csv", AZ + f"{_STAMP},inf,10\n", "z.csv:2", "ContextTokens"),
    (
        "burstgpt-time-nan",
        "b.csv",
        BG + "nan,ChatGPT,100,10,110,Conversation log\n",
        "b.csv:2",
        "Timestamp",
    ),
    (
        "burstgpt-tokens-inf",
        "b.csv",
        BG + "0,ChatGPT,inf,10,110,Conversation log\n",
        "b.csv:2",
        "Request tokens",
    ),
    (
        "mooncake-timestamp-NaN",
        "m.jsonl",
        MC.replace('"timestamp": 0', '"timestamp": NaN'),
        "m.jsonl:1",
        "timestamp",
    ),
    (
        "mooncake-input-Infinity",
        "m.jsonl",
        MC.replace("100", "Infinity"),
        "m.jsonl:1",
        "input_length",
    ),
    ("requests-tokens-nan", "q.csv", RQ + "0,nan,10,,\n", "q.csv:2", "prompt_tokens"),
    ("requests-time-nan", "q.csv", RQ + "nan,100,10,,\n", "q.csv:2", "arrival_s"),
]:
    add(request_case(_id, _name, _data, (_line, _column)))

STEPS_HEADER = (
    "start_s,duration_s,num_prefill_seqs,num_prefill_tokens,prefill_context_tokens,"
    "num_decode_seqs,decode_context_tokens\n"
)
for _id, _row, _column in [
    ("steps-duration-nan", "0.1,nan,1,10,10,0,0", "duration_s"),
    ("steps-duration-inf", "0.1,inf,1,10,10,0,0", "duration_s"),
    ("steps-duration-negative", "0.1,-1,1,10,10,0,0", "duration_s"),
    ("steps-tokens-1e30", "0.1,0.1,1,1e30,10,0,0", "num_prefill_tokens"),
    ("steps-tokens-400-digits", "0.1,0.1,1," + "9" * 400 + ",10,0,0", "num_prefill_tokens"),
]:
    add(
        Case(
            _id,
            _with_files(
                {"s.csv": STEPS_HEADER + "0.0,0.1,1,10,10,0,0\n" + _row + "\n"},
                _args("calibrate", "steps", "{d}/s.csv", "--out", "{d}/c.json"),
            ),
            ("s.csv:3", _column),
        )
    )


# cost, calibration, model and GPU JSON
def json_case(
    id: str, option: str, text: str | bytes, expect: tuple[str, ...], *, command: str = "replay"
) -> Case:
    name = "c.json"
    if command == "replay":
        build = replay("a.csv", option, "{d}/" + name)
    elif command == "simulate":
        build = simulate("q.csv", option, "{d}/" + name)
    else:  # gpu replay on the host stand-in, with --sim rows using the cost file
        build = lambda d: [
            "gpu",
            "replay",
            str(d / "a.csv"),
            "--backend",
            "host",
            "-p",
            "first-fit",
            "--sim",
            option,
            str(d / name),
            "--out",
            str(d / OUT),
            "--no-progress",
        ]
    return Case(
        id,
        _with_files({"a.csv": GOOD_ALLOC, "q.csv": GOOD_REQUESTS, name: text}, build),
        ("c.json", *expect),
    )


COSTS = {
    "malloc_us": {"nbytes": [1, 2], "us": [1, 2]},
    "free_us": {"nbytes": [1, 2], "us": [1, 2]},
    "d2d_bytes_per_s": 1e12,
    "h2d_bytes_per_s": 1e10,
    "d2h_bytes_per_s": 1e10,
}
add(json_case("costs-broken-json", "--costs", '{"malloc_us": ', ("c.json:1",)))
add(json_case("costs-not-object", "--costs", "[1, 2]", ()))
add(json_case("costs-not-utf8", "--costs", b'{"device": "\xff\xfe"}', ()))
add(
    json_case(
        "costs-negative-bandwidth",
        "--costs",
        json.dumps({**COSTS, "d2d_bytes_per_s": -1}),
        ("d2d_bytes_per_s",),
    )
)
add(
    json_case(
        "costs-missing-curve",
        "--costs",
        json.dumps({k: v for k, v in COSTS.items() if k != "free_us"}),
        ("free_us",),
    )
)
add(
    json_case(
        "costs-size-text",
        "--costs",
        json.dumps({**COSTS, "malloc_us": {"nbytes": ["a", "b"], "us": [1, 2]}}),
        ("malloc_us",),
    )
)
add(
    json_case(
        "costs-broken-json-simulate", "--costs", '{"malloc_us": ', ("c.json:1",), command="simulate"
    )
)
add(
    json_case(
        "costs-broken-json-gpu-replay", "--costs", '{"malloc_us": ', ("c.json:1",), command="gpu"
    )
)
add(
    json_case(
        "calibration-broken-json",
        "--calibration",
        '{"mfu_decode": ',
        ("line 1",),
        command="simulate",
    )
)
add(
    json_case(
        "calibration-out-of-range",
        "--calibration",
        '{"mfu_decode": 7}',
        ("mfu_decode",),
        command="simulate",
    )
)
add(
    json_case(
        "calibration-not-utf8", "--calibration", b'{"mfu_decode": "\xff"}', (), command="simulate"
    )
)
add(
    json_case(
        "calibration-unknown-factor",
        "--calibration",
        '{"speed": 1}',
        ("speed",),
        command="simulate",
    )
)

# a fitted calibration's hostile values: each refused with the file and the key path
FITTED = {
    "format": "poollab-step-time/2",
    "terms": {"fixed_s": 0.01, "per_token_s": 1e-5},
    "warmup_s": 0.0,
    "factors": {},
    "fit": {
        "feature_range": {
            "steps": "recorded",
            "quantile": 0.99,
            "features": {
                name: {"max": 9000.0, "quantile": 8000.0, "min": 1.0}
                for name in (
                    "num_prefill_tokens",
                    "prefill_context_tokens",
                    "num_decode_seqs",
                    "decode_context_tokens",
                    "kv_tokens",
                )
            },
        }
    },
}
_RANGE = "fit.feature_range"
_DC_MAX = f"{_RANGE}.features.decode_context_tokens.max"


def _fitted(edit: Callable[[dict], object] | None = None, literal: str | None = None) -> str:
    """``FITTED`` changed by ``edit``, or with decode_context_tokens' max written as ``literal``
    (JSON text: ``NaN``, ``Infinity``, a 400-digit integer)."""
    data = json.loads(json.dumps(FITTED))
    if edit is not None:
        edit(data)
    if literal is None:
        return json.dumps(data)
    data["fit"]["feature_range"]["features"]["decode_context_tokens"]["max"] = "@@"
    return json.dumps(data).replace('"@@"', literal)


def _features(data: dict) -> dict:
    return data["fit"]["feature_range"]["features"]


for _id, _literal in [
    ("1e30", "1e30"),
    ("nan", "NaN"),
    ("infinity", "Infinity"),
    ("negative", "-1"),
    ("string", '"big"'),
    ("10**400", "1" + "0" * 400),
]:
    add(
        json_case(
            f"calibration-range-max-{_id}",
            "--calibration",
            _fitted(literal=_literal),
            (f"c.json: {_DC_MAX}: not a finite count",),
            command="simulate",
        )
    )
for _id, _text, _expect in [
    (
        "missing-max",
        _fitted(lambda c: _features(c)["kv_tokens"].pop("max")),
        f"{_RANGE}.features.kv_tokens.max: missing",
    ),
    (
        "missing-feature",
        _fitted(lambda c: _features(c).pop("kv_tokens")),
        f"{_RANGE}.features: missing ['kv_tokens']",
    ),
    (
        "newer-feature",
        _fitted(lambda c: _features(c).update(new_tokens={"max": 1, "quantile": 1})),
        f"{_RANGE}.features: unknown key(s) ['new_tokens']",
    ),
    (
        "newer-key",
        _fitted(lambda c: c["fit"]["feature_range"].update(version=3)),
        f"{_RANGE}: unknown key(s) ['version']",
    ),
    (
        "newer-entry-key",
        _fitted(lambda c: _features(c)["kv_tokens"].update(p50=3)),
        f"{_RANGE}.features.kv_tokens: unknown key(s) ['p50']",
    ),
    (
        "quantile-nan",
        _fitted(lambda c: c["fit"]["feature_range"].update(quantile=float("nan"))),
        f"{_RANGE}.quantile: must be a number in (0, 1]",
    ),
    (
        "features-list",
        _fitted(lambda c: c["fit"]["feature_range"].update(features=[1, 2])),
        f"{_RANGE}.features: must be an object",
    ),
    (
        "entry-number",
        _fitted(lambda c: _features(c).update(kv_tokens=5)),
        f"{_RANGE}.features.kv_tokens: must be an object",
    ),
    (
        "term-10**400",
        _fitted().replace('"fixed_s": 0.01', '"fixed_s": 1' + "0" * 400),
        "term 'fixed_s' must be a finite number",
    ),
    (
        "warmup-10**400",
        _fitted().replace('"warmup_s": 0.0', '"warmup_s": 1' + "0" * 400),
        "'warmup_s' must be a finite number",
    ),
    (
        "factor-10**400",
        _fitted(lambda c: c.update(factors={"step_overhead_s": "@"})).replace(
            '"@"', "1" + "0" * 400
        ),
        "'step_overhead_s' must be a finite number",
    ),
    (
        "int-5000-digits",
        _fitted().replace('"warmup_s": 0.0', '"warmup_s": 1' + "0" * 5000),
        "not valid JSON: Exceeds the limit",
    ),
    (
        "tp-10**400",
        _fitted(lambda c: c.update(tp="@")).replace('"@"', "1" + "0" * 400),
        "tp(=1000",
    ),
    ("nested-objects", '{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deep"),
]:
    add(json_case(f"calibration-{_id}", "--calibration", _text, (_expect,), command="simulate"))
add(
    json_case(
        "costs-10**400",
        "--costs",
        json.dumps({**COSTS, "d2d_bytes_per_s": "@"}).replace('"@"', "1" + "0" * 400),
        ("d2d_bytes_per_s",),
    )
)
add(json_case("costs-nested", "--costs", "[" * 100_000 + "]" * 100_000, ("nested too deep",)))

# an endless or oversized settings file: refused after 16 MiB, never read forever
_SETTINGS_LIMIT = "more than the limit of 16,777,216 bytes on a settings file"
for _option in ("--calibration", "--costs", "--model", "--gpu"):
    add(
        Case(
            f"settings-dev-zero{_option.replace('--', '-')}",
            _with_files({"q.csv": GOOD_REQUESTS}, simulate("q.csv", _option, "/dev/zero")),
            ("/dev/zero", _SETTINGS_LIMIT),
        )
    )
add(
    Case(
        "settings-dev-zero-sweep",
        lambda d: [
            "sweep",
            "/dev/zero",
            "--out",
            str(d / OUT),
            "--scheduler",
            "serial",
            "--no-progress",
        ],
        ("/dev/zero", _SETTINGS_LIMIT),
    )
)
add(
    json_case(
        "calibration-200MB",
        "--calibration",
        json.dumps({**FITTED, "source": "x" * (17 << 20)}),
        (_SETTINGS_LIMIT,),
        command="simulate",
    )
)
add(
    Case(
        "model-folder",
        _with_files({"q.csv": GOOD_REQUESTS}, simulate("q.csv", "--model", "{d}")),
        ("is a folder, not a JSON file",),
    )
)
add(
    Case(
        "sweep-calibration-fifo",
        _with_files(
            {
                "q.csv": GOOD_REQUESTS,
                "sw.yaml": "mode: simulate\ntraces: [q.csv]\npolicies: [paged]\n"
                "calibration: cal.fifo\n",
                "cal.fifo": lambda d: os.mkfifo(d / "cal.fifo"),
            },
            sweep(),
        ),
        ("sw.yaml", "calibration", "not a regular file", "cal.fifo"),
    )
)
add(json_case("model-broken-json", "--model", '{"name": ', ("line 1",), command="simulate"))
add(json_case("model-missing-field", "--model", '{"name": "m"}', ("missing",), command="simulate"))
add(json_case("model-not-utf8", "--model", b'{"name": "\xff"}', (), command="simulate"))
add(json_case("gpu-broken-json", "--gpu", '{"name": ', ("line 1",), command="simulate"))
add(json_case("gpu-not-utf8", "--gpu", b"\xff\xfe{}", (), command="simulate"))
add(
    Case(
        "synth-alloc-model-broken",
        _with_files(
            {"c.json": '{"num_layers": '},
            _args("traces", "synth-alloc", "--model", "{d}/c.json", "--out", "{d}/t.csv"),
        ),
        ("c.json",),
    )
)

# options that cannot work
add(
    Case(
        "synth-alloc-negative-rate",
        _args("traces", "synth-alloc", "--rate", "-1", "--out", "{d}/t.csv"),
        ("--rate",),
    )
)
add(
    Case(
        "synth-alloc-nan-rate",
        _args("traces", "synth-alloc", "--rate", "nan", "--out", "{d}/t.csv"),
        ("--rate",),
    )
)
add(
    Case(
        "synth-too-many-requests",
        _args(
            "traces", "synth", "--rate", "5", "--num-requests", "10000000000", "--out", "{d}/t.csv"
        ),
        ("num_requests", "10,000,000,000"),
    )
)
add(
    Case(
        "synth-too-long-duration",
        _args("traces", "synth", "--rate", "1e9", "--duration", "1e9", "--out", "{d}/t.csv"),
        ("requests",),
    )
)
add(
    Case(
        "synth-negative-rate",
        _args("traces", "synth", "--rate", "-5", "--num-requests", "10", "--out", "{d}/t.csv"),
        ("rate",),
    )
)
add(
    Case(
        "synth-out-txt",
        _args("traces", "synth", "--rate", "5", "--num-requests", "10", "--out", "{d}/t.txt"),
        ("t.txt",),
    )
)
add(Case("synth-alloc-out-txt", _args("traces", "synth-alloc", "--out", "{d}/t.txt"), ("t.txt",)))
add(
    Case(
        "replay-out-is-a-file",
        _with_files(
            {"a.csv": GOOD_ALLOC, "out.txt": "x"},
            lambda d: ["replay", str(d / "a.csv"), "--out", str(d / "out.txt"), "--no-progress"],
        ),
        ("out.txt",),
    )
)

# --out under a path that is a file (NotADirectoryError), every command that writes
UNDER = "{d}/blocker/out"
add(
    Case(
        "out-under-file-replay",
        _with_files(
            {"a.csv": GOOD_ALLOC, "blocker": _blocker},
            _args("replay", "{d}/a.csv", "-p", "first-fit", "--out", UNDER, "--no-progress"),
        ),
        ("blocker",),
    )
)
add(
    Case(
        "out-under-file-simulate",
        _with_files(
            {"q.csv": GOOD_REQUESTS, "blocker": _blocker},
            _args(
                "simulate", "{d}/q.csv", "-p", "paged", "--model", "Llama-3.2-1B", "--out", UNDER
            ),
        ),
        ("blocker",),
    )
)
add(
    Case(
        "out-under-file-synth",
        _with_files(
            {"blocker": _blocker},
            _args(
                "traces", "synth", "--rate", "5", "--num-requests", "10", "--out", UNDER + ".csv"
            ),
        ),
        ("blocker",),
    )
)
add(
    Case(
        "out-under-file-synth-alloc",
        _with_files(
            {"blocker": _blocker},
            _args("traces", "synth-alloc", "--num-requests", "2", "--out", UNDER + ".csv"),
        ),
        ("blocker",),
    )
)
add(
    Case(
        "out-under-file-fidelity",
        _with_files(
            {
                S: _snapshot([_entry("alloc"), _entry("free_completed", time_us=5)]),
                "blocker": _blocker,
            },
            _args("fidelity", "{d}/" + S, "--out", UNDER),
        ),
        ("blocker",),
    )
)
add(
    Case(
        "out-under-file-gpu-replay-host",
        _with_files(
            {"a.csv": GOOD_ALLOC, "blocker": _blocker},
            _args(
                "gpu",
                "replay",
                "{d}/a.csv",
                "--backend",
                "host",
                "-p",
                "first-fit",
                "--out",
                UNDER,
                "--no-progress",
            ),
        ),
        ("blocker",),
    )
)
add(
    Case(
        "out-under-file-sweep",
        _with_files(
            {"a.csv": GOOD_ALLOC, "sw.yaml": GOOD_SWEEP, "blocker": _blocker},
            _args("sweep", "{d}/sw.yaml", "--out", UNDER, "--scheduler", "serial", "--no-progress"),
        ),
        ("blocker",),
    )
)


def _result_folder(
    d: Path,
    name: str = "res",
    summary: str | bytes = "trace,policy,backend\nt,p,sim\n",
    run_json: str | bytes | None = None,
) -> None:
    (d / name).mkdir()
    _write(d / name, "summary.csv", summary)
    if run_json is not None:
        _write(d / name, "run.json", run_json)


add(
    Case(
        "out-under-file-report",
        _with_files(
            {"res": _result_folder, "blocker": _blocker},
            _args("report", "{d}/res", "--out", "{d}/blocker/report.html"),
        ),
        ("blocker",),
    )
)
add(
    Case(
        "report-summary-not-utf8",
        _with_files(
            {"res": lambda d: _result_folder(d, summary=b"trace,policy\n\xff\xfe,\x80\n")},
            _args("report", "{d}/res", "--out", "{d}/r.html"),
        ),
        ("summary.csv",),
    )
)
add(
    Case(
        "report-run-json-broken",
        _with_files(
            {"res": lambda d: _result_folder(d, run_json='{"command": ')},
            _args("report", "{d}/res", "--out", "{d}/r.html"),
        ),
        ("run.json",),
    )
)
add(
    Case(
        "report-parquet-broken",
        _with_files(
            {
                "res": lambda d: (
                    _result_folder(d),
                    _write(d / "res", "timeseries.parquet", b"PAR1junk"),
                )
            },
            _args("report", "{d}/res", "--out", "{d}/r.html"),
        ),
        ("timeseries.parquet",),
    )
)


# -- issue 29, hostile request traces, generator specs, policy specs and sweep files --------------
HUGE, HUGER = "9" * 400, "9" * 5000  # past float64; past Python's int-string digit limit
DEEP_SPEC = "elastic:base=[" * 3000 + "best-fit" + "]" * 3000
add(
    request_case(
        "azure-tokens-400-digits",
        "az.csv",
        AZ + f"2023-11-16 18:17:03.9799600,{HUGE},10\n",
        ("az.csv:2", "ContextTokens", "more than"),
    )
)
add(
    request_case(
        "azure-year-9999",
        "az.csv",
        AZ + "2023-11-16 18:17:03.979960,100,10\n9999-11-16 18:17:03.979960,100,10\n",
        ("az.csv:3", "TIMESTAMP", "years after"),
    )
)
add(
    request_case(
        "azure-year-9999-7-digits",
        "az.csv",
        AZ + "2023-11-16 18:17:03.9799600,100,10\n9999-11-16 18:17:03.9799600,100,10\n",
        ("az.csv:3", "TIMESTAMP", "2262"),
    )
)
add(
    request_case(
        "burstgpt-timestamp-400-digits",
        "b.csv",
        BG + f"5,ChatGPT,100,10,110,x\n{HUGE},ChatGPT,1,1,2,x\n",
        ("b.csv:3", "Timestamp", "later than"),
    )
)
add(
    request_case(
        "requests-tokens-400-digits",
        "q.csv",
        RQ + f"0,{HUGE},10,,\n",
        ("q.csv:2", "prompt_tokens", "more than"),
    )
)
add(
    request_case(
        "requests-time-400-digits",
        "q.csv",
        RQ + f"0,100,10,,\n{HUGE},100,10,,\n",
        ("q.csv:3", "arrival_s", "later than"),
    )
)
add(
    request_case(
        "requests-tokens-5000-digits",
        "q.csv",
        RQ + f"0,100,{HUGER},,\n",
        ("q.csv:2", "output_tokens", "5,000 characters"),
    )
)
add(
    request_case(
        "requests-tokens-boolean",
        "q.csv",
        RQ + "0,True,10,,\n1,False,10,,\n",
        ("q.csv:2", "prompt_tokens", "boolean"),
    )
)
add(
    request_case(
        "vidur-prefill-minus-400-digits",
        "v.csv",
        VD + f"0,-{HUGE},10\n",
        ("v.csv:2", "num_prefill_tokens", "negative"),
    )
)
add(
    request_case(
        "mooncake-input-400-digits",
        "m.jsonl",
        MC + f'{{"timestamp": 5, "input_length": {HUGE}, "output_length": 10}}\n',
        ("m.jsonl:2", "input_length", "more than"),
    )
)
add(
    request_case(
        "mooncake-timestamp-400-digits",
        "m.jsonl",
        MC + f'{{"timestamp": {HUGE}, "input_length": 10, "output_length": 10}}\n',
        ("m.jsonl:2", "timestamp", "later than"),
    )
)
add(
    request_case(
        "mooncake-5000-digits",
        "m.jsonl",
        MC + f'{{"timestamp": 5, "input_length": 10, "output_length": {HUGER}}}\n',
        ("m.jsonl:2", "digits"),
    )
)
add(
    request_case(
        "mooncake-deep-json",
        "m.jsonl",
        MC
        + '{"timestamp": 5, "input_length": 1, "output_length": 1, "x": '
        + "[" * 50_000
        + "]" * 50_000
        + "}\n",
        ("m.jsonl:2", "nested"),
    )
)
add(
    request_case(
        "mooncake-hash-ids-string",
        "m.jsonl",
        MC + '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": "123"}\n',
        ("m.jsonl:2", "hash_ids '123'"),
    )
)
add(
    request_case(
        "mooncake-hash-ids-floats",
        "m.jsonl",
        MC + '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1.0, 2.5]}\n',
        ("m.jsonl:2", "hash_ids"),
    )
)
PQ_OK = {
    "arrival_s": pa.array([0.0, 1.0]),
    "prompt_tokens": pa.array([4, 5]),
    "output_tokens": pa.array([1, 2]),
}
for _id, _col in [
    ("bool-tokens", {"prompt_tokens": pa.array([True, True])}),
    ("time-is-a-date", {"arrival_s": pa.array([0, 86_400_000_000], pa.timestamp("us"))}),
    ("hash-ids-string", {"hash_ids": pa.array(["123", "4"])}),
    ("hash-ids-floats", {"hash_ids": pa.array([[1.0, 2.5], [3.0]])}),
]:
    add(
        Case(
            f"requests-pq-{_id}",
            _with_files(
                {"q.parquet": lambda d, c=_col: _parquet(d, "q.parquet", {**PQ_OK, **c})},
                simulate("q.parquet"),
            ),
            ("q.parquet (row 1)", next(iter(_col))),
        )
    )
SYNTH = ["traces", "synth", "--rate", "5", "--num-requests", "10", "--out", "{d}/t.csv"]
add(
    Case(
        "synth-prompt-fixed-1e10",
        _args(*SYNTH, "--prompt", "fixed:1e10"),
        ("fixed", "2,147,483,647"),
    )
)
add(Case("synth-prompt-1e400", _args(*SYNTH, "--prompt", "fixed:1e400"), ("fixed:1e400", "finite")))
add(
    Case(
        "synth-prompt-lognormal-1e300",
        _args(*SYNTH, "--output", "lognormal:median=1e300,sigma=1"),
        ("median",),
    )
)
add(
    Case(
        "synth-prompt-5000-digits",
        _args(*SYNTH, "--prompt", "fixed:" + HUGER),
        ("characters long",),
    )
)
add(
    Case(
        "synth-prefix-nested",
        _args(*SYNTH, "--prefix-sharing", "prefix_tokens=[[[[1]]]]"),
        ("prefix-sharing", "nested"),
    )
)
add(
    Case(
        "synth-prefix-block-1e13",
        _args(*SYNTH, "--prefix-sharing", "block_tokens=10000000000000"),
        ("block_tokens",),
    )
)
add(
    Case(
        "synth-rate-1e-300",
        _args("traces", "synth", "--rate", "1e-300", "--num-requests", "3", "--out", "{d}/t.csv"),
        ("1e+11 s",),
    )
)
add(Case("synth-gamma-cv-1e300", _args(*SYNTH, "--arrival", "gamma", "--cv", "1e300"), ("cv",)))
add(
    Case(
        "synth-alloc-1e8-requests",
        _args("traces", "synth-alloc", "--num-requests", "100000000", "--out", "{d}/t.csv"),
        ("events",),
    )
)
add(
    alloc_case(
        "replay-policy-spec-3000-deep",
        "a.csv",
        GOOD_ALLOC,
        ("policy spec", "characters long"),
        command=lambda name: (
            lambda d: [
                "replay",
                str(d / name),
                "-p",
                DEEP_SPEC,
                "--out",
                str(d / OUT),
                "--no-progress",
            ]
        ),
    )
)
add(
    alloc_case(
        "replay-policy-spec-nested-100",
        "a.csv",
        GOOD_ALLOC,
        ("policy spec", "100 levels deep"),
        command=lambda name: (
            lambda d: [
                "replay",
                str(d / name),
                "-p",
                "tag-limits:limits=" + "[" * 100 + "]" * 100,
                "--out",
                str(d / OUT),
                "--no-progress",
            ]
        ),
    )
)
add(
    alloc_case(
        "replay-tag-limit-400-digits",
        "a.csv",
        GOOD_ALLOC,
        ("limits", "too large"),
        command=lambda name: (
            lambda d: [
                "replay",
                str(d / name),
                "-p",
                f"tag-limits:limits=[kv={HUGE}]",
                "--out",
                str(d / OUT),
                "--no-progress",
            ]
        ),
    )
)
_LAUGHS = "".join(
    [f"a0: &a0 [{', '.join(['1MiB'] * 10)}]\n"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10)]
)
add(
    sweep_case(
        "sweep-billion-laughs",
        GOOD_SWEEP + _LAUGHS + "capacities: *a9\n",
        ("sw.yaml", "line 8", "aliases"),
    )
)
add(
    sweep_case(
        "sweep-alias-cycle",
        "mode: replay\ntraces: [a.csv]\npolicies: &p [first-fit, *p]\n",
        ("sw.yaml", "line 3", "contains it"),
    )
)
add(
    sweep_case(
        "sweep-deep-lists",
        GOOD_SWEEP + "name: " + "[" * 20_000 + "]" * 20_000 + "\n",
        ("sw.yaml", "line 4", "nested"),
    )
)
add(
    sweep_case(
        "sweep-deep-mappings",
        GOOD_SWEEP + "name: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n",
        ("sw.yaml", "line 4", "nested"),
    )
)
add(
    sweep_case(
        "sweep-deep-policy-spec",
        f"mode: replay\ntraces: [a.csv]\npolicies: ['{DEEP_SPEC}']\n",
        ("sw.yaml", "characters long"),
    )
)
_VALUES = ", ".join(str(i) for i in range(1, 1001))
add(
    sweep_case(
        "sweep-billion-cells",
        f"mode: replay\ntraces: [{', '.join(['a.csv'] * 1000)}]\n"
        f"policies: [{{policy: size-class, params: {{classes_per_doubling: [{_VALUES}]}}}}]\n"
        f"capacities: [{', '.join(f'{i}MiB' for i in range(1, 1001))}]\n",
        ("sw.yaml", "1,000,000,000 cells", "100,000"),
    )
)

# issue 29 (helper D): numbers that do not fit in options, at parse time; result folders that are
# not what they claim, or hold files poollab did not write
DIGITS_400 = "9" * 400


def _label(value: str) -> str:
    return value if len(value) <= 16 else f"{len(value)}-characters-{value[-3:]}"


for opt, value, want in [
    ("--capacity", DIGITS_400, "too large"),
    ("--capacity", f"{DIGITS_400}GiB", "too large"),
    ("--capacity", "-1GiB", "--capacity"),
    ("--latency-sample", "nan", "finite"),
    ("--latency-sample", "inf", "finite"),
    ("--sample-every", "0", "--sample-every"),
    ("--sample-every", DIGITS_400, "--sample-every"),
]:
    add(
        Case(
            f"option-replay{opt}-{_label(value)}",
            _with_files({"a.csv": GOOD_ALLOC}, replay("a.csv", opt, value)),
            (opt, want),
        )
    )
for opt, value, want in [
    ("--kv-capacity", DIGITS_400, "too large"),
    ("--rate-scale", "1e-300", "1e-06"),
    ("--rate-scale", "nan", "finite"),
    ("--rate-scale", "inf", "finite"),
    ("--rate-scale", "-1", "--rate-scale"),
    ("--slo-ttft", "nan", "finite"),
    ("--max-num-seqs", DIGITS_400, "--max-num-seqs"),
    ("--workspace", "1e400", "--workspace"),
    ("--gpu-memory-utilization", "nan", "finite"),
    ("--virtual-page", "4GiB", "too large"),
]:
    add(
        Case(
            f"option-simulate{opt}-{_label(value)}",
            _with_files({"q.csv": GOOD_REQUESTS}, simulate("q.csv", opt, value)),
            (opt, want),
        )
    )
add(
    Case(
        "option-colocate-tenant-rate-nan",
        _with_files(
            {"q.csv": GOOD_REQUESTS},
            _args(
                "colocate",
                "{d}/q.csv",
                "--tenants",
                "2",
                "--tenant-rate-scale",
                "1,nan",
                "--out",
                "{d}/" + OUT,
            ),
        ),
        ("--tenant-rate-scale", "finite"),
    )
)
add(
    Case(
        "option-colocate-rate-scale-1e-300",
        _with_files(
            {"q.csv": GOOD_REQUESTS},
            _args("colocate", "{d}/q.csv", "--rate-scale", "1e-300", "--out", "{d}/" + OUT),
        ),
        ("--rate-scale",),
    )
)
add(
    Case(
        "option-colocate-tenants-huge",
        _with_files(
            {"q.csv": GOOD_REQUESTS},
            _args("colocate", "{d}/q.csv", "--tenants", DIGITS_400, "--out", "{d}/" + OUT),
        ),
        ("--tenants",),
    )
)
add(
    Case(
        "option-synth-scale-1e-300",
        _args(
            "traces",
            "synth",
            "--rate",
            "5",
            "--num-requests",
            "10",
            "--scale",
            "1e-300",
            "--out",
            "{d}/t.csv",
        ),
        ("--scale",),
    )
)
add(
    Case(
        "option-synth-rate-inf",
        _args("traces", "synth", "--rate", "inf", "--num-requests", "10", "--out", "{d}/t.csv"),
        ("--rate", "finite"),
    )
)
add(
    Case(
        "option-synth-seed-negative",
        _args(
            "traces",
            "synth",
            "--rate",
            "5",
            "--num-requests",
            "10",
            "--seed",
            "-1",
            "--out",
            "{d}/t.csv",
        ),
        ("--seed",),
    )
)
add(
    Case(
        "option-synth-alloc-requests-huge",
        _args("traces", "synth-alloc", "--num-requests", DIGITS_400, "--out", "{d}/t.csv"),
        ("--num-requests",),
    )
)
add(
    Case(
        "option-gpu-replay-capacity-huge",
        _with_files(
            {"a.csv": GOOD_ALLOC},
            _args(
                "gpu",
                "replay",
                "{d}/a.csv",
                "--backend",
                "host",
                "--capacity",
                DIGITS_400,
                "--out",
                "{d}/" + OUT,
            ),
        ),
        ("--capacity", "too large"),
    )
)
add(
    Case(
        "option-fidelity-capacity-huge",
        _with_files(
            {S: _snapshot([_entry("alloc")])},
            _args("fidelity", "{d}/" + S, "--capacity", DIGITS_400, "--out", "{d}/" + OUT),
        ),
        ("--capacity", "too large"),
    )
)
add(
    Case(
        "option-sweep-workers-huge",
        _with_files(
            {"a.csv": GOOD_ALLOC, "sw.yaml": GOOD_SWEEP},
            _args("sweep", "{d}/sw.yaml", "--workers", DIGITS_400, "--out", "{d}/" + OUT),
        ),
        ("--workers",),
    )
)
for value, what in [("[1, 2]", "a list"), ("null", "null"), ("7", "a number")]:
    add(
        Case(
            f"report-run-json-{what.split()[-1]}",
            _with_files(
                {"res": lambda d, v=value: _result_folder(d, run_json=v)},
                _args("report", "{d}/res", "--out", "{d}/r.html"),
            ),
            ("res/run.json", what),
        )
    )
add(
    Case(
        "report-written-list-broken",
        _with_files(
            {
                "res": lambda d: (
                    _result_folder(d),
                    _write(d / "res", ".poollab-files.json", '{"files": 3}'),
                )
            },
            _args("report", "{d}/res", "--out", "{d}/r.html"),
        ),
        (".poollab-files.json",),
    )
)
add(
    Case(
        "replay-out-written-list-broken",
        _with_files(
            {
                "a.csv": GOOD_ALLOC,
                "x": lambda d: _write(d / OUT, ".poollab-files.json", "[not json"),
            },
            replay("a.csv"),
        ),
        ("out/.poollab-files.json", "nothing was changed"),
    )
)
# out/ holds summary.csv and timeseries.parquet that no poollab run listed as its own: refused, not
# replaced
add(
    Case(
        "replay-out-holds-files-poollab-did-not-write",
        _with_files({"a.csv": GOOD_ALLOC}, replay("a.csv")),
        ("out/summary.csv", "did not write it"),
    )
)
add(
    Case(
        "simulate-out-holds-files-poollab-did-not-write",
        _with_files({"q.csv": GOOD_REQUESTS}, simulate("q.csv")),
        ("out/summary.csv", "did not write it"),
    )
)


# -- issue 29, allocation traces and streams (helper B): hostile fields, impossible snapshots,
# numbers
# that do not fit, columns of the wrong kind, what a log cannot do, traces from a pipe ------------
MiB = 1 << 20
SEG_A, SEG_B = 0x7F0000000000, 0x7F0010000000


def _seg(address: int, total_size: int, blocks: list, **extra) -> dict:
    return {
        "device": 0,
        "address": address,
        "total_size": total_size,
        "allocated_size": 0,
        "stream": 0,
        "segment_type": "large",
        "is_expandable": False,
        "blocks": blocks,
        **extra,
    }


def _blk(address: int, size: int, state: str = "inactive", **extra) -> dict:
    return {"address": address, "size": size, "requested_size": size, "state": state, **extra}


def _nested_snapshot(depth: int = 100_000) -> bytes:
    """A snapshot whose one trace entry is a list nested ``depth`` deep, by opcode (pickle.dumps
    recurses)."""
    key = lambda text: b"\x8c" + bytes([len(text)]) + text.encode()  # noqa: E731 (SHORT_BINUNICODE)
    return (
        b"\x80\x04}"
        + key("segments")
        + b"]s"
        + key("device_traces")
        + b"]]"
        + b"]" * depth
        + b"a" * (depth - 1)
        + b"aas."
    )


def _from_pipe(data: bytes, command: Callable[[str], list[str]]) -> Build:
    """The trace is a pipe, as ``<(...)`` hands one over (``/dev/fd/N``), fed by a thread."""

    def build(d: Path) -> list[str]:
        import threading

        r, w = os.pipe()

        def feed():
            with os.fdopen(w, "wb") as f:
                f.write(data)

        threading.Thread(target=feed, daemon=True).start()
        return command(f"/dev/fd/{r}")

    return build


def _replay_path(path: str) -> list[str]:
    return ["replay", path, "-p", "first-fit", "--no-progress", "--out", "{d}/" + OUT]


def _pipe_case(id: str, data: bytes, expect: tuple[str, ...], command=_replay_path) -> Case:
    def build(d: Path) -> list[str]:
        return [a.replace("{d}", str(d)) for a in _from_pipe(data, command)(d)]

    return Case(id, build, expect)


_LONG_CSV = _csv(
    *(f"{2 * i},alloc,{i},4096,0,\n{2 * i + 1},free,{i},4096,0," for i in range(300))
)  # > 4 KiB
_WEIGHTS = [_blk(SEG_A, 2 * MiB, "active_allocated")]
# snapshot fields out of range or of the wrong type
add(
    alloc_case(
        "snap-addr-2**63", S, _snapshot([_entry("alloc", addr=2**63)]), (S, "index 0", "address")
    )
)
add(
    alloc_case(
        "snap-addr-negative", S, _snapshot([_entry("alloc", addr=-4096)]), (S, "index 0", "address")
    )
)
add(
    alloc_case(
        "snap-free-addr-2**64",
        S,
        _snapshot([_entry("free_completed", addr=2**64)]),
        (S, "index 0", "address"),
    )
)
add(
    alloc_case(
        "snap-device-trace-int",
        S,
        _snapshot([], raw={"segments": [], "device_traces": [[_entry("alloc")], 3]}),
        (S, "device_traces index 1", "not a list"),
    )
)
add(
    alloc_case(
        "snap-devices-str-and-int",
        S,
        _snapshot(
            [_entry("alloc")],
            [_seg(SEG_A, 2 * MiB, [], device="0"), _seg(SEG_B, 2 * MiB, [], device=1)],
        ),
        (S, "segments index 0", "device '0'"),
    )
)
add(
    alloc_case(
        "snap-device-unhashable",
        S,
        _snapshot([_entry("alloc")], [_seg(SEG_A, 2 * MiB, [], device=[0])]),
        (S, "segments index 0", "device [0]"),
    )
)
add(
    alloc_case(
        "snap-segment-event-addr-text",
        S,
        _snapshot([_entry("segment_alloc", addr="0x7f00", size=2 * MiB), _entry("alloc")]),
        (S, "index 0", "address '0x7f00'"),
    )
)
add(
    alloc_case(
        "snap-stream-text",
        S,
        _snapshot([_entry("alloc", stream="default")]),
        (S, "index 0", "stream"),
    )
)
add(
    alloc_case(
        "snap-expandable-map-2**55",
        S,
        _snapshot(
            [_entry("segment_map", addr=SEG_A, size=2**55), _entry("alloc", addr=SEG_A)],
            [_seg(SEG_A, 2 * MiB, [_blk(SEG_A, 2 * MiB)], is_expandable=True)],
        ),
        (S, "index 0", "virtual address space"),
    )
)
add(alloc_case("snap-nested-100000-deep", "s.pickle", _nested_snapshot(), ("s.pickle",)))
# snapshots that cannot be real
add(
    alloc_case(
        "snap-block-larger-than-segment",
        S,
        _snapshot(
            [_entry("alloc", addr=SEG_B)],
            [_seg(SEG_A, 2 * MiB, [_blk(SEG_A, 4 * MiB, "active_allocated")])],
        ),
        (S, "segments index 0", "block 0"),
    )
)
add(
    alloc_case(
        "snap-overlapping-segments",
        S,
        _snapshot(
            [_entry("alloc", addr=SEG_B)],
            [
                _seg(SEG_A, 4 * MiB, [_blk(SEG_A, 4 * MiB)]),
                _seg(SEG_A + 2 * MiB, 2 * MiB, [_blk(SEG_A + 2 * MiB, 2 * MiB)]),
            ],
        ),
        (S, "segments index 1", "overlaps segments index 0"),
    )
)
for _kind, _requested in (("negative", -8), ("text", "4096"), ("fractional", 4095.5)):
    add(
        alloc_case(
            f"snap-requested-size-{_kind}",
            S,
            _snapshot(
                [_entry("alloc", addr=SEG_B)],
                [_seg(SEG_A, 2 * MiB, [{**_WEIGHTS[0], "requested_size": _requested}])],
            ),
            (S, "segments index 0", "requested_size"),
        )
    )
# our CSV and Parquet
add(
    alloc_case(
        "csv-size-5000-digits",
        "a.csv",
        _csv("0,alloc,0," + "9" * 5000 + ",0,"),
        ("a.csv:2", "nbytes"),
    )
)
add(
    alloc_case(
        "csv-time-5000-digits",
        "a.csv",
        _csv("0,alloc,0,4096,0,", "9" * 5000 + ",free,0,4096,0,"),
        ("a.csv:3", "time_us"),
    )
)
add(
    alloc_case(
        "csv-free-on-another-stream",
        "a.csv",
        _csv("0,alloc,0,4096,0,", "5,free,0,4096,3,"),
        ("a.csv:3", "stream 3"),
    )
)
add(
    Case(
        "pq-bool-nbytes",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", _alloc_columns(nbytes=pa.array([True, True]))
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet", "nbytes", "bool"),
    )
)
add(
    Case(
        "pq-timestamp-time",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", _alloc_columns(time_us=pa.array([0, 5], pa.timestamp("us")))
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet", "time_us", "timestamp"),
    )
)
add(
    Case(
        "pq-free-on-another-stream",
        _with_files(
            {
                "a.parquet": lambda d: _parquet(
                    d, "a.parquet", _alloc_columns(stream=pa.array([0, 1], pa.int64()))
                )
            },
            replay("a.parquet"),
        ),
        ("a.parquet (record 2)", "stream"),
    )
)
# RMM logs that cannot be real
add(
    alloc_case(
        "rmm-overlapping-allocations",
        "r.csv",
        _rmm(f"1,{T},allocate,0x1000,4096,0x0", f"1,{T},allocate,0x1800,64,0x0"),
        ("r.csv:3", "overlaps"),
    )
)
add(
    alloc_case(
        "rmm-time-goes-back",
        "r.csv",
        _rmm("1,10:00:09.000000,allocate,0x10,8,0x0", "1,10:00:01.000000,free,0x10,8,0x0"),
        ("r.csv:3", "Time goes back"),
    )
)
# traces from a pipe: detection no longer eats the first 4 KiB, errors name the pipe and line
add(
    _pipe_case(
        "pipe-csv-bad-row-past-4KiB",
        (_LONG_CSV + "700,explode,9,1,0,\n").encode(),
        ("/dev/fd/", ":602", "op"),
    )
)
add(
    _pipe_case(
        "pipe-gzip-snapshot-size-2**70",
        _snapshot([_entry("alloc", size=2**70)]),
        ("/dev/fd/", "index 0"),
    )
)
add(
    _pipe_case(
        "pipe-info-rmm-free-not-live",
        _rmm(f"1,{T},free,0x10,4096,0x0").encode(),
        ("/dev/fd/", ":2", "not live"),
        command=lambda path: ["traces", "info", path],
    )
)
add(
    _pipe_case(
        "pipe-simulate-requests-negative",
        (RQ + "0,100,10,,\n1,-5,10,,\n").encode(),
        ("/dev/fd/", ":3", "prompt"),
        command=lambda path: [
            "simulate",
            path,
            "-p",
            "paged",
            "--model",
            "Llama-3.2-1B",
            "--out",
            "{d}/" + OUT,
        ],
    )
)

#: Over the reading limits, with the limit lowered to 1 MiB (``POOLLAB_MAX_TRACE_BYTES``) so the
#: files stay small.
LIMIT_CASES: list[Case] = []


def _sparse(d: Path, name: str, header: str, nbytes: int) -> None:
    with open(d / name, "wb") as f:
        f.write(header.encode())
        f.truncate(nbytes)


LIMIT_CASES.append(
    Case(
        "limit-sparse-csv",
        _with_files(
            {"a.csv": lambda d: _sparse(d, "a.csv", ALLOC_HEADER + "\n", 8 * MiB)}, replay("a.csv")
        ),
        ("a.csv", "8,388,608 bytes", "POOLLAB_MAX_TRACE_BYTES"),
    )
)
LIMIT_CASES.append(
    Case(
        "limit-gzip-bomb",
        _with_files(
            {"a.csv.gz": gzip.compress(GOOD_ALLOC.encode() + b"\0" * 16 * MiB, mtime=0)},
            replay("a.csv.gz"),
        ),
        ("a.csv.gz", "decompresses", "1,048,576"),
    )
)
LIMIT_CASES.append(
    Case(
        "limit-gzip-bomb-requests",
        _with_files(
            {"q.csv.gz": gzip.compress(GOOD_REQUESTS.encode() + b"\0" * 16 * MiB, mtime=0)},
            simulate("q.csv.gz"),
        ),
        ("q.csv.gz", "decompresses"),
    )
)
LIMIT_CASES.append(
    Case(
        "limit-bad-setting",
        _with_files({"a.csv": GOOD_ALLOC}, replay("a.csv")),
        ("POOLLAB_MAX_TRACE_BYTES='1MiB'",),
    )
)


@pytest.mark.parametrize("case", LIMIT_CASES, ids=[c.id for c in LIMIT_CASES])
def test_bad_input_over_the_limits_is_one_line_exit_2_and_changes_nothing(
    case: Case, tmp_path: Path, monkeypatch
):
    monkeypatch.setenv(
        "POOLLAB_MAX_TRACE_BYTES", "1MiB" if case.id == "limit-bad-setting" else str(MiB)
    )
    argv = _prepare(case, tmp_path)
    before = _tree(tmp_path)
    code, _, err = run_in_process(argv)
    check(case, tmp_path, code, err, before)


# -- the test ---------------------------------------------------------------------------------

#: Written into ``out/`` before each case: a failed run must leave it exactly so.
OLD_RESULT = {
    "summary.csv": b"trace,policy,backend\nold,run,sim\n",
    "timeseries.parquet": b"old bytes",
}


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for folders): the state a failed run must
    keep."""
    return {  # a FIFO is named, not read (reading it would wait for a writer)
        str(p.relative_to(root)): (
            None if p.is_dir() else p.read_bytes() if p.is_file() else b"(not a regular file)"
        )
        for p in sorted(root.rglob("*"))
    }


def _prepare(case: Case, folder: Path) -> list[str]:
    (folder / OUT).mkdir()
    for name, data in OLD_RESULT.items():
        (folder / OUT / name).write_bytes(data)
    return case.build(folder)


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    """``poollab ARGV`` in this process: (exit status, stdout, stderr)."""
    runner = CliRunner()
    with runner.isolation() as (out, err, _):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return code, out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace")


def check(case: Case, folder: Path, code: int, err: str, before: dict) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert code == 2, f"exit {code}; stderr: {err}"
    assert len(lines) == 1, f"{len(lines)} lines on stderr: {err}"
    for want in case.expect:
        want = want.replace("{d}", str(folder))
        assert want in lines[0], f"{want!r} not in {lines[0]!r}"
    assert _tree(folder) == before, (
        "the run changed files it must not have (partial output or a damaged --out)"
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case: Case, tmp_path: Path):
    argv = _prepare(case, tmp_path)
    before = _tree(tmp_path)
    code, _, err = run_in_process(argv)
    check(case, tmp_path, code, err, before)


def test_the_corpus_is_large_and_covers_every_reader_and_command():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)
    prefixes = {c.id.split("-")[0] for c in CASES}
    for reader in (
        "csv",
        "pq",
        "rmm",
        "snap",
        "azure",
        "burstgpt",
        "mooncake",
        "vidur",
        "requests",
        "sweep",
        "costs",
        "calibration",
        "model",
        "gpu",
    ):
        assert reader in prefixes, reader
    ids = " ".join(c.id for c in CASES)  # the ids name the commands (building a case writes files)
    for command in (
        "replay",
        "simulate",
        "synth",
        "synth-alloc",
        "fidelity",
        "report",
        "sweep",
        "gpu-replay",
        "info",
    ):
        assert command in ids, command


#: Run through the real entry point too: one per kind of failure.
SUBPROCESS_CASES = [
    "csv-truncated-gzip",
    "snap-size-2**70",
    "mooncake-not-utf8",
    "sweep-yaml-not-utf8",
    "out-under-file-simulate",
    "synth-too-many-requests",
]


def poollab_subprocess(argv: list[str], **kw) -> subprocess.CompletedProcess:
    """The installed console script (``poollab``) when on PATH, else ``python -m poollab``."""
    exe = Path(sys.executable).with_name("poollab")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "poollab"]
    return subprocess.run(cmd + argv, capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_bad_input_through_the_real_entry_point(case_id: str, tmp_path: Path):
    case = next(c for c in CASES if c.id == case_id)
    argv = _prepare(case, tmp_path)
    before = _tree(tmp_path)
    proc = poollab_subprocess(argv, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    check(case, tmp_path, proc.returncode, proc.stderr, before)
    assert proc.stderr.startswith("poollab: error: ")
