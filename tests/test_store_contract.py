"""The remote store contract (tests/store_contract.py) on every store of ``STORES``, and
its share of the catalogue of planted bugs: stores whose ``get_into`` takes a valid value
of another size than the buffer must each fail the size checks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import Phase, settings

from tests import store_contract
from tests.planted import STORE_CONTRACT, Planted, share
from tests.planted.stores import PlantedStore
from tests.store_contract import CONTRACT, STORES, StoreFactory, StoreMaker, valkey_stores

BY_NAME = {check.__name__: check for check in CONTRACT}


@pytest.mark.parametrize("check", CONTRACT, ids=lambda check: check.__name__[6:])
@pytest.mark.parametrize("factory", STORES, ids=lambda factory: factory.name)
def test_the_store_keeps_the_contract(
    factory: StoreFactory, check: Callable[[StoreMaker], None]
) -> None:
    with factory.opened() as make:
        check(make)


@pytest.mark.parametrize("entry", share(STORE_CONTRACT), ids=lambda bug: bug.name)
def test_the_store_contract_finds_its_share_of_the_catalogue(
    entry: Planted, monkeypatch: pytest.MonkeyPatch
) -> None:
    bug = entry.subject
    assert isinstance(bug, PlantedStore)
    # Stop at the first failing batch: shrinking it would only cost time here.
    found_only = settings(store_contract.MIXED_BATCHES, phases=(Phase.generate,), database=None)
    monkeypatch.setattr(store_contract, "MIXED_BATCHES", found_only)
    for name in bug.caught_by:
        with valkey_stores(bug.store_class) as make, pytest.raises(AssertionError):
            BY_NAME[name](make)
