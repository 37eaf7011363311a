"""Checks every policy must pass, callable by any policy author (like Gymnasium's ``check_env``).

``check_invariants(policy, live_allocations)`` recounts a pool's state by brute force and
compares it with what the policy reports; ``check_policy(policy_factory)`` runs the whole
battery in ``POLICY_CHECKS`` (random workloads, bad requests, refusals, reset, trim, grow,
parameters); ``check_real_pool(make_pool, spec)`` runs a policy on a real pool with validation
(``realgpu.GpuPool``, passed in by the caller) against the same requests on its model device.
Every check raises ``AssertionError`` naming what is wrong (not ``assert``, so the checks
survive ``python -O``).

A *policy factory* is any callable ``factory(capacity_bytes=None, device=None) -> Policy``: a
policy class, ``functools.partial(policies.create, "best-fit:...")`` or a lambda.

Policies that let several live allocations hold the same pages (prefix sharing) report those
ranges through an optional ``shared_extents() -> list[(offset, length)]`` method; overlaps are
allowed inside them and the shared bytes count once in ``allocated_bytes``.

``SegmentPerRequest`` is the plainest policy that honours the whole contract; the suite's own
tests and wrapper tests use it so they do not depend on any built-in policy.

Pure Python, like the rest of ``policies``: no hypothesis here (the property tests in
``tests/policies`` drive these checks with it).
"""

from policies.testing._common import BAD_SIZES, PolicyFactory
from policies.testing.battery import (
    POLICY_CHECKS,
    check_allocation_fields,
    check_bad_sizes,
    check_capacity_refusal,
    check_capacity_workload,
    check_device_refusal,
    check_double_free,
    check_fresh_pool,
    check_grow,
    check_huge_request,
    check_batched_calls,
    check_params,
    check_policy,
    check_random_workload,
    check_real_pool,
    check_release_and_retry,
    check_reset,
    check_same_size_reuse,
    check_trim,
    check_unknown_free,
    random_size,
)
from policies.testing.invariants import check_invariants
from policies.testing.reference import SegmentPerRequest

__all__ = [
    "check_invariants",
    "check_policy",
    "POLICY_CHECKS",
    "SegmentPerRequest",
    "random_size",
    "BAD_SIZES",
    "PolicyFactory",
    "check_fresh_pool",
    "check_allocation_fields",
    "check_random_workload",
    "check_capacity_workload",
    "check_bad_sizes",
    "check_double_free",
    "check_unknown_free",
    "check_capacity_refusal",
    "check_device_refusal",
    "check_reset",
    "check_trim",
    "check_grow",
    "check_params",
    "check_release_and_retry",
    "check_same_size_reuse",
    "check_huge_request",
    "check_batched_calls",
    "check_real_pool",
]
