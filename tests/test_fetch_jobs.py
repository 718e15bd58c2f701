"""Fetch jobs of several plans, some abandoned, then ``reset`` or ``wait``: against a real
Valkey server, for every job of 1-4 plans and every subset of them abandoned.

One ``fetch`` sends its keys as one remote job carrying one store plan per key. What the
offloader waits for is that job: as long as one of its plans is live (not abandoned), the
job may still write every block id of it, so ``reset`` and ``wait`` must wait for it (and
refuse, or say False, within a timeout); only a job whose plans are all abandoned is left
to finish on its own, its block ids quarantined. Whatever is asked, no block id of a job
still in flight may be handed to another key, and every key ready afterwards loads its own
bytes.

Each case runs twice: *held* (the server paused, so the job is in flight for sure while the
plans are abandoned and the offloader is reset or waited on; what the catalogue's share is
run against) and *racing* (the server live: the job ends at any moment, the offloader's
lock and the remote worker's calls jittered by ``Jitter``, a seed per case).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvoffload import Offloader, OffloadManager
from kvoffload.tiers import RemoteJob
from kvoffload.transfer.engine import TransferTimeoutError
from kvoffload_spec.surface import StorePlan
from tests.jitter import Jitter
from tests.planted import FETCH_JOBS, Planted, share
from tests.remote_support import Engine, content, make_store
from tests.valkey_server import ValkeyServer

HELD_FOR = 0.01  # s: what reset and wait are given while the job is held in flight
THEN = ("reset", "wait")


@dataclass(frozen=True)
class Case:
    plans: int  # keys fetched in one call: one job, this many plans
    abandoned: frozenset[int]  # which of the plans (by position)
    then: str  # "reset" or "wait"

    @property
    def live(self) -> int:
        return self.plans - len(self.abandoned)

    def __str__(self) -> str:
        return f"{self.plans} plans, {sorted(self.abandoned)} abandoned, then {self.then}"


def cases(plans: int) -> list[Case]:
    subsets = itertools.chain.from_iterable(
        itertools.combinations(range(plans), size) for size in range(plans + 1)
    )
    return [Case(plans, frozenset(subset), then) for subset in subsets for then in THEN]


class JitteryStore:
    """The remote worker's store calls, each after a jittered pause."""

    def __init__(self, store: Any, jitter: Jitter) -> None:
        self._store = store
        self._jitter = jitter

    def get_into(self, *args: Any) -> list[bool]:
        self._jitter.pause()
        done: list[bool] = self._store.get_into(*args)
        self._jitter.pause()
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def jittered(engine: Engine, seed: int) -> None:
    offloader = engine.offloader
    jitter = Jitter(seed)
    jitter.install(offloader)
    assert offloader._tiers is not None
    remote = offloader._tiers.workers[0]  # its store asks the tiers in order
    remote.store = JitteryStore(remote.store, jitter)


class Run:
    """One case on one offloader: what it saw, in ``problems``."""

    def __init__(self, server: ValkeyServer, case: Case, offloader: type[Offloader]) -> None:
        self.case = case
        self.server = server
        # A pool of exactly the fetched keys: every block id is one of the job's, so a
        # store after a reset can only take one of them.
        self.engine = Engine(make_store(server.url, timeout_s=5.0), case.plans, cls=offloader)
        self.problems: list[str] = []
        self.keys = [100 + i for i in range(case.plans)]
        values = [content(key) for key in self.keys]
        assert make_store(server.url).put(self.keys, values) == [True] * case.plans

    def fetch(self) -> tuple[list[StorePlan], RemoteJob]:
        offloader = self.engine.offloader
        plans = offloader.fetch(self.keys)
        assert [plan.keys for plan in plans] == [(key,) for key in self.keys]
        assert offloader._tiers is not None
        (job,) = offloader._tiers.fetch_jobs()
        assert self.engine.stats().in_flight == 1  # one job for them all
        for index in sorted(self.case.abandoned):
            offloader.abandon(plans[index])
        return plans, job

    def then(self, timeout: float) -> bool:
        """Reset or wait as the case says; whether it went through (reset) or said every
        job it waits for finished (wait)."""
        offloader = self.engine.offloader
        if self.case.then == "wait":
            return offloader.wait(timeout=timeout)
        try:
            self.engine.reported += offloader.reset(timeout=timeout)
        except TransferTimeoutError:
            return False
        return True

    def reuse_the_pool(self, job: RemoteJob, plans: list[StorePlan]) -> None:
        """Store other keys into every block id there is room for; none may be a block id
        of the fetch job while it can still write it."""
        theirs = {plan.block_ids[0] for plan in plans}
        offloader = self.engine.offloader
        for key in range(self.case.plans):
            self.engine.cache[0] = torch.frombuffer(bytearray(content(key)), dtype=torch.uint8)
            plan = offloader.store([key], [0])
            if plan is None:
                continue  # no room: every block id is held
            taken = theirs.intersection(plan.block_ids)
            if taken and not job.done:
                self.problems.append(
                    f"{self.case}: block id {taken.pop()} of the fetch job in flight was "
                    f"handed to key {key}"
                )
            assert offloader.wait([plan], timeout=30)  # the copy, not the fetch
            self.engine.reported += offloader.poll()

    def finish(self, job: RemoteJob, plans: list[StorePlan]) -> None:
        """Let everything end; then every plan reported once, as the case says, and every
        ready key loads its own bytes."""
        engine = self.engine
        assert job.wait(30)  # abandoned plans too: wait() alone does not wait for them
        engine.settle()
        _, wrong = engine.load_ready([*range(self.case.plans), *self.keys])
        self.problems += [f"{self.case}: key {key} loads another key's bytes" for key in wrong]
        fetched = {done.plan.plan_id: done for done in engine.reported if done.fetched}
        if sorted(fetched) != sorted(plan.plan_id for plan in plans):
            self.problems.append(f"{self.case}: fetch plans reported {sorted(fetched)}")
        for index, plan in enumerate(plans):
            done = fetched.get(plan.plan_id)
            if done is not None and done.abandoned != (index in self.case.abandoned):
                self.problems.append(f"{self.case}: plan {index} reported {done}")
        if engine.offloader.num_in_flight:
            self.problems.append(f"{self.case}: {engine.offloader.num_in_flight} in flight")
        manager = engine.offloader.manager
        assert isinstance(manager, OffloadManager)
        if manager.num_quarantined_blocks:
            self.problems.append(f"{self.case}: block ids quarantined after every job ended")
        manager.check_invariants()


