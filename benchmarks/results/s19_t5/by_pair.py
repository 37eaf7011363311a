"""By workload pair, from ``bench_calibration.py``'s held-out table (its Markdown on stdin): each
judged run's share of steps past the fit's range, how far past (its largest KV tokens over the
fit's), its share under the range, and the figures missed. Held-out rows only (no †).

    python benchmarks/results/s19_t5/by_pair.py < held_out.md
"""

import re
import statistics
import sys


def group(name: str) -> str:
    m = re.match(r"(.*?_\d+s)(?:_|$)", name)
    return m.group(1) if m else name


def pct(cell: str) -> float:
    return float(cell.rstrip(" %"))


def span(values, fmt):
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


by: dict[tuple[str, str, str], list] = {}
for line in sys.stdin:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 12 or cells[2] != "held out" or not cells[0].startswith("calibrate steps"):
        continue
    fit, judged = cells[0], cells[1]
    kind = "pooled" if fit.startswith("calibrate steps pooled") else "single-run"
    fit_group = group(fit.split()[-1] if kind == "single-run" else fit.split()[3])
    key = (kind, fit_group, group(judged))
    by.setdefault(key, []).append(
        (pct(cells[3]), float(cells[4].rstrip("x")), pct(cells[5]), sum("✗" in c for c in cells[6:]))
    )

print(
    "| fit | fit -> judged | rows | steps past, median (range) | largest KV over the fit's, "
    "median (range) | steps under, median (range) | missed |"
)
print("|---|---|---|---|---|---|---|")
for (kind, f, j), rows in sorted(by.items()):
    past, ratio, under, missed = zip(*rows)
    print(
        f"| {kind} | {f} -> {j} | {len(rows)} | {span(past, lambda v: f'{v:.0f} %')} | "
        f"{span(ratio, lambda v: f'{v:.2g}x')} | {span(under, lambda v: f'{v:.0f} %')} | "
        f"{sum(missed)} / {6 * len(rows)} |"
    )
