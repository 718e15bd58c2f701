"""Constructors' bad input: each case gets its typed ``OffloadError``, and no thread is left.

Garbage in place of one argument of ``OffloadManager``, ``OffloadModel``, ``Offloader``,
``KVLayout``, ``CpuBlockPool``, ``TransferEngine`` and ``TransferEngine.for_cache``: the exact
error class, raised before any worker starts. docs/reliability.md lists every case by its
label (a test keeps it complete).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import Offloader
from kvoffload.manager import OffloadManager
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.loading import BUILTIN_POLICIES
from kvoffload.transfer import CpuBlockPool, KVLayout, PoolTooLargeError, TransferEngine
from kvoffload_spec import OffloadModel
from kvoffload_spec.errors import InvalidArgumentError, OffloadError, UnknownPolicyError
from tests.garbage import (
    BAD_COUNT,
    BAD_FLAG,
    BAD_SECONDS,
    JUNK,
    Call,
    refused,
    undocumented,
)


def tensors_of(*shapes: tuple[int, ...], device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(shape, device=device) for shape in shapes]


def bad_caches() -> dict[str, st.SearchStrategy[tuple[object, object]]]:
    """(kv_caches, block_dim) that no layout accepts, by case label."""

    def built(*makers: Callable[[], object]) -> st.SearchStrategy[tuple[object, object]]:
        return (
            st.sampled_from(makers)
            .map(lambda make: make())
            .map(lambda made: made if isinstance(made, tuple) else (made, 0))
        )

    return {
        "kv_caches: not a list of tensors": built(
            lambda: None,
            lambda: [],
            lambda: torch.zeros(4, 8),
            lambda: [np.zeros((4, 8))],
            lambda: [torch.zeros(4, 8), "layer 2"],
            lambda: {0: torch.zeros(4, 8)},
            lambda: (t for t in tensors_of((4, 8))),
        ),
        "kv_caches: no usable block dimension": built(
            lambda: [torch.tensor(1.0)],
            lambda: tensors_of((0, 8)),
            lambda: tensors_of((4, 0)),
            lambda: (tensors_of((4, 8)), 2),
            lambda: (tensors_of((4, 8)), -1),
        ),
        "kv_caches: sparse or nested": built(
            lambda: [torch.eye(4).to_sparse()],
            lambda: [torch.eye(4).to_sparse_csr()],
            lambda: [torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(3, 3)])],
        ),
        "kv_caches: blocks overlap or are not contiguous": built(
            lambda: [torch.zeros(1, 8).expand(4, 8)],
            lambda: [torch.zeros(40).as_strided((4, 8), (2, 1))],
            lambda: [torch.zeros(4, 8, 2).transpose(1, 2)],
            lambda: [torch.zeros(4, 1).expand(4, 8)],
        ),
        "kv_caches: tensors disagree on the number of blocks": built(
            lambda: tensors_of((4, 8), (5, 8)),
            lambda: (tensors_of((4, 8), (2, 5, 8)), [0, 1]),
        ),
        "kv_caches: on different or unsupported devices": built(
            lambda: [torch.zeros(4, 8), torch.zeros(4, 8, device="meta")],
            lambda: [torch.zeros(4, 8, device="meta"), torch.zeros(4, 8)],
        ),
        "block_dim: not an int, or one per tensor": built(
            lambda: (tensors_of((4, 8)), True),
            lambda: (tensors_of((4, 8)), "0"),
            lambda: (tensors_of((4, 8)), 0.0),
            lambda: (tensors_of((4, 8), (4, 8)), [0]),
            lambda: (tensors_of((4, 8)), [0, 0]),
            lambda: (tensors_of((4, 8)), None),
        ),
    }


class _ValidCache:
    """Stands for a valid KV cache in a constructor call (garbage goes elsewhere)."""

    def __repr__(self) -> str:
        return "<a valid KV cache>"


VALID_CACHE = _ValidCache()


def constructor_cases() -> dict[str, tuple[type[OffloadError], st.SearchStrategy[Call]]]:
    huge = st.integers(2**50, 2**62)
    policies = st.one_of(
        st.text(max_size=4).filter(lambda text: ":" not in text and text not in BUILTIN_POLICIES),
        st.sampled_from(
            [
                "no.such.module:Policy",
                "kvoffload:Offloader",
                "kvoffload.policies.base:EvictionPolicy",
                "collections:nothing",
            ]
        ),
        st.sampled_from([int, EvictionPolicy, None, 3]),
    )

    def replacing(target: str, **garbage: st.SearchStrategy[Any]) -> st.SearchStrategy[Call]:
        bases: dict[str, dict[str, object]] = {
            "OffloadManager": {"num_blocks": 4},
            "OffloadModel": {"num_blocks": 4},
            "Offloader": {"kv_caches": VALID_CACHE, "num_cpu_blocks": 4},
            "CpuBlockPool": {"block_bytes": 64, "num_blocks": 4},
            "TransferEngine.for_cache": {"kv_caches": VALID_CACHE, "num_cpu_blocks": 4},
        }
        base = bases[target]
        return st.sampled_from(sorted(garbage)).flatmap(
            lambda name: garbage[name].map(lambda value: Call(target, (), {**base, name: value}))
        )

    meta = st.builds(
        lambda: Call(
            "Offloader", (), {"kv_caches": tensors_of((4, 8), device="meta"), "num_cpu_blocks": 2}
        )
    )
    caches = {
        label: strategy.map(
            lambda made: Call(
                "Offloader", (), {"kv_caches": made[0], "block_dim": made[1], "num_cpu_blocks": 2}
            )
        )
        | strategy.map(lambda made: Call("KVLayout", made, {}))
        for label, strategy in bad_caches().items()
    }
    return {
        **{label: (InvalidArgumentError, strategy) for label, strategy in caches.items()},
        # A layout of meta tensors is fine (it sizes a pool without memory); copies are not.
        "kv_caches: on different or unsupported devices": (
            InvalidArgumentError,
            caches["kv_caches: on different or unsupported devices"] | meta,
        ),
        "counts: not an int >= 1": (
            InvalidArgumentError,
            st.one_of(
                replacing(
                    "OffloadManager",
                    num_blocks=BAD_COUNT,
                    store_threshold=BAD_COUNT,
                    max_tracker_size=BAD_COUNT,
                ),
                replacing(
                    "OffloadModel",
                    num_blocks=BAD_COUNT,
                    store_threshold=BAD_COUNT,
                    max_tracker_size=BAD_COUNT,
                ),
                replacing("Offloader", num_cpu_blocks=BAD_COUNT, block_size_factor=BAD_COUNT),
                replacing(
                    "TransferEngine.for_cache",
                    num_cpu_blocks=BAD_COUNT,
                    block_size_factor=BAD_COUNT,
                ),
                replacing("CpuBlockPool", block_bytes=BAD_COUNT, num_blocks=BAD_COUNT),
            ),
        ),
        "policy: unknown": (
            UnknownPolicyError,
            st.one_of(
                replacing("OffloadManager", policy=policies),
                replacing("OffloadModel", policy=policies),
                replacing("Offloader", policy=policies),
            ),
        ),
        "flags: not a bool": (
            InvalidArgumentError,
            st.one_of(
                replacing("OffloadManager", enable_events=BAD_FLAG),
                replacing("OffloadModel", enable_events=BAD_FLAG),
                replacing("Offloader", threaded=BAD_FLAG, prefault=BAD_FLAG),
                replacing("TransferEngine.for_cache", threaded=BAD_FLAG, prefault=BAD_FLAG),
                replacing("CpuBlockPool", pin=BAD_FLAG, prefault=BAD_FLAG),
            ),
        ),
        "seconds: not a finite number > 0": (
            InvalidArgumentError,
            st.one_of(
                replacing("OffloadManager", stall_after=BAD_SECONDS),
                replacing("Offloader", stall_after=BAD_SECONDS),
            ),
        ),
        "clock: not a function": (
            InvalidArgumentError,
            replacing("OffloadManager", clock=JUNK),
        ),
        "pool size: neither or both of count and bytes": (
            InvalidArgumentError,
            st.one_of(
                st.just(Call("Offloader", (), {"kv_caches": VALID_CACHE})),
                st.just(
                    Call(
                        "Offloader",
                        (),
                        {"kv_caches": VALID_CACHE, "num_cpu_blocks": 2, "cpu_bytes": 4096},
                    )
                ),
                st.just(Call("CpuBlockPool", (64,), {})),
                st.just(Call("CpuBlockPool", (64, 2), {"budget_bytes": 4096})),
            ),
        ),
        "pool size: a byte budget below one block": (
            InvalidArgumentError,
            st.one_of(
                st.integers(1, 95).map(
                    lambda b: Call("Offloader", (), {"kv_caches": VALID_CACHE, "cpu_bytes": b})
                ),
                st.integers(1, 63).map(lambda b: Call("CpuBlockPool", (64,), {"budget_bytes": b})),
            ),
        ),
        "pool size: larger than memory": (
            PoolTooLargeError,
            st.one_of(
                replacing("Offloader", num_cpu_blocks=huge),
                huge.map(
                    lambda b: Call("Offloader", (), {"kv_caches": VALID_CACHE, "cpu_bytes": b})
                ),
                replacing("CpuBlockPool", num_blocks=huge),
            ),
        ),
        "manager: another size or not a manager": (
            InvalidArgumentError,
            st.one_of(
                st.sampled_from([3, 5]).map(
                    lambda n: Call(
                        "Offloader",
                        (),
                        {
                            "kv_caches": VALID_CACHE,
                            "num_cpu_blocks": 4,
                            "manager": OffloadManager(n),
                        },
                    )
                ),
                JUNK.filter(lambda value: value is not None).map(
                    lambda junk: Call("Offloader", (), {"kv_caches": VALID_CACHE, "manager": junk})
                ),
            ),
        ),
        "engine: the pool does not fit the layout": (
            InvalidArgumentError,
            st.one_of(
                st.sampled_from([48, 192]).map(lambda b: Call("TransferEngine", (b,), {})),
                st.just(Call("TransferEngine", (96,), {"block_size_factor": 2})),
                JUNK.filter(lambda v: v is not None).map(
                    lambda c: Call("TransferEngine", (96,), {"copier": c})
                ),
                BAD_FLAG.map(lambda flag: Call("TransferEngine", (96,), {"threaded": flag})),
            ),
        ),
    }


def construct(made: Call) -> object:
    """Build what ``made`` names; ``VALID_CACHE`` and engines get a valid cache."""
    kwargs = dict(made.kwargs)
    if kwargs.get("kv_caches") is VALID_CACHE:
        kwargs["kv_caches"] = tensors_of((4, 2, 3, 4))  # 96-byte blocks
    if made.method == "TransferEngine":
        layout = KVLayout(tensors_of((4, 2, 3, 4)))
        (block_bytes,) = made.args
        return TransferEngine(layout, CpuBlockPool(block_bytes, 2), **kwargs)  # type: ignore[arg-type]
    constructors: dict[str, Callable[..., object]] = {
        "OffloadManager": OffloadManager,
        "OffloadModel": OffloadModel,
        "Offloader": Offloader,
        "CpuBlockPool": CpuBlockPool,
        "KVLayout": KVLayout,
        "TransferEngine.for_cache": TransferEngine.for_cache,
    }
    return constructors[made.method](*made.args, **kwargs)


CONSTRUCTOR_LABELS = sorted(constructor_cases())


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@given(data=st.data(), label=st.sampled_from(CONSTRUCTOR_LABELS))
def test_constructors_refuse_garbage_before_starting_anything(
    data: st.DataObject, label: str
) -> None:
    expected, calls = constructor_cases()[label]
    made = data.draw(calls, label="call")
    threads = threading.active_count()
    refused(expected, construct, made)
    assert threading.active_count() == threads, "a refused constructor left a thread running"


def test_the_docs_list_every_constructor_case() -> None:
    missing = undocumented(CONSTRUCTOR_LABELS, Path(__file__).name)
    assert not missing, f"docs/reliability.md does not list {missing} for {Path(__file__).name}"
