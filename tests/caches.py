"""KV caches in the engines' layouts, and each block's expected bytes: what the data-path
tests (layout, transfer, offloader, faults) build their caches from."""

from __future__ import annotations

import math

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
    ),
]
DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64]
KINDS = ["per_layer", "kv_split", "kv_interleaved", "cross_layer", "layer_views", "mixed"]
# The row styles of a "mixed" cache, layer by layer: a block's bytes packed (stride == bytes),
# followed by a gap of padding, or by the next block's bytes of another view (every other).
MIXED_STYLES = ("packed", "padded", "every_other")


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
    of ``[N, 2, 3, 4]``; cross_layer: one ``[N, layers, 2, 3, 4]`` tensor; layer_views:
    its per-layer views ``[N, 2, 3, 4]`` (the segments of a block are adjacent in memory);
    mixed: per-layer ``[N, 2, 3, 4]`` tensors whose rows are packed and strided in turn
    (``MIXED_STYLES``: a padded row, a view of every other block of a larger tensor).
    """
    shapes: list[tuple[int, ...]]
    if kind == "layer_views":
        whole, _ = make_cache(
            "cross_layer",
            num_blocks=num_blocks,
            dtype=dtype,
            layers=layers,
            device=device,
            seed=seed,
        )
        return list(whole[0].unbind(1)), 0
    if kind == "mixed":
        styles = [MIXED_STYLES[layer % len(MIXED_STYLES)] for layer in range(layers)]
        return styled_cache(styles, num_blocks=num_blocks, dtype=dtype, device=device, seed=seed), 0
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
            base = random_tensor((shape[1], shape[0], *shape[2:]), dtype, generator)
            tensors.append(base.to(device).transpose(0, 1))
        else:
            tensors.append(random_tensor(shape, dtype, generator).to(device))
    return tensors, block_dim


def styled_cache(
    styles: list[str],
    *,
    num_blocks: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
    block_shape: tuple[int, ...] = (2, 3, 4),
) -> list[torch.Tensor]:
    """Per-layer ``[num_blocks, *block_shape]`` tensors of random bytes, each row in its
    style (``MIXED_STYLES``): its blocks back to back, each followed by as many bytes of
    padding, or every other block of a tensor twice as long (the gap holds other blocks)."""
    generator = torch.Generator().manual_seed(seed)
    width = math.prod(block_shape)
    tensors = []
    for style in styles:  # the strided views are taken on the device (a copy would pack them)
        if style == "packed":
            tensor = random_tensor((num_blocks, *block_shape), dtype, generator).to(device)
        elif style == "padded":
            wide = random_tensor((num_blocks, 2 * width), dtype, generator).to(device)
            tensor = wide[:, :width].view(num_blocks, *block_shape)
        else:
            tensor = random_tensor((2 * num_blocks, *block_shape), dtype, generator).to(device)
            tensor = tensor[::2]
        tensors.append(tensor)
    return tensors


def random_tensor(
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
    # Copied into a fresh tensor rather than ``.contiguous()``: torch calls a tensor whose
    # size-1 dims have odd strides contiguous already, and such a tensor cannot be viewed
    # as bytes.
    slices = [t.select(d, block) for t, d in zip(tensors, dims, strict=True)]
    parts = [
        torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x).view(torch.uint8).flatten()
        for x in slices
    ]
    return torch.cat(parts).cpu()
