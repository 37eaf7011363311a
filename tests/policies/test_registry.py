import warnings

import pytest

import policies
from policies import registry
from policies.errors import PolicyError
from policies.first_fit import FirstFit
from policies.testing import SegmentPerRequest

MiB = 1 << 20


class FakeEntryPoint:
    """What ``importlib.metadata.entry_points(group=...)`` yields: name, value, load()."""

    def __init__(self, name, target):
        self.name = name
        self.value = f"fake_pkg:{getattr(target, '__name__', target)}"
        self.target = target
        self.num_loads = 0

    def load(self):
        self.num_loads += 1
        return self.target


class ThirdParty(SegmentPerRequest):
    name = "third-party"


class Picky(SegmentPerRequest):
    name = "picky"

    def __init__(self, *, level: int = 1, capacity_bytes=None, device=None):
        if level > 3:
            raise ValueError(f"level(={level}) must be at most 3")
        self.level = level
        super().__init__(capacity_bytes=capacity_bytes, device=device)


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Install entry points; the cached table is rebuilt now and again after the test."""
    calls = []

    def install(*eps):
        def entry_points(**kw):
            calls.append(kw)
            return list(eps)

        monkeypatch.setattr(registry, "entry_points", entry_points)
        registry._entry_point_table.cache_clear()
        return calls

    yield install
    monkeypatch.undo()
    registry._entry_point_table.cache_clear()


@pytest.fixture
def runtime_names():
    """Unregisters whatever a test registered at run time."""
    names = []
    yield names
    for name in names:
        registry.unregister(name)


# ---------------------------------------------------------------------------- lookup
def test_available_lists_builtins_first_in_table_order():
    assert policies.available()[: len(registry.BUILTIN_POLICIES)] == list(registry.BUILTIN_POLICIES)


@pytest.mark.parametrize("name", list(registry.BUILTIN_POLICIES))
def test_every_builtin_resolves_to_a_policy_of_that_name(name):
    cls = policies.get(name)
    assert issubclass(cls, policies.Policy) and cls.name == name


def test_unknown_name_raises_and_lists_the_names():
    with pytest.raises(PolicyError, match=r"unknown policy 'nope'; available: first-fit, best-fit"):
        policies.get("nope")


def test_create_with_unknown_name_raises():
    with pytest.raises(PolicyError, match="unknown policy 'nope'"):
        policies.create("nope:x=1")


def test_target_that_is_not_a_policy_raises(runtime_names):
    registry.register("not-a-policy", "policies.units:parse_bytes")
    runtime_names.append("not-a-policy")
    with pytest.raises(PolicyError, match="not a policies.Policy subclass"):
        policies.get("not-a-policy")


# ---------------------------------------------------------------------------- create
def test_spec_parameters_reach_the_constructor():
    p = policies.create("first-fit:segment_bytes=4MiB,alignment_bytes=1024")
    assert (p.segment_bytes, p.alignment_bytes) == (4 * MiB, 1024)


def test_keyword_parameters_override_the_spec():
    p = policies.create("first-fit:segment_bytes=4MiB", segment_bytes=8 * MiB)
    assert p.segment_bytes == 8 * MiB


def test_unknown_parameter_raises_and_lists_the_parameters():
    with pytest.raises(
        PolicyError,
        match=r"policy 'first-fit' has no parameter 'segment_size'; parameters: .*segment_bytes",
    ):
        policies.create("first-fit:segment_size=4MiB")


def test_unknown_keyword_parameter_raises():
    with pytest.raises(PolicyError, match="no parameter 'colour'"):
        policies.create("first-fit", colour="red")


def test_capacity_may_come_from_the_spec():
    assert policies.create("first-fit:capacity_bytes=1GiB").capacity_bytes == 1 << 30


def test_capacity_keyword_wins_over_the_spec():
    assert (
        policies.create("first-fit:capacity_bytes=1GiB", capacity_bytes=2 << 30).capacity_bytes
        == 2 << 30
    )


def test_device_is_passed_through():
    device = policies.VirtualDevice()
    assert policies.create("first-fit", device=device).device is device


def test_create_accepts_a_class():
    p = policies.create(SegmentPerRequest, rounding_bytes=4096, capacity_bytes=MiB)
    assert (type(p), p.rounding_bytes, p.capacity_bytes) == (SegmentPerRequest, 4096, MiB)


def test_constructor_value_error_becomes_policy_error_naming_the_spec(runtime_names):
    registry.register("picky", Picky)
    runtime_names.append("picky")
    with pytest.raises(
        PolicyError, match=r"^policy spec 'picky:level=5': level\(=5\) must be at most 3$"
    ):
        policies.create("picky:level=5")
    with pytest.raises(PolicyError, match=r"^policy 'picky': level\(=5\) must be at most 3$"):
        policies.create(Picky, level=5)  # a class has no spec string: its name says which


def test_constructor_policy_error_keeps_its_reason_under_the_spec():
    with pytest.raises(PolicyError) as info:
        policies.create("first-fit:segment_bytes=0")
    assert info.value.reason == "segment_bytes(=0) must be an integer >= 1"
    assert info.value.spec == "first-fit:segment_bytes=0"


# ---------------------------------------------------------------------------- errors name the spec
_BAD_SPECS = [
    ("best-fit:alignment_bytes=-5", "alignment_bytes(=-5) must be an integer >= 1"),
    ("best-fit:nope=1", "policy 'best-fit' has no parameter 'nope'"),
    ("no-such-policy", "unknown policy 'no-such-policy'"),
    ("best-fit:alignment_bytes", "'alignment_bytes' is not key=value"),
    ("best-fit:a=1,a=2", "'a' is given twice"),
    ("bad name!", "'bad name!' is not a policy name"),
    ("elastic:base=[best-fit:alignment_bytes=-5]", "elastic base(='best-fit:alignment_bytes=-5'):"),
    ("elastic:base=[nope]", "elastic base(='nope'): unknown policy 'nope'"),
    ("elastic:base=[best-fit],high=2", "high(=2) must be"),
    ("elastic:base=[elastic:base=[best-fit:x=1]]", "elastic base(='best-fit:x=1'): policy"),
    ("tag-limits:limits=[x]", "limits(='x'): 'x' is not tag=size"),
    ("elastic:base=[best-fit", "unbalanced '['"),
]


@pytest.mark.parametrize("spec, reason", _BAD_SPECS)
def test_every_spec_error_names_the_whole_spec_once(spec, reason):
    """With several ``-p`` options, sweep entries or API calls, the message says which spec."""
    with pytest.raises(PolicyError) as info:
        policies.create(f"  {spec} ")
    message = str(info.value)
    assert reason in message and message.count("policy spec") == 1, message
    if "unbalanced" in reason:  # the grammar's own message quotes the spec (cut short if long)
        assert message.endswith(f"in policy spec {spec!r}")
    else:
        assert message.startswith(f"policy spec {spec!r}: ")


@pytest.mark.parametrize("spec", ["", "   ", None])
def test_an_empty_spec_says_so_once(spec):
    with pytest.raises(PolicyError) as info:
        policies.create(spec)
    assert str(info.value) == (
        f"policy spec {spec!r} is empty; expected 'name' or 'name:key=value,...'"
    )


@pytest.mark.parametrize("ask", [registry.device_kind, registry.can_hold_kv])
def test_spec_questions_name_the_spec_too(ask):
    with pytest.raises(PolicyError, match=r"^policy spec 'elastic:base=\[nope\]': elastic"):
        ask("elastic:base=[nope]")
    with pytest.raises(PolicyError, match=r"^policy spec 'nope:x=1': unknown policy 'nope'"):
        ask("nope:x=1")


def test_a_spec_error_survives_a_pickle_whole():
    """A sweep's worker process sends its error back pickled."""
    import pickle

    with pytest.raises(PolicyError) as info:
        policies.create("best-fit:alignment_bytes=-5")
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is PolicyError and str(back) == str(info.value)
    assert (back.reason, back.spec) == (info.value.reason, info.value.spec)


