"""The trampoline under callgrind (session 15, T4): the generate snapshot's first N requests,
replayed twice through ``poollab_malloc``/``poollab_free`` without the GIL (as PyTorch calls).

Run from the root of the tree to count (a compiled copy), e.g.::

    TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONPATH=. valgrind --tool=callgrind \
        --toggle-collect=poollab_malloc /work/torchenv/bin/python callgrind_driver.py best-fit 20000
"""

import os
import sys

sys.path.insert(0, os.getcwd())

from realgpu.torch_allocator import host_allocator_core, load_shim  # noqa: E402
from traces import read_alloc_trace  # noqa: E402

SNAPSHOT = "/work/main/.data/llama1b_generate_mixed.pickle.gz"
policy, num_events = sys.argv[1], int(sys.argv[2])
_, is_alloc, ids, nbytes, _ = read_alloc_trace(SNAPSHOT).arrays()
requests = [
    (bool(a), int(k), int(n))
    for a, k, n in zip(is_alloc[:num_events], ids[:num_events], nbytes[:num_events])
    if n > 0
]
shim = load_shim()
core = host_allocator_core(policy)  # what use_policy builds, on the host
shim.bind(core)
num_mallocs = num_frees = 0
for _ in range(2):
    ptrs = {}
    for alloc, key, size in requests:
        if alloc:
            code, ptr, msg = shim.probe_malloc(size, release_gil=True)
            assert code == 0, msg
            ptrs[key] = (ptr, size)
            num_mallocs += 1
        elif key in ptrs:
            shim.call_free(*ptrs.pop(key))
            num_frees += 1
    for ptr, size in ptrs.values():
        shim.call_free(ptr, size)
        num_frees += 1
print("mallocs", num_mallocs, "frees", num_frees, "errors", len(core.errors))
