"""KV layouts: every block's bytes, in every layout and dtype, are exactly its segments.

Also home of the cache builders the data-path tests share (``make_cache``,
``reference_block``, ``DEVICES``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.transfer import KVLayout
from kvoffload_spec.errors import InvalidArgumentError

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
    ),
]
DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64]
KINDS = ["per_layer", "kv_split", "kv_interleaved", "cross_layer"]


def make_cache(
    kind: str,
    *,
    num_blocks: int,
    dtype: torch.dtype = torch.bfloat16,
    layers: int = 2,
    device: str = "cpu",
    seed: int = 0,
) -> tuple[list[torch.Tensor], int]:
    """A KV cache of random bytes in one of the engines' layouts, and its ``block_dim``.

    per_layer: ``[N, 2, 3, 4]`` per layer (K and V inside the block); kv_split:
    ``[2, N, 3, 4]`` per layer; kv_interleaved: the same shape as a non-contiguous view
    of ``[N, 2, 3, 4]``; cross_layer: one ``[N, layers, 2, 3, 4]`` tensor.
    """
    shapes: list[tuple[int, ...]]
    if kind == "cross_layer":
        shapes, block_dim = [(num_blocks, layers, 2, 3, 4)], 0
    elif kind == "per_layer":
        shapes, block_dim = [(num_blocks, 2, 3, 4)] * layers, 0
    else:
        shapes, block_dim = [(2, num_blocks, 3, 4)] * layers, 1
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for shape in shapes:
        if kind == "kv_interleaved":
            base = _random_tensor((shape[1], shape[0], *shape[2:]), dtype, generator)
            tensors.append(base.to(device).transpose(0, 1))
        else:
            tensors.append(_random_tensor(shape, dtype, generator).to(device))
    return tensors, block_dim


def _random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype)
    raw = tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return tensor


def reference_block(
    tensors: list[torch.Tensor], block_dim: int | list[int], block: int
) -> torch.Tensor:
    """A device block's bytes as the layout must see them: each tensor's slice at
    ``block``, in order, flattened to bytes (computed by torch indexing, not by offsets).
    """
    dims = [block_dim] * len(tensors) if isinstance(block_dim, int) else block_dim
    parts = [
        t.select(d, block).contiguous().view(torch.uint8).flatten()
        for t, d in zip(tensors, dims, strict=True)
    ]
    return torch.cat(parts).cpu()


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
