"""``realgpu.live_map.LiveMap``: PyTorch's live pointer map, a table of C keys, against a ``dict``.

Runs interpreted and, through ``tests/policies/test_compiled.py``, against the compiled module
(where ``add``/``take`` take C integers and the table is C memory).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from realgpu import live_map
from realgpu.live_map import MIN_SLOTS, LiveMap, new_live_map

#: pointers as PyTorch's are (512-aligned, a few GiB apart), a few colliding on purpose: the small
#: range makes probe runs long and wrap around the table's end
_pointers = st.one_of(
    st.integers(1, 4 * MIN_SLOTS).map(lambda k: k * 512),
    st.integers(1, 2**64 - 1),
)
_ops = st.lists(
    st.tuples(st.sampled_from(["add", "take", "set", "pop", "del", "in", "get"]), _pointers),
    max_size=600,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_live_map_answers_as_a_dict_does(ops):
    table, ref = LiveMap(), {}
    for n, (op, key) in enumerate(ops):
        value = (op, n)
        if op == "add":  # setdefault, and whether the map grew
            grew = key not in ref
            ref.setdefault(key, value)
            assert table.add(key, value) is grew
        elif op == "take":
            assert table.take(key) is ref.pop(key, None)
        elif op == "set":
            table[key] = ref[key] = value
        elif op == "pop":
            assert table.pop(key, None) is ref.pop(key, None)
        elif op == "del":
            if key in ref:
                del ref[key]
                del table[key]
            else:
                with pytest.raises(KeyError):
                    del table[key]
        elif op == "in":
            assert (key in table) is (key in ref)
        else:
            assert table.get(key) is ref.get(key)
        assert len(table) == len(ref) and bool(table) is bool(ref)
    assert (
        dict(table.items()) == ref and table.keys() == ref.keys() and sorted(table) == sorted(ref)
    )
    assert sorted(map(id, table.values())) == sorted(map(id, ref.values()))
    for key, value in ref.items():
        assert table[key] is value


def test_every_entry_stays_found_through_growth_and_removal():
    """Thousands of live pointers (the table doubles several times), then every other one freed
    and the rest found: linear probing's shifted removals lose no entry."""
    table = LiveMap()
    keys = [0x7F00_0000_0000 + 512 * k * 3 for k in range(5000)]
    for k in keys:
        assert table.add(k, k)
    assert len(table) == 5000
    for k in keys[::2]:
        assert table.take(k) == k
    for k in keys[1::2]:
        assert table[k] == k
    assert all(k not in table for k in keys[::2]) and len(table) == 2500


def test_keys_outside_pointers_are_refused_with_key_error():
    table = LiveMap()
    for bad in (0, -512, 2**64, "0x200", 1.0):
        assert bad not in table and table.get(bad) is None and table.pop(bad, None) is None
        with pytest.raises(KeyError):
            table[bad] = object()
        with pytest.raises(KeyError):
            table[bad]
    assert (
        len(table) == 0 and table.setdefault(512, "a") == "a" and table.setdefault(512, "b") == "a"
    )


def test_the_compiled_build_keeps_a_live_map_and_the_interpreted_one_a_dict():
    compiled = not live_map.__file__.endswith(".py")  # an extension module
    expected = LiveMap if compiled else dict
    assert type(new_live_map()) is expected
