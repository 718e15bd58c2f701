"""Recency bookkeeping shared by the built-in policies.

Every resident key carries an integer stamp from a clock that only moves forward, so a
key's place in the order is its stamp, whatever happens to the key meanwhile. The evictable
keys are kept apart, ordered by stamp (``StampOrder``): finding victims walks only evictable
keys, least recent first, and skips the protected ones (at most one per key of the call).
A key that is pinned leaves that order and returns to it under the same stamp, so pinning
never changes recency.
"""

from __future__ import annotations

import functools
from bisect import bisect_left, insort
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from itertools import chain, filterfalse, islice
from operator import itemgetter
from typing import Any

from sortedcontainers import SortedKeyList

from kvoffload.sharded import ShardedDict
from kvoffload_spec.surface import Key

STAMPS_PER_BUCKET_BITS = 8  # a bucket holds the keys of 256 consecutive stamps
_BY_STAMP = itemgetter(1)


class StampOrder:
    """Keys ordered by their unique integer stamps, in buckets of consecutive stamps.

    Bucket ``stamp >> self._bits`` is a plain dict ``key -> stamp``, and ``_ids`` lists the
    non-empty buckets in ascending order. Adding, removing and finding the oldest key are a
    few operations on small dicts, in C, whatever the number of keys; no table grows past
    a bucket, so none pauses to rebuild.

    Keys nearly always arrive in stamp order (a new or touched key has the newest stamp),
    so a bucket's insertion order is its stamp order. A key that returns with an older
    stamp (unpinned, or its store completed after newer stores) marks its bucket *unsorted*;
    the bucket is sorted once, in place, the next time it is read (at most 256 entries).
    The caller keeps each key's stamp and passes it in.
    """

    __slots__ = ("_bits", "_buckets", "_ids", "_newest", "_unsorted")

    def __init__(self, low_bits: int = 0) -> None:
        """``low_bits``: how many low bits of a stamp are not time (ARC's list bits)."""
        self._bits = STAMPS_PER_BUCKET_BITS + low_bits
        self._buckets: dict[int, dict[Key, int]] = {}
        self._ids: list[int] = []  # the keys of _buckets, ascending
        self._unsorted: set[int] = set()  # buckets whose dict order is not stamp order
        self._newest = -1  # no stamp added since the last clear exceeds it

    def __repr__(self) -> str:
        return f"StampOrder({list(self)!r})"

    def __len__(self) -> int:
        return sum(map(len, self._buckets.values()))

    def add(self, key: Key, stamp: int) -> None:
        """Add ``key`` (absent) under ``stamp`` (no other key's)."""
        at = stamp >> self._bits
        bucket = self._buckets.get(at)
        if stamp > self._newest:  # the common case: the newest key so far
            self._newest = stamp
            if bucket is not None:
                bucket[key] = stamp
                return
        elif bucket is not None:
            if stamp < next(reversed(bucket.values())):
                self._unsorted.add(at)
            bucket[key] = stamp
            return
        self._buckets[at] = {key: stamp}
        ids = self._ids
        if not ids or ids[-1] < at:
            ids.append(at)
        else:
            insort(ids, at)

    def add_each(self, pairs: list[tuple[Key, int]]) -> None:
        """``add`` each ``(key, stamp)`` of ``pairs`` (which it may reorder)."""
        if not pairs:
            return
        # Sorted first (in C; a run that descends, as a touched store's keys do, is
        # reversed in one pass), the pairs fall into runs of one bucket each, found by
        # bisection; each run goes into its bucket with one dict.update, and marks the
        # bucket unsorted only if it starts below the bucket's newest entry.
        pairs.sort(key=_BY_STAMP)
        if pairs[0][1] > self._newest:
            self.extend(pairs)
            return
        buckets, ids, bits = self._buckets, self._ids, self._bits
        start = 0
        while start < len(pairs):
            first = pairs[start][1]
            at = first >> bits
            end = bisect_left(pairs, (at + 1) << bits, start, key=_BY_STAMP)
            bucket = buckets.get(at)
            if bucket is None:
                bucket = buckets[at] = {}
                if not ids or ids[-1] < at:
                    ids.append(at)
                else:
                    insort(ids, at)
            elif first < next(reversed(bucket.values())):
                self._unsorted.add(at)
            bucket.update(pairs[start:end])
            start = end
        self._newest = max(self._newest, pairs[-1][1])

    def extend(self, pairs: list[tuple[Key, int]]) -> None:
        """``add`` each ``(key, stamp)`` of ``pairs``, whose stamps ascend and exceed every
        stamp here (ARC's new ghosts, a completed store's keys).
        """
        if not pairs:
            return
        buckets, ids, bits = self._buckets, self._ids, self._bits
        at = pairs[-1][1] >> bits
        if pairs[0][1] >> bits == at:  # all in one bucket, as a call's keys nearly always are
            bucket = buckets.get(at)
            if bucket is None:
                bucket = buckets[at] = {}
                ids.append(at)
            bucket.update(pairs)  # in C
            self._newest = pairs[-1][1]
            return
        at, bucket, stamp = -1, {}, self._newest
        for key, stamp in pairs:
            if stamp >> bits != at:
                at = stamp >> bits
                if at not in buckets:
                    buckets[at] = {}
                    ids.append(at)
                bucket = buckets[at]
            bucket[key] = stamp
        self._newest = stamp

    def discard(self, key: Key, stamp: int) -> bool:
        """Remove ``key``, held under ``stamp``, if it is here; whether it was."""
        at = stamp >> self._bits
        bucket = self._buckets.get(at)
        if bucket is None or bucket.pop(key, None) is None:
            return False
        if not bucket:
            self._drop(at)
        return True

    def remove(self, key: Key, stamp: int) -> None:
        """Remove ``key``, which is here under ``stamp``."""
        at = stamp >> self._bits
        bucket = self._buckets[at]
        del bucket[key]
        if not bucket:
            self._drop(at)

    def remove_each(self, pairs: Iterable[tuple[Key, int]]) -> None:
        """``remove`` each ``(key, stamp)`` of ``pairs``, all of them here."""
        buckets, bits = self._buckets, self._bits
        for key, stamp in pairs:
            bucket = buckets[stamp >> bits]
            del bucket[key]
            if not bucket:
                self._drop(stamp >> bits)

    def contains(self, key: Key, stamp: int) -> bool:
        """Whether ``key``, whose stamp is ``stamp``, is here."""
        return key in self._buckets.get(stamp >> self._bits, ())

    def pop_oldest(self) -> Key:
        """Remove and return the key with the least stamp; IndexError when empty."""
        at = self._ids[0]
        bucket = self._bucket(at)
        oldest = next(iter(bucket))
        del bucket[oldest]
        if not bucket:
            self._drop(at)
        return oldest

    def pop_oldest_each(self, count: int) -> list[Key]:
        """Remove and return the ``count`` keys with the least stamps, oldest first
        (IndexError when there are fewer): whole buckets at a time.
        """
        taken: list[Key] = []
        while len(taken) < count:
            at = self._ids[0]
            bucket = self._bucket(at)
            wanted = count - len(taken)
            if wanted >= len(bucket):
                taken += bucket
                self._drop(at)
            else:
                oldest = list(islice(bucket, wanted))
                for key in oldest:
                    del bucket[key]
                taken += oldest
        return taken

    def __iter__(self) -> Iterator[Key]:
        """Oldest first. Nothing may be added or removed while the iteration runs."""
        # Chained in C: the walk for victims costs no Python frame per key.
        return chain.from_iterable(map(self._bucket, self._ids))

    def __reversed__(self) -> Iterator[Key]:
        for at in reversed(self._ids):
            yield from reversed(self._bucket(at))

    def clear(self) -> None:
        self._buckets.clear()
        self._ids.clear()
        self._unsorted.clear()
        self._newest = -1

    def problems(self, stamp_of: Callable[[Key], int | None]) -> list[str]:
        """What is wrong inside, in words; ``stamp_of`` gives each key's true stamp."""
        found: list[str] = []
        if self._ids != sorted(self._buckets) or not all(self._buckets.values()):
            found.append(f"stamp buckets {self._ids} are not the non-empty buckets, ascending")
        for at, bucket in self._buckets.items():
            for key, stamp in bucket.items():
                if stamp >> self._bits != at or stamp_of(key) != stamp:
                    found.append(f"{key!r} is in stamp bucket {at} under {stamp}")
            stamps = list(bucket.values())
            if at not in self._unsorted and stamps != sorted(stamps):
                found.append(f"stamp bucket {at} is out of order and not marked so")
        return found

    def _bucket(self, at: int) -> dict[Key, int]:
        bucket = self._buckets[at]
        if at in self._unsorted:
            # Reordering changes no key's place in the order: it is still stamp order.
            ordered = sorted(bucket.items(), key=_BY_STAMP)
            bucket.clear()
            bucket.update(ordered)
            self._unsorted.discard(at)
        return bucket

    def _drop(self, at: int) -> None:
        del self._buckets[at]
        ids = self._ids
        del ids[bisect_left(ids, at)]
        self._unsorted.discard(at)


def stamp_ordered(stamps: Mapping[Key, int] | ShardedDict[Key, int]) -> Any:
    """An empty sorted list of keys ordered by ``stamps[key]`` (which must be unique).

    The sort key is a ``partial`` of the class's ``__getitem__`` rather than a bound method,
    because ``copy.deepcopy`` copies a partial's arguments through its memo: the clone's list
    then reads the clone's stamps, not the original's.
    """
    lookup: Any = type(stamps).__getitem__
    return SortedKeyList(key=functools.partial(lookup, stamps))


def unprotected(ordered: Iterable[Key], protected: Container[Key]) -> Iterator[Key]:
    """The keys of ``ordered``, least recent first, skipping those in ``protected``."""
    return filterfalse(protected.__contains__, ordered)
