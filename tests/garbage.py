"""Garbage for the bad-input tests (tests/test_bad_input_*.py), and how they check a refusal.

Hypothesis strategies of wrong arguments (junk, unhashable keys, bad counts, flags and
seconds, bad block ids), a bad call as data (``Call``) and how to make it, ``refused`` (the
exact error class), and ``undocumented``: which of a file's case labels docs/reliability.md
does not list as tested there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from kvoffload_spec.errors import OffloadError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"

# The keys of every world the tests build: stored and readable, pending (its store not
# completed), and absent (never stored, or dropped).
READY, PENDING, ABSENT = ("a", "b"), ("p",), ("q", "s", "t", "u", "z")


class Call(NamedTuple):
    method: str
    args: tuple[object, ...]
    kwargs: dict[str, object]


def call(method: str, *args: st.SearchStrategy[Any], **kwargs: st.SearchStrategy[Any]) -> Any:
    """A strategy of ``Call(method, args, kwargs)`` drawing each argument from its own."""
    return st.tuples(st.tuples(*args), st.fixed_dictionaries(kwargs)).map(
        lambda drawn: Call(method, drawn[0], drawn[1])
    )


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.integers(), st.integers(), max_size=2),
    st.builds(object),
)
UNHASHABLE = st.one_of(
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.integers(), st.integers(), max_size=2),
    st.sets(st.integers(), max_size=2),
    st.binary(max_size=2).map(bytearray),
)
# A lone str or bytes is refused too: it is nearly always a missing [...].
NOT_A_KEY_LIST = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.binary(max_size=3).map(bytearray),
    st.dictionaries(st.integers(), st.integers(), max_size=2),
    st.frozensets(st.integers(), max_size=2),
    st.builds(object),
)


@st.composite
def with_unhashable(draw: st.DrawFn) -> list[object]:
    keys: list[object] = draw(st.lists(st.sampled_from(["a", b"h", 3, (4, "t")]), max_size=3))
    keys.insert(draw(st.integers(0, len(keys))), draw(UNHASHABLE))
    return keys


BAD_COUNT = st.one_of(
    st.integers(max_value=0),
    st.floats(),
    st.booleans(),
    st.text(max_size=2),
    st.none(),
    st.builds(object),
)
BAD_FLAG = st.one_of(st.integers(), st.none(), st.text(max_size=2), st.floats())
BAD_SECONDS = st.one_of(
    st.floats(max_value=0.0),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.integers(max_value=0),
    st.booleans(),
    st.text(max_size=2),
    st.lists(st.integers(), max_size=1),
    st.builds(object),
)


@st.composite
def out_of_range(draw: st.DrawFn, limit: int, count: int) -> list[int]:
    ids = draw(st.lists(st.integers(0, limit - 1), min_size=count, max_size=count))
    wrong = st.one_of(st.integers(max_value=-1), st.integers(min_value=limit))
    ids[draw(st.integers(0, count - 1))] = draw(wrong)
    return ids


def not_ints(count: int) -> st.SearchStrategy[object]:
    """Block ids of the wrong type: containers of other things, or not a container."""
    other = st.one_of(
        st.floats(), st.booleans(), st.text(max_size=2), st.none(), st.lists(st.integers(0, 1))
    )
    return st.one_of(
        st.lists(st.integers(0, 1), min_size=count - 1, max_size=count - 1).flatmap(
            lambda ids: st.tuples(st.integers(0, len(ids)), other).map(
                lambda at: [*ids[: at[0]], at[1], *ids[at[0] :]]
            )
        ),
        st.one_of(st.none(), st.integers(), st.text(max_size=2), st.builds(object)),
        st.sets(st.integers(0, 1), min_size=1, max_size=1),
        st.just(np.zeros(count, dtype=np.float32)),
        st.just(np.zeros((count, 1), dtype=np.int64)),
        st.just(np.array([True] * count)),
        st.just(np.array([None] * count, dtype=object)),
        st.builds(lambda: torch.zeros(count)),
        st.builds(lambda: torch.zeros(count, 1, dtype=torch.int64)),
        st.builds(lambda: torch.zeros(count, dtype=torch.bool)),
        st.just([2**70] * count),
    )


def wrong_count(limit: int, count: int) -> st.SearchStrategy[list[int]]:
    sizes = st.integers(0, limit).filter(lambda size: size != count)
    return sizes.flatmap(lambda size: st.permutations(range(limit)).map(lambda ids: ids[:size]))


def invoke(target: object, made: Call, resolve_value: Callable[[object], object]) -> None:
    args = [resolve_value(value) for value in made.args]
    kwargs = {name: resolve_value(value) for name, value in made.kwargs.items()}
    getattr(target, made.method)(*args, **kwargs)


def refused(
    expected: type[OffloadError], function: Callable[..., object], *args: object, **kwargs: object
) -> OffloadError:
    """What ``function(*args, **kwargs)`` raised, which must be exactly ``expected``."""
    with pytest.raises(OffloadError) as raised:
        function(*args, **kwargs)
    assert type(raised.value) is expected, f"{raised.value!r} instead of {expected.__name__}"
    return raised.value


def make_tensors(num_blocks: int) -> tuple[list[torch.Tensor], int]:
    generator = torch.Generator().manual_seed(num_blocks)
    tensors = [
        torch.randint(0, 256, (2, num_blocks, 3, 4), dtype=torch.uint8, generator=generator)
        for _ in range(2)
    ]
    return tensors, 1


def ids_for(keys: int, factor: int) -> st.SearchStrategy[list[int]]:
    return st.permutations(range(8)).map(lambda ids: ids[: keys * factor])


def undocumented(labels: Iterable[str], test_file: str) -> list[str]:
    """The ``labels`` whose row in docs/reliability.md's table of bad input does not name
    ``test_file``."""
    section = DOCS.read_text().split("\n## Bad input\n")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    row_of = {row.split("`")[1]: row for row in rows}
    return sorted(label for label in labels if f"`{test_file}`" not in row_of.get(label, ""))
