"""Tabulate misses (✗, rows without †) of a bench_calibration output by fit."""
import sys, collections
fig = ["TTFT p50","TTFT p99","TPOT p50","TPOT p99","e2e p50","e2e p99"]
by_fit = collections.defaultdict(list); tot = collections.Counter()
for line in open(sys.argv[1]):
    c = [x.strip() for x in line.strip().strip("|").split("|")]
    if len(c) != 12 or c[2] not in ("held out",): continue
    fit, judged = c[0], c[1]
    tot[fit] += 6
    for f, v in zip(fig, c[6:]):
        if "✗" in v: by_fit[fit].append(f"{judged.replace('synth_mixed_','s').replace('azure_code_60s','az')}:{f}:{v.replace(' ✗','')}")
for fit in tot:
    m = by_fit.get(fit, [])
    if m: print(f"{fit} [{len(m)}/{tot[fit]}]: " + "; ".join(m))
print("total misses", sum(len(v) for v in by_fit.values()), "of", sum(tot.values()))