def held(server: ValkeyServer, case: Case, offloader: type[Offloader]) -> Run:
    """The job held in flight (the server paused) while its plans are abandoned, the
    offloader reset or waited on, and the pool reused; then the server resumes."""
    run = Run(server, case, offloader)
    server.pause()
    try:
        plans, job = run.fetch()
        went_through = run.then(HELD_FOR)
        if went_through and case.live:
            run.problems.append(
                f"{case}: {case.then} did not wait for the job of {case.live} live plans"
            )
        if not went_through and not case.live:
            run.problems.append(f"{case}: {case.then} waited for a job of abandoned plans")
        for plan in plans:  # a plan named: its job, abandoned or not
            if run.engine.offloader.wait([plan], timeout=HELD_FOR):
                run.problems.append(f"{case}: wait([plan]) said a job held in flight ended")
        run.reuse_the_pool(job, plans)
    finally:
        server.resume()
    run.finish(job, plans)
    return run


def racing(server: ValkeyServer, case: Case, seed: int) -> Run:
    """The job free to end at any moment; the hand-offs jittered. reset and wait are given
    time enough: each must go through, and only once the job can write no more."""
    run = Run(server, case, Offloader)
    jittered(run.engine, seed)
    plans, job = run.fetch()
    if not run.then(timeout=30):
        run.problems.append(f"{case}: {case.then} did not finish with the server up")
    if case.live and not job.done:
        run.problems.append(f"{case}: {case.then} returned with the job of live plans running")
    run.reuse_the_pool(job, plans)
    run.finish(job, plans)
    return run


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    made: list[Run] = []
    yield made
    for run in made:
        run.engine.close()


Scenario = Callable[[ValkeyServer, Case], Run]


@pytest.mark.parametrize("plans", [1, 2, 3, 4])
def test_a_job_held_in_flight_keeps_its_block_ids_whatever_is_abandoned(
    valkey_server: ValkeyServer, runs: list[Run], plans: int
) -> None:
    for case in cases(plans):
        runs.append(held(valkey_server, case, Offloader))
        assert runs[-1].problems == []


@pytest.mark.parametrize("plans", [1, 2, 3, 4])
def test_a_job_racing_reset_and_wait_keeps_its_block_ids_whatever_is_abandoned(
    valkey_server: ValkeyServer, runs: list[Run], plans: int
) -> None:
    for seed, case in enumerate(cases(plans)):
        runs.append(racing(valkey_server, case, seed=plans * 100 + seed))
        assert runs[-1].problems == []


@pytest.mark.parametrize("entry", share(FETCH_JOBS), ids=lambda bug: bug.name)
def test_the_fetch_job_checks_find_their_share_of_the_catalogue(
    entry: Planted, valkey_server: ValkeyServer, runs: list[Run]
) -> None:
    broken = entry.subject
    assert isinstance(broken, type) and issubclass(broken, Offloader)
    found = []
    for case in cases(3):
        runs.append(held(valkey_server, case, broken))
        found += runs[-1].problems
    assert found, f"{entry.name}: not found"