# ---------------------------------------------------------------------------- run-time registration
def test_register_a_class_at_run_time(runtime_names):
    registry.register("third-party", ThirdParty)
    runtime_names.append("third-party")
    assert policies.available()[-1] == "third-party"
    assert isinstance(policies.create("third-party:rounding_bytes=1024"), ThirdParty)


def test_register_an_import_string_loads_it_lazily(runtime_names):
    registry.register("by-string", "policies.testing:SegmentPerRequest")
    runtime_names.append("by-string")
    assert policies.get("by-string") is SegmentPerRequest


def test_register_a_taken_name_raises(runtime_names):
    with pytest.raises(PolicyError, match="'first-fit' is already registered"):
        registry.register("first-fit", ThirdParty)
    registry.register("third-party", ThirdParty)
    runtime_names.append("third-party")
    with pytest.raises(PolicyError, match="already registered"):
        registry.register("third-party", SegmentPerRequest)


def test_register_replace_swaps_a_run_time_policy(runtime_names):
    registry.register("third-party", ThirdParty)
    runtime_names.append("third-party")
    registry.register("third-party", SegmentPerRequest, replace=True)
    assert policies.get("third-party") is SegmentPerRequest


def test_register_replace_swaps_a_builtin(runtime_names):
    registry.register("first-fit", ThirdParty, replace=True)
    runtime_names.append("first-fit")
    assert policies.get("first-fit") is ThirdParty


