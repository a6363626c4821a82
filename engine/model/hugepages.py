"""The model's weights on transparent huge pages (2 MiB), on a Linux CPU.

At a small batch a step streams every weight once, and on 4 KiB pages that stream crosses a page, with its TLB miss
and a stop of the hardware prefetcher (which does not cross pages), every 4 KiB. Torch allocates each tensor on its
own (4 KiB pages unless the kernel's transparent_hugepage is "always"), so `move_to_hugepages` copies every
parameter into one arena the kernel is asked (madvise MADV_HUGEPAGE) to back with 2 MiB pages, and points the
parameters there. On the AVX-512 EPYC, the 121 bf16 linears of smollm2-135m at one row read 33 GB/s on 4 KiB pages
and 42-46 GB/s on huge ones (2 threads, alternating in one process, 2026-12-03).

Where the kernel has transparent huge pages "never", or the platform has no madvise, the arena is still one
allocation and the weights still work: only the pages stay small (`HugePageArena.huge` says which).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class HugePageArena:
    """What `move_to_hugepages` did: the tensors moved, their bytes, and whether the kernel was asked for huge
    pages (madvise accepted and transparent huge pages not "never")."""

    num_tensors: int
    nbytes: int
    huge: bool


def thp_enabled() -> bool:
    """Whether the kernel gives transparent huge pages to memory that asks (its setting "always" or "madvise")."""
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _aligned(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def move_to_hugepages(model: nn.Module) -> HugePageArena:
    """Copy every CPU parameter and buffer of `model` (the linears' packed panels among them; a tied one once) into
    one huge-page arena and point it there. The arena lives as long as any tensor views it."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu" and t.numel() > 0]
    if not tensors:
        return HugePageArena(0, 0, False)
    offsets, size = [], 0
    for p in tensors:
        offsets.append(size)
        size = _aligned(size + p.numel() * p.element_size(), ALIGN)
    arena = mmap.mmap(-1, _aligned(size, HUGE_PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = thp_enabled() and hasattr(mmap, "MADV_HUGEPAGE")
    if huge:
        arena.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copies below fault the pages in
    data = torch.frombuffer(arena, dtype=torch.uint8)
    for p, offset in zip(tensors, offsets, strict=True):
        view = data[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view  # the Parameter object stays: modules that share it (a tied LM head) see the move
    return HugePageArena(len(tensors), size, huge)
