"""``ServerConfig``: one declaration per knob (``Knob`` metadata) that validates, documents and
names it."""

import math

import pytest

from sim.serving.config import Knob, ServerConfig, knobs
from sim.serving.choices import STRATEGIES
from sim.serving.choices import POOL_LAYOUTS
from sim.serving.choices import PREEMPTION_MODES


def test_every_field_has_help_a_type_and_a_command_line_name():
    ks = knobs()
    assert list(ks) == list(ServerConfig.__dataclass_fields__)
    for name, k in ks.items():
        assert k.help and k.type in (bool, int, float, str), name
        assert k.cli and not k.cli.startswith("-") and "_" not in k.cli
        if k.nullable:
            assert k.none, f"{name}: say what None means"
    assert ks["kv_capacity_bytes"].cli == "kv-capacity" and ks["max_num_seqs"].cli == "max-num-seqs"


def test_choices_come_from_the_modules_that_own_them():
    ks = knobs()
    assert (ks["kv_strategy"].choices, ks["pool_layout"].choices, ks["preemption"].choices) == (
        STRATEGIES,
        POOL_LAYOUTS,
        PREEMPTION_MODES,
    )


def test_defaults_are_valid_and_resolved_ones_stay_none():
    cfg = ServerConfig()
    assert cfg.max_model_len is None and cfg.kv_strategy == "pow2"
    assert cfg.replace(max_model_len=4096).max_model_len == 4096


@pytest.mark.parametrize(
    "name, value",
    [
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.01),
        ("watermark", 1.0),
        ("watermark", -0.1),
        ("max_num_seqs", 0),
        ("max_num_seqs", 2.0),
        ("max_num_seqs", True),
        ("max_num_seqs", None),
        ("kv_capacity_bytes", 0),
        ("workspace_bytes", -1),
        ("freeze_after_steps", -1),
        ("pregrow_safety", math.inf),
        ("slo_ttft_s", 0.0),
        ("horizon_s", math.nan),
        ("kv_strategy", "lucky"),
        ("prefix_caching", 1),
        ("aux_policy", 3),
    ],
)
def test_a_bad_value_is_one_error_naming_the_knob_and_what_it_takes(name, value):
    with pytest.raises(ValueError, match=rf"^{name}\(=.*\) must be "):
        ServerConfig(**{name: value})


@pytest.mark.parametrize(
    "name, value",
    [
        ("workspace_bytes", 0),
        ("freeze_after_steps", 0),
        ("watermark", 0.0),
        ("gpu_memory_utilization", 1),
        ("pregrow_safety", 2),
        ("kv_capacity_bytes", None),
        ("slo_e2e_s", 0.5),
    ],
)
def test_edge_values_are_accepted(name, value):
    assert getattr(ServerConfig(**{name: value}), name) == value


def test_describe_says_the_range():
    assert (
        Knob("x", type=float, low=0, low_open=True, high=1).describe()
        == "a finite number in (0, 1]"
    )
    assert Knob("x", type=int, low=1, nullable=True).describe() == "an integer >= 1 or None"
    assert Knob("x", type=str, choices=("a", "b")).describe() == "one of a, b"


# ---------------------------------------------------------------------------- rules across knobs
@pytest.mark.parametrize(
    "kw, check, message",
    [
        (
            {"kv_strategy": "virtual", "pool_layout": "shared"},
            {},
            "kv_strategy=virtual .* pool_layout must be 'separate'",
        ),
        (
            {"kv_strategy": "virtual", "freeze_after_steps": 3},
            {},
            "freeze_after_steps acts on the KV policy",
        ),
        (
            {"kv_strategy": "virtual", "compact_between_steps": True},
            {},
            "compact_between_steps acts on the KV policy",
        ),
        (
            {"kv_capacity_bytes": 1 << 30},
            {"tenants": True},
            "kv_capacity_bytes is the tenant layout's to decide",
        ),
        (
            {"pool_layout": "shared"},
            {"tenants": True},
            "tenants keep their weights out of the KV pool",
        ),
        (
            {"pregrow_safety": 1.0},
            {"kv_policy": "paged"},
            "pregrow_safety needs a KV pool that can reserve",
        ),
        (
            {"compact_between_steps": True},
            {"kv_policy": "best-fit"},
            "compact_between_steps needs a compacting KV pool",
        ),
    ],
)
def test_rules_across_knobs_are_checked_in_one_place(kw, check, message):
    import policies

    cfg = ServerConfig(**kw)  # each knob alone is fine
    if "kv_policy" in check:
        check = {"kv_policy": policies.create(check["kv_policy"])}
    with pytest.raises(ValueError, match=message):
        cfg.check_rules(**check)


def test_rules_pass_for_what_goes_together():
    import policies

    ServerConfig(kv_strategy="virtual").check_rules()
    ServerConfig().check_rules(tenants=True)
    ServerConfig(pregrow_safety=1.2).check_rules(kv_policy=policies.create("elastic"))
    ServerConfig(compact_between_steps=True).check_rules(
        kv_policy=policies.create("compacting:base=[best-fit]")
    )
