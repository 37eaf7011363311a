"""From held_out_pooled_hosts.md: single-run fits' held-out misses by the fit run's host ratio."""
import re, sys
text = open(sys.argv[1]).read()
host = {m[0]: float(m[1]) for m in re.findall(r"^\| (\S+) \| \d+ \| ([\d.]+) \|", text, re.M)}
miss = {m[0]: int(m[1]) for m in re.findall(r"^\| calibrate steps (\S+) \| (\d+) / \d+ \|", text, re.M)}
bands = [(1.2, "under 1.2"), (1.3, "1.2-1.3"), (9, "1.3 and over")]
for hi, label in bands:
    lo = max([b for b, _ in bands if b < hi], default=0)
    runs = [r for r, h in host.items() if lo <= h < hi]
    print(f"{label:14s} {len(runs):2d} fits, {sum(miss.get(r, 0) for r in runs):3d} misses: "
          + ", ".join(f"{r} {host[r]:.2f}:{miss.get(r, 0)}" for r in sorted(runs, key=host.get)))
