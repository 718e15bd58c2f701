"""KV caches in the engines' layouts, and each block's expected bytes: what the data-path
tests (layout, transfer, offloader, faults) build their caches from."""

from __future__ import annotations

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
KINDS = ["per_layer", "kv_split", "kv_interleaved", "cross_layer", "layer_views"]


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
    its per-layer views ``[N, 2, 3, 4]`` (the segments of a block are adjacent in memory).
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
