"""Belady's optimum: the hit ratio no eviction policy can beat on a known key stream.

Offline, with the whole trace known: per request, the hits are the longest prefix of
resident ids; then each id of the request, in order, becomes resident unless it is never
used again, and when the cache is full the resident block whose next use is farthest away is
evicted (blocks of the current request included). This is the reference simulation
whose figures accompany the bundled traces (docs/performance.md).

Next uses are precomputed in one backward pass; the farthest next use comes from a max-heap
with lazy deletion (an entry is stale once its key was evicted or used again), compacted
whenever stale entries outnumber live ones, so a run costs O(N log C) for N references and
C blocks.

With room for two blocks, 3 evicts 2 (used later than 1), so the third request hits
only its first block, and the last one hits 3:

>>> belady_hits([(1, 2), (3,), (1, 2), (3,)], capacity=2)
2
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from kvoffload_spec.validation import check_count


def next_uses(stream: Sequence[Hashable]) -> list[int]:
    """For each position, the next position holding the same key; ``len(stream)`` if none."""
    never = len(stream)
    following: dict[Hashable, int] = {}
    result = [never] * never
    for position in range(never - 1, -1, -1):
        key = stream[position]
        result[position] = following.get(key, never)
        following[key] = position
    return result


def belady_hits(requests: Sequence[Sequence[Hashable]], capacity: int) -> int:
    """Block hits of Belady's optimal cache of ``capacity`` blocks over ``requests``."""
    check_count("capacity", capacity)
    stream = [key for request in requests for key in request]
    next_use = next_uses(stream)
    never = len(stream)
    # key -> position of its latest reference; its next use is next_use[that position]
    resident: dict[Hashable, int] = {}
    # Entries are (-next use, position): the top is the farthest next use, and positions
    # are unique, so ties never compare keys (which may be of mixed types). An entry is
    # live while its key is resident and was not referenced again since.
    farthest: list[tuple[int, int]] = []
    hits = 0
    start = 0
    for request in requests:
        for key in request:
            if key not in resident:
                break
            hits += 1
        for position in range(start, start + len(request)):
            key = stream[position]
            if key not in resident:
                if next_use[position] == never:
                    continue
                if len(resident) >= capacity:
                    _evict_farthest(resident, farthest, stream)
            resident[key] = position
            heapq.heappush(farthest, (-next_use[position], position))
        if len(farthest) > 2 * len(resident) + 64:
            farthest = [(-next_use[position], position) for position in resident.values()]
            heapq.heapify(farthest)
        start += len(request)
    return hits


def _evict_farthest(
    resident: dict[Hashable, int], farthest: list[tuple[int, int]], stream: Sequence[Hashable]
) -> None:
    while True:
        _, position = heapq.heappop(farthest)
        key = stream[position]
        if resident.get(key) == position:
            del resident[key]
            return
