"""Session 22 (h1): the 1.55 M-entry snapshot read by one tree: rows, a hash of the event table,
the clamped count and the best CPU time of N reads.

    python snapshot_read.py TREE N
"""

import hashlib
import sys
import time

sys.path.insert(0, sys.argv[1])
import pandas as pd  # noqa: E402

from traces.detect import read_alloc_trace  # noqa: E402

best = 1e9
for _ in range(int(sys.argv[2])):
    t = time.process_time()
    tr = read_alloc_trace("/tmp/llama1b_generate_1m.pickle.gz")
    best = min(best, time.process_time() - t)
ev = tr.events
h = hashlib.sha256(pd.util.hash_pandas_object(ev, index=True).values.tobytes()).hexdigest()[:16]
clamped = tr.meta.get("num_time_clamped")
print(f"{sys.argv[1]} rows={len(ev)} hash={h} clamped={clamped} best_cpu_s={best:.3f}")
