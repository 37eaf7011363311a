"""before.csv against after.csv (survey.py's rows): a markdown table of the cases whose outcome
changed, and the counts of every outcome.

    /work/venv/bin/python benchmarks/results/s21_t4/compare.py
"""

import csv
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent


def outcome(r: dict) -> str:
    if r["rc"] == "timeout":
        return "hang (killed at 30 s)"
    if r["traceback"] == "True":
        return f"exit {r['rc']}, traceback: {r['stderr_last'][:60]}"
    if r["rc"] == "0":
        return "exit 0 (works)"
    return f"exit {r['rc']}: {r['stderr_last'].removeprefix('poollab: error: ')[:110]}"


def kind(r: dict) -> str:
    if r["rc"] == "timeout":
        return "hang"
    if r["traceback"] == "True":
        return "traceback"
    return {"0": "exit 0", "2": "exit 2, one line"}.get(r["rc"], f"exit {r['rc']}")


before = list(csv.DictReader((HERE / "before.csv").open()))
after = list(csv.DictReader((HERE / "after.csv").open()))
assert [(r["group"], r["case"]) for r in before] == [(r["group"], r["case"]) for r in after]
print("| input | command / file slot | before (.s21) | after |")
print("|---|---|---|---|")
for b, a in zip(before, after):
    if kind(b) != kind(a) or (b["rc"] == "0") != (a["rc"] == "0"):
        text = lambda s: s.replace("|", "\\|")
        print(f"| {b['case']} | {b['group']} | {text(outcome(b))} | {text(outcome(a))} |")
print()
print("before:", dict(Counter(kind(r) for r in before)))
print("after: ", dict(Counter(kind(r) for r in after)))
