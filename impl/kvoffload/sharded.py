"""Key-indexed tables that never pause: large dicts split into many small ones by hash.

A CPython dict rebuilds its whole hash table, in O(entries), in the insertion that finds it
out of room, and deletions use that room up as insertions do. A table that churns (a
key in for every key out, as a full block pool does on every store) therefore stops for
tens of milliseconds at a million entries, over and over. Split into shards of at most a
few hundred entries each, the same work comes in pieces of a few microseconds, at the
same amortized cost and the same memory per entry.

``ShardedDict`` is that split dict; its iteration order is arbitrary (callers that need
an order sort). ``OrderedKeys`` is an insertion-ordered set (what an ``OrderedDict`` of keys
to None is used for) kept in buckets of consecutive insertion numbers, so that its
appends, removals and pops from the front touch only small dicts. ``AscendingDict`` holds int keys
that arrive in increasing order (plan ids) in chunks of consecutive keys, iterated in order.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

SHARD_ENTRIES = 512  # a rebuild of a dict this size takes a few microseconds


def shard_count(expected_entries: int) -> int:
    """How many shards hold ``expected_entries`` at about ``SHARD_ENTRIES`` each: an odd
    number, so that keys which are multiples of a power of two still spread evenly.
    """
    return (expected_entries // SHARD_ENTRIES) | 1


class ShardedDict(Generic[K, V]):
    """A dict split by ``hash(key)`` into ``shard_count(expected_entries)`` plain dicts.

    The subset of the dict interface the manager and its policies use. Sized for
    ``expected_entries``, it holds any number, only with larger shards. ``len`` sums the
    shards' sizes (O(shards): about 2,000 at a million entries): keeping a count instead
    would cost every insertion a second lookup, and the hot paths never ask.
    """

    __slots__ = ("_count", "_shards")

    def __init__(self, expected_entries: int) -> None:
        self._count = shard_count(expected_entries)
        self._shards: list[dict[K, V]] = [{} for _ in range(self._count)]

    def __repr__(self) -> str:
        return f"ShardedDict({dict(self.items())!r})"

    def __reduce__(self) -> tuple[object, ...]:
        # A copy must place each key by *its own* hash (a copied key that hashes by
        # identity lands in another shard), so copies and pickles are rebuilt by insertion.
        return (_sharded_dict, (self._count, list(self.items())))

    def shard(self, key: K) -> dict[K, V]:
        """The plain dict that holds ``key`` (or would)."""
        return self._shards[hash(key) % self._count]

    def layout(self) -> tuple[list[dict[K, V]], int]:
        """The shards and their count: ``key`` lives in ``shards[hash(key) % count]``.

        For a hot loop over a call's keys, which then reaches each key's shard with no
        method call (a call costs more than the dict operation it wraps). The shards are
        the dict's own: write through them only as ``shard[key] = value``, ``del`` or
        ``pop``, never replace or resize the list.
        """
        return self._shards, self._count

    def __len__(self) -> int:
        return sum(len(shard) for shard in self._shards)

    def __contains__(self, key: object) -> bool:
        return key in self._shards[hash(key) % self._count]

    def __getitem__(self, key: K) -> V:
        return self._shards[hash(key) % self._count][key]

    def __setitem__(self, key: K, value: V) -> None:
        self._shards[hash(key) % self._count][key] = value

    def __delitem__(self, key: K) -> None:
        del self._shards[hash(key) % self._count][key]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._shards[hash(key) % self._count].get(key, default)

    def pop(self, key: K) -> V:
        """Remove ``key`` and return its value; KeyError if absent."""
        return self._shards[hash(key) % self._count].pop(key)

    # Whole calls' worth of keys at once: one Python step per call, not per key.

    def get_each(self, keys: Iterable[K]) -> list[V | None]:
        """``[self.get(key) for key in keys]``."""
        shards, count = self._shards, self._count
        return [shards[hash(key) % count].get(key) for key in keys]

    def values_of(self, keys: Iterable[K]) -> list[V]:
        """``[self[key] for key in keys]``: KeyError at the first absent key."""
        shards, count = self._shards, self._count
        return [shards[hash(key) % count][key] for key in keys]

    def missing(self, keys: Iterable[K]) -> list[K]:
        """The ``keys`` not in the dict, in their order."""
        shards, count = self._shards, self._count
        return [key for key in keys if key not in shards[hash(key) % count]]

    def pop_each(self, keys: Iterable[K]) -> list[V]:
        """``[self.pop(key) for key in keys]``: KeyError at the first absent key."""
        shards, count = self._shards, self._count
        return [shards[hash(key) % count].pop(key) for key in keys]

    def set_each(self, keys: Iterable[K], values: Iterable[V]) -> None:
        """``self[key] = value`` for each pair: as many keys as values."""
        shards, count = self._shards, self._count
        for key, value in zip(keys, values, strict=True):
            shards[hash(key) % count][key] = value

    def __iter__(self) -> Iterator[K]:
        for shard in self._shards:
            yield from shard

    def keys(self) -> Iterator[K]:
        return iter(self)

    def values(self) -> Iterator[V]:
        for shard in self._shards:
            yield from shard.values()

    def items(self) -> Iterator[tuple[K, V]]:
        for shard in self._shards:
            yield from shard.items()

    def update(self, pairs: Iterable[tuple[K, V]]) -> None:
        shards, count = self._shards, self._count
        for key, value in pairs:
            shards[hash(key) % count][key] = value

    def clear(self) -> None:
        for shard in self._shards:
            shard.clear()


def _sharded_dict(count: int, items: list[tuple[K, V]]) -> ShardedDict[K, V]:
    rebuilt: ShardedDict[K, V] = ShardedDict(0)
    rebuilt._count = count
    rebuilt._shards = [{} for _ in range(count)]
    rebuilt.update(items)
    return rebuilt


class OrderedKeys(Generic[K]):
    """An insertion-ordered set of keys, oldest first, each with an int value (0 unless
    given): appends at the end, removals anywhere, pops from the front, each a few
    small-dict operations with no pause.

    Each appended key gets the next number of a counter, its *stamp*; ``_stamps`` maps key
    -> stamp in shards (as ``ShardedDict``), and the keys themselves sit in buckets of
    ``BUCKET_STAMPS`` consecutive stamps, plain dicts (key -> value) in insertion (= stamp)
    order.
    ``_ids`` lists the non-empty buckets in ascending order: stamps only grow, so a new
    bucket always goes at its end.
    """

    __slots__ = ("_buckets", "_clock", "_count", "_ids", "_size", "_stamps")

    BUCKET_BITS = 8  # 256 stamps per bucket

    def __init__(self, expected_entries: int) -> None:
        self._count = shard_count(expected_entries)
        self._stamps: list[dict[K, int]] = [{} for _ in range(self._count)]
        self._buckets: dict[int, dict[K, int]] = {}
        self._ids: list[int] = []
        self._clock = 0
        self._size = 0

    def __repr__(self) -> str:
        return f"OrderedKeys({list(self)!r})"

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt by appending, for the reason of ``ShardedDict.__reduce__``.
        return (_ordered_keys, (self._count, list(self.items())))

    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: object) -> bool:
        return key in self._stamps[hash(key) % self._count]

    def __iter__(self) -> Iterator[K]:
        buckets = self._buckets
        for at in self._ids:
            yield from buckets[at]

    def items(self) -> Iterator[tuple[K, int]]:
        """Each key and its value, oldest first."""
        buckets = self._buckets
        for at in self._ids:
            yield from buckets[at].items()

    def append(self, key: K, value: int = 0) -> None:
        """Add ``key`` as the newest, with ``value``; it must not be present."""
        stamp = self._clock
        self._clock = stamp + 1
        self._stamps[hash(key) % self._count][key] = stamp
        at = stamp >> self.BUCKET_BITS
        bucket = self._buckets.get(at)
        if bucket is None:
            bucket = self._buckets[at] = {}
            self._ids.append(at)
        bucket[key] = value
        self._size += 1

    def discard(self, key: K) -> bool:
        """Remove ``key`` if present; whether it was."""
        return self.pop(key) is not None

    def pop(self, key: K) -> int | None:
        """Remove ``key`` if present and return its value; None if it was not there."""
        stamp = self._stamps[hash(key) % self._count].pop(key, None)
        if stamp is None:
            return None
        return self._unlink(key, stamp)

    def move_to_end(self, key: K) -> None:
        """Make the present ``key`` the newest (its value kept)."""
        self.append(key, self._unlink(key, self._stamps[hash(key) % self._count].pop(key)))

    def pop_oldest(self) -> K:
        """Remove and return the oldest key; KeyError when empty."""
        if not self._size:
            raise KeyError("pop_oldest from empty OrderedKeys")
        at = self._ids[0]
        bucket = self._buckets[at]
        oldest = next(iter(bucket))
        del self._stamps[hash(oldest) % self._count][oldest]
        del bucket[oldest]
        if not bucket:
            del self._buckets[at], self._ids[0]
        self._size -= 1
        return oldest

    def append_within(self, key: K, limit: int, value: int = 0) -> None:
        """``append(key, value)``, then pop the oldest keys until at most ``limit`` are
        left."""
        self.append(key, value)
        while self._size > limit:
            self.pop_oldest()

    def clear(self) -> None:
        for shard in self._stamps:
            shard.clear()
        self._buckets.clear()
        self._ids.clear()
        self._size = 0

    def _unlink(self, key: K, stamp: int) -> int:
        at = stamp >> self.BUCKET_BITS
        bucket = self._buckets[at]
        value = bucket.pop(key)
        if not bucket:
            del self._buckets[at]
            ids = self._ids
            del ids[bisect_left(ids, at)]
        self._size -= 1
        return value


def _ordered_keys(count: int, items: list[tuple[K, int]]) -> OrderedKeys[K]:
    rebuilt: OrderedKeys[K] = OrderedKeys(count * SHARD_ENTRIES)
    for key, value in items:
        rebuilt.append(key, value)
    return rebuilt


class AscendingDict(MutableMapping[int, V]):
    """A dict of int keys inserted in increasing order (plan ids), iterated in key order,
    and split into chunks of ``CHUNK_KEYS`` consecutive keys so that no table is large.

    Keys arrive in increasing order and leave in any order: the chunks are created in key
    order (a plain dict of chunks keeps that order) and each chunk's entries are in key
    order too. A chunk is dropped when its last key leaves, so the dict of chunks holds one
    entry per chunk with a key still present, and changes once per ``CHUNK_KEYS`` keys.
    """

    __slots__ = ("_chunks",)

    CHUNK_KEYS = 1_024

    def __init__(self) -> None:
        self._chunks: dict[int, dict[int, V]] = {}

    def __repr__(self) -> str:
        return f"AscendingDict({dict(self.items())!r})"

    def __len__(self) -> int:
        return sum(len(chunk) for chunk in self._chunks.values())

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int):
            return False
        chunk = self._chunks.get(key // self.CHUNK_KEYS)
        return chunk is not None and key in chunk

    def __getitem__(self, key: int) -> V:
        chunk = self._chunks.get(key // self.CHUNK_KEYS)
        if chunk is None:
            raise KeyError(key)
        return chunk[key]

    def get(self, key: int, default: V | None = None) -> V | None:  # type: ignore[override]
        chunk = self._chunks.get(key // self.CHUNK_KEYS)
        return default if chunk is None else chunk.get(key, default)

    def __iter__(self) -> Iterator[int]:
        for chunk in list(self._chunks.values()):
            yield from chunk

    def __setitem__(self, key: int, value: V) -> None:
        """Insert ``key`` (a new key must exceed every key inserted before) or update it."""
        at = key // self.CHUNK_KEYS
        chunk = self._chunks.get(at)
        if chunk is None:
            chunk = self._chunks[at] = {}
        chunk[key] = value

    def __delitem__(self, key: int) -> None:
        at = key // self.CHUNK_KEYS
        chunk = self._chunks[at]
        del chunk[key]
        if not chunk:
            del self._chunks[at]

    def clear(self) -> None:
        self._chunks.clear()
