"""What the transfer tests share: engines over test caches, round trips drawn by
Hypothesis, fault hooks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from kvoffload.transfer import (
    CpuBlockPool,
    KVLayout,
    TransferEngine,
)
from kvoffload.transfer.engine import CopierName
from kvoffload.transfer.runs import BlockMapping
from tests.caches import CUDA, DTYPES, KINDS, make_cache, reference_block

# (copier, threaded): the CPU default, its two paths alone (memmove, numpy rows), the two
# paths CUDA uses (per-run copies, and the staging buffer of small runs), worker threads
CPU_PATHS: list[tuple[CopierName | None, bool]] = [
    (None, False),
    ("memmove", False),
    ("rows", False),
    ("span", False),
    ("tensor", False),
    ("gather", False),
    (None, True),
]
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def build_engine(
    kind: str,
    *,
    num_blocks: int = 8,
    cpu_blocks: int = 6,
    factor: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    copier: CopierName | None = None,
    threaded: bool = False,
) -> tuple[TransferEngine, list[torch.Tensor], int]:
    tensors, block_dim = make_cache(kind, num_blocks=num_blocks, dtype=dtype, device=device)
    layout = KVLayout(tensors, block_dim)
    pool = CpuBlockPool(factor * layout.bytes_per_block, cpu_blocks, pin=device == "cuda")
    engine = TransferEngine(
        layout, pool, block_size_factor=factor, threaded=threaded, copier=copier
    )
    return engine, tensors, block_dim


def blocks_of(tensors: list[torch.Tensor], block_dim: int) -> list[torch.Tensor]:
    count = tensors[0].shape[block_dim]
    return [reference_block(tensors, block_dim, block) for block in range(count)]


def same(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(map(torch.equal, left, right))


def finish(engine: TransferEngine, job: int) -> None:
    engine.wait([job])
    (result,) = engine.poll()
    assert result.job_id == job and result.ok, result


# -- round trips ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundTrip:
    """Store ``sources`` into ``cpu_ids``, then load ``loaded`` (the same CPU blocks, in
    another order) into ``targets``.
    """

    kind: str
    dtype: torch.dtype
    factor: int
    num_blocks: int
    cpu_blocks: int
    cpu_ids: list[int]
    sources: list[int]
    loaded: list[int]
    targets: list[int]


@st.composite
def round_trips(draw: st.DrawFn) -> RoundTrip:
    factor = draw(st.integers(1, 3))
    cpu_blocks = draw(st.integers(1, 5))
    num_blocks = draw(st.integers(factor * cpu_blocks, factor * cpu_blocks + 4))
    batch = draw(st.integers(0, cpu_blocks))
    if draw(st.booleans()):  # contiguous ids: the runs coalesce
        first_cpu = draw(st.integers(0, cpu_blocks - batch))
        cpu_ids = list(range(first_cpu, first_cpu + batch))
        first = draw(st.integers(0, num_blocks - factor * batch))
        sources = list(range(first, first + factor * batch))
    else:  # random ids; a store may read one device block twice
        cpu_ids = draw(st.permutations(range(cpu_blocks)))[:batch]
        size = factor * batch
        sources = draw(st.lists(st.integers(0, num_blocks - 1), min_size=size, max_size=size))
    return RoundTrip(
        kind=draw(st.sampled_from(KINDS)),
        dtype=draw(st.sampled_from(DTYPES)),
        factor=factor,
        num_blocks=num_blocks,
        cpu_blocks=cpu_blocks,
        cpu_ids=cpu_ids,
        sources=sources,
        loaded=draw(st.permutations(cpu_ids)),
        targets=draw(st.permutations(range(num_blocks)))[: factor * batch],
    )


def check_round_trip(
    case: RoundTrip, device: str, copier: CopierName | None, threaded: bool
) -> None:
    engine, tensors, block_dim = build_engine(
        case.kind,
        num_blocks=case.num_blocks,
        cpu_blocks=case.cpu_blocks,
        factor=case.factor,
        dtype=case.dtype,
        device=device,
        copier=copier,
        threaded=threaded,
    )
    before = blocks_of(tensors, block_dim)
    pool_before = engine.pool.tensor.clone()

    finish(engine, engine.submit_store(case.sources, case.cpu_ids))
    assert same(blocks_of(tensors, block_dim), before), "a store changed its source"
    untouched = [c for c in range(case.cpu_blocks) if c not in case.cpu_ids]
    assert torch.equal(engine.pool.tensor[untouched], pool_before[untouched])
    pool_stored = engine.pool.tensor.clone()

    finish(engine, engine.submit_load(case.loaded, case.targets))
    assert torch.equal(engine.pool.tensor, pool_stored), "a load changed the pool"
    k = case.factor
    origin = {
        target: case.sources[case.cpu_ids.index(case.loaded[j // k]) * k + j % k]
        for j, target in enumerate(case.targets)
    }
    after = blocks_of(tensors, block_dim)
    for block, content in enumerate(after):
        expected = before[origin.get(block, block)]
        assert torch.equal(content, expected), f"device block {block}"
    engine.close()


def mapping_for(kind: str, factor: int, layers: int = 3) -> BlockMapping:
    tensors, block_dim = make_cache(kind, num_blocks=16, layers=layers)
    return BlockMapping(KVLayout(tensors, block_dim), factor)


def ids(*values: int) -> np.ndarray[tuple[int], np.dtype[np.int64]]:
    return np.array(values, dtype=np.int64)


class FailAt:
    """A fault hook that raises once, at run ``run`` of job ``job``."""

    def __init__(self, job: int, run: int) -> None:
        self.job, self.run = job, run
        self.raised: list[Exception] = []

    def __call__(self, job: int, run: int) -> None:
        if (job, run) == (self.job, self.run):
            error = RuntimeError(f"injected into job {job} at run {run}")
            self.raised.append(error)
            raise error
