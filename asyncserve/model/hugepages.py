"""CPU memory for the buffers every decode step streams through, on 2 MiB pages where Linux allows.

A decode step reads all packed weights (270 MB for SmolLM2 in bf16) and the KV rows of every
sequence from DRAM. On 4 KiB pages that is a TLB miss and a page walk every 4 KiB, and the
hardware prefetchers stop at each page's end; transparent huge pages remove both. Most systems
run THP in "madvise" mode, so the memory has to ask: ``empty`` maps a fresh, 2 MiB-aligned region
and advises it (MADV_HUGEPAGE) before anything touches it, so it faults in as huge pages. Weights
of a few MB each come from an ``Arena`` of such regions, so they share huge pages. Measured on the
AMD EPYC of BENCHMARKS.md: GEMM time of a W1 decode step -4%, attention -3%. Where THP is off or
madvise fails, the memory is ordinary pages and nothing else changes. ``ASYNCSERVE_HUGE_PAGES=0``
turns the advice off (to measure without it).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 32 << 20         # an Arena's region size (a larger request gets a region of its own)


def enabled() -> bool:
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("ASYNCSERVE_HUGE_PAGES", "1") != "0")


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A new 1-D CPU tensor of ``numel`` elements, uninitialised, starting on a 2 MiB boundary of a
    fresh anonymous mapping advised for huge pages (plain memory when not ``enabled()``). The
    mapping is its own, not the allocator's: memory the allocator hands out again may have been
    touched already, as 4 KiB pages."""
    if not enabled():
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * dtype.itemsize
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)           # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, size)
    except OSError:          # a kernel without THP: ordinary pages
        pass
    return raw[start:start + nbytes].view(dtype)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): building the weights frees the
    file's tensors as it goes, and glibc keeps such memory resident for reuse, while the weights on huge
    pages live in mappings of their own and never reuse it. No-op without glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Arena:
    """Hands out slices of huge-page regions (``empty``) for tensors of a few MB that live as long as
    the model's weights. A region is freed when the last tensor taken from it is."""

    ALIGN = 64       # bytes: each tensor starts on a cache line

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._region: torch.Tensor | None = None      # uint8 view of the current region
        self._used = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D CPU tensor of ``numel`` elements, uninitialised."""
        nbytes = numel * dtype.itemsize
        used = -(-self._used // self.ALIGN) * self.ALIGN
        if self._region is None or used + nbytes > self._region.numel():
            if nbytes > self.chunk_bytes:            # a region of its own
                return empty(numel, dtype)
            self._region, used = empty(self.chunk_bytes, torch.uint8), 0
        self._used = used + nbytes
        return self._region[used:used + nbytes].view(dtype)
