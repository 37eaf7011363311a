"""Replay N requests of the generate snapshot through the trampoline (GIL released), for callgrind."""
import sys, numpy as np, os
sys.path.insert(0, os.getcwd())
policy = sys.argv[1]
n = int(sys.argv[2])
req = np.load("/tmp/t4/req.npy")[:n]
import policies
from realgpu.torch_allocator import AlignedHostDevice, AllocatorCore, _make_pool, load_shim
shim = load_shim()
segment = policies.registry.device_kind(policy) == "segment"
pool = _make_pool(policy, validate=False, device=0, capacity_bytes=None,
                  backend=AlignedHostDevice() if segment else "host-vmm")
core = AllocatorCore(pool)
shim.bind(core)
ptrs = {}
nm = nf = 0
for rnd in range(2):
    for is_alloc, key, size in req.tolist():
        if is_alloc:
            code, ptr, msg = shim.probe_malloc(size, release_gil=True)
            assert code == 0, msg
            ptrs[key] = (ptr, size); nm += 1
        elif key in ptrs:
            ptr, size = ptrs.pop(key)
            shim.call_free(ptr, size); nf += 1
    for ptr, size in list(ptrs.values()):
        shim.call_free(ptr, size); nf += 1
    ptrs.clear()
print("mallocs", nm, "frees", nf, "errors", len(core.errors))
