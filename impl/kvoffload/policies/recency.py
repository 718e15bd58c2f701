"""Recency bookkeeping shared by the built-in policies.

Every resident key carries an integer stamp from a clock that only moves forward, so a
key's place in the order is its stamp, whatever happens to the key meanwhile. The evictable
keys are kept apart in a sorted list ordered by stamp: finding victims walks only evictable
keys, least recent first, and skips the protected ones (at most one per key of the call).
A key that is pinned leaves that list and returns to it under the same stamp, so pinning
never changes recency.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Iterator, Mapping
from typing import Any

from sortedcontainers import SortedKeyList

from kvoffload.sharded import ShardedDict
from kvoffload_spec.surface import Key


def stamp_ordered(stamps: Mapping[Key, int] | ShardedDict[Key, int]) -> Any:
    """An empty sorted list of keys ordered by ``stamps[key]`` (which must be unique).

    The sort key is a ``partial`` of the class's ``__getitem__`` rather than a bound method,
    because ``copy.deepcopy`` copies a partial's arguments through its memo: the clone's list
    then reads the clone's stamps, not the original's.
    """
    lookup: Any = type(stamps).__getitem__
    return SortedKeyList(key=functools.partial(lookup, stamps))


def unprotected(ordered: Any, protected: Container[Key]) -> Iterator[Key]:
    """The keys of ``ordered``, least recent first, skipping those in ``protected``."""
    return (key for key in ordered if key not in protected)
