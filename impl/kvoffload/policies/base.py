"""The eviction-policy interface: an order over resident blocks, and the choice of victims.

The manager owns the blocks, their block ids, refs, counters, plans and events; a policy owns only
an *order*. The manager tells the policy every change that matters to it: a key became
resident (pending, so not evictable), became evictable (its store completed, or its last
load finished), stopped being evictable (a load pinned it), left without being evicted (its
store failed), or everything was dropped (a reset). Because the policy hears about
evictability as it changes, it can keep its evictable keys apart and find victims without
walking past pinned, pending or protected blocks.

``choose_victims`` must not change anything: the manager validates the choice and commits it
with ``evict`` only once the whole ``prepare_store`` is known to succeed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING, ClassVar

from kvoffload_spec.surface import Key

if TYPE_CHECKING:
    from kvoffload_spec.policies import PolicyOrder


class PolicyContractError(RuntimeError):
    """A policy broke its contract (for example it chose a pinned or protected victim).

    This is a bug in the policy, not a misuse by the caller, so it is not an ``OffloadError``.
    The manager raises it before committing anything, so the cache is left unchanged.
    """


# Each per-key method and the batch form that defaults to it.
_BATCH_FORMS = (
    ("insert", "insert_each"),
    ("mark_evictable", "mark_evictable_each"),
    ("mark_unevictable", "mark_unevictable_each"),
)


class EvictionPolicy(ABC):
    """Base class of eviction policies; subclass it to plug in your own.

    A policy class is constructed as ``Policy(capacity)`` with the manager's ``num_blocks``.
    The lifecycle of a key as a policy sees it::

        insert -> (mark_evictable | mark_unevictable)* -> evict | remove | clear

    ``on_store_miss`` hears the keys a ``prepare_store`` is about to place, before any
    victim is chosen. ``insert`` makes the key resident and most recent, not evictable;
    ``mark_evictable`` and ``mark_unevictable`` alternate, starting with
    ``mark_evictable``; ``evict`` only ever receives keys that are evictable, ``remove``
    only keys that are not. ``touch`` may name keys that are not resident: ignore them (or,
    like ARC, use them as ghost hits). The manager calls the batch forms
    ``insert_each``, ``mark_evictable_each`` and ``mark_unevictable_each`` with a call's
    keys; they default to the per-key methods, so a policy need only write those.
    """

    __slots__ = ("capacity",)

    #: True when ``touch`` of a ready key counts as a repeated use (frequency), not just
    #: recency, as in ARC (T1 -> T2). Engine adapters then touch only the keys a request
    #: really reused, so that a request's own stores never count as a second use.
    touch_counts_reuse: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key) -> None:
        """``key`` became resident (its store is in flight), as the most recent key."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """``key`` left without being evicted (its store failed); it was not evictable."""

    @abstractmethod
    def mark_evictable(self, key: Key) -> None:
        """``key`` is ready with no loads reading it: it may now be chosen as a victim."""

    @abstractmethod
    def mark_unevictable(self, key: Key) -> None:
        """A load pinned ``key``: it must not be chosen until marked evictable again."""

    # The manager hands a whole call's keys to the batch forms below. Each defaults to its
    # per-key method, key by key, and a subclass that overrides the per-key method but not
    # the batch form gets that default back (``__init_subclass__``): an override of
    # ``mark_evictable`` is never bypassed by an inherited, inlined ``mark_evictable_each``.

    def insert_each(self, keys: Sequence[Key]) -> None:
        """``insert`` each of ``keys``, in order."""
        for key in keys:
            self.insert(key)

    def mark_evictable_each(self, keys: Sequence[Key]) -> None:
        """``mark_evictable`` each of ``keys``, in order."""
        for key in keys:
            self.mark_evictable(key)

    def mark_unevictable_each(self, keys: Sequence[Key]) -> None:
        """``mark_unevictable`` each of ``keys``, in order."""
        for key in keys:
            self.mark_unevictable(key)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for single, batch in _BATCH_FORMS:
            if single in cls.__dict__ and batch not in cls.__dict__:
                setattr(cls, batch, getattr(EvictionPolicy, batch))

    @abstractmethod
    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        """``keys`` were used; the first key ends up the most recent (process in reverse)."""

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        """``prepare_store`` is about to place ``keys`` (distinct, absent, admitted by the
        store threshold), before it asks for victims or inserts them; called also when the
        store is then refused. A policy with a history (ARC's ghosts) learns from the miss
        here, before ``insert`` forgets it. The default learns nothing.
        """
        return

    @abstractmethod
    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        """``need`` distinct evictable keys not in ``protected``, in eviction order, or None
        when there are fewer. Must change nothing.
        """

    @abstractmethod
    def evict(self, victims: Sequence[Key]) -> None:
        """Commit a choice of ``choose_victims``: these keys leave, in this order."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything (``reset_cache``)."""

    @abstractmethod
    def resident(self) -> list[Key]:
        """Every resident key, in the policy's order (for invariant checks and tests)."""

    def abstract_order(self) -> PolicyOrder | None:
        """The spec's order this policy's structures stand for (its part of the refinement
        mapping, see ``kvoffload_spec.refinement``), or None for a policy the spec does not
        define; checkers then follow its victims and compare everything else. The
        built-ins return their spec twin (O(n log n): for checks and tests).
        """
        return None

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        """What is wrong inside the policy, in words; ``is_evictable`` is the manager's view.

        The manager calls this from its own ``check_invariants``; override it to check the
        policy's internal structures.
        """
        return []
