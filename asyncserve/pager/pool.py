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

Prefix caching: a KV page that holds a full block of tokens can be registered under that block's
key (its tokens, everything before them and the adapter, see Scheduler). Sequences whose prompts
start with the same blocks share such pages (a reference count per KV page); once no sequence
holds one it stays cached, counted as free and reclaimed least recently used first when the free
list runs out.

Page size is the KV block, ``num_layers * 2 * block_size * kv_size`` elements, which must be at least
the longest weight row (the intermediate size) — true for every Llama with block_size >= 1 here.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import torch

from asyncserve.model import hugepages


class PoolExhausted(RuntimeError):
    """Not enough free pages for an allocation; the caller waits, evicts or preempts."""


@dataclass
class PoolCounts:
    total: int
    free: int              # includes the cached pages
    kv: int                # KV pages held by sequences
    adapter: int
    cached: int = 0        # KV pages no sequence holds, kept for the prefix cache


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
        # data: [num_pages, page_numel]; on CPU on huge pages, as a step reads KV rows all over it
        if self.device.type == "cpu":
            self.data = hugepages.empty(num_pages * self.page_numel, dtype).view(num_pages, self.page_numel).zero_()
        else:
            self.data = torch.zeros(num_pages, self.page_numel, dtype=dtype, device=self.device)
        # LIFO free list: recently freed pages are reused first (warm in cache)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._kind = ["free"] * num_pages          # free | kv | adapter | cached
        self._kv_pages = 0
        self._adapter_pages = 0
        self._refs = [0] * num_pages                # KV pages: how many sequences hold each
        self._block_of: dict[int, Hashable] = {}    # page -> key of the cached block it holds
        self._page_of: dict[Hashable, int] = {}     # key -> page
        self._cached: OrderedDict[int, None] = OrderedDict()   # held by no sequence, LRU first

    @classmethod
    def page_bytes(cls, num_layers: int, block_size: int, kv_size: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * kv_size * dtype.itemsize

    # ---- allocation -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones and cached ones."""
        return len(self._free) + len(self._cached)

    def allocate(self, n: int, kind: str) -> list[int]:
        """Take ``n`` pages for ``kind`` ("kv" or "adapter"); all or nothing. Free pages go first,
        then the least recently used cached blocks are dropped."""
        if n > self.num_free:
            raise PoolExhausted(f"need {n} pages, {self.num_free} free")
        pages = [self._free.pop() if self._free else self._uncache() for _ in range(n)]
        for p in pages:
            self._kind[p] = kind
            self._refs[p] = 1 if kind == "kv" else 0
        self._count(kind, n)
        return pages

    def reserve(self) -> int:
        """Take one page for good, outside the KV and adapter counts (the CUDA graphs' padding rows
        write their KV there)."""
        page = self.allocate(1, "kv")[0]
        self._kind[page] = "reserved"
        self._count("kv", -1)
        return page

    def release(self, pages: list[int]) -> None:
        """Give pages back; a KV page another sequence still holds stays, one holding a cached block
        becomes cached."""
        for p in pages:
            kind = self._kind[p]
            if kind in ("free", "cached"):
                raise RuntimeError(f"page {p} released twice")
            if kind == "kv":
                self._refs[p] -= 1
                if self._refs[p] > 0:
                    continue
            self._count(kind, -1)
            if p in self._block_of:
                self._kind[p] = "cached"
                self._cached[p] = None
            else:
                self._kind[p] = "free"
                self._free.append(p)

    # ---- prefix cache -----------------------------------------------------------------------
    def cached_block(self, key: Hashable) -> int | None:
        """The page holding the block registered under ``key``, if any."""
        return self._page_of.get(key)

    def share(self, page: int) -> None:
        """One more sequence holds this KV page (a prefix-cache hit)."""
        if self._kind[page] == "cached":
            del self._cached[page]
            self._kind[page] = "kv"
            self._count("kv", 1)
        elif self._kind[page] != "kv":
            raise RuntimeError(f"page {page} holds no KV block")
        self._refs[page] += 1

    def register_block(self, page: int, key: Hashable) -> None:
        """Record that KV page ``page`` holds the full block ``key`` (the first page to do so keeps it)."""
        if key not in self._page_of and page not in self._block_of:
            self._page_of[key] = page
            self._block_of[page] = key

    def _uncache(self) -> int:
        page, _ = self._cached.popitem(last=False)
        del self._page_of[self._block_of.pop(page)]
        return page

    def _count(self, kind: str, n: int) -> None:
        if kind == "kv":
            self._kv_pages += n
        elif kind == "adapter":
            self._adapter_pages += n
        else:
            raise ValueError(f"unknown page kind {kind!r}")

    def counts(self) -> PoolCounts:
        return PoolCounts(self.num_pages, self.num_free, self._kv_pages, self._adapter_pages, len(self._cached))

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


def page_spans(placements: list[tuple[int, int]], row_lengths: list[int]) -> list[tuple[int, int, int, int]]:
    """plan_row_packing's placements as one span per page: (page index, offset in the page, first
    element of its rows laid end to end in packing order, elements). A page's rows follow one another
    in both, so each page's are one copy."""
    spans: list[tuple[int, int, int, int]] = []
    first = 0
    for (page, offset), length in zip(placements, row_lengths):
        if spans and spans[-1][0] == page:
            p, o, f, n = spans[-1]
            spans[-1] = (p, o, f, n + length)
        else:
            spans.append((page, offset, first, length))
        first += length
    return spans
