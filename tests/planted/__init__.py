"""The catalogue of planted bugs: every deliberately broken copy the checks must catch.

Each entry names the bug, says it in words, holds the broken thing (a copy of the spec with
edited lines, :class:`~tests.planted.spec.Variant`; a manager built with a broken class,
:class:`ManagerBug`; or broken remote-tier rules and the world they are explored in,
:class:`~tests.planted.tiers.TierBug`) and is tagged with the checkers that must find it.
tests/test_catalogue.py runs each checker on its share (CrossHair's share runs in
tests/test_crosshair.py, whose CrossHair processes are pooled); a check that cannot fail
shows up there as a bug it misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvoffload.manager import OffloadManager
from kvoffload.offloader import Offloader
from kvoffload.policies.base import EvictionPolicy
from kvoffload.tiers import ValkeyStore
from kvoffload_spec.disk import DiskRules
from tests.planted import block_ids as broken_ids
from tests.planted import crosshair_manager as broken_contracts
from tests.planted import disk as broken_disk
from tests.planted import layouts as broken_layouts
from tests.planted import manager as broken
from tests.planted import planner as broken_planner
from tests.planted import policies as broken_policies
from tests.planted import races as broken_races
from tests.planted import stores as broken_stores
from tests.planted import tiers as broken_tiers
from tests.planted.spec import VARIANTS, Variant

EXPLORER = "explorer"  # exhaustive exploration of the broken spec (kvoffload_spec.explore)
CROSSHAIR = "crosshair"  # the spec's contracts, checked symbolically on the broken spec
CONFORMANCE = "conformance"  # the kit's random lockstep histories against the spec
DIRECTED = "directed"  # the kit's directed histories alone
SOAK = "soak"  # bench/soak.py's long random run
FAULTS = "faults"  # the data path's fault scenario: a stalled store abandoned, the pool reused
TIERS = "tier explorer"  # exhaustive exploration of the pool with the remote tier (spec)
MANAGER_CROSSHAIR = "crosshair (manager)"  # the manager's contracts, one commuting square each
REFUSALS = "refusals"  # a refused call (bad argument) changes nothing, abstraction included
BLOCK_IDS = "block-id checks"  # every layer that validates block ids, at and past the edges
RACES = "race checks"  # jittered hand-offs between the offloader's threads, many seeds
LAYOUTS = "layout checks"  # valid layouts with odd size-1 strides must be accepted
OFFLOADER_MACHINE = "offloader machine"  # the Offloader's state machine, data path included
VERIFY = "verify"  # `kvoffload verify --policy module:Class` on a user's policy
ABANDONED_FETCH = "abandoned fetch"  # a stalled fetch abandoned, the pool reused, bytes read
DISK = (
    "disk explorer"  # the pool over its disk tier, crashes and restarts (tests/test_disk_spec.py)
)
FETCH_JOBS = "fetch jobs"  # jobs of 1-4 fetch plans, every subset abandoned, reset or wait
PARTLY_PRESENT = "partly-present keys"  # adapters' batches with every subset stored already
PLANNER = "run planner checks"  # mixed packed/strided layouts, both paths, vs a reference
STORE_CONTRACT = "store contract"  # tests/store_contract.py: every RemoteStore keeps it
CALL_DEADLINE = "call deadline"  # tests/test_remote_bounds.py: calls over a trickling link
REPLY_BOUNDS = "reply bounds"  # tests/test_remote_bounds.py: values planted oversized
MALFORMED_REPLIES = "malformed replies"  # tests/test_remote_bounds.py: a fake server's replies

CHECKERS = (
    EXPLORER,
    CROSSHAIR,
    CONFORMANCE,
    DIRECTED,
    SOAK,
    FAULTS,
    TIERS,
    MANAGER_CROSSHAIR,
    REFUSALS,
    BLOCK_IDS,
    RACES,
    LAYOUTS,
    OFFLOADER_MACHINE,
    VERIFY,
    ABANDONED_FETCH,
    FETCH_JOBS,
    PARTLY_PRESENT,
    PLANNER,
    STORE_CONTRACT,
    DISK,
    CALL_DEADLINE,
    REPLY_BOUNDS,
    MALFORMED_REPLIES,
)


@dataclass(frozen=True)
class ManagerBug:
    """A manager with a broken class, or with a broken policy; ``policy`` is what the
    conformance kit compares it with (None: a policy the spec does not know, whose victims
    the kit follows) and, for a broken manager class, the policy it runs."""

    broken: type[OffloadManager] | type[EvictionPolicy]
    policy: str | None

    def make(self, num_blocks: int, **options: Any) -> OffloadManager:
        """A broken manager of ``num_blocks`` (``options`` as ``OffloadManager`` takes)."""
        if issubclass(self.broken, OffloadManager):
            return self.broken(num_blocks, self.policy or "lru", **options)
        return OffloadManager(num_blocks, self.broken, **options)


@dataclass(frozen=True)
class PlantedAdapter:
    """A broken adapter class of ``engine``, named for the engine's own factory to load
    (importing it imports the engine, so the catalogue does not)."""

    engine: str
    module: str
    class_name: str


@dataclass(frozen=True)
class CrossHairTarget:
    """A broken manager whose ``check`` contract CrossHair must refute."""

    broken: type[OffloadManager]
    check: str

    @property
    def target(self) -> str:
        return f"{self.broken.__module__}.{self.broken.__name__}.{self.check}"


Subject = (
    Variant
    | ManagerBug
    | broken_tiers.TierBug
    | DiskRules
    | CrossHairTarget
    | broken_ids.PlantedIdBug
    | broken_races.PlantedRace
    | broken_layouts.StrictStrideBug
    | type[Offloader]
    | broken_policies.UserPolicyBug
    | broken_stores.PlantedStore
    | type[ValkeyStore]
    | PlantedAdapter
    | broken_planner.PlannerBug
)
"""What a planted bug is: the broken thing its checkers are handed."""


@dataclass(frozen=True)
class Planted:
    name: str
    bug: str
    subject: Subject
    found_by: frozenset[str]


def _planted(name: str, documented: object, subject: Subject, *by: str) -> Planted:
    """An entry whose bug, in words, is ``documented``'s docstring on one line (else its
    name)."""
    said = " ".join((getattr(documented, "__doc__", None) or name).split())
    return Planted(name, said, subject, frozenset(by))


def _entry(
    name: str, broken: type[OffloadManager] | type[EvictionPolicy], policy: str | None, *by: str
) -> Planted:
    return _planted(name, broken, ManagerBug(broken, policy), *by)


_SPEC = tuple(
    Planted(
        variant.name,
        variant.bug,
        variant,
        frozenset({EXPLORER} | ({CROSSHAIR} if variant.crosshair else set())),
    )
    for variant in VARIANTS
)

_MANAGERS = (
    _entry(
        "counter not restored by complete_load",
        broken.CounterNotRestoredOnLoad,
        "lru",
        CONFORMANCE,
    ),
    _entry("nested loads share one pin", broken.NestedLoadsShareOnePin, "lru", CONFORMANCE),
    _entry(
        "stale load completion applied",
        broken.StaleLoadCompletionApplied,
        "arc",
        CONFORMANCE,
    ),
    _entry(
        "stale store completion applied",
        broken.StaleStoreCompletionApplied,
        "lru",
        CONFORMANCE,
    ),
    _entry("ARC without fallback", broken.ArcWithoutFallbackToT1, "arc", CONFORMANCE),
    _entry("pinning changes LRU recency", broken.LruRestampedWhenUnpinned, "lru", CONFORMANCE),
    _entry(
        "duel: a touch of a pending block is a reuse",
        broken.DuelTouchOfPendingIsReuse,
        "duel",
        CONFORMANCE,
    ),
    _entry(
        "duel breaks a tie towards LRU-2",
        broken.DuelBreaksTiesTowardsTheLastOrder,
        "duel",
        CONFORMANCE,
    ),
    _entry(
        "duel: LRU-2 reads the last use",
        broken.DuelLru2ReadsTheLastUse,
        "duel",
        CONFORMANCE,
        DIRECTED,
    ),
    _entry(
        "duel: a gone key's last use forgotten",
        broken.DuelForgetsTheLastUseOfAGoneKey,
        "duel",
        CONFORMANCE,
    ),
    _entry("user policy refuses a store that fits", broken.GivesUpOnProtected, None, CONFORMANCE),
    _entry(
        "touch deduplicated keeping the last (LRU)",
        broken.TouchDeduplicatedKeepingTheLast,
        "lru",
        CONFORMANCE,
        DIRECTED,
    ),
    _entry(
        "touch deduplicated keeping the last (ARC)",
        broken.TouchDeduplicatedKeepingTheLast,
        "arc",
        CONFORMANCE,
        DIRECTED,
    ),
    _entry(
        "ARC target adapted by whole blocks",
        broken.ArcIntegerTarget,
        "arc",
        CONFORMANCE,
        DIRECTED,
    ),
    _entry(
        "abandon frees a store's slots at once",
        broken.AbandonFreesAtOnce,
        "lru",
        CONFORMANCE,
        SOAK,
        FAULTS,
    ),
    _entry("abandon keeps a load's pins", broken.AbandonedLoadKeepsItsPins, "lru", CONFORMANCE),
    _entry(
        "a late load completion unpins again",
        broken.LateLoadCompletionUnpinsAgain,
        "lru",
        CONFORMANCE,
    ),
    _entry("reset frees the quarantine", broken.ResetFreesQuarantine, "lru", CONFORMANCE),
    _entry(
        "a failed store's removal is not reported",
        broken.ForgetsAFailedStoresEvent,
        "lru",
        CONFORMANCE,
    ),
    _entry("a touch counts as an offer", broken.CountsATouchAsAnOffer, "lru", CONFORMANCE),
    _entry("a refused touch still touches", broken.RefusedTouchStillTouches, "lru", REFUSALS),
)

_TIERS = tuple(
    _planted(type(bug.rules).__name__, type(bug.rules), bug, TIERS)
    for bug in broken_tiers.PLANTED_TIER_BUGS
)


_DISK = tuple(
    _planted(rules.__name__, rules, rules(), DISK)
    for rules in (
        broken_disk.AcceptsATornWrite,
        broken_disk.ExceedsTheCapacity,
        broken_disk.KeepsBlocksAcrossANamespaceChange,
    )
)


def _contract(cls: type[OffloadManager]) -> Planted:
    checks = [name for name in vars(cls) if name.startswith("check_")]
    return _planted(cls.__name__, cls, CrossHairTarget(cls, checks[0]), MANAGER_CROSSHAIR)


_CONTRACTS = tuple(
    _contract(cls)
    for cls in (
        broken_contracts.CounterNotRestoredOnLoad,
        broken_contracts.EvictsBeforeGivingUp,
        broken_contracts.StaleStoreCompletionApplied,
        broken_contracts.AbandonFreesSlotsAtOnce,
        broken_contracts.EvictsTheNewest,
    )
)

_IDS = tuple(
    _planted(bug.name, bug.replacement, bug, BLOCK_IDS) for bug in broken_ids.PLANTED_ID_BUGS
)

_RACES = tuple(
    _planted(race.name, next(iter(race.planted.values())), race, RACES)
    for race in broken_races.PLANTED_RACES
)

_LAYOUTS = tuple(
    Planted(bug.name, f"a stricter layout check: {bug.name}", bug, frozenset({LAYOUTS}))
    for bug in broken_layouts.STRICT_STRIDE_BUGS
)

_OFFLOADERS = (
    _planted(
        "the offloader deduplicates a touch keeping the last",
        broken.OffloaderTouchDeduplicatedKeepingTheLast,
        broken.OffloaderTouchDeduplicatedKeepingTheLast,
        OFFLOADER_MACHINE,
    ),
    _planted(
        "the offloader frees an abandoned fetch's block id at once",
        broken.OffloaderFreesAnAbandonedFetchAtOnce,
        broken.OffloaderFreesAnAbandonedFetchAtOnce,
        ABANDONED_FETCH,
        FETCH_JOBS,
    ),
    _planted(
        "the offloader stops waiting for a fetch job at its first abandoned plan",
        broken.OffloaderStopsWaitingAtAnAbandonedPlan,
        broken.OffloaderStopsWaitingAtAnAbandonedPlan,
        FETCH_JOBS,
    ),
)

_USER_POLICIES = tuple(
    _planted(bug.policy.__name__, bug.policy, bug, VERIFY)
    for bug in broken_policies.USER_POLICY_BUGS
)

_STORES = tuple(
    _planted(bug.store_class.__name__, bug.store_class, bug, STORE_CONTRACT)
    for bug in broken_stores.PLANTED_STORES
)

_DEADLINES = (
    _planted(
        "the remote store times each socket operation, not the call",
        broken_stores.TimesEachSocketOperation,
        broken_stores.TimesEachSocketOperation,
        CALL_DEADLINE,
    ),
    _planted(
        "the remote store reads a value of any length before refusing it",
        broken_stores.ReadsAValueWhateverItsLength,
        broken_stores.ReadsAValueWhateverItsLength,
        REPLY_BOUNDS,
    ),
    _planted(
        "the remote store reads a reply's numbers with int()",
        broken_stores.ParsesNumbersWithInt,
        broken_stores.ParsesNumbersWithInt,
        MALFORMED_REPLIES,
    ),
    _planted(
        "the remote store parses nested arrays recursively",
        broken_stores.ParsesNestedArraysRecursively,
        broken_stores.ParsesNestedArraysRecursively,
        MALFORMED_REPLIES,
    ),
)

_ADAPTERS = (
    Planted(
        "sglang: a batch set pairs the call's keys with the plan's block ids",
        "A batch set pairs the call's keys (not the plan's) with the plan's block ids: when "
        "some keys are stored already, one key's page goes under another key.",
        PlantedAdapter("sglang", "tests.planted.adapters", "PairsTheCallsKeysWithThePlansBlocks"),
        frozenset({PARTLY_PRESENT}),
    ),
    Planted(
        "sglang: a batch set takes the stored keys for a prefix",
        "A batch set takes the plan's pages from the end of the call, as if the keys stored "
        "already were a prefix: where they are not, a new key's block gets another's page.",
        PlantedAdapter("sglang", "tests.planted.adapters", "AssumesTheStoredKeysAreAPrefix"),
        frozenset({PARTLY_PRESENT}),
    ),
    Planted(
        "sglang: a batch set from host pages gathers the first pages for the new keys",
        "batch_set_v1 sends only the keys not stored yet, each with one of the first host "
        "pages instead of its own: the pages of the keys before it are stored.",
        PlantedAdapter("sglang", "tests.planted.adapters", "GathersTheFirstHostPagesForTheNewKeys"),
        frozenset({PARTLY_PRESENT}),
    ),
    Planted(
        "vllm: prepare_store names the last offered keys as the keys to store",
        "prepare_store names the last offered keys, as many as the plan stores, as the keys "
        "to store: where the stored ones are not a prefix of the offer, vLLM copies one "
        "key's block into another's CPU block.",
        PlantedAdapter("vllm", "tests.planted.vllm_adapter", "NamesTheLastOfferedKeysAsStored"),
        frozenset({PARTLY_PRESENT}),
    ),
)

_PLANNERS = tuple(
    Planted(bug.name, bug.bug, bug, frozenset({PLANNER})) for bug in broken_planner.PLANNER_BUGS
)

CATALOGUE: tuple[Planted, ...] = (
    _SPEC
    + _MANAGERS
    + _TIERS
    + _DISK
    + _CONTRACTS
    + _IDS
    + _RACES
    + _LAYOUTS
    + _OFFLOADERS
    + _USER_POLICIES
    + _STORES
    + _DEADLINES
    + _ADAPTERS
    + _PLANNERS
)
"""Every planted bug, spec copies first."""


def share(checker: str) -> list[Planted]:
    """The bugs ``checker`` must find."""
    return [bug for bug in CATALOGUE if checker in bug.found_by]


def named(name: str) -> Planted:
    return next(bug for bug in CATALOGUE if bug.name == name)
