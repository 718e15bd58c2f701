"""How an engine's KV cache tensors are cut into blocks, as byte ranges.

An engine hands over its KV cache as a list of tensors whose ``block_dim`` indexes the
block: one tensor per layer (``[num_blocks, ...]``), K and V split (``[2, num_blocks, ...]``,
``block_dim=1``), or one cross-layer tensor. Whatever the dtype, every tensor is seen as bytes:
each index of the dimensions before ``block_dim`` gives one *segment*, and block ``i`` of a
segment is the contiguous byte range ``[base + i * stride, base + i * stride + nbytes)`` of
the tensor's storage. A device block is the concatenation of its segments, in order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Segment:
    """One byte range per block in the storage of ``layout.storages[tensor_index]``."""

    tensor_index: int
    base: int  # byte offset of block 0 in the storage
    stride: int  # bytes from one block to the next
    nbytes: int  # bytes of one block


class KVLayout:
    """The device KV cache as segments of bytes per block (see the module docstring).

    ``storages[i]`` is a flat ``uint8`` view of the whole storage of ``tensors[i]``: copies
    address byte ranges in it, so any dtype and any strides of the outer dimensions work.
    The dimensions after ``block_dim`` must be contiguous (a block's bytes in one piece).
    The tensors must not be resized while a layout uses them: copies address their memory.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], block_dim: int | Sequence[int] = 0):
        import torch

        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise InvalidArgumentError("kv_caches must be a non-empty list of tensors")
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise InvalidArgumentError("kv_caches must hold torch tensors only")
        for index, tensor in enumerate(tensors):
            if tensor.layout != torch.strided or tensor.is_nested:
                kind = "nested" if tensor.is_nested else str(tensor.layout)
                raise InvalidArgumentError(
                    f"tensor {index} is {kind}: KV caches must be dense tensors "
                    "(torch.strided); pass the engine's own cache tensors"
                )
        dims = _block_dims(block_dim, len(tensors))
        device = tensors[0].device
        if any(t.device != device for t in tensors):
            raise InvalidArgumentError("all KV cache tensors must be on the same device")
        segments: list[Segment] = []
        for index, (tensor, dim) in enumerate(zip(tensors, dims, strict=True)):
            segments.extend(_segments_of(index, tensor, dim))
        counts = {t.shape[d] for t, d in zip(tensors, dims, strict=True)}
        if len(counts) != 1:
            raise InvalidArgumentError(f"tensors disagree on the number of blocks: {counts}")
        self.tensors = tuple(tensors)
        self.block_dims = dims
        self.device = device
        self.num_blocks: int = counts.pop()
        self.segments = tuple(segments)
        self.bytes_per_block = sum(s.nbytes for s in segments)
        self.storages = tuple(
            torch.empty(0, dtype=torch.uint8, device=device).set_(t.untyped_storage())
            for t in tensors
        )

    def __repr__(self) -> str:
        return (
            f"KVLayout({len(self.tensors)} tensors on {self.device}, {self.num_blocks} blocks "
            f"of {self.bytes_per_block} bytes in {len(self.segments)} segments)"
        )


def _block_dims(block_dim: int | Sequence[int], count: int) -> tuple[int, ...]:
    if isinstance(block_dim, int):
        given: tuple[object, ...] = (block_dim,) * count
    else:
        given = tuple(block_dim) if isinstance(block_dim, (list, tuple)) else ()
    dims = tuple(d for d in given if isinstance(d, int) and not isinstance(d, bool))
    if len(dims) != count or len(given) != count:
        raise InvalidArgumentError(
            f"block_dim must be an int or one int per tensor ({count}), got {block_dim!r}"
        )
    return dims


def _segments_of(index: int, tensor: torch.Tensor, dim: int) -> list[Segment]:
    shape, strides = tuple(tensor.shape), tensor.stride()
    if not 0 <= dim < len(shape):
        raise InvalidArgumentError(f"block_dim {dim} is out of range for tensor {index} {shape}")
    size = tensor.element_size()
    inner = shape[dim + 1 :]
    packed = [math.prod(inner[i + 1 :]) for i in range(len(inner))]
    if any(n > 1 and s != p for n, s, p in zip(inner, strides[dim + 1 :], packed, strict=True)):
        raise InvalidArgumentError(
            f"tensor {index}: the dimensions after block_dim must be contiguous "
            f"(shape {shape}, strides {strides})"
        )
    nbytes = math.prod(inner) * size
    stride = strides[dim] * size
    if nbytes == 0 or shape[dim] == 0:
        raise InvalidArgumentError(f"tensor {index} has no bytes per block: shape {shape}")
    if shape[dim] > 1 and stride < nbytes:
        raise InvalidArgumentError(f"tensor {index}: consecutive blocks overlap in memory")
    outer, outer_strides = shape[:dim], strides[:dim]
    if any(n > 1 and s == 0 for n, s in zip(outer, outer_strides, strict=True)):
        raise InvalidArgumentError(f"tensor {index} is broadcast: its segments share memory")
    start = int(tensor.storage_offset())
    return [
        Segment(index, (start + _dot(at, outer_strides)) * size, stride, nbytes)
        for at in itertools.product(*map(range, outer))
    ]


def _dot(position: Sequence[int], strides: Sequence[int]) -> int:
    return sum(i * s for i, s in zip(position, strides, strict=True))
