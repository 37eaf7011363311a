"""A policy spec built on the costed device it declares: the one place a spec gets its device,
for a replay and for the serving simulator's pools alike (so replay needs no serving module)."""

from __future__ import annotations

from typing import Any

import policies
from policies.base import Policy
from sim.replay.costs import CostModel, costed_device

__all__ = ["create_policy"]


def create_policy(
    spec: str,
    *,
    capacity_bytes: int | None,
    costs: CostModel | None,
    fill: dict[str, Any] | None = None,
    device: Any = None,
) -> Policy:
    """Build ``spec`` on the costed device it declares (``policies.registry.device_kind``): a
    ``CostedDevice`` charging ``costs`` per ``cudaMalloc``, or a page-mapped device charging
    them per cuMem call (``sim.replay.costs.costed_device``); or on ``device`` when given (the KV
    pool's page-mapped device under ``kv_strategy=virtual``). The one place a spec gets its device.

    ``fill`` gives knobs the policy gets when it has them and the spec does not set them: the
    model's ``bytes_per_token`` for a paged pool, so that a page holds whole tokens.
    """
    extra: dict[str, Any] = {}
    if fill:
        name, params = policies.parse_spec(spec)
        known = policies.get(name)._param_names()
        extra = {k: v for k, v in fill.items() if v is not None and k in known and k not in params}
    if device is None:
        device = costed_device(policies.registry.device_kind(spec), costs)
    return policies.create(spec, capacity_bytes=capacity_bytes, device=device, **extra)
