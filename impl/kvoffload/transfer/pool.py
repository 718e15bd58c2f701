"""The CPU block pool: one allocation, sized exactly, optionally pinned and pre-faulted.

``pin_memory=True`` would round the allocation up to a power of two (vLLM #48436): a 40 GiB
pool would cost 64 GiB of locked memory. So the pool is plain memory, page-aligned, that is
then registered with CUDA (``cudaHostRegister``) when pinning is asked for.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvoffload_spec.errors import InvalidArgumentError, OffloadError
from kvoffload_spec.validation import check_count, check_flag

if TYPE_CHECKING:
    import torch

PAGE = 4096


class PoolTooLargeError(InvalidArgumentError):
    """The CPU pool asked for is larger than this machine's memory."""


def machine_memory_bytes() -> int:
    """Physical memory, or the cgroup's limit where that is lower (a container)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as limit:
            text = limit.read().strip()
    except OSError:
        return physical
    return min(physical, int(text)) if text.isdigit() else physical


def available_memory_bytes() -> int:
    """Memory that can be allocated now without swapping: the kernel's ``MemAvailable``
    (Linux), or within a container's limit what is left of it; the physical memory where
    neither can be read."""
    limit = machine_memory_bytes()
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = limit
    try:
        with open("/sys/fs/cgroup/memory.current") as current:
            used = int(current.read().strip())
    except (OSError, ValueError):
        used = 0
    return max(0, min(available, limit - used))


def pool_size(block_bytes: int, num_blocks: int | None, budget_bytes: int | None) -> int:
    """The number of CPU blocks: ``num_blocks``, or as many as ``budget_bytes`` holds."""
    check_count("block_bytes", block_bytes)
    if (num_blocks is None) == (budget_bytes is None):
        raise InvalidArgumentError("give exactly one of num_cpu_blocks and cpu_bytes")
    if num_blocks is not None:
        return check_count("num_cpu_blocks", num_blocks)
    budget = check_count("cpu_bytes", budget_bytes)
    if budget < block_bytes:
        raise InvalidArgumentError(
            f"cpu_bytes={budget} cannot hold one CPU block of {block_bytes} bytes"
        )
    return budget // block_bytes


def require_memory(nbytes: int, what: str) -> None:
    """Refuse, before anything is allocated, a pool larger than this machine's memory."""
    available = machine_memory_bytes()
    if nbytes > available:
        raise PoolTooLargeError(
            f"{what} = {nbytes / 2**30:.1f} GiB exceeds this machine's memory "
            f"({available / 2**30:.1f} GiB): give fewer num_cpu_blocks or a smaller cpu_bytes"
        )


class CpuBlockPool:
    """``num_blocks`` CPU blocks of ``block_bytes`` each, in one page-aligned allocation.

    ``tensor`` is ``uint8[num_blocks, block_bytes]`` and ``flat`` the same bytes in one
    dimension. ``pin`` registers the memory with CUDA (page-locked, DMA-able); ``prefault``
    writes every page at start-up so that the first copies do not pay the page faults.
    """

    def __init__(
        self,
        block_bytes: int,
        num_blocks: int | None = None,
        *,
        budget_bytes: int | None = None,
        pin: bool = False,
        prefault: bool = False,
    ) -> None:
        count = pool_size(block_bytes, num_blocks, budget_bytes)
        check_flag("pin", pin)
        check_flag("prefault", prefault)
        nbytes = count * block_bytes
        require_memory(nbytes, f"a CPU pool of {count} blocks x {block_bytes} bytes")
        if pin:
            require_cuda("a pinned CPU pool")
        self.num_blocks = count
        self.block_bytes = block_bytes
        self.flat = _allocate_aligned(nbytes)
        self.tensor = self.flat.view(count, block_bytes)
        if prefault:
            self.flat.zero_()
        self.pinned = pin
        self._unpin: Callable[[], None] | None = None
        if pin:
            self._unpin = weakref.finalize(self, HostRegistration(self.flat))

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def close(self) -> None:
        """Unregister pinned memory now rather than at garbage collection (idempotent)."""
        if self._unpin is not None:
            self._unpin()

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "pageable"
        return f"CpuBlockPool({self.num_blocks} x {self.block_bytes} bytes, {kind})"


def require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise InvalidArgumentError(f"{what} needs CUDA, and torch sees no CUDA device")


class HostRegistrationError(OffloadError):
    """CUDA refused to page-lock (or release) the CPU pool's memory."""


class HostRegistration:
    """Page-locks a CPU tensor's memory for DMA (``cudaHostRegister``) until called.

    Holding the tensor keeps its memory alive for as long as it is registered. The calls
    are those of torch's own ``torch.cuda._pin_memory_utils``.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        import torch

        self._tensor = tensor
        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        portable = 1  # cudaHostRegisterPortable: pinned for every CUDA context
        code = int(self._cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), portable))
        if code != 0:
            raise HostRegistrationError(
                f"cudaHostRegister of {tensor.numel()} bytes failed with cudaError {code}"
            )

    def __call__(self) -> None:
        code = int(self._cudart.cudaHostUnregister(self._tensor.data_ptr()))
        if code != 0:
            raise HostRegistrationError(f"cudaHostUnregister failed with cudaError {code}")


def _allocate_aligned(nbytes: int) -> torch.Tensor:
    """Exactly ``nbytes`` starting on a page boundary (what ``cudaHostRegister`` locks)."""
    import torch

    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]
