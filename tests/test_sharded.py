"""The sharded tables behave as the plain containers they replace, operation for operation.

Small ``expected_entries`` give a handful of shards, so that keys share and leave shards
as they would at scale; the references are ``dict`` and ``OrderedDict``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.sharded import AscendingDict, OrderedKeys, ShardedDict, shard_count

KEYS = st.integers(-20, 60) | st.binary(max_size=2)
STEPS = st.lists(st.tuples(st.integers(0, 4), KEYS, st.integers()), max_size=200)


def test_shard_counts_are_odd_and_grow_with_the_expected_size() -> None:
    assert [shard_count(n) for n in (0, 511, 512, 1_024, 1_000_000)] == [1, 1, 1, 3, 1_953]


@given(st.integers(1, 3_000), STEPS)
def test_sharded_dict_is_a_dict(expected: int, steps: list[tuple[int, object, int]]) -> None:
    sharded: ShardedDict[object, int] = ShardedDict(expected)
    plain: dict[object, int] = {}
    for op, key, value in steps:
        if op == 0:
            sharded[key] = plain[key] = value
        elif op == 1 and key in plain:
            assert sharded.pop(key) == plain.pop(key)
        elif op == 2 and key in plain:
            del sharded[key], plain[key]
        elif op == 3:
            assert sharded.get(key) == plain.get(key)
        assert (key in sharded) == (key in plain)
        assert len(sharded) == len(plain)
    assert dict(sharded.items()) == plain == {key: sharded[key] for key in sharded}
    assert sorted(sharded.values()) == sorted(plain.values())
    identity_keyed: ShardedDict[object, int] = ShardedDict(expected)
    token = object()  # hashes by identity: its copy has another hash
    identity_keyed[token] = 1
    (clone,) = copy.deepcopy([identity_keyed])
    assert list(clone.values()) == [1] and next(iter(clone)) in clone
    sharded.clear()
    assert len(sharded) == 0 and list(sharded) == []


@given(st.integers(1, 3_000), STEPS)
def test_ordered_keys_are_an_ordered_dict_of_keys(
    expected: int, steps: list[tuple[int, object, int]]
) -> None:
    keys: OrderedKeys[object] = OrderedKeys(expected)
    reference: OrderedDict[object, None] = OrderedDict()
    for op, key, _ in steps:
        if op == 0 and key not in reference:
            keys.append(key)
            reference[key] = None
        elif op == 1:
            assert keys.discard(key) == (key in reference)
            reference.pop(key, None)
        elif op == 2 and key in reference:
            keys.move_to_end(key)
            reference.move_to_end(key)
        elif op == 3 and reference:
            assert keys.pop_oldest() == reference.popitem(last=False)[0]
        assert (key in keys) == (key in reference)
        assert len(keys) == len(reference)
    assert list(keys) == list(reference)
    clone = copy.deepcopy(keys)  # a cloned manager's ghosts must be a list of their own
    clone.append(object())
    assert list(keys) == list(reference) and len(clone) == len(keys) + 1
    assert list(clone)[:-1] == list(reference)
    keys.clear()
    assert list(keys) == [] and len(keys) == 0


def test_popping_from_empty_ordered_keys_raises_key_error() -> None:
    keys: OrderedKeys[int] = OrderedKeys(10)
    try:
        keys.pop_oldest()
    except KeyError:
        return
    raise AssertionError("pop_oldest of nothing returned")


@pytest.mark.parametrize("limit", [1, 3, 600])
def test_append_within_keeps_exactly_the_newest_limit_keys(limit: int) -> None:
    """The duel policy's history: past its limit it holds exactly the last ``limit`` keys."""
    keys: OrderedKeys[int] = OrderedKeys(10)
    for key in range(2 * limit + 5):
        keys.append_within(key, limit)
        assert list(keys) == list(range(max(0, key + 1 - limit), key + 1))
        assert len(keys) == min(key + 1, limit)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5_000)), max_size=300))
def test_ascending_dict_iterates_in_key_order(steps: list[tuple[bool, int]]) -> None:
    table: AscendingDict[int] = AscendingDict()
    plain: dict[int, int] = {}
    next_key = 0
    for insert, gap in steps:
        if insert or not plain:
            next_key += gap  # increasing keys, with gaps across chunks
            table[next_key] = plain[next_key] = gap
            next_key += 1
        else:
            victim = sorted(plain)[gap % len(plain)]
            del table[victim], plain[victim]
        assert len(table) == len(plain)
    assert list(table) == sorted(plain)
    assert dict(table) == plain
    assert all(table.get(key) == plain.get(key) for key in range(next_key + 2))
    table.clear()
    assert list(table) == []
