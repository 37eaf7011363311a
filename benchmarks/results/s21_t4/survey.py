"""Session 21 (t4): every file-taking argument of every command fed a FIFO, /dev/stdin, /dev/zero,
a directory, an empty file and bytes that are not UTF-8; a calibration with hostile values; hostile
policy specs. Each case runs as a real ``poollab`` subprocess with a 30 s timeout, in the tree given
(``--tree``: ``.s21`` for before, ``.`` for after); one CSV row per case: exit status (or
``timeout``), seconds, traceback or not, the last line of stderr.

    cd /work/wt/t4 && /work/venv/bin/python benchmarks/results/s21_t4/survey.py --tree .s21 \
        --out benchmarks/results/s21_t4/before.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PY = "/work/venv/bin/python"
CAL = json.loads(Path("/tmp/t4/cal.json").read_text())  # poollab calibrate steps wrote it
ALLOC = "time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,0,4096,0,\n5,free,0,4096,0,\n"
REQ = "arrival_s,prompt_tokens,output_tokens\n0,100,10\n0.5,200,20\n"
STEPS = Path("/work/shared/data/engine/transformers_cb_azure_code_60s_steps.csv").read_text()
SWEEP = "mode: replay\ntraces: [a.csv]\npolicies: [first-fit]\n"
COSTS = Path("benchmarks/results/costs_h200_calibrated.json").read_text()
MODEL = json.dumps(
    {
        "name": "tiny",
        "num_layers": 2,
        "hidden_size": 256,
        "num_kv_heads": 2,
        "head_dim": 64,
        "num_params": 1000000,
        "dtype_bytes": 2,
        "max_model_len": 4096,
        "num_attention_heads": 4,
    }
)

# (name, argv with {f} for the file under test, the good content of that file)
SLOTS = [
    ("replay TRACE", ["replay", "{f}", "-p", "first-fit", "--no-progress"], ALLOC),
    (
        "replay --costs",
        ["replay", "a.csv", "-p", "first-fit", "--no-progress", "--costs", "{f}"],
        COSTS,
    ),
    ("simulate TRACE", ["simulate", "{f}", "-p", "paged", "--model", "Llama-3.2-1B"], REQ),
    (
        "simulate --calibration",
        ["simulate", "q.csv", "-p", "paged", "--calibration", "{f}"],
        json.dumps(CAL),
    ),
    ("simulate --costs", ["simulate", "q.csv", "-p", "paged", "--costs", "{f}"], COSTS),
    ("simulate --model FILE", ["simulate", "q.csv", "-p", "paged", "--model", "{f}"], MODEL),
    ("colocate TRACE", ["colocate", "{f}", "--tenants", "2", "--model", "Llama-3.2-1B"], REQ),
    (
        "colocate --calibration",
        ["colocate", "q.csv", "--tenants", "2", "--model", "Llama-3.2-1B", "--calibration", "{f}"],
        json.dumps(CAL),
    ),
    ("fidelity SNAPSHOT", ["fidelity", "{f}"], None),
    ("plan SNAPSHOT", ["plan", "{f}"], None),
    ("sweep SWEEP.yaml", ["sweep", "{f}", "--dry-run"], SWEEP),
    ("calibrate steps PROFILE", ["calibrate", "steps", "{f}", "--out", "c2.json"], STEPS),
    ("calibrate requests REQUESTS", ["calibrate", "requests", "{f}", "--out", "c3.json"], None),
    ("gpu replay TRACE", ["gpu", "replay", "{f}", "-p", "first-fit", "--backend", "host"], ALLOC),
    ("traces info TRACE", ["traces", "info", "{f}"], ALLOC),
    ("report DIR", ["report", "{f}", "--out", "r.html"], None),
]
KINDS = ["fifo", "stdin", "devzero", "dir", "empty", "not-utf8"]

CAL_HOSTILE = [
    ("max 1e30", "1e30"),
    ("max NaN", "NaN"),
    ("max Infinity", "Infinity"),
    ("max -1", "-1"),
    ("max string", '"big"'),
    ("max 10**400", "1" + "0" * 400),
]


def cal_with_max(literal: str) -> str:
    text = json.dumps(CAL)
    fr = CAL["fit"]["feature_range"]["features"]["decode_context_tokens"]
    old = json.dumps({"decode_context_tokens": fr})[1:-1]
    new = old.replace(f'"max": {json.dumps(fr["max"])}', f'"max": {literal}')
    assert old in text and new != old
    return text.replace(old, new)


def cal_other() -> list[tuple[str, str | bytes]]:
    out = []
    c = json.loads(json.dumps(CAL))
    del c["fit"]["feature_range"]["features"]["kv_tokens"]["min"]
    out.append(("missing features.kv_tokens.min", json.dumps(c)))
    c = json.loads(json.dumps(CAL))
    del c["fit"]["feature_range"]["quantile"]
    out.append(("missing feature_range.quantile", json.dumps(c)))
    c = json.loads(json.dumps(CAL))
    c["fit"]["feature_range"]["features"]["new_feature"] = {"max": 1, "quantile": 1, "min": 0}
    out.append(("unknown feature (newer version)", json.dumps(c)))
    c = json.loads(json.dumps(CAL))
    c["fit"]["feature_range"]["version"] = 3
    out.append(("unknown feature_range key", json.dumps(c)))
    c = json.loads(json.dumps(CAL))
    c["format"] = "poollab-step-time/3"
    out.append(("format of a newer version", json.dumps(c)))
    c = json.loads(json.dumps(CAL))
    c["fit"]["feature_range"]["quantile"] = float("nan")
    out.append(("quantile NaN", json.dumps(c)))
    c = json.loads(json.dumps(CAL))
    c["fit"]["feature_range"]["features"] = [1, 2]
    out.append(("features a list", json.dumps(c)))
    c = json.loads(json.dumps(CAL))
    c["terms"]["fixed_s"] = float("inf")
    out.append(("terms.fixed_s Infinity", json.dumps(c)))
    c = json.loads(json.dumps(CAL))
    c["fit"]["feature_range"]["features"]["kv_tokens"]["min"] = 1e9
    out.append(("min > max", json.dumps(c)))
    out.append(
        (
            "terms.fixed_s 10**400",
            json.dumps(CAL).replace(
                f'"fixed_s": {json.dumps(CAL["terms"]["fixed_s"])}', '"fixed_s": 1' + "0" * 400
            ),
        )
    )
    out.append(("tp 10**400", json.dumps(CAL).replace('"tp": 1', '"tp": 1' + "0" * 400)))
    out.append(
        (
            "warmup_s 10**400",
            json.dumps(CAL).replace(
                f'"warmup_s": {json.dumps(CAL["warmup_s"])}', '"warmup_s": 1' + "0" * 400
            ),
        )
    )
    out.append(("nested 100,000 deep", "[" * 100000 + "]" * 100000))
    out.append(("nested object 100,000 deep", '{"a":' * 100000 + "1" + "}" * 100000))
    out.append(("200 MB file", json.dumps({**CAL, "notes": "x" * 200_000_000})))
    out.append(
        ("integer of 5,000 digits", json.dumps(CAL).replace('"tp": 1', '"tp": 1' + "0" * 5000))
    )
    return out


SPECS = [
    "best-fit:virtual=nan",
    "paged:page_bytes=0",
    "paged:page_bytes=-1",
    "paged:page_bytes=1e400",
    "size-class:classes_per_doubling=1e400",
    "best-fit[[[[[[",
    "best-fit:" + "a=1," * 20000,
    "x" * 100000,
    "paged:page_bytes=" + "9" * 5000,
    "best-fit:virtual=",
    "paged:page_bytes=64KiB:x=1",
    "paged:page_bytes=inf",
    "-1",
    "1e400",
    "best-fit:=1",
    "best-fit:virtual=true=1",
]


def _limit_memory() -> None:
    """4 GiB of address space a case: a reader that reads /dev/zero whole must not take the
    shared machine's memory (it fails with MemoryError instead)."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def run(tree: Path, d: Path, argv: list[str], stdin_data: bytes | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()), COLUMNS="200")
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            [PY, "-m", "poollab", *argv],
            cwd=d,
            env=env,
            capture_output=True,
            timeout=30,
            input=stdin_data if stdin_data is not None else b"",
            preexec_fn=_limit_memory,
        )
        rc, err = str(p.returncode), p.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", (e.stderr or b"").decode(errors="replace")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return {
        "rc": rc,
        "s": f"{time.monotonic() - t0:.1f}",
        "traceback": "Traceback" in err,
        "stderr_last": (lines[-1] if lines else "")[:160],
    }


