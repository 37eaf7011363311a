import pytest
from hypothesis import given, strategies as st

import policies
from policies import registry
from policies.errors import PolicyError
from policies.spec import format_spec, parse_spec, parse_value
from policies.testing import SegmentPerRequest

MiB = 1 << 20


@pytest.fixture
def segment_per_request():
    registry.register(SegmentPerRequest.name, SegmentPerRequest, replace=True)
    yield
    registry.unregister(SegmentPerRequest.name)


# ---------------------------------------------------------------------------- parsing
def test_bare_name_has_no_params():
    assert parse_spec("first-fit") == ("first-fit", {})


def test_name_with_empty_param_list():
    assert parse_spec("first-fit:") == ("first-fit", {})


def test_params_keep_their_order():
    _, params = parse_spec("x:b=1,a=2,c=3")
    assert list(params) == ["b", "a", "c"]


@pytest.mark.parametrize(
    "text, value",
    [
        ("4", 4),
        ("-3", -3),
        ("1_000", 1000),
        ("0.85", 0.85),
        ("1e3", 1000.0),
        ("true", True),
        ("Yes", True),
        ("on", True),
        ("false", False),
        ("NO", False),
        ("off", False),
        ("none", None),
        ("null", None),
        ("2MiB", 2 * MiB),
        ("80GiB", 80 << 30),
        ("1.5kb", 1500),
        ("lifo", "lifo"),
        ("best-fit", "best-fit"),
        (" 4 ", 4),
        ("[best-fit:segment_bytes=4MiB]", "best-fit:segment_bytes=4MiB"),
    ],
)
def test_values_read_as_the_first_type_that_fits(text, value):
    parsed = parse_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_whitespace_around_names_keys_and_values_is_ignored():
    assert parse_spec("  first-fit : segment_bytes = 4MiB , alignment_bytes=1024 ") == (
        "first-fit",
        {"segment_bytes": 4 * MiB, "alignment_bytes": 1024},
    )


def test_nested_spec_stays_a_string_for_the_wrapper():
    name, params = parse_spec(
        "elastic:base=[size-class:classes_per_doubling=8,refill_bytes=4MiB],high=0.85,low=0.3"
    )
    assert name == "elastic"
    assert params == {
        "base": "size-class:classes_per_doubling=8,refill_bytes=4MiB",
        "high": 0.85,
        "low": 0.3,
    }


def test_nesting_goes_deeper():
    _, outer = parse_spec(
        "elastic:base=[elastic:base=[first-fit:segment_bytes=4MiB],patience=2],high=0.9"
    )
    _, inner = parse_spec(outer["base"])
    assert parse_spec(inner["base"]) == ("first-fit", {"segment_bytes": 4 * MiB})
    assert (inner["patience"], outer["high"]) == (2, 0.9)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("first fit", "is not a policy name"),
        (":a=1", "is not a policy name"),
        ("x:a", "'a' is not key=value"),
        ("x:a=1,,b=2", "is not key=value"),
        ("x:1a=2", "is not key=value"),
        ("x:a=1,a=2", "'a' is given twice"),
        ("x:base=[first-fit", "unbalanced '\\['"),
        ("x:base=first-fit]", "unbalanced '\\]'"),
    ],
)
def test_malformed_spec_raises_naming_the_spec(spec, message):
    with pytest.raises(PolicyError, match=message):
        parse_spec(spec)


def _nested(depth: int, wrapper: str = "elastic") -> str:
    return f"{wrapper}:base=[" * depth + "best-fit" + "]" * depth


@pytest.mark.parametrize("wrapper", ["elastic", "tag-limits"])
def test_a_spec_nested_too_deep_is_refused_before_any_policy_is_built(wrapper):
    """Thousands deep used to build policy inside policy until Python's stack ran out
    (RecursionError)."""
    from policies.spec import MAX_SPEC_DEPTH

    with pytest.raises(
        PolicyError,
        match=f"nests \\[...\\] {MAX_SPEC_DEPTH + 1} levels deep; at most {MAX_SPEC_DEPTH}",
    ):
        policies.create(_nested(MAX_SPEC_DEPTH + 1, wrapper))
    assert policies.create(_nested(MAX_SPEC_DEPTH, wrapper)).allocate(4096) is not None


