"""Adapter residency: host adapters paged into the unified pool on demand, evicted LRU when idle.

An adapter is "in use" while running sequences hold a reference; only idle adapters are evicted,
least recently used first, when the pool needs pages (for KV or for another adapter).

Paging in is two halves: the scheduler (on the event loop) allocates pages and records where each
row goes; the copy of the rows into the pages waits in ``pending`` until the stepper's thread runs
``write_pending`` at the start of the next step. All tensor work thus stays in the one thread that
runs torch (BENCHMARKS.md: a second OpenMP thread team slows every step), and the event loop never
spends time copying weights.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from asyncserve.lora.batch import PROJECTIONS, DeviceAdapter
from asyncserve.model.config import ModelConfig
from asyncserve.pager.adapters import HostAdapter
from asyncserve.pager.pool import PagedPool, PoolExhausted, plan_row_packing


class AdapterPager:
    def __init__(self, pool: PagedPool, config: ModelConfig):
        self.pool = pool
        self.config = config
        self.host: dict[str, HostAdapter] = {}
        self._footprints: dict[str, int] = {}       # pages each host adapter takes when resident
        self._registrations: dict[str, int] = {}    # name -> which load of a name this is (see registration)
        self._registered_total = 0
        self.resident: OrderedDict[str, DeviceAdapter] = OrderedDict()   # LRU order: oldest first
        self.refs: dict[str, int] = {}
        self.loads_total = 0
        self.pending: dict[str, tuple[HostAdapter, list[int], list[tuple[int, int]]]] = {}
        self._generation = 0

    # ---- host tier ---------------------------------------------------------------------------
    def register(self, adapter: HostAdapter) -> None:
        if adapter.name in self.host:
            raise ValueError(f"adapter {adapter.name!r} is already loaded")
        needed, _ = plan_row_packing(adapter.row_lengths(self.config), self.pool.page_numel)
        if needed > self.pool.num_pages:
            raise ValueError(f"adapter {adapter.name!r} needs {needed} pages, the pool has {self.pool.num_pages}")
        self.host[adapter.name] = adapter
        self._footprints[adapter.name] = needed
        self._registered_total += 1
        self._registrations[adapter.name] = self._registered_total

    def unregister(self, name: str) -> None:
        """Forget an adapter; its pages go back once no running sequence uses it."""
        if name not in self.host:
            raise KeyError(name)
        del self.host[name]
        del self._footprints[name]
        del self._registrations[name]
        if self.refs.get(name, 0) == 0:
            self._evict(name)

    # ---- device tier -------------------------------------------------------------------------
    def footprint(self, name: str) -> int:
        """Pages the adapter occupies when resident (asked for every request it serves)."""
        return self._footprints[name]

    def registration(self, name: str) -> int | None:
        """Tells loads of one name apart: an adapter unloaded and loaded again (maybe other weights
        under the same name) gets a new number, so nothing computed with the old one is reused.
        None once unloaded."""
        return self._registrations.get(name)

    def pages_needed(self, name: str) -> int:
        """Pages paging the adapter in would take now (0 when already resident)."""
        return 0 if name in self.resident else self.footprint(name)

    def is_resident(self, name: str) -> bool:
        return name in self.resident

    def idle_pages(self) -> int:
        return sum(len(a.pages) for n, a in self.resident.items() if self.refs.get(n, 0) == 0)

    def make_room(self, pages: int, keep: frozenset[str] = frozenset()) -> bool:
        """Evict idle adapters (LRU first, sparing ``keep``) until ``pages`` are free."""
        for name in list(self.resident):
            if self.pool.num_free >= pages:
                break
            if self.refs.get(name, 0) == 0 and name not in keep:
                self._evict(name)
        return self.pool.num_free >= pages

    def ensure_resident(self, name: str, keep: frozenset[str] = frozenset()) -> DeviceAdapter | None:
        """Page the adapter in (evicting idle ones if needed); None if the pool cannot fit it now."""
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        adapter = self.host[name]
        needed, placements = plan_row_packing(adapter.row_lengths(self.config), self.pool.page_numel)
        if not self.make_room(needed, keep | {name}):
            return None
        try:
            pages = self.pool.allocate(needed, "adapter")
        except PoolExhausted:
            return None
        device = self._place(adapter, pages, placements)
        self.pending[name] = (adapter, pages, placements)
        self.resident[name] = device
        self.loads_total += 1
        return device

    def acquire(self, name: str) -> DeviceAdapter:
        self.refs[name] = self.refs.get(name, 0) + 1
        self.resident.move_to_end(name)
        return self.resident[name]

    def release(self, name: str) -> None:
        self.refs[name] -= 1
        if self.refs[name] == 0:
            del self.refs[name]
            if name not in self.host:        # unloaded while in use
                self._evict(name)

    def _evict(self, name: str) -> None:
        device = self.resident.pop(name, None)
        if device is not None:
            self.pending.pop(name, None)
            self.pool.release(device.pages)

    def _packed_rows(self, adapter: HostAdapter):
        """(layer, projection, 0 for A / 1 for B^T, j, row) in pool packing order (HostAdapter.row_lengths)."""
        for layer in range(self.config.num_layers):
            for p in range(len(PROJECTIONS)):
                for ab, table in enumerate((adapter.a_rows, adapter.b_rows)):
                    for j in range(adapter.ranks[p]):
                        yield layer, p, ab, j, table[(layer, p)][j]

    def _place(self, adapter: HostAdapter, pages: list[int], placements: list[tuple[int, int]]) -> DeviceAdapter:
        """Record each row's offset in the pool; the rows are copied later by ``write_pending``."""
        L, P, r_max = self.config.num_layers, len(PROJECTIONS), max(adapter.ranks)
        ptr = [[[[0] * r_max for _ in range(P)] for _ in range(L)] for _ in range(2)]   # [A|B][L][P][r]
        for (layer, p, ab, j, _), (page, off) in zip(self._packed_rows(adapter), placements):
            ptr[ab][layer][p][j] = pages[page] * self.pool.page_numel + off
        self._generation += 1
        dev = self.pool.device
        return DeviceAdapter(name=adapter.name, ranks=list(adapter.ranks),
                             a_ptr=torch.tensor(ptr[0], dtype=torch.int64, device=dev),
                             b_ptr=torch.tensor(ptr[1], dtype=torch.int64, device=dev),
                             scaling=adapter.scaling.to(dev), pages=pages, generation=self._generation)

    def write_pending(self) -> None:
        """Copy the rows of adapters paged in since the last call (staged on the host, one copy per page).
        Runs in the stepper's thread before the step that first uses them."""
        pool = self.pool
        for adapter, pages, placements in self.pending.values():
            staging = torch.zeros(len(pages), pool.page_numel, dtype=pool.dtype)
            for (*_, row), (page, off) in zip(self._packed_rows(adapter), placements):
                staging[page, off:off + row.shape[0]] = row
            pool.data[torch.tensor(pages, device=pool.device)] = staging.to(pool.device)
        self.pending.clear()
