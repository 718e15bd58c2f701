"""The engine's device prefix cache, as the sweep and the simulation model it: the tier in
front of the CPU pool, whose hits the CPU tier never sees."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from itertools import islice

from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.validation import check_count


class DevicePrefixCache:
    """The engine's device prefix cache: LRU over keys, each held in a device block.

    ``admit`` plays one request in the engine's call order and returns its hit prefix.
    Every block of the request must be on the device at once, so a request longer than the
    cache is an error, raised before anything changes.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = check_count("num_blocks", num_blocks)
        # key -> its device block, least recent first
        self.slots: OrderedDict[Hashable, int] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first

    def admit(self, request: Sequence[Hashable]) -> int:
        distinct = list(dict.fromkeys(request))
        if len(distinct) > self.num_blocks:
            raise InvalidArgumentError(
                f"a request of {len(distinct)} blocks does not fit in a device cache of "
                f"{self.num_blocks} blocks"
            )
        hits = 0
        for key in request:
            if key not in self.slots:
                break
            hits += 1
        absent = [key for key in distinct if key not in self.slots]
        protected = set(distinct)
        need = len(absent) - len(self._free)
        if need > 0:
            # Least recent first; stops early, so a full cache costs O(need + request).
            victims = islice((key for key in self.slots if key not in protected), need)
            for key in list(victims):
                self._free.append(self.slots.pop(key))
        for key in absent:
            self.slots[key] = self._free.pop()
        for key in reversed(request):
            self.slots.move_to_end(key)
        return hits
