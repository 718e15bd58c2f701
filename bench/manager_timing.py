"""Timing the manager one call at a time, as bench/manager_bench.py does: pools built in
engine-sized batches, the setup frozen out of the collector's sight, and each call's wall
and CPU time with what interrupted it (a collection, a large dict's rebuild)."""

from __future__ import annotations

import ctypes
import gc
import platform
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvoffload.manager import OffloadManager
from kvoffload_spec.surface import Key

BIG_DICT = 1_000  # entries: from here a rebuild of the dict is a pause of tens of us
CHUNK = 64  # blocks per plan while a pool is built: an engine-sized batch


def chunks(keys: Sequence[Key], size: int = CHUNK) -> Iterator[Sequence[Key]]:
    for start in range(0, len(keys), size):
        yield keys[start : start + size]


def fill(manager: OffloadManager, keys: Sequence[Key]) -> None:
    """Store ``keys`` in engine-sized batches, least recent first, and complete them."""
    for batch in chunks(keys):
        plan = manager.prepare_store(batch)
        if plan is None or len(plan.keys) != len(batch):
            raise RuntimeError(f"could not fill {manager!r}")
        manager.complete_store(plan)


def pin(manager: OffloadManager, keys: Sequence[Key]) -> None:
    """Open (and leave open) load plans reading ``keys``."""
    for batch in chunks(keys):
        manager.prepare_load(batch)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Measure with the setup's objects out of the collector's sight (see the docstring)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


def seconds_per_call(call: Callable[[], object], calls: int, rounds: int = 5) -> float:
    """The fastest of ``rounds`` loops of ``calls`` calls, per call (timeit's convention:
    on a shared machine the slower rounds measure the neighbours).
    """
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def watched_dicts(manager: OffloadManager) -> list[dict[object, object]]:
    """Every dict the manager and its policy hold (found through their ``__slots__``)."""
    found: list[dict[object, object]] = []
    for owner in (manager, manager.policy):
        for cls in type(owner).__mro__:
            for name in getattr(cls, "__slots__", ()):
                value = getattr(owner, name, None)
                if isinstance(value, dict):
                    found.append(value)
    return found


# CPython's PyDictObject on 64-bit builds (3.10 to 3.13): refcount, type, ma_used and
# ma_version_tag take 8 bytes each, then comes ma_keys, the pointer to the hash table.
_MA_KEYS_OFFSET = 32


def table_address(mapping: dict[object, object]) -> int:
    """Where the dict's hash table lives: it moves exactly when the table is rebuilt, to
    grow or to squeeze out deleted entries (an O(n) pause). 0 where this cannot be read.
    """
    if not _CAN_SEE_TABLES:
        return 0
    return ctypes.c_void_p.from_address(id(mapping) + _MA_KEYS_OFFSET).value or 0


def _tables_visible() -> bool:
    if platform.python_implementation() != "CPython" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return False
    probe: dict[object, object] = {0: 0}
    before = ctypes.c_void_p.from_address(id(probe) + _MA_KEYS_OFFSET).value
    probe.update(dict.fromkeys(range(1, 100)))  # grows: a new table
    return before != ctypes.c_void_p.from_address(id(probe) + _MA_KEYS_OFFSET).value


_CAN_SEE_TABLES = _tables_visible()


class CallTimer:
    """Times calls one by one, and tells whether a collection or a dict rebuild (each costs
    O(heap) or O(n), however rarely it comes) happened during each.
    """

    def __init__(self, watched: list[dict[object, object]], calls: int) -> None:
        self.wall_ns = array("q", bytes(8 * calls))
        self.cpu_ns = array("q", bytes(8 * calls))
        self.causes: dict[int, str] = {}  # call index -> cause, for unsteady calls only
        self._watched = watched
        self._last_tables = self._tables()
        self._collections = 0

    def _tables(self) -> list[int]:
        # A small dict's rebuild is part of the steady cost; only a big one is a pause.
        return [table_address(d) if len(d) >= BIG_DICT else 0 for d in self._watched]

    def _count_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._collections += 1

    def run(self, call: Callable[[], None]) -> None:
        gc.callbacks.append(self._count_collection)
        try:
            wall, cpu = time.perf_counter_ns, time.thread_time_ns
            for index in range(len(self.wall_ns)):
                collections = self._collections
                started, computing = wall(), cpu()
                call()
                self.cpu_ns[index] = cpu() - computing
                self.wall_ns[index] = wall() - started
                if self._collections != collections:
                    self.causes[index] = "collection"
                tables = self._tables()
                if tables != self._last_tables:
                    self.causes.setdefault(index, "dict rebuild")
                    self._last_tables = tables
        finally:
            gc.callbacks.remove(self._count_collection)
