"""PyTorch's two calls without torch (session 18, t4): the generate snapshot's first N requests,
replayed twice through ``AllocatorCore.malloc``/``free`` (``TorchPath``: compiled, the C
``torch_malloc``/``torch_free`` the trampoline calls) on a host-backed pool. For callgrind,
toggled on the compiled functions, e.g. (from the root of a compiled tree)::

    PYTHONPATH=. valgrind --tool=callgrind --toggle-collect='*torch_malloc*' \
        python callgrind_path.py best-fit 20000

With ``--time`` it prints the CPU time a call (mallocs and frees together, best of 5 passes; the
loop's own work included).
"""

import os
import pickle
import sys
import time

sys.path.insert(0, os.getcwd())

from realgpu.torch_allocator import host_allocator_core  # noqa: E402

SNAPSHOT = "/work/main/.data/llama1b_generate_mixed.pickle.gz"
#: the snapshot's requests as ``(is_alloc, id, nbytes)`` tuples, pickled (a Python without the
#: trace readers' pyarrow reads them from here): ``--requests FILE``
REQUESTS = sys.argv[sys.argv.index("--requests") + 1] if "--requests" in sys.argv else None
policy, num_events = sys.argv[1], int(sys.argv[2])
timed = "--time" in sys.argv
if REQUESTS:
    with open(REQUESTS, "rb") as f:
        requests = [r for r in pickle.load(f)[:num_events] if r[2] > 0]
else:
    from traces import read_alloc_trace

    _, is_alloc, ids, nbytes, _ = read_alloc_trace(SNAPSHOT).arrays()
    requests = [
        (bool(a), int(k), int(n))
        for a, k, n in zip(is_alloc[:num_events], ids[:num_events], nbytes[:num_events])
        if n > 0
    ]
core = host_allocator_core(policy)  # what use_policy builds, on the host
malloc, free = core.malloc, core.free
num_mallocs = num_frees = 0
best_ns = float("inf")
for _ in range(5 if timed else 2):
    ptrs = {}
    t0 = time.process_time_ns()
    for alloc, key, size in requests:
        if alloc:
            ptrs[key] = (malloc(size, 0, 0), size)
            num_mallocs += 1
        elif key in ptrs:
            free(*ptrs.pop(key), 0, 0)
            num_frees += 1
    for ptr, size in ptrs.values():
        free(ptr, size, 0, 0)
        num_frees += 1
    best_ns = min(best_ns, (time.process_time_ns() - t0))
print("mallocs", num_mallocs, "frees", num_frees, "errors", len(core.errors))
if timed:
    per_pass = num_mallocs / 5
    print(f"{policy}: {best_ns / (2 * per_pass):.0f} ns a call (malloc or free; best of 5 passes)")
