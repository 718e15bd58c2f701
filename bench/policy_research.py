"""Keys-only replays of eviction and admission rules that are not built-in policies, beside
LRU, in the sweep's call order: the figures behind the policy research of docs/manager.md.

Per request, as ``kvoffload sweep`` drives a tier: the hits are the longest resident
prefix; the absent keys are stored in request order, evicting keys outside the request (a
pool that cannot make room for all of them stores none, as the manager; a rule with
admission stores a prefix of them, up to the first it refuses: a tail without its head is
useless); then the request is touched, its first key ending most recent. The ``lru`` rule
must reproduce the sweep's LRU hit for hit (the run fails otherwise): that is what makes
the other columns comparable with the sweep's.

The rules:

- ``lru``: least recently used first.
- ``lru2``: LRU-2 with a history of evicted keys' last uses (4 x capacity, as ``duel``):
  the keys used once go first, least recent first, then the reused ones by their second
  most recent use.
- ``tinylfu``: LRU, and a block is stored only if it was asked for more often lately than
  the victim it would displace (TinyLFU, Einziger, Friedman and Manes, ACM ToS 2017):
  counts per key, halved every 10 x capacity offers.
- ``admission-duel``: LRU, with ``tinylfu``'s admission on while a shadow pool with it has
  served more prefix hits lately than a shadow without (scores decayed by ``DUEL_DECAY``
  per request, as ``duel``'s).
- ``three-way-duel``: shadows under LRU, LRU-2 and LRU with admission; the pool follows the
  one with the highest score (a tie goes to the earlier).

The shadows are full-size, not sampled as ``duel``'s are. ``python bench/policy_research.py
--trace tests/traces/agentic-dev.jsonl.gz --capacities 15k,30k,60k`` takes about 7
minutes on one core; ``--quick`` is a smoke run of a few seconds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvoffload.replay.sweep import sweep
from kvoffload.replay.traces import Trace, resolve_trace
from kvoffload.units import parse_count
from kvoffload_spec.policies import DUEL_DECAY, DUEL_HISTORY
from kvoffload_spec.surface import Key

RESULTS = Path(__file__).resolve().parent / "results"
AGING_OFFERS = 10
"""Counts are halved every this many times the capacity offers (TinyLFU's sample size)."""


@dataclass(frozen=True)
class Contender:
    name: str
    order: str  # "lru" or "lru2"
    admits: bool  # whether a store must win against its victims


LRU = Contender("lru", "lru", False)
LRU2 = Contender("lru2", "lru2", False)
TINYLFU = Contender("tinylfu", "lru", True)
RULES: dict[str, tuple[Contender, ...]] = {
    "lru": (LRU,),
    "lru2": (LRU2,),
    "tinylfu": (TINYLFU,),
    "admission-duel": (LRU, TINYLFU),
    "three-way-duel": (LRU, LRU2, TINYLFU),
}


class Counts:
    """How often each key was offered lately: one count per distinct key of a request,
    every count halved (zeros forgotten) once ``AGING_OFFERS * capacity`` offers passed."""

    def __init__(self, capacity: int) -> None:
        self.counts: Counter[Key] = Counter()
        self.period = AGING_OFFERS * capacity
        self.offers = 0

    def offer(self, keys: Sequence[Key]) -> None:
        self.counts.update(keys)
        self.offers += len(keys)
        if self.offers >= self.period:
            self.offers = 0
            self.counts = Counter({k: n // 2 for k, n in self.counts.items() if n >= 2})


@dataclass
class Pool:
    """A keys-only pool: recency always, and the uses LRU-2 reads when ``second_use``."""

    capacity: int
    second_use: bool
    recency: OrderedDict[Key, None] = field(default_factory=OrderedDict)
    last: dict[Key, int] = field(default_factory=dict)
    penult: dict[Key, int] = field(default_factory=dict)
    history: OrderedDict[Key, int] = field(default_factory=OrderedDict)
    by_second: list[tuple[int, int, Key]] = field(default_factory=list)  # lazy heap
    clock: int = 0
    score: float = 0.0

    def prefix_hits(self, request: Sequence[Key]) -> int:
        hits = 0
        while hits < len(request) and request[hits] in self.recency:
            hits += 1
        return hits

    def victim(self, order: str, protected: set[Key]) -> Key | None:
        if order == "lru":
            return next((key for key in self.recency if key not in protected), None)
        heap, stepped_over, found = self.by_second, [], None
        while heap:
            penult, last, key = heap[0]
            if key not in self.recency or (self.penult[key], self.last[key]) != (penult, last):
                heapq.heappop(heap)  # a stale entry: the key left, or was used since
            elif key in protected:
                stepped_over.append(heapq.heappop(heap))
            else:
                found = key
                break
        for entry in stepped_over:
            heapq.heappush(heap, entry)
        return found

    def evict(self, key: Key) -> None:
        del self.recency[key]
        if self.second_use:
            self.history[key] = self.last.pop(key)
            del self.penult[key]
            while len(self.history) > DUEL_HISTORY * self.capacity:
                self.history.popitem(last=False)

    def step(self, request: Sequence[Key], order: str, admits: bool, counts: Counts) -> int:
        """Serve ``request`` (distinct keys, as a ``Trace`` holds them): its prefix hits, then
        its store and its touch."""
        hits = self.prefix_hits(request)
        self.score = self.score * DUEL_DECAY + hits
        protected = set(request)
        ready = {key for key in request if key in self.recency}
        absent = [key for key in request if key not in ready]
        free = self.capacity - len(self.recency)
        stored: list[Key] = []
        if admits:
            for key in absent:
                if free > 0:
                    free -= 1
                else:
                    victim = self.victim(order, protected)
                    if victim is None or counts.counts[key] <= counts.counts[victim]:
                        break
                    self.evict(victim)
                stored.append(key)
        elif len(absent) - free <= len(self.recency) - len(ready):
            for _ in range(len(absent) - free):
                victim = self.victim(order, protected)
                assert victim is not None  # there are enough keys outside the request
                self.evict(victim)
            stored = absent
        for key in stored:
            self.recency[key] = None
            if self.second_use:
                self.penult[key] = self.history.pop(key, -1)
        self.touch(request, ready)
        return hits

    def touch(self, request: Sequence[Key], ready: set[Key]) -> None:
        for key in reversed(request):
            if key not in self.recency:
                continue
            self.recency.move_to_end(key)
            self.clock += 1
            if self.second_use:
                if key in ready:  # used again while resident
                    self.penult[key] = self.last[key]
                self.last[key] = self.clock
        if self.second_use:
            for key in request:
                if key in self.recency:
                    entry = (self.penult[key], self.last[key], key)
                    heapq.heappush(self.by_second, entry)
            if len(self.by_second) > 4 * len(self.recency) + 1024:
                self.by_second = [(self.penult[k], self.last[k], k) for k in self.recency]
                heapq.heapify(self.by_second)


@dataclass(frozen=True)
class Row:
    rule: str
    capacity: int
    hit_ratio: float
    leads: dict[str, float]  # the share of requests each contender led (duels only)


def replay(trace: Trace, capacity: int, rule: str) -> Row:
    contenders = RULES[rule]
    second_use = any(c.order == "lru2" for c in contenders)
    pool = Pool(capacity, second_use)
    shadows = [Pool(capacity, c.order == "lru2") for c in contenders] if len(contenders) > 1 else []
    counts = Counts(capacity)
    led = Counter[str]()
    hits = 0
    for request in trace.requests:
        counts.offer(request)
        leader = contenders[0]
        if shadows:
            best = max(shadow.score for shadow in shadows)
            leader = next(c for c, s in zip(contenders, shadows, strict=True) if s.score == best)
            led[leader.name] += 1
        hits += pool.step(request, leader.order, leader.admits, counts)
        for contender, shadow in zip(contenders, shadows, strict=False):
            shadow.step(request, contender.order, contender.admits, counts)
    requests = max(trace.num_requests, 1)
    leads = {c.name: led[c.name] / requests for c in contenders} if shadows else {}
    return Row(rule, capacity, hits / max(trace.num_refs, 1), leads)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Eviction and admission rules, keys only.")
    parser.add_argument("--trace", default="conversation", help="a bundled name or a path")
    parser.add_argument("--capacities", default="1000,4000,16000,64000")
    parser.add_argument("--rules", default=",".join(RULES), help=f"any of {', '.join(RULES)}")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 300 requests")
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    parser.add_argument("--out", type=Path, default=RESULTS / "policy_research.json")
    args = parser.parse_args(argv)
    rules = [rule.strip() for rule in args.rules.split(",") if rule.strip()]
    unknown = [rule for rule in rules if rule not in RULES]
    if unknown or not rules:
        parser.error(f"--rules: choose among {', '.join(RULES)} (got {args.rules!r})")
    trace = resolve_trace("synthetic" if args.quick else args.trace)
    capacities = [500, 1000] if args.quick else [parse_count(c) for c in args.capacities.split(",")]
    if args.quick:
        trace = Trace(trace.name, trace.requests[:300])
    rows = [replay(trace, capacity, rule) for capacity in capacities for rule in rules]
    # The LRU rule is the sweep's LRU, or the other columns are not comparable with it.
    reference = sweep(trace, capacities, ["lru"])
    lru_matches_sweep = all(
        row.hit_ratio == point.hit_ratio
        for point in reference.points
        for row in rows
        if row.rule == "lru" and row.capacity == point.capacity
    )
    result = {
        "benchmark": "policy_research",
        "trace": trace.name,
        "quick": args.quick,
        "lru_matches_sweep": lru_matches_sweep,
        "rows": [asdict(row) for row in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"hit ratios on {trace.name}, keys only, single tier")
        print("| blocks | " + " | ".join(rules) + " |")
        print("|---" * (len(rules) + 1) + "|")
        for capacity in capacities:
            cells = [f"{row.hit_ratio:.4f}" for row in rows if row.capacity == capacity]
            print(f"| {capacity:,} | " + " | ".join(cells) + " |")
        for row in rows:
            if row.leads:
                shares = ", ".join(f"{name} {share:.0%}" for name, share in row.leads.items())
                print(f"{row.rule} at {row.capacity:,}: led by {shares}")
        print("the lru column is the sweep's LRU: " + ("yes" if lru_matches_sweep else "NO"))
    return 0 if lru_matches_sweep else 1


if __name__ == "__main__":
    sys.exit(main())
