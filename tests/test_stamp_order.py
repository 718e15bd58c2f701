"""``StampOrder``, the ordered set under every built-in policy, against a sorted list.

The policies' own tests rarely span more than one bucket of 256 stamps, so the paths that
do (a key returning with an old stamp into a bucket of its own, a batch across buckets,
popping whole buckets) are driven here directly: random histories in the domain the
policies use (stamps from a clock that only moves forward, and keys that come back under
the stamp they left with), compared after every step with the obvious model.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvoffload.policies.recency import STAMPS_PER_BUCKET_BITS, StampOrder
from kvoffload_spec.surface import Key

BUCKET = 1 << STAMPS_PER_BUCKET_BITS

OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "add",
                "add_each",
                "extend",
                "return",
                "return_each",
                "discard",
                "remove_each",
                "pop_oldest",
                "pop_oldest_each",
                "clear",
            ]
        ),
        st.integers(1, 3 * BUCKET),  # how far the clock moves, or how many keys
        st.integers(0, 10**6),  # which keys
    ),
    max_size=40,
)


def check(order: StampOrder, model: dict[Key, int]) -> None:
    expected = sorted(model, key=model.__getitem__)
    assert list(order) == expected
    assert list(reversed(order)) == expected[::-1]
    assert len(order) == len(model)
    assert order.problems(model.get) == []
    assert all(order.contains(key, stamp) for key, stamp in model.items())


@given(OPERATIONS, st.sampled_from([0, 1, 3]))
def test_stamp_order_is_a_sorted_list(operations: list[tuple[str, int, int]], bits: int) -> None:
    order, model = StampOrder(bits), dict[Key, int]()
    left: dict[Key, int] = {}  # keys out of the order, with the stamp they will return under
    clock, fresh = 0, 0

    def new_pairs(count: int, step: int) -> list[tuple[Key, int]]:
        nonlocal clock, fresh
        pairs: list[tuple[Key, int]] = []
        for _ in range(count):
            clock += step << bits  # the low bits are not time
            fresh += 1
            pairs.append((f"k{fresh}", clock))
        return pairs

    def leave(keys: list[Key]) -> None:
        for key in keys:
            left[key] = model.pop(key)

    for name, amount, pick in operations:
        present = sorted(model, key=model.__getitem__)
        chosen = [present[(pick + i * 7) % len(present)] for i in range(3)] if present else []
        chosen = list(dict.fromkeys(chosen))
        if name == "add":
            ((key, stamp),) = new_pairs(1, amount)
            order.add(key, stamp)
            model[key] = stamp
        elif name in ("add_each", "extend"):
            pairs = new_pairs(1 + amount % 5, 1 + pick % (2 * BUCKET))
            (order.add_each if name == "add_each" else order.extend)(list(pairs))
            model.update(pairs)
        elif name in ("return", "return_each") and left:
            gone = sorted(left, key=left.__getitem__)
            keys = [gone[pick % len(gone)]] if name == "return" else gone[: 1 + amount % 4]
            pairs = [(key, left.pop(key)) for key in keys]
            if name == "return":
                order.add(*pairs[0])
            else:
                order.add_each(list(pairs))
            model.update(pairs)
        elif name == "discard" and chosen:
            assert order.discard(chosen[0], model[chosen[0]])
            assert not order.discard(chosen[0], model[chosen[0]])  # gone: a no-op
            leave(chosen[:1])
        elif name == "remove_each" and chosen:
            order.remove_each([(key, model[key]) for key in chosen])
            leave(chosen)
        elif name == "pop_oldest" and present:
            assert order.pop_oldest() == present[0]
            leave(present[:1])
        elif name == "pop_oldest_each" and present:
            count = 1 + amount % len(present)
            assert order.pop_oldest_each(count) == present[:count]
            leave(present[:count])
        elif name == "clear":
            order.clear()
            left.update(model)  # they may come back, under their old stamps
            model.clear()
        check(order, model)


def test_a_key_back_under_an_old_stamp_opens_its_own_bucket_in_order() -> None:
    order = StampOrder()
    order.add("new", 4 * BUCKET)
    order.add("old", 5)
    assert list(order) == ["old", "new"]
    order.add_each([("older", 1), ("between", 2 * BUCKET)])
    assert list(order) == ["older", "old", "between", "new"]
    stamps: dict[Key, int] = {"new": 4 * BUCKET, "old": 5, "older": 1, "between": 2 * BUCKET}
    assert order.problems(stamps.get) == []


def test_a_batch_across_buckets_keeps_later_keys_in_place() -> None:
    order = StampOrder()
    order.extend([("a", BUCKET - 6), ("b", BUCKET + 4)])
    order.add("x", BUCKET - 1)
    order.add("y", BUCKET + 2)
    assert list(order) == ["a", "x", "y", "b"]
    stamps: dict[Key, int] = {"a": BUCKET - 6, "b": BUCKET + 4, "x": BUCKET - 1, "y": BUCKET + 2}
    assert order.problems(stamps.get) == []


def test_popping_whole_buckets_leaves_no_empty_one() -> None:
    order = StampOrder()
    order.add_each([("a", 1), ("b", 2), ("c", BUCKET + 44)])
    assert order.pop_oldest_each(2) == ["a", "b"]
    assert list(order) == ["c"]
    left: dict[Key, int] = {"c": BUCKET + 44}
    assert order.problems(left.get) == []
    assert order.pop_oldest_each(1) == ["c"]
    assert list(order) == [] and order.problems(dict[Key, int]().get) == []
