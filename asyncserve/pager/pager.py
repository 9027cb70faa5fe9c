"""Adapter residency: host adapters paged into the unified pool on demand, evicted LRU when idle.

Residency is kept per load, not per name: every registration of an adapter gets a new load number
(the prefix cache keys by it too), and a sequence holds the load it was admitted with. So when a
name is unloaded and loaded again with other weights, sequences still running on the old load keep
its pages until they finish (then it is evicted), while new ones page in and use the new weights.

An adapter is "in use" while running sequences hold a reference; only idle adapters are evicted,
least recently used first, when the pool needs pages (for KV or for another adapter).

Paging in is two halves: the event loop (scheduler and prefetch) allocates pages and records where
each row goes; the copy of the rows into the pages waits in ``pending`` until the stepper's thread
runs ``write_pending`` at the start of the next step. All tensor work thus stays in the one thread
that runs torch (BENCHMARKS.md: a second OpenMP thread team slows every step), and the event loop
never spends time copying weights. ``pending`` is the one structure the two threads share, so it is
a queue: the event loop appends, the torch thread pops (both atomic on a deque); everything else
here belongs to the event loop.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

import torch

from asyncserve.model.config import PROJECTIONS, ModelConfig
from asyncserve.pager.adapters import HostAdapter
from asyncserve.pager.pool import PagedPool, PoolExhausted, plan_row_packing


@dataclass
class DeviceAdapter:
    """An adapter resident in the pool: its pages and per-row offsets (built by the pager)."""
    name: str
    ranks: list[int]                 # per projection, PROJECTIONS order; 0 = not targeted
    a_ptr: torch.Tensor              # [L, P, r_max] int64, on the pool's device
    b_ptr: torch.Tensor              # [L, P, r_max] int64
    scaling: torch.Tensor            # [L, P] float32
    pages: list[int]
    generation: int                  # bumps whenever the adapter is (re)paged: keys backend caches

    @property
    def r_max(self) -> int:
        return int(self.a_ptr.shape[-1])



class PageIn(NamedTuple):
    """A copy waiting for the torch thread: the adapter's rows into the pages ``device`` names."""
    load: int
    device: DeviceAdapter
    adapter: HostAdapter
    placements: list[tuple[int, int]]    # per row in packing order: (index into device.pages, offset)


