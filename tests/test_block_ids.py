"""Every layer that validates block ids, at its exact boundaries, with planted bugs it must see.

The transfer engine (``submit_store`` / ``submit_load``), the offloader in front of it
(``store`` / ``load``: the device ids it is given and the block ids its manager plans, each
checked once, before the engine's trusted entry) and the raw copiers' last-resort bounds
check each decide which ids may be written. A bound off by one lets a job write past the
pool; a distinctness check that compares only neighbours lets ``[1, 2, 1]`` write one block
twice. So the checker below tries, at each layer, on the CPU side and the device side, and
for short calls and long ones (ids are checked by plain Python up to ``SMALL`` of them, by
numpy beyond): the last block (accepted, and the bytes arrive), one past it and -1 (refused,
nothing queued), and repeats that are not adjacent (refused). Each planted bug must make it
report a problem.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvoffload import Offloader
from kvoffload import offloader as offloader_module
from kvoffload.manager import OffloadManager
from kvoffload.transfer import CpuBlockPool, KVLayout, TransferEngine
from kvoffload.transfer import engine as engine_module
from kvoffload.transfer.engine import SMALL, CopierName, as_block_ids, require_distinct
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import Lookup
from tests.misplanning import Misplanning
from tests.planted import BLOCK_IDS, Planted, share
from tests.planted.block_ids import (
    PlantedIdBug,
    bound_off_by_one,
    distinct_neighbours_only,
)

DEVICE_BLOCKS = SMALL + 16
CPU_BLOCKS = SMALL + 8
LENGTHS = (3, SMALL + 4)  # ids per call: the plain-Python check and the numpy one
COPIERS: tuple[CopierName, ...] = ("memmove", "rows", "span", "tensor")


def device_cache() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    shape = (2, DEVICE_BLOCKS, 8)
    return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator) for _ in "kv"]


def device_block(tensors: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([t[:, block].reshape(-1) for t in tensors])


def refused_ids(last: int, length: int) -> list[tuple[str, list[int]]]:
    """Ids a layer must refuse, for a side whose highest valid id is ``last``: each list is
    ``length`` long and would be fine but for one id."""
    valid = list(range(last + 1 - length, last + 1))
    return [
        ("one past the last block", [*valid[1:], last + 1]),
        ("-1", [-1, *valid[1:]]),
    ]


def repeated_ids(last: int, length: int) -> list[tuple[str, list[int]]]:
    """Distinct ids but for one repeat, never next to its twin."""
    valid = list(range(last + 1 - length, last + 1))
    return [
        ("the first id again at the end", [*valid[:-1], valid[0]]),
        ("an id again two places later", [*valid[:2], valid[0], *valid[3:]]),
    ]


class Checker:
    """Collects what went wrong; ``refused`` and ``accepted`` try one call each."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def refused(
        self, what: str, unchanged: Callable[[], object], call: Callable[..., object], *args: Any
    ) -> None:
        before = unchanged()
        try:
            call(*args)
        except InvalidArgumentError:
            if unchanged() != before:
                self.problems.append(f"{what}: refused, but only after changing something")
            return
        except Exception as error:  # the wrong error is a problem, not a crash of the checker
            self.problems.append(f"{what}: raised {error!r} instead of InvalidArgumentError")
            return
        self.problems.append(f"{what}: accepted")

    def accepted(self, what: str, call: Callable[..., object], *args: Any) -> object:
        try:
            return call(*args)
        except Exception as error:
            self.problems.append(f"{what}: refused ({error!r})")
            return None