def test_unregister_removes_the_name(runtime_names):
    registry.register("third-party", ThirdParty)
    registry.unregister("third-party")
    assert "third-party" not in policies.available()


# ---------------------------------------------------------------------------- entry points
def test_entry_point_policy_is_available(fake_entry_points):
    calls = fake_entry_points(FakeEntryPoint("third-party", ThirdParty))
    assert "third-party" in policies.available()
    assert calls == [{"group": "poollab.policies"}]


def test_entry_point_policy_is_created_by_spec(fake_entry_points):
    fake_entry_points(FakeEntryPoint("third-party", ThirdParty))
    p = policies.create("third-party:rounding_bytes=2048", capacity_bytes=MiB)
    assert (type(p), p.rounding_bytes, p.capacity_bytes) == (ThirdParty, 2048, MiB)


def test_entry_point_is_loaded_only_when_used(fake_entry_points):
    ep = FakeEntryPoint("third-party", ThirdParty)
    fake_entry_points(ep)
    policies.available()
    assert ep.num_loads == 0
    policies.get("third-party")
    assert ep.num_loads == 1


def test_entry_point_table_is_cached(fake_entry_points):
    calls = fake_entry_points(FakeEntryPoint("third-party", ThirdParty))
    policies.available()
    policies.get("third-party")
    assert len(calls) == 1


def test_entry_point_shadowing_a_builtin_warns_and_is_ignored(fake_entry_points):
    fake_entry_points(FakeEntryPoint("first-fit", ThirdParty))
    with pytest.warns(RuntimeWarning, match="'first-fit' .* already registered; ignored"):
        policies.available()
    assert policies.get("first-fit") is FirstFit


def test_duplicate_entry_points_warn_and_keep_the_first(fake_entry_points):
    fake_entry_points(
        FakeEntryPoint("third-party", ThirdParty), FakeEntryPoint("third-party", SegmentPerRequest)
    )
    with pytest.warns(RuntimeWarning, match="'third-party'"):
        names = policies.available()
    assert names.count("third-party") == 1
    assert policies.get("third-party") is ThirdParty


def test_entry_point_to_a_non_policy_raises(fake_entry_points):
    fake_entry_points(FakeEntryPoint("bogus", dict))
    with pytest.raises(PolicyError, match="'bogus' resolves to .*not a policies.Policy subclass"):
        policies.get("bogus")


def test_no_warning_without_duplicates(fake_entry_points):
    fake_entry_points(FakeEntryPoint("third-party", ThirdParty))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policies.available()
