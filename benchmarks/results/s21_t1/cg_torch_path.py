"""Callgrind harness: N malloc/free pairs through TorchPath (the compiled copy first on sys.path)."""

import sys
from realgpu.torch_allocator import host_allocator_core
import realgpu.malloc_path as mp

spec, n = sys.argv[1], int(sys.argv[2])
core = host_allocator_core(spec)
malloc, free = core.malloc, core.free
sizes = [4096, 1 << 20, 70_000, 512, 3 << 20, 12_288]
for _ in range(2000):  # warm: segments made, caches filled
    ps = [malloc(s, 0, 0) for s in sizes]
    for p, s in zip(ps, sizes):
        free(p, s, 0, 0)


def run():
    for _ in range(n):
        ps = [malloc(s, 0, 0) for s in sizes]
        for p, s in zip(ps, sizes):
            free(p, s, 0, 0)


run()
print(mp.__file__, core.errors, core.path.countdown)