def feed_fifo(path: Path, data: bytes) -> threading.Thread:
    def writer():
        try:
            with open(path, "wb") as f:  # blocks until a reader opens; written once, then closed
                f.write(data)
        except OSError:
            pass

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    return t


def unblock(path: Path) -> None:
    try:  # a writer still blocked in open() is released by a reader opening and closing
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    rows = []
    base = Path(tempfile.mkdtemp(prefix="t4survey"))
    snapshot = Path(".data/llama1b_generate_mixed.pickle.gz")

    def case(group: str, name: str, argv: list[str], files: dict, stdin=None, fifo=None):
        if args.only and args.only not in group + name:
            return
        d = base / f"c{len(rows)}"
        d.mkdir()
        (d / "a.csv").write_text(ALLOC)
        (d / "q.csv").write_text(REQ)
        for n, v in files.items():
            (d / n).write_bytes(v if isinstance(v, bytes) else v.encode())
        if fifo:
            os.mkfifo(d / fifo[0])
            feed_fifo(d / fifo[0], fifo[1])
        r = run(args.tree, d, argv, stdin)
        if fifo:
            unblock(d / fifo[0])
        rows.append({"group": group, "case": name, **r})
        print(rows[-1], flush=True)
        shutil.rmtree(d, ignore_errors=True)

    for slot, argv, good in SLOTS:
        good_bytes = (
            good.encode()
            if good is not None
            else snapshot.read_bytes()
            if "SNAPSHOT" in slot
            else REQ.encode()
        )
        for kind in KINDS:
            f = {
                "fifo": "in.fifo",
                "stdin": "/dev/stdin",
                "devzero": "/dev/zero",
                "dir": ".",
                "empty": "empty.json",
                "not-utf8": "bad.json",
            }[kind]
            files = {"empty.json": b"", "bad.json": b"\xff\xfe\x80\x81 not text \xc3\x28\n"}
            av = [a.replace("{f}", f) for a in argv]
            fifo = ("in.fifo", good_bytes) if kind == "fifo" else None
            stdin = good_bytes if kind == "stdin" else None
            case(slot, kind, av, files, stdin=stdin, fifo=fifo)
    for name, lit in CAL_HOSTILE:
        case(
            "calibration",
            name,
            [
                "simulate",
                "q.csv",
                "-p",
                "paged",
                "--engine",
                "transformers",
                "--calibration",
                "c.json",
            ],
            {"c.json": cal_with_max(lit)},
        )
    for name, text in cal_other():
        case(
            "calibration",
            name,
            [
                "simulate",
                "q.csv",
                "-p",
                "paged",
                "--engine",
                "transformers",
                "--calibration",
                "c.json",
            ],
            {"c.json": text},
        )
    for spec in SPECS:
        case(
            "policy spec",
            spec[:40] + ("..." if len(spec) > 40 else ""),
            ["replay", "a.csv", "-p", spec, "--no-progress"],
            {},
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
