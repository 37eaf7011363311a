import sys
from sim.replay.costed_policy import create_policy
p = create_policy(sys.argv[1], capacity_bytes=None, costs=None)
n = int(sys.argv[2])
sizes = [512 * (1 + (i * 7919) % 4000) for i in range(64)]
live = []
for i in range(n):
    a = p.allocate(sizes[i % 64], stream=0)
    live.append(a)
    if len(live) > 32:
        p.free(live.pop(0))
