"""Which policies ``simulate`` runs: only those that declare they can hold a KV cache
(``Policy.can_hold_kv``), and errors that name a knob the policy has (issue 29)."""

import pytest

import policies
from policies import registry
from policies.testing import SegmentPerRequest
from sim.serving.simulate import check_kv_policy, simulate, simulate_runs
from traces.requests import RequestTrace, make_requests

MODEL, GPU = "Llama-3.2-1B", "H200"


def tiny(n=4):
    return RequestTrace(make_requests([0.01 * i for i in range(n)], [64] * n, [8] * n), name="tiny")


def test_by_default_every_policy_that_can_hold_kv_runs_and_no_other():
    """Notebook 1 and ``simulate_runs`` without specs stopped at vmm-stitch: "its page (None B)
    must hold at least one token's KV ...; set its page size", a knob vmm-stitch does not have."""
    runs = simulate_runs(tiny(), model=MODEL, gpu=GPU)
    ran = [r.summary["policy"] for r in runs]
    assert ran == policies.available(holds_kv=True)
    assert "vmm-stitch" in policies.available() and "vmm-stitch" not in ran
    assert all(r.summary["n_finished"] == 4 for r in runs)


def test_every_registered_policy_either_holds_kv_or_is_refused_up_front():
    for name in policies.available():
        if registry.can_hold_kv(name):
            simulate(tiny(2), name, model=MODEL, gpu=GPU)
        else:
            refusal = f"policy '{name}' cannot hold a KV cache.*policies that can: first-fit"
            with pytest.raises(ValueError, match=refusal):
                simulate(tiny(2), name, model=MODEL, gpu=GPU)


@pytest.mark.parametrize(
    "spec, able",
    [
        ("vmm-stitch", False),
        ("elastic:base=[vmm-stitch]", False),
        ("tag-limits:base=[elastic:base=[vmm-stitch]]", False),
        ("elastic:base=[page-pool]", True),
        ("paged", True),
        ("best-fit", True),
    ],
)
def test_the_capability_is_read_from_the_spec_and_wrappers_answer_for_their_base(spec, able):
    assert registry.can_hold_kv(spec) is able
    assert policies.create(spec).can_hold_kv is able  # the built policy says the same


def test_a_page_too_small_names_the_knob_that_sets_it():
    with pytest.raises(
        ValueError, match=r"set page_bytes \(e.g. paged:page_bytes=524288, 16 tokens\)"
    ):
        simulate(tiny(), "paged:page_bytes=4096", model=MODEL, gpu=GPU)
    with pytest.raises(ValueError, match="set page_bytes of its base 'paged:page_bytes=4096'"):
        simulate(tiny(), "elastic:base=[paged:page_bytes=4096]", model=MODEL, gpu=GPU)


class _PiecesWithoutPages(SegmentPerRequest):
    """A third-party policy that splits allocations but declares neither a page nor can_hold_kv =
    False."""

    name = "pieces"
    contiguous = False


def test_a_policy_in_pieces_without_a_page_size_is_told_what_to_declare():
    registry.register("pieces", _PiecesWithoutPages)
    try:
        with pytest.raises(ValueError, match="declares no page size.*can_hold_kv = False"):
            simulate(tiny(), "pieces", model=MODEL, gpu=GPU)
        check_kv_policy("pieces")  # it claims it can: the layout check is what refuses it
    finally:
        registry.unregister("pieces")


def test_the_commands_default_policies_can_all_hold_kv():
    from poollab.commands._common import DEFAULT_POLICIES

    assert all(registry.can_hold_kv(name) for name in DEFAULT_POLICIES)