def engine_problems(copier: CopierName) -> list[str]:
    tensors = device_cache()
    layout = KVLayout(tensors, 1)
    engine = TransferEngine(layout, CpuBlockPool(layout.bytes_per_block, CPU_BLOCKS), copier=copier)
    check = Checker()

    def issued() -> int:  # nothing may be queued by a refused call
        return engine._issued

    for length in LENGTHS:
        top_device = list(range(DEVICE_BLOCKS - length, DEVICE_BLOCKS))
        top_cpu = list(range(CPU_BLOCKS - length, CPU_BLOCKS))
        at = f"engine ({copier}, {length} ids)"
        expected = [device_block(tensors, block).clone() for block in top_device]
        # The last blocks of both sides are valid, and their bytes make the round trip.
        for job in (
            check.accepted(
                f"{at}: a store from and into the last blocks",
                engine.submit_store,
                top_device,
                top_cpu,
            ),
            check.accepted(
                f"{at}: a load from and into the last blocks",
                engine.submit_load,
                top_cpu,
                top_device[::-1],
            ),
        ):
            if isinstance(job, int):
                engine.wait([job])
        for result in engine.poll():
            if not result.ok:
                check.problems.append(f"{at}: job {result.job_id} failed: {result.error!r}")
        if not all(
            torch.equal(device_block(tensors, block), want)
            for block, want in zip(top_device[::-1], expected, strict=True)
        ):
            check.problems.append(f"{at}: the last blocks did not round-trip byte-exact")
        for why, ids in refused_ids(CPU_BLOCKS - 1, length):
            check.refused(
                f"{at}: store into CPU ids with {why}", issued, engine.submit_store, top_device, ids
            )
            check.refused(
                f"{at}: load from CPU ids with {why}", issued, engine.submit_load, ids, top_device
            )
        for why, ids in refused_ids(DEVICE_BLOCKS - 1, length):
            check.refused(
                f"{at}: store from device ids with {why}", issued, engine.submit_store, ids, top_cpu
            )
            check.refused(
                f"{at}: load into device ids with {why}", issued, engine.submit_load, top_cpu, ids
            )
        for why, ids in repeated_ids(CPU_BLOCKS - 1, length):
            check.refused(
                f"{at}: store into CPU ids with {why}", issued, engine.submit_store, top_device, ids
            )
        for why, ids in repeated_ids(DEVICE_BLOCKS - 1, length):
            check.refused(
                f"{at}: load into device ids with {why}", issued, engine.submit_load, top_cpu, ids
            )
    engine.close()
    return check.problems


def offloader_problems() -> list[str]:
    """The offloader's own checks: of the device ids it is given, and of the block ids its
    manager plans (a manager of the caller's own may plan ids outside the pool)."""
    tensors = device_cache()
    manager = Misplanning(OffloadManager(CPU_BLOCKS))
    offloader = Offloader(tensors, block_dim=1, manager=manager)
    check = Checker()

    def unchanged() -> tuple[object, ...]:
        inner = manager.inner
        return (
            offloader.num_in_flight,
            offloader.engine._issued,
            inner.num_free_blocks,
            inner.num_evictable_blocks,
        )

    def misplanned(call: Callable[..., object], ids: list[int]) -> Callable[..., object]:
        def planning_ids(*args: object) -> object:
            manager.block_ids = ids
            try:
                return call(*args)
            finally:
                manager.block_ids = None

        return planning_ids

    for length in LENGTHS:
        keys = [f"{length}-{index}" for index in range(length)]
        top = list(range(DEVICE_BLOCKS - length, DEVICE_BLOCKS))
        at = f"offloader ({length} keys)"
        for why, ids in refused_ids(DEVICE_BLOCKS - 1, length):
            check.refused(
                f"{at}: store from device ids with {why}", unchanged, offloader.store, keys, ids
            )
        for why, ids in [
            *refused_ids(CPU_BLOCKS - 1, length),
            *repeated_ids(CPU_BLOCKS - 1, length),
            ("one id too few", list(range(length - 1))),
        ]:
            store = misplanned(offloader.store, ids)
            check.refused(
                f"{at}: store into planned CPU ids with {why}", unchanged, store, keys, top
            )
        check.accepted(f"{at}: a store from the last device blocks", offloader.store, keys, top)
        offloader.wait()
        offloader.poll()
        if any(manager.lookup(key) is not Lookup.HIT for key in keys):
            check.problems.append(f"{at}: the store from the last device blocks did not land")
            continue
        for why, ids in [
            *refused_ids(DEVICE_BLOCKS - 1, length),
            *repeated_ids(DEVICE_BLOCKS - 1, length),
        ]:
            check.refused(
                f"{at}: load into device ids with {why}", unchanged, offloader.load, keys, ids
            )
        for why, ids in refused_ids(CPU_BLOCKS - 1, length):
            load = misplanned(offloader.load, ids)
            check.refused(f"{at}: load from planned CPU ids with {why}", unchanged, load, keys, top)
        expected = [device_block(tensors, block) for block in top]
        for tensor in tensors:
            tensor.zero_()
        check.accepted(f"{at}: a load into the last device blocks", offloader.load, keys, top)
        offloader.wait()
        if not all(done.ok for done in offloader.poll()) or not all(
            torch.equal(device_block(tensors, block), want)
            for block, want in zip(top, expected, strict=True)
        ):
            check.problems.append(f"{at}: the last device blocks did not round-trip byte-exact")
    offloader.close()
    return check.problems


