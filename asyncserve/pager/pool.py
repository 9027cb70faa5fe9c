"""The unified paged pool (S-LoRA §5.1): one preallocated device buffer shared by KV cache and adapters.

Layout
------
``pool.data`` is one tensor ``[num_pages, page_numel]`` in the model dtype. Every page comes from one
free list and is used either as a KV block or as adapter-weight storage, so memory flows between
the two as the load changes.

* KV page: ``block_size`` tokens of K and V for every layer of one sequence,
  viewed as ``[2 (K, V), num_layers, block_size, num_kv_heads, head_dim]``. A sequence owns a block
  table (list of page ids); token ``t`` of it lives in page ``table[t // block_size]`` at slot
  ``t % block_size`` — one table serves all layers, as in vLLM. K (and V) of one layer is one
  contiguous ``[block_size, kv_size]`` run, so gathering a sequence's pages for a layer is one
  ``index_select`` that yields ``[pages * block_size, kv_heads, head_dim]`` without re-layout.
* Adapter pages: the rows of an adapter's matrices, packed in order (layer, projection, A rows then
  B^T rows), each row ``in_features`` (A) or ``out_features`` (B^T) contiguous elements. A row never
  straddles a page; a row that does not fit in what is left of a page starts the next page. Every
  row's flat element offset into ``pool.data.view(-1)`` is recorded (S-LoRA's fine-grained gather),
  so kernels read weights in place, non-contiguously, with a different rank per adapter. Waste is
  under one page per adapter plus the row tails.

Page size is the KV block, ``num_layers * 2 * block_size * kv_size`` elements, which must be at least
the longest weight row (the intermediate size) — true for every Llama with block_size >= 1 here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class PoolExhausted(RuntimeError):
    """Not enough free pages for an allocation; the caller waits, evicts or preempts."""


@dataclass
class PoolCounts:
    total: int
    free: int
    kv: int
    adapter: int


class PagedPool:
    def __init__(self, num_pages: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        if num_pages < 2:
            raise ValueError(f"the pool needs at least 2 pages, got {num_pages}; raise --pool-mem")
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_numel = num_layers * 2 * block_size * num_kv_heads * head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # data: [num_pages, page_numel]
        self.data = torch.zeros(num_pages, self.page_numel, dtype=dtype, device=self.device)
        # LIFO free list: recently freed pages are reused first (warm in cache)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._kind = ["free"] * num_pages
        self._kv_pages = 0
        self._adapter_pages = 0

    @classmethod
    def page_bytes(cls, num_layers: int, block_size: int, kv_size: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * kv_size * torch.empty((), dtype=dtype).element_size()

    # ---- allocation -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, kind: str) -> list[int]:
        """Take ``n`` pages for ``kind`` ("kv" or "adapter"); all or nothing."""
        if n > len(self._free):
            raise PoolExhausted(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._kind[p] = kind
        self._count(kind, n)
        return pages

    def release(self, pages: list[int]) -> None:
        for p in pages:
            kind = self._kind[p]
            if kind == "free":
                raise RuntimeError(f"page {p} released twice")
            self._kind[p] = "free"
            self._count(kind, -1)
            self._free.append(p)

    def _count(self, kind: str, n: int) -> None:
        if kind == "kv":
            self._kv_pages += n
        elif kind == "adapter":
            self._adapter_pages += n
        else:
            raise ValueError(f"unknown page kind {kind!r}")

    def counts(self) -> PoolCounts:
        return PoolCounts(self.num_pages, len(self._free), self._kv_pages, self._adapter_pages)

    # ---- views ------------------------------------------------------------------------------
    def kv_view(self) -> torch.Tensor:
        # [num_pages, 2, num_layers, block_size, num_kv_heads * head_dim]
        return self.data.view(self.num_pages, 2, self.num_layers, self.block_size,
                              self.num_kv_heads * self.head_dim)

    @property
    def flat(self) -> torch.Tensor:
        return self.data.view(-1)

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass
class RowPlacement:
    """Where packed rows landed: the pages used and each row's flat element offset."""
    pages: list[int]
    row_offsets: list[int]


def plan_row_packing(row_lengths: list[int], page_numel: int) -> tuple[int, list[tuple[int, int]]]:
    """Pack rows in order into pages without straddling; returns (pages needed, [(page_index, offset)])."""
    placements = []
    page, used = 0, 0
    for length in row_lengths:
        if length > page_numel:
            raise ValueError(f"a weight row of {length} elements exceeds the page size {page_numel}")
        if used + length > page_numel:
            page, used = page + 1, 0
        placements.append((page, used))
        used += length
    return (page + 1 if row_lengths else 0), placements