def test_a_spec_thousands_deep_or_long_is_refused_naming_its_length():
    with pytest.raises(PolicyError, match="45,008 characters long; at most 4,096"):
        policies.create(_nested(3000))
    with pytest.raises(PolicyError, match="nests \\[...\\] 2,000 levels deep"):
        parse_spec("x:a=" + "[" * 2000 + "]" * 2000)


@pytest.mark.parametrize("spec", [None, 3, ["first-fit"]])
def test_non_string_spec_raises(spec):
    with pytest.raises(PolicyError, match="is empty"):
        parse_spec(spec)


# ---------------------------------------------------------------------------- formatting
def test_format_without_params_is_the_name():
    assert format_spec("first-fit", {}) == "first-fit"


def test_format_brackets_strings_that_hold_a_spec():
    assert format_spec("elastic", {"base": "first-fit:segment_bytes=4194304", "high": 0.9}) == (
        "elastic:base=[first-fit:segment_bytes=4194304],high=0.9"
    )


def test_format_leaves_plain_strings_bare():
    assert format_spec("elastic", {"base": "first-fit"}) == "elastic:base=first-fit"


def test_format_writes_a_policy_value_as_its_bracketed_spec():
    inner = policies.create("first-fit:segment_bytes=4MiB")
    assert format_spec("wrapper", {"base": inner}) == f"wrapper:base=[{inner.spec}]"


_plain_text = st.text("abcdefghijklmnopqrstuvwxyz-_.", min_size=1, max_size=12).filter(
    lambda s: parse_value(s) == s
)
_values = st.one_of(
    st.integers(-(10**12), 10**12),
    st.booleans(),
    st.none(),
    _plain_text,
    st.floats(allow_nan=False, allow_infinity=False).filter(
        lambda f: f != int(f) or abs(f) >= 1e16
    ),
)
_keys = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)


@given(st.dictionaries(_keys, _values, max_size=5))
def test_format_then_parse_round_trips(params):
    assert parse_spec(format_spec("some-policy", params)) == ("some-policy", params)


@given(st.dictionaries(_keys, _values, max_size=3), st.dictionaries(_keys, _values, max_size=3))
def test_nested_format_then_parse_round_trips(inner, outer):
    params = {**outer, "base": format_spec("inner-policy", inner)}
    name, parsed = parse_spec(format_spec("wrapper", params))
    assert parse_spec(parsed.pop("base")) == ("inner-policy", inner)
    assert {k: v for k, v in params.items() if k != "base"} == parsed


# ---------------------------------------------------------------------------- create(p.spec)
@pytest.mark.parametrize(
    "spec",
    [
        "first-fit:segment_bytes=8MiB,alignment_bytes=1024",
        "best-fit:split_threshold_bytes=1MiB",
        "size-class:classes_per_doubling=8",
        "paged:page_bytes=1MiB,segment_bytes=16MiB",
        "torch-caching",
        "elastic:base=[size-class:classes_per_doubling=8],high=0.9,low=0.2,patience=4,grow_bytes=64MiB",
        "elastic:base=[elastic:base=[paged:page_bytes=1MiB]],min_reserved_bytes=1GiB",
        "segment-per-request:rounding_bytes=4096",
    ],
)
def test_create_from_a_policys_spec_gives_equal_params(spec, segment_per_request):
    p = policies.create(spec, capacity_bytes=8 << 30)
    again = policies.create(p.spec, capacity_bytes=p.capacity_bytes)
    assert type(again) is type(p)
    assert again.get_params() == p.get_params()


@pytest.mark.parametrize("name", policies.available())
def test_default_policy_spec_is_its_name(name):
    assert policies.create(name).spec == name


def test_spec_lists_only_changed_knobs():
    assert (
        policies.create("first-fit:segment_bytes=8MiB,alignment_bytes=256").spec
        == "first-fit:segment_bytes=8388608"
    )


def test_spec_leaves_capacity_out():
    assert policies.create("first-fit", capacity_bytes=MiB).spec == "first-fit"
