"""The randomized soak over every registered policy, one process per policy.

    python benchmarks/soak.py --ops 1000000 --jobs 16 --out results.json [--seed 1] [--spec SPEC
    ...]

Runs ``policies.testing.soak`` (random allocate/free of every size class, several streams and
tags, capacities that force failures, trim, grow, freeze, reset, bad requests; the battery's
invariants checked after every operation) for each registered policy, plus a few
configurations that make wrappers and options act often (``soak_specs()``; ``--spec``
replaces the whole list). Each policy runs in a
process of its own, ``--jobs`` at a time. Prints and writes, per policy: operations,
violations, refused requests, seconds, and the first violation messages (each names the seed,
episode and operation that replay it). Exit status 1 when any violation was found.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import policies  # noqa: E402
from policies.testing.soak import soak, soak_specs  # noqa: E402


def _run(spec: str, num_ops: int, seed: int) -> dict[str, Any]:
    """One policy's soak, in a worker process."""
    report = soak(functools.partial(policies.create, spec), num_ops, seed=seed, spec=spec)
    return report.as_dict()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ops", type=int, default=100_000, help="operations per policy (default 100000)"
    )
    ap.add_argument(
        "--jobs", type=int, default=1, help="policies soaked at once, one process each (default 1)"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--spec",
        action="append",
        help="policy spec to soak (repeatable; default: every registered policy "
        "and a few active configurations)",
    )
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.ops <= 0 or args.jobs <= 0:
        ap.error("--ops and --jobs must be positive")
    specs = args.spec or soak_specs()

    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(specs))) as pool:
        futures = [pool.submit(_run, spec, args.ops, args.seed) for spec in specs]
        rows = []
        for future in futures:  # in spec order; each result printed as soon as its turn comes
            row = future.result()
            rows.append(row)
            print(
                f"{row['spec']:<52} {row['num_ops']:>10,} ops {row['num_violations']:>4} "
                f"violations {row['num_failures']:>9,} refused {row['seconds']:>9.1f} s",
                flush=True,
            )
            for message in row["violations"]:
                print(f"    {message}")
    wall_s = time.perf_counter() - start
    total_violations = sum(r["num_violations"] for r in rows)
    print(
        f"{len(rows)} policies, {sum(r['num_ops'] for r in rows):,} operations, "
        f"{total_violations} violations, {wall_s:.1f} s wall with {args.jobs} jobs"
    )
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "ops_per_policy": args.ops,
                    "seed": args.seed,
                    "jobs": args.jobs,
                    "wall_s": wall_s,
                    "machine": f"{platform.node()} ({platform.machine()}, "
                    f"{platform.python_version()})",
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "policies": rows,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {args.out}")
    return 1 if total_violations else 0


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