class AdapterPager:
    def __init__(self, pool: PagedPool, config: ModelConfig):
        self.pool = pool
        self.config = config
        self.host: dict[str, HostAdapter] = {}
        self._footprints: dict[str, int] = {}       # pages each host adapter takes when resident
        self._loads: dict[str, int] = {}            # name -> its current load number (see registration)
        self._loads_total = 0
        self._live: set[int] = set()                # the current loads (values of _loads)
        self.resident: OrderedDict[int, DeviceAdapter] = OrderedDict()   # by load; LRU order: oldest first
        self.refs: dict[int, int] = {}                                   # by load: running sequences using it
        self.loads_total = 0                                             # page-ins so far
        self.pending: deque[PageIn] = deque()
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
        self._loads_total += 1
        self._loads[adapter.name] = self._loads_total
        self._live.add(self._loads_total)

    def unregister(self, name: str) -> None:
        """Forget an adapter; its pages go back once no running sequence uses it."""
        if name not in self.host:
            raise KeyError(name)
        del self.host[name]
        del self._footprints[name]
        load = self._loads.pop(name)
        self._live.discard(load)
        if self.refs.get(load, 0) == 0:
            self._evict(load)

    # ---- device tier -------------------------------------------------------------------------
    def footprint(self, name: str) -> int:
        """Pages the adapter occupies when resident (asked for every request it serves)."""
        return self._footprints[name]

    def registration(self, name: str) -> int | None:
        """The name's current load number: an adapter unloaded and loaded again (maybe other weights
        under the same name) gets a new one, so nothing computed with the old load is reused.
        None once unloaded."""
        return self._loads.get(name)

    def pages_needed(self, name: str) -> int:
        """Pages paging the adapter in would take now (0 when already resident)."""
        return 0 if self.is_resident(name) else self.footprint(name)

    def is_resident(self, name: str) -> bool:
        return self._loads.get(name) in self.resident

    def resident_names(self) -> set[str]:
        """Names whose current load is resident."""
        return {name for name, load in self._loads.items() if load in self.resident}

    def idle_pages(self) -> int:
        return sum(len(a.pages) for load, a in self.resident.items() if self.refs.get(load, 0) == 0)

    def make_room(self, pages: int, keep: frozenset[int] = frozenset()) -> bool:
        """Evict idle loads (LRU first, sparing the loads in ``keep``) until ``pages`` are free."""
        for load in list(self.resident):
            if self.pool.num_free >= pages:
                break
            if self.refs.get(load, 0) == 0 and load not in keep:
                self._evict(load)
        return self.pool.num_free >= pages

    def ensure_resident(self, name: str) -> DeviceAdapter | None:
        """Page the name's current load in (evicting idle ones if needed); None if the pool cannot fit it now."""
        load = self._loads[name]
        if load in self.resident:
            self.resident.move_to_end(load)
            return self.resident[load]
        adapter = self.host[name]
        needed, placements = plan_row_packing(adapter.row_lengths(self.config), self.pool.page_numel)
        if not self.make_room(needed, frozenset((load,))):
            return None
        try:
            pages = self.pool.allocate(needed, "adapter")
        except PoolExhausted:
            return None
        device = self._place(adapter, pages, placements)
        self.resident[load] = device
        self.pending.append(PageIn(load, device, adapter, placements))
        self.loads_total += 1
        return device

    def acquire(self, load: int) -> DeviceAdapter:
        """A running sequence holds ``load`` (resident: see ensure_resident) until ``release``."""
        self.refs[load] = self.refs.get(load, 0) + 1
        self.resident.move_to_end(load)
        return self.resident[load]

    def release(self, load: int) -> None:
        self.refs[load] -= 1
        if self.refs[load] == 0:
            del self.refs[load]
            if load not in self._live:        # unloaded (or replaced) while in use
                self._evict(load)

    def _evict(self, load: int) -> None:
        device = self.resident.pop(load, None)
        if device is not None:                          # a copy still pending sees it gone and is dropped
            self.pool.release(device.pages)

    def _packed_rows(self, adapter: HostAdapter):
        """(layer, projection, 0 for A / 1 for B^T, rows [r, length]) in pool packing order
        (HostAdapter.row_lengths)."""
        for layer in range(self.config.num_layers):
            for p in range(len(PROJECTIONS)):
                if adapter.ranks[p]:
                    yield layer, p, 0, adapter.a_rows[(layer, p)]
                    yield layer, p, 1, adapter.b_rows[(layer, p)]

    def _place(self, adapter: HostAdapter, pages: list[int], placements: list[tuple[int, int]]) -> DeviceAdapter:
        """Record each row's offset in the pool; the rows are copied later by ``write_pending``."""
        L, P, r_max = self.config.num_layers, len(PROJECTIONS), max(adapter.ranks)
        ptr = [[[[0] * r_max for _ in range(P)] for _ in range(L)] for _ in range(2)]   # [A|B][L][P][r]
        i = 0
        for layer, p, ab, rows in self._packed_rows(adapter):
            out = ptr[ab][layer][p]
            for j in range(rows.shape[0]):
                page, off = placements[i + j]
                out[j] = pages[page] * self.pool.page_numel + off
            i += rows.shape[0]
        self._generation += 1
        dev = self.pool.device
        return DeviceAdapter(name=adapter.name, ranks=list(adapter.ranks),
                             a_ptr=torch.tensor(ptr[0], dtype=torch.int64, device=dev),
                             b_ptr=torch.tensor(ptr[1], dtype=torch.int64, device=dev),
                             scaling=adapter.scaling.to(dev), pages=pages, generation=self._generation)

    def write_pending(self) -> None:
        """Copy the rows of adapters paged in since the last call. Runs in the stepper's thread before
        the step that first uses them; the event loop may append meanwhile."""
        pool = self.pool
        while True:
            try:
                load, device, adapter, placements = self.pending.popleft()
            except IndexError:
                return
            if self.resident.get(load) is not device:    # evicted before its copy: its pages may hold KV now
                continue
            if pool.device.type == "cpu":                 # straight into the pages
                target, page_of = pool.data, device.pages
            else:                                         # staged on the host: one copy to the device
                target, page_of = torch.empty(len(device.pages), pool.page_numel, dtype=pool.dtype), None
            i = 0
            for *_, rows in self._packed_rows(adapter):
                r, length = rows.shape
                j = 0
                while j < r:                              # rows of one matrix that share a page are one run
                    page, off = placements[i + j]
                    k = j + 1
                    while k < r and placements[i + k][0] == page:
                        k += 1
                    target[page_of[page] if page_of else page, off:off + (k - j) * length] = rows[j:k].reshape(-1)
                    j = k
                i += r
            if page_of is None:
                pool.data[torch.tensor(device.pages, device=pool.device)] = target.to(pool.device)
