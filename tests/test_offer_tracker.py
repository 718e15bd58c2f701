"""The store threshold's offer tracker when it is full: the manager's against the spec's.

The lockstep runs use trackers of a few thousand keys, which their short histories never
fill; here trackers of one to three keys overflow at nearly every call, so what is
forgotten, and what is not recorded at all, is compared call by call.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvoffload.manager import OffloadManager
from kvoffload_spec import OffloadModel
from kvoffload_spec.surface import Key

KEYS = "abcdef"


def offers(manager: OffloadManager) -> list[int]:
    return [manager.offer_count(key) for key in KEYS]


@given(
    st.integers(2, 3),
    st.integers(1, 3),
    st.lists(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4), max_size=12),
)
def test_a_full_tracker_forgets_as_the_spec_does(
    threshold: int, tracker: int, calls: list[list[Key]]
) -> None:
    manager = OffloadManager(64, store_threshold=threshold, max_tracker_size=tracker)
    model = OffloadModel(64, store_threshold=threshold, max_tracker_size=tracker)
    for keys in calls:
        ours, theirs = manager.prepare_store(keys), model.prepare_store(keys)
        assert (ours is None) is (theirs is None)
        if ours is not None and theirs is not None:
            assert ours.keys == theirs.keys  # the candidates: offered often enough
            manager.complete_store(ours)
            model.complete_store(theirs)
        assert offers(manager) == [model.state.offers.get(key, 0) for key in KEYS]
        # In the same order too: the least recently offered is forgotten first.
        assert list(manager.abstract_state().offers.items()) == list(model.state.offers.items())


def test_keys_of_one_call_never_push_each_other_out() -> None:
    manager = OffloadManager(8, store_threshold=2, max_tracker_size=2)
    assert manager.prepare_store(["a", "b", "c"]) is not None
    assert [manager.offer_count(key) for key in "abc"] == [1, 1, 0]


def test_an_offer_makes_a_tracked_key_the_last_to_be_forgotten() -> None:
    manager = OffloadManager(8, store_threshold=3, max_tracker_size=2)
    for keys in (["a"], ["b"], ["a"], ["c"]):
        manager.prepare_store(keys)
    assert [manager.offer_count(key) for key in "abc"] == [2, 0, 1]


def test_only_keys_outside_the_call_are_forgotten_for_its_new_ones() -> None:
    manager = OffloadManager(8, store_threshold=3, max_tracker_size=2)
    for keys in (["x"], ["y"], ["y", "n1", "n2"]):
        manager.prepare_store(keys)
    counts = {key: manager.offer_count(key) for key in ("x", "y", "n1", "n2")}
    assert counts == {"x": 0, "y": 2, "n1": 1, "n2": 0}