def block_id_problems() -> list[str]:
    return [
        *(problem for copier in COPIERS for problem in engine_problems(copier)),
        *offloader_problems(),
    ]


def test_every_layer_takes_its_last_block_and_refuses_one_past_it_and_repeats() -> None:
    assert block_id_problems() == []


def test_the_offloader_checks_each_id_once_and_the_engine_trusts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store and a load through the offloader check the device ids and the planned block
    ids once each, at the offloader; the engine's own checks (for its direct callers) are
    not run again."""
    checked: list[str] = []

    def counted(module: Any, name: str) -> None:
        real = getattr(module, name)

        def counting(what: str, *args: Any) -> Any:
            checked.append(f"{module.__name__.rsplit('.', 1)[-1]}.{name}({what})")
            return real(what, *args)

        monkeypatch.setattr(module, name, counting)

    for module in (engine_module, offloader_module):
        for name in ("as_block_ids", "require_distinct"):
            counted(module, name)
    offloader = Offloader(device_cache(), block_dim=1, num_cpu_blocks=CPU_BLOCKS)
    assert offloader.store(["a", "b"], [0, 1]) is not None
    offloader.wait()
    assert all(done.ok for done in offloader.poll())
    assert checked == [
        "offloader.as_block_ids(device_block_ids)",
        "offloader.as_block_ids(cpu_block_ids)",
        "offloader.require_distinct(cpu_block_ids)",
    ]
    checked.clear()
    offloader.load(["a", "b"], [2, 3])
    offloader.wait()
    assert checked == [
        "offloader.as_block_ids(device_block_ids)",
        "offloader.require_distinct(device_block_ids)",
        "offloader.as_block_ids(cpu_block_ids)",
    ]
    assert all(done.ok for done in offloader.poll())
    offloader.close()


# -- planted bugs: each must make the checker above report a problem --------------------------


@contextlib.contextmanager
def planted(bug: PlantedIdBug) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in bug.targets:
            patch.setattr(owner, name, bug.replacement)
        yield


@pytest.mark.parametrize("entry", share(BLOCK_IDS), ids=lambda bug: bug.name)
def test_the_block_id_checks_find_their_share_of_the_catalogue(entry: Planted) -> None:
    bug = entry.subject
    assert isinstance(bug, PlantedIdBug)
    with planted(bug):
        problems = block_id_problems()
    assert any(bug.caught_as in problem for problem in problems), problems


def test_the_planted_checks_are_not_the_real_ones() -> None:
    """Sanity of the plants: each really lets through what the real check refuses."""
    near_end = np.array([0, 1, CPU_BLOCKS], dtype=np.int64)
    with pytest.raises(InvalidArgumentError):
        as_block_ids("ids", near_end, CPU_BLOCKS)
    assert list(bound_off_by_one("ids", near_end, CPU_BLOCKS)) == [0, 1, CPU_BLOCKS]
    with pytest.raises(InvalidArgumentError):
        require_distinct("ids", np.array([1, 2, 1]))
    distinct_neighbours_only("ids", np.array([1, 2, 1]))
