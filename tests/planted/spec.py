"""Deliberately broken copies of the spec, to show that our checks can fail.

Each :class:`Variant` is the spec's ``state.py`` with a few lines edited, the way a plausible
bug would edit them. It can be loaded as a module (for the explorer, through
:meth:`Variant.model`) or written out with a copy of ``contracts.py`` that imports it (for
CrossHair, which runs in a subprocess). An edit must match the spec's text exactly once, so
a spec that changes under a variant breaks the variant loudly instead of silently making
it a copy of the correct spec.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import kvoffload_spec.contracts
import kvoffload_spec.state
from kvoffload_spec import OffloadModel
from kvoffload_spec.state import SpecState

STATE_SOURCE = Path(kvoffload_spec.state.__file__).read_text()
CONTRACTS_SOURCE = Path(kvoffload_spec.contracts.__file__).read_text()
STATE_IMPORT = "from kvoffload_spec.state import"


@dataclass(frozen=True)
class Variant:
    """The spec with ``edits`` (old text, new text) applied to ``state.py``.

    ``crosshair`` names the contract check (``Class.method`` of ``contracts.py``) that
    CrossHair must fail on this variant, if it is one CrossHair is asked to catch.
    """

    name: str
    bug: str
    edits: tuple[tuple[str, str], ...]
    crosshair: str | None = None

    def source(self) -> str:
        text = STATE_SOURCE
        for old, new in self.edits:
            count = text.count(old)
            if count != 1:
                raise LookupError(f"{self.name}: {old!r} occurs {count} times in state.py")
            text = text.replace(old, new)
        return text

    @functools.cached_property
    def module(self) -> ModuleType:
        """The broken ``state.py`` without its ``assert`` contracts, imported under a name of
        its own. Without the contracts, what catches the bug is the checker under test, as
        it would be in a manager that has no such asserts."""
        name = f"kvoffload_spec_broken_{self.name}"
        module = ModuleType(name)
        sys.modules[name] = module  # dataclasses look their module up while decorating
        code = compile(self.source(), f"<{name}>", "exec", optimize=1)  # drops the asserts
        exec(code, module.__dict__)
        return module

    @functools.cached_property
    def model_class(self) -> type[OffloadModel]:
        """:class:`OffloadModel` with this variant's transitions."""
        broken: type[SpecState] = self.module.SpecState

        class BrokenModel(OffloadModel):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                fields = dataclasses.fields(SpecState)
                self.state = broken(**{f.name: getattr(self.state, f.name) for f in fields})

        BrokenModel.__name__ = BrokenModel.__qualname__ = f"BrokenModel_{self.name}"
        return BrokenModel

    def model(
        self, num_blocks: int, policy: str = "lru", *, store_threshold: int = 1
    ) -> OffloadModel:
        """A broken reference model, with events."""
        return self.model_class(
            num_blocks, policy, store_threshold=store_threshold, enable_events=True
        )

    def write_contracts(self, directory: Path) -> str:
        """Write this variant and a ``contracts.py`` that uses it into ``directory``; return
        the contracts module's name (put ``directory`` on the path to import it)."""
        state_module = f"broken_state_{self.name}"
        contracts_module = f"broken_contracts_{self.name}"
        if CONTRACTS_SOURCE.count(STATE_IMPORT) != 1:
            raise LookupError(f"contracts.py must import the state once as {STATE_IMPORT!r}")
        contracts = CONTRACTS_SOURCE.replace(STATE_IMPORT, f"from {state_module} import")
        (directory / f"{state_module}.py").write_text(self.source())
        (directory / f"{contracts_module}.py").write_text(contracts)
        return contracts_module


VARIANTS = (
    Variant(
        "counter_not_restored",
        "complete_load unpins a block but does not count it evictable again",
        (
            (
                "                self.num_evictable += 1\n        released",
                "                pass\n        released",
            ),
        ),
        crosshair="LruContracts.check_complete_load",
    ),
    Variant(
        "guard_off_by_one",
        "the fast-fail guard refuses a store that exactly fits",
        (("if need > self.num_evictable:", "if need >= self.num_evictable:"),),
        crosshair="LruContracts.check_prepare_store",
    ),
    Variant(
        "protected_evictable",
        "prepare_store may evict a key of its own call",
        (("self.evictable(key) and key not in protected", "self.evictable(key)"),),
    ),
    Variant(
        "failed_store_leaks_slot",
        "a failed store drops its block but never frees the slot",
        (("                self._free(block.block_id)\n", ""),),
        crosshair="LruContracts.check_complete_store",
    ),
    Variant(
        "stale_store_completion_applied",
        "complete_store ignores the generation and marks whatever is pending on the key "
        "ready: the ABA hazard after a reset",
        (
            ("            return  # the ABA guard", "            pass  # the ABA guard"),
            ("if self._pending_on(k, plan.plan_id)]", "if self.lookup(k) is Lookup.PENDING]"),
        ),
    ),
    Variant(
        "stale_load_completion_applied",
        "complete_load of a plan made before a reset unpins the blocks stored since under "
        "the same keys, so a block being read can be evicted and overwritten",
        (
            (" is None and plan.generation == self.generation:\n", " is None:\n"),
            (
                "block = self.blocks[key]\n            block.refs -= 1",
                "block = self.blocks.get(key, Block(-1))\n            block.refs -= 1",
            ),
            (
                "if self.blocks[key].refs == 0)\n        assert",
                "if key in self.blocks and self.blocks[key].refs == 0)\n        assert",
            ),
        ),
        crosshair="ArcContracts.check_complete_load",
    ),
    Variant(
        "completion_keeps_plan_open",
        "complete_load forgets to close its plan, so completing it twice unpins twice",
        (
            (
                "        del self.open_plans[plan.plan_id]\n        if self.abandoned.pop(",
                "        if self.abandoned.pop(",
            ),
        ),
    ),
    Variant(
        "abandon_frees_slots",
        "abandon frees a stalled store's slots at once, though its job may still write them",
        (
            (
                "quarantine.append(self.blocks.pop(key).block_id)",
                "self._free(self.blocks.pop(key).block_id)",
            ),
        ),
        crosshair="LruContracts.check_abandon",
    ),
    Variant(
        "reset_ends_quarantine",
        "reset_cache frees every slot, the quarantined ones included",
        (
            (
                "[\n            block_id for block_id in range(self.num_blocks) if block_id not in "
                "quarantined\n        ]",
                "list(range(self.num_blocks))",
            ),
        ),
        crosshair="LruContracts.check_reset_cache",
    ),
)
