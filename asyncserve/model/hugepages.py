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
import logging
import os
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
# an Arena's region size (a larger request gets a region of its own); at 32 MiB and more, glibc
# maps every allocation afresh (its mmap threshold tops out there), so the pages are untouched
CHUNK_BYTES = 32 << 20

_libc = None


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("ASYNCSERVE_HUGE_PAGES", "1") != "0"


def _advise(address: int, nbytes: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if _libc.madvise(address, nbytes, MADV_HUGEPAGE) == 0:
        return True
    log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return False


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A new 1-D CPU tensor of ``numel`` elements, uninitialised, starting on a 2 MiB boundary and
    advised for huge pages (plain pages when not ``enabled()``)."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if not enabled():
        return torch.empty(numel, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # allocations this large are fresh anonymous mappings, untouched until written
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    region = raw[start:start + size]
    _advise(region.data_ptr(), size)
    return region[:nbytes].view(dtype)


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
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        used = -(-self._used // self.ALIGN) * self.ALIGN
        if self._region is None or used + nbytes > self._region.numel():
            if nbytes > self.chunk_bytes:            # a region of its own
                return empty(numel, dtype)
            self._region, used = empty(self.chunk_bytes, torch.uint8), 0
        self._used = used + nbytes
        return self._region[used:used + nbytes].view(dtype)
