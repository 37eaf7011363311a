"""The one ``key=value`` grammar: round trip, brackets, the caller's errors."""

import pytest
from hypothesis import given, strategies as st

from traces.spec_grammar import check_text, format_items, parse_items, split_top, unbracket


class Bad(ValueError):
    pass


def _bad(item):
    return Bad(f"bad item {item!r}")


def _twice(key):
    return Bad(f"{key!r} twice")


_KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
_ATOM = (
    st.text(st.sampled_from("abcXYZ019._-:=,/ "), min_size=1, max_size=10)
    .map(str.strip)
    .filter(bool)
)
# values with balanced brackets (a nested spec), whatever separators they hold
_VALUES = st.recursive(
    _ATOM, lambda inner: st.builds(lambda a, b: f"{a}[{b}]", _ATOM, inner), max_leaves=4
)


@given(st.dictionaries(_KEYS, _VALUES, max_size=6))
def test_format_then_parse_gives_every_item_back(items):
    parsed = parse_items(format_items(items), bad_item=_bad, twice=_twice)
    assert list(parsed) == list(items)
    assert {key: unbracket(value) for key, value in parsed.items()} == items


@given(st.dictionaries(_KEYS, st.integers(0, 1 << 40), max_size=6))
def test_numbers_are_written_bare(items):
    text = format_items(items)
    assert "[" not in text
    assert parse_items(text, bad_item=_bad) == {k: str(v) for k, v in items.items()}


def test_brackets_hold_commas_and_nest():
    text = "base=[elastic:base=[size-class:classes_per_doubling=8],high=0.85],low=0.3"
    assert parse_items(text, bad_item=_bad) == {
        "base": "[elastic:base=[size-class:classes_per_doubling=8],high=0.85]",
        "low": "0.3",
    }
    assert split_top("a,[b,c],d") == ["a", "[b,c]", "d"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("a=1,b", "bad item 'b'"),
        ("=1", "bad item '=1'"),
        ("a=1,a=2", "'a' twice"),
        ("1a=2", "bad item '1a=2'"),
    ],
)
def test_bad_items_raise_the_callers_error(text, message):
    with pytest.raises(Bad, match=message):
        parse_items(text, bad_item=_bad, twice=_twice)


def test_empty_items_and_values_follow_the_callers_rule():
    assert parse_items("a=1,,b=2", bad_item=_bad) == {"a": "1", "b": "2"}
    with pytest.raises(Bad, match="bad item ''"):
        parse_items("a=1,,b=2", bad_item=_bad, skip_empty=False)
    assert parse_items("a=", bad_item=_bad) == {"a": ""}
    with pytest.raises(Bad, match="bad item 'a='"):
        parse_items("a=", bad_item=_bad, need_value=True)
    assert parse_items("a=1,a=2", bad_item=_bad) == {"a": "2"}  # no ``twice``: the last one wins


@pytest.mark.parametrize(
    "text, message",
    [
        ("x" * 50, "is 50 characters long; at most 40"),
        ("a=[b", r"unbalanced '\[' in spec 'a=\[b'"),
        ("a=b]", r"unbalanced '\]' in spec"),
        ("a=[[[b]]]", r"nests \[...\] 3 levels deep; at most 2"),
    ],
)
def test_check_text_names_the_text(text, message):
    with pytest.raises(Bad, match=message):
        check_text(text, "spec", error=Bad, max_chars=40, max_depth=2)


def test_check_text_without_depth_checks_the_length_only():
    check_text("a=]]", "spec", error=Bad, max_depth=None)
    with pytest.raises(Bad, match="characters long"):
        check_text("]" * 10, "spec", error=Bad, max_chars=5, max_depth=None)


def test_someone_elses_settings_are_read_leniently_with_their_separator():
    conf = (
        "expandable_segments:True, "
        "roundup_power2_divisions:[256:1,512:2,>:8],garbage,max_split_size_mb:128"
    )
    assert parse_items(conf, bad_item=None, valid_key=bool, assign=":") == {
        "expandable_segments": "True",
        "roundup_power2_divisions": "[256:1,512:2,>:8]",
        "max_split_size_mb": "128",
    }
