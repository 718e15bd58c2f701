"""KV layouts: every block's bytes, in every layout and dtype, are exactly its segments."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.transfer import KVLayout
from kvoffload.transfer import layout as layout_module
from kvoffload_spec.errors import InvalidArgumentError
from tests.caches import DEVICES, DTYPES, KINDS, make_cache, random_tensor, reference_block
from tests.planted import LAYOUTS, Planted, share
from tests.planted.layouts import StrictStrideBug


def layout_block(layout: KVLayout, block: int) -> torch.Tensor:
    parts = [
        layout.storages[s.tensor_index][s.base + block * s.stride :][: s.nbytes]
        for s in layout.segments
    ]
    return torch.cat(parts).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_block_is_its_segments(kind: str, dtype: torch.dtype, device: str) -> None:
    tensors, block_dim = make_cache(kind, num_blocks=5, dtype=dtype, device=device)
    layout = KVLayout(tensors, block_dim)
    per_block = reference_block(tensors, block_dim, 0).numel()
    assert layout.num_blocks == 5
    assert layout.bytes_per_block == per_block == 2 * 2 * 3 * 4 * tensors[0].element_size()
    for block in range(5):
        assert torch.equal(layout_block(layout, block), reference_block(tensors, block_dim, block))


@st.composite
def strided_caches(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[int]]:
    """Tensors of random rank and dtype, with the block dimension anywhere, the outer
    dimensions in any memory order (a permuted view) and any storage offset.
    """
    num_blocks = draw(st.integers(1, 4))
    tensors, dims = [], []
    for _ in range(draw(st.integers(1, 3))):
        outer = draw(st.lists(st.integers(1, 3), max_size=2))
        inner = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
        dtype = draw(st.sampled_from(DTYPES))
        order = draw(st.permutations(range(len(outer) + 1)))
        stored_shape = [([*outer, num_blocks])[i] for i in order] + inner
        skip = draw(st.integers(0, 5))  # the view may start inside its storage
        size = math.prod(stored_shape)
        base = torch.arange(skip + size, dtype=torch.int64).to(dtype)[skip:]
        base = base.reshape(stored_shape)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        view = base.permute(*inverse, *range(len(order), len(stored_shape)))
        tensors.append(view)
        dims.append(len(outer))
    return tensors, dims


@given(strided_caches())
def test_segments_follow_any_strides(cache: tuple[list[torch.Tensor], list[int]]) -> None:
    tensors, dims = cache
    layout = KVLayout(tensors, dims)
    for block in range(layout.num_blocks):
        assert torch.equal(layout_block(layout, block), reference_block(tensors, dims, block))


def test_segments_of_a_kv_split_tensor() -> None:
    (tensor,), block_dim = make_cache("kv_split", num_blocks=7, dtype=torch.float16, layers=1)
    layout = KVLayout([tensor], block_dim)
    k_segment, v_segment = layout.segments
    block = 3 * 4 * 2
    assert (k_segment.base, k_segment.stride, k_segment.nbytes) == (0, block, block)
    assert (v_segment.base, v_segment.stride, v_segment.nbytes) == (7 * block, block, block)
    assert "1 tensors on cpu, 7 blocks of 48 bytes in 2 segments" in repr(layout)


def _bad_layouts() -> list[tuple[object, object, str]]:
    blocks = torch.zeros(4, 3, 2)
    return [
        ([], 0, "non-empty list"),
        (blocks, 0, "non-empty list"),
        ([blocks, "kv"], 0, "torch tensors"),
        ([blocks, torch.zeros(4, 3, 2, device="meta")], 0, "same device"),
        ([blocks, torch.zeros(5, 3, 2)], 0, "number of blocks"),
        ([blocks], 3, "out of range"),
        ([blocks], -1, "out of range"),
        ([blocks], True, "block_dim must be"),
        ([blocks, blocks], [0], "block_dim must be"),
        ([blocks.transpose(1, 2)], 0, "must be contiguous"),
        ([torch.zeros(1, 4, 2).expand(3, 4, 2)], 1, "broadcast"),
        ([torch.zeros(4, 0)], 0, "no bytes per block"),
        ([torch.zeros(16).as_strided((4, 4), (2, 1))], 0, "overlap"),
    ]


@pytest.mark.parametrize(("tensors", "block_dim", "message"), _bad_layouts())
def test_bad_layouts_raise_typed_errors(tensors: object, block_dim: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        KVLayout(tensors, block_dim)  # type: ignore[arg-type]


# -- size-1 dimensions: torch gives them any stride, and they address nothing -----------------


def restrided(tensor: torch.Tensor, strides: dict[int, int]) -> torch.Tensor:
    """The same view, with ``strides[d]`` as the stride of each size-1 dimension ``d``: an
    index into a size-1 dimension is always 0, so its stride moves no byte."""
    assert all(tensor.shape[d] == 1 for d in strides)
    new = [strides.get(d, s) for d, s in enumerate(tensor.stride())]
    return tensor.as_strided(tensor.shape, new, tensor.storage_offset())


@st.composite
def caches_with_size_one_dims(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[int]]:
    """``strided_caches`` with size-1 dimensions spliced in anywhere (before, at or after
    the block dimension, or a single block), each with an arbitrary stride."""
    tensors, dims = draw(strided_caches())
    odd, odd_dims = [], []
    for tensor, dim in zip(tensors, dims, strict=True):
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, tensor.dim()))
            tensor = tensor.unsqueeze(at)
            dim += at <= dim
        sizes = [d for d in range(tensor.dim()) if tensor.shape[d] == 1]
        strides = {d: draw(st.sampled_from((0, 1, 3, 1 << 20))) for d in sizes}
        odd.append(restrided(tensor, strides))
        odd_dims.append(dim)
    return odd, odd_dims


@given(caches_with_size_one_dims())
def test_size_one_dims_with_any_stride_are_accepted_and_addressed_right(
    cache: tuple[list[torch.Tensor], list[int]],
) -> None:
    tensors, dims = cache
    layout = KVLayout(tensors, dims)
    for block in range(layout.num_blocks):
        assert torch.equal(layout_block(layout, block), reference_block(tensors, dims, block))


def _size_one_layouts() -> list[tuple[str, list[torch.Tensor], int]]:
    """Valid caches whose size-1 dimensions have the strides torch (or an engine) may give."""
    base = random_tensor((6, 2, 8), torch.float16, torch.Generator().manual_seed(1))
    single = random_tensor((1, 2, 8), torch.float16, torch.Generator().manual_seed(2))
    return [
        ("a size-1 last dim from transpose", [base.unsqueeze(2).transpose(2, 3)], 0),
        ("a size-1 inner dim, stride 0", [restrided(base.unsqueeze(1), {1: 0})], 0),
        ("a size-1 inner dim, huge stride", [restrided(base.unsqueeze(2), {2: 1 << 20})], 0),
        ("a size-1 outer dim, stride 0", [restrided(base.unsqueeze(0), {0: 0})], 1),
        ("a size-1 outer dim from movedim", [base.unsqueeze(1).movedim(1, 0)], 1),
        ("one block, stride 0", [restrided(single, {0: 0})], 0),
        ("one block, stride 1", [restrided(single, {0: 1})], 0),
        ("K and V of one head", [restrided(base.view(6, 2, 1, 8), {2: 3})], 0),
    ]


def size_one_problems() -> list[str]:
    """What goes wrong with the layouts above: a refusal, a segment that is not the block,
    or a store and load through the engine (every copier, on the CPU) that is not byte-exact."""
    from kvoffload.transfer import CpuBlockPool, TransferEngine
    from kvoffload.transfer.engine import CopierName

    problems = []
    for name, tensors, block_dim in _size_one_layouts():
        try:
            layout = KVLayout(tensors, block_dim)
        except InvalidArgumentError as error:
            problems.append(f"{name}: refused ({error})")
            continue
        count = layout.num_blocks
        expected = [reference_block(tensors, block_dim, block) for block in range(count)]
        if not all(torch.equal(layout_block(layout, b), want) for b, want in enumerate(expected)):
            problems.append(f"{name}: the segments are not the blocks")
        copiers: tuple[CopierName, ...] = ("memmove", "rows", "span", "tensor", "gather")
        for copier in copiers:
            pool = CpuBlockPool(layout.bytes_per_block, count)
            engine = TransferEngine(layout, pool, copier=copier)
            saved = [t.clone() for t in tensors]
            engine.wait([engine.submit_store(list(range(count)), list(range(count)))])
            for tensor in tensors:
                tensor.zero_()
            engine.wait([engine.submit_load(list(range(count))[::-1], list(range(count)))])
            if not all(result.ok for result in engine.poll()) or not all(
                torch.equal(reference_block(tensors, block_dim, block), expected[count - 1 - block])
                for block in range(count)
            ):
                problems.append(f"{name}: a round trip through the {copier} copier lost bytes")
            for tensor, before in zip(tensors, saved, strict=True):
                tensor.copy_(before)
            engine.close()
    return problems


def test_layouts_with_size_one_dims_round_trip_byte_exact() -> None:
    assert size_one_problems() == []


LAYOUT_SOURCE = Path(layout_module.__file__).read_text()


def strict_segments_of(bug: StrictStrideBug) -> Any:
    """``_segments_of`` of a copy of layout.py with ``bug``'s edit (which must match once)."""
    old, new = bug.edit
    assert LAYOUT_SOURCE.count(old) == 1, f"{bug.name}: {old!r} no longer in layout.py"
    module = types.ModuleType("kvoffload_layout_strict")
    sys.modules[module.__name__] = module  # dataclasses look their module up while decorating
    exec(compile(LAYOUT_SOURCE.replace(old, new), "<strict layout>", "exec"), module.__dict__)
    return module._segments_of


@pytest.mark.parametrize("entry", share(LAYOUTS), ids=lambda bug: bug.name)
def test_the_layout_checks_find_their_share_of_the_catalogue(
    entry: Planted, monkeypatch: pytest.MonkeyPatch
) -> None:
    bug = entry.subject
    assert isinstance(bug, StrictStrideBug)
    monkeypatch.setattr(layout_module, "_segments_of", strict_segments_of(bug))
    problems = size_one_problems()
    assert any(problem.startswith(bug.caught_as) for problem in problems), problems
