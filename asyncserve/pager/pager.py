"""Adapter residency in three tiers: disk -> host -> device (S-LoRA §5, CaraServe).

* Disk: every registered adapter (``registry``): its folder, ranks and sizes, read from its config and
  safetensors header at registration; no weights. Thousands cost little.
* Host: an LRU of adapters' rows bounded in bytes, in a POSIX shared-memory arena (ipc.HostArena),
  so CPU LoRA workers read the very rows the pager pages in (``host_handle``). An adapter is read
  from disk into it when a request needs it; the least recently used adapters that no queued or
  running request needs, and that are not pinned, make room, and fall back to the disk tier.
* Device: the unified pool. Host adapters are paged into it on demand and evicted LRU when idle;
  a pinned adapter never is. The tiers are inclusive: an adapter on the device keeps its host copy.

Residency is kept per load, not per name: every registration of an adapter gets a new load number
(the prefix cache keys by it too), and a sequence holds the load it was admitted with. So when a
name is unloaded and loaded again with other weights, sequences still running on the old load keep
its pages, and its host block, until they finish (then both go), while new ones use the new weights.

An adapter is "in use" on the device while running sequences hold a reference; only idle adapters
are evicted, least recently used first, when the pool needs pages (for KV or for another adapter).

Paging in is two halves: the event loop (scheduler and prefetch) allocates pages and records where
each row goes; the copy of the rows into the pages waits in ``pending`` until the stepper's thread
runs ``write_pending`` at the start of the next step. All tensor work thus stays in the one thread
that runs torch (BENCHMARKS.md: a second OpenMP thread team slows every step), and the event loop
never spends time copying weights. ``pending`` is the one structure the two threads share, so it is
a queue: the event loop appends, the torch thread pops (both atomic on a deque); everything else
here belongs to the event loop. Storing into the host tier is split the same way: the event loop
evicts and allocates the arena block (``host_allocate``), the torch thread copies (``host_write``).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from asyncserve.model.config import PROJECTIONS, ModelConfig
from asyncserve.model.shard import Shard, shard_config
from asyncserve.pager.adapters import AdapterError, AdapterInfo, HostAdapter, VocabRows, row_lengths
from asyncserve.pager.pool import PagedPool, PoolExhausted, page_spans, plan_row_packing
from ipc import AdapterHandle, HostArena, block_bytes


@dataclass
class DeviceAdapter:
    """An adapter resident in the pool: its pages and per-row offsets (built by the pager)."""
    name: str
    ranks: list[int]                 # per projection, ModelConfig.lora_projections order; 0 = not targeted
    a_ptr: torch.Tensor              # [L, P, r_max] int64, on the pool's device
    b_ptr: torch.Tensor              # [L, P, r_max] int64
    scaling: torch.Tensor            # [L, P] float32
    pages: list[int]
    generation: int                  # unique per placement, bumped whenever an adapter is (re)paged: keys backend caches
    # host copies for the step tables (from the tensors if not given): a_ptr and b_ptr as one array
    # [2, L, P, r_max], and scaling [L, P] (a CPU tensor); filling a table slot then reads no device memory
    host_ptr: np.ndarray | None = None
    host_scaling: torch.Tensor | None = None
    dora_scale: torch.Tensor | None = None   # DoRA's g [L, all projections' outputs] float32 (lora/dora.py)
    embed: VocabRows | None = None           # LoRA on the embeddings and the head, on the pool's device
    head: VocabRows | None = None
    linear_attn: dict[tuple[int, str], VocabRows] | None = None   # on the linear-attention layers' projections

    def __post_init__(self):
        if self.host_ptr is None:
            self.host_ptr = np.stack([self.a_ptr.cpu().numpy(), self.b_ptr.cpu().numpy()])
        if self.host_scaling is None:
            self.host_scaling = self.scaling.cpu()

    @property
    def r_max(self) -> int:
        return int(self.a_ptr.shape[-1])


@dataclass
class Registration:
    """A registered adapter (the disk tier): what is known without reading its weights."""
    name: str
    path: str
    ranks: list[int]                 # per projection, ModelConfig.lora_projections order; 0 = not targeted
    file_bytes: int                  # its safetensors file
    host_bytes: int                  # its block in the host arena
    footprint: int                   # pool pages it takes on the device
    load: int                        # its load number (see AdapterPager.registration)
    pinned: bool = False             # never evicted from the device (nor, so, from the host)
    vocab: bool = False              # LoRA on the embeddings or the head: never merged
    linear_attn: bool = False        # LoRA on the linear-attention layers' projections: never merged

    @property
    def experts(self) -> bool:
        """LoRA on the routed experts or the router: never merged nor CPU-assisted (they need the routing)."""
        return any(self.ranks[len(PROJECTIONS):])


# rank sets whose row plans are kept (a rank-256 adapter on every projection of SmolLM2: ~10 MB)
ROW_PLANS_KEPT = 32


class RowPlan(NamedTuple):
    """Where an adapter's rows go in the pages it is given, the same for every adapter of its ranks:
    computed once per rank set, so paging in is a few array ops on the event loop. numpy, not torch:
    a torch op on the event loop's thread starts a second OpenMP team, and with more OpenMP threads
    than cores libgomp stops spinning between parallel regions: every step ~20% slower (BENCHMARKS.md)."""
    pages: int                           # pages it takes
    page_index: np.ndarray               # [2 (A, B^T), L, P, r_max] int64: index into its pages
    offset: np.ndarray                   # [2, L, P, r_max] int64: offset in that page
    used: np.ndarray                     # [2, L, P, r_max] bool: j < rank of the projection
    # per page the rows fill: (index into its pages, offset there, first element in the rows laid end
    # to end in packing order, elements): rows never straddle a page, so a page's rows are one copy
    page_spans: list[tuple[int, int, int, int]]


class PageIn(NamedTuple):
    """A copy waiting for the torch thread: the adapter's rows into the pages ``device`` names."""
    load: int
    device: DeviceAdapter
    adapter: HostAdapter
    page_spans: list[tuple[int, int, int, int]]    # RowPlan.page_spans
    since: float                         # perf_counter() when paged in: the copy's end measures the load


def row_plan(ranks: list[int], config: ModelConfig, page_numel: int) -> RowPlan:
    """Where the rows of an adapter of these ranks go in the pages it is given (config: the pool's model,
    a tensor-parallel rank's shard included, whose rows are that shard's)."""
    lengths = row_lengths(ranks, config)
    pages, placements = plan_row_packing(lengths, page_numel)
    L, P, r_max = config.num_layers, len(config.lora_projections()), max(ranks)
    used = np.zeros((2, L, P, r_max), dtype=bool)
    for p, r in enumerate(ranks):
        used[:, :, p, :r] = True
    # packing order (row_lengths): layer, projection, A rows then B^T rows: the order of
    # used.transpose(1, 2, 0, 3)'s True entries
    order = used.transpose(1, 2, 0, 3)
    page_index = np.zeros((L, P, 2, r_max), dtype=np.int64)
    offset = np.zeros((L, P, 2, r_max), dtype=np.int64)
    where = np.asarray(placements, dtype=np.int64).reshape(-1, 2)
    page_index[order], offset[order] = where[:, 0], where[:, 1]
    return RowPlan(pages, page_index.transpose(2, 0, 1, 3), offset.transpose(2, 0, 1, 3), used,
                   page_spans(placements, lengths))


class Unpaged(NamedTuple):
    """What an adapter has beside its rows in pool pages, on the pool's device."""
    dora_scale: torch.Tensor | None
    embed: VocabRows | None
    head: VocabRows | None
    linear_attn: dict[tuple[int, str], VocabRows] | None

    @staticmethod
    def of(adapter: HostAdapter, device: torch.device) -> Unpaged | None:
        parts = (adapter.dora_scale, adapter.embed, adapter.head)
        if all(p is None for p in parts) and adapter.linear_attn is None:
            return None
        linear_attn = None if adapter.linear_attn is None else {
            key: rows.to(device) for key, rows in adapter.linear_attn.items()}
        return Unpaged(*(None if p is None else p.to(device) for p in parts), linear_attn)


def place(name: str, ranks: list[int], scaling: torch.Tensor, pages: list[int], plan: RowPlan, pool: PagedPool,
          generation: int, unpaged: Unpaged | None = None) -> DeviceAdapter:
    """The DeviceAdapter of rows placed by ``plan`` in ``pages``: each row's offset in the pool (0 past a
    projection's rank)."""
    page_start = np.asarray(pages, dtype=np.int64) * pool.page_numel
    ptr = np.where(plan.used, page_start[plan.page_index] + plan.offset, 0)     # [2, L, P, r_max]
    dev = pool.device
    return DeviceAdapter(name=name, ranks=list(ranks), a_ptr=torch.from_numpy(np.ascontiguousarray(ptr[0])).to(dev),
                         b_ptr=torch.from_numpy(np.ascontiguousarray(ptr[1])).to(dev), scaling=scaling.to(dev),
                         pages=pages, generation=generation, host_ptr=ptr, host_scaling=scaling,
                         **(unpaged._asdict() if unpaged is not None else {}))


def shard_rows(a_rows: dict, b_rows: dict, ranks: list[int], config: ModelConfig, shard: Shard) -> torch.Tensor:
    """A tensor-parallel rank's part of an adapter's rows, end to end in pool packing order (S-LoRA §6):
    config is the rank's shard, whose projection shapes say how long its rows are. A column-parallel
    projection keeps A whole and its B^T rows' slice of the outputs; a row-parallel one its A rows' slice
    of the inputs and B^T whole."""
    shapes = config.projection_shapes()
    parts = []
    for layer in range(config.num_layers):
        for p, proj in enumerate(config.lora_projections()):
            if not ranks[p]:
                continue
            fan_in, fan_out = shapes[proj]
            for rows, width in ((a_rows[(layer, p)], fan_in), (b_rows[(layer, p)], fan_out)):
                part = rows if rows.shape[1] == width else rows[:, shard.rank * width:(shard.rank + 1) * width]
                parts.append(part.reshape(-1))
    return torch.cat(parts)


def copy_rows(pool: PagedPool, pages: list[int], spans: list[tuple[int, int, int, int]], packed: torch.Tensor) -> None:
    """The rows end to end into their pages: one copy per page (RowPlan.page_spans)."""
    for page, offset, first, numel in spans:
        pool.data[pages[page], offset:offset + numel] = packed[first:first + numel]


class AdapterPager:
    def __init__(self, pool: PagedPool, config: ModelConfig, dtype: torch.dtype, host_bytes: int,
                 shard: Shard = Shard(0, 1)):
        self.pool = pool
        self.config = config
        # tensor parallelism: the pool holds this rank's shard of each adapter (the host tier whole adapters)
        self.shard = shard
        self.pool_config = shard_config(config, shard.world)
        self.dtype = dtype
        self.registry: dict[str, Registration] = {}                    # the disk tier: every adapter
        self._loads_total = 0
        self._live: set[int] = set()                                     # the current loads
        self._row_plans: OrderedDict[tuple[int, ...], RowPlan] = OrderedDict()   # by ranks, the most recent last
        # host tier: name -> HostAdapter viewing its arena block, LRU order (oldest first); blocks by load
        self.arena = HostArena(host_bytes)
        self.host_capacity = self.arena.allocator.free_bytes         # bytes for blocks, past the directory
        self.host: OrderedDict[str, HostAdapter] = OrderedDict()
        self._blocks: dict[int, AdapterHandle] = {}
        self._ranks: dict[int, list[int]] = {}                           # by load, until its block goes
        self._unpaged: dict[int, Unpaged] = {}        # by load while in the host tier: what is not in pool pages
        # device tier
        self.resident: OrderedDict[int, DeviceAdapter] = OrderedDict()   # by load; LRU order: oldest first
        self.refs: dict[int, int] = {}                                   # by load: running sequences using it
        self.loads_total = 0                                             # page-ins so far
        self.device_hits: dict[str, int] = {}                            # admissions that found it resident
        self.pending: deque[PageIn] = deque()
        # (tier loaded from: "disk" | "host", name, seconds), appended by either thread, drained by metrics
        self.load_times: deque[tuple[str, str, float]] = deque(maxlen=4096)
        self.mean_load_seconds: dict[str, float] = {}                    # by tier: recent loads, weighted
        self._generation = 0

    def record_load(self, tier: str, name: str, seconds: float) -> None:
        """An adapter load from `tier` ("disk" | "host") took `seconds`: for metrics and load estimates."""
        self.load_times.append((tier, name, seconds))
        mean = self.mean_load_seconds.get(tier, seconds)
        self.mean_load_seconds[tier] = mean + (seconds - mean) / 8

    # ---- disk tier ---------------------------------------------------------------------------
    def register(self, info: AdapterInfo, pinned: bool = False) -> Registration:
        """Register an adapter on the disk tier (its weights are read when first needed)."""
        if info.name in self.registry:
            raise AdapterError(f"adapter {info.name!r} is already loaded")
        footprint = self._row_plan(info.ranks).pages
        if footprint > self.pool.num_pages:
            raise AdapterError(f"adapter {info.name!r} needs {footprint} pages, the pool has {self.pool.num_pages}")
        shapes = self.config.projection_shapes()
        projections = self.config.lora_projections()
        host_bytes = block_bytes(self.config.num_layers, len(projections), info.ranks,
                                 [shapes[p] for p in projections], self.dtype)
        if host_bytes > self.host_capacity:
            raise AdapterError(f"adapter {info.name!r} takes {host_bytes / 2**20:.1f} MiB in host memory, more than "
                               f"the host tier holds ({self.arena.capacity / 2**20:.1f} MiB); raise --host-adapter-mem")
        self._loads_total += 1
        self._live.add(self._loads_total)
        reg = Registration(info.name, info.path, list(info.ranks), info.file_bytes, host_bytes, footprint,
                           self._loads_total, pinned, info.vocab, info.linear_attn)
        self.registry[info.name] = reg
        self._ranks[reg.load] = reg.ranks
        return reg

    def registry_version(self) -> tuple[int, int]:
        """(registrations ever, registered now): changes whenever one is registered or unregistered."""
        return self._loads_total, len(self.registry)

    def add(self, adapter: HostAdapter, pinned: bool = False) -> None:
        """Register an adapter already built in memory and store it in the host tier, in the calling
        thread (offline, start-up and tests; the server splits this across its threads)."""
        reg = self.register(adapter.info(adapter.nbytes), pinned)
        handle = None
        try:
            if not self.host_room(adapter.name, frozenset()):
                raise AdapterError(f"adapter {adapter.name!r} does not fit in the host tier beside the adapters "
                                   "in use; raise --host-adapter-mem")
            handle = self.host_allocate(adapter.name)
            view = self.host_write(handle, adapter)
        except BaseException:
            if handle is not None:
                self.host_abandon(handle)
            self.unregister(adapter.name)
            raise
        self.host_admit(adapter.name, reg.load, handle, view)

    def unregister(self, name: str) -> None:
        """Forget an adapter; its pages and host block go once no running sequence uses them."""
        reg = self.registry.pop(name)
        self.device_hits.pop(name, None)
        self._live.discard(reg.load)
        self.host.pop(name, None)
        if self.refs.get(reg.load, 0) == 0:
            self._evict(reg.load)
            self._release_block(reg.load)

    def tier(self, name: str) -> str:
        """The fastest tier holding the name's current load: "device", "host" or "disk"."""
        if self.is_resident(name):
            return "device"
        return "host" if name in self.host else "disk"

    def _row_plan(self, ranks: list[int]) -> RowPlan:
        key = tuple(ranks)
        if key in self._row_plans:
            self._row_plans.move_to_end(key)
            return self._row_plans[key]
        plan = self._row_plans[key] = row_plan(ranks, self.pool_config, self.pool.page_numel)
        if len(self._row_plans) > ROW_PLANS_KEPT:
            self._row_plans.popitem(last=False)
        return plan

    # ---- host tier ---------------------------------------------------------------------------
    def host_room(self, name: str, in_use: frozenset[str] | set[str]) -> bool:
        """Make room in the host arena for the name's block, evicting least recently used host adapters
        that are not in ``in_use`` (names queued or running requests need), not pinned and not held by
        a running sequence; False if it does not fit now. AdapterError if it never can (pinned ones
        fill the tier)."""
        need = self.registry[name].host_bytes
        if self.arena.fits(need):
            return True
        pinned = sum(self.registry[n].host_bytes for n in self.host if self.registry[n].pinned)
        if pinned + need > self.host_capacity:
            raise AdapterError(f"adapter {name!r} does not fit in the host tier beside the pinned adapters; "
                               "raise --host-adapter-mem")
        for victim in list(self.host):
            reg = self.registry[victim]
            if victim in in_use or reg.pinned or self.refs.get(reg.load, 0):
                continue
            self._evict(reg.load)                   # inclusive tiers: its device copy goes too
            del self.host[victim]
            self._release_block(reg.load)
            if self.arena.fits(need):
                return True
        return False

    def host_allocate(self, name: str) -> AdapterHandle:
        """The arena block for the name's rows (after host_room); the torch thread fills it."""
        reg = self.registry[name]
        shapes = self.config.projection_shapes()
        return self.arena.allocate(self.config.num_layers, reg.ranks, [shapes[p] for p in self.config.lora_projections()],
                                   self.dtype)

    def host_write(self, handle: AdapterHandle, adapter: HostAdapter) -> HostAdapter:
        """Copy a built adapter into its block (torch thread); returns the HostAdapter viewing the arena."""
        self.arena.write(handle, adapter.ranks, adapter.scaling, adapter.a_rows, adapter.b_rows)
        view = self.arena.view(handle)
        # the rows from the arena, all it keeps beside them (DoRA, vocabulary, linear attention) as built
        return replace(adapter, ranks=list(adapter.ranks), a_rows=view.a_rows, b_rows=view.b_rows)

    def host_admit(self, name: str, load: int, handle: AdapterHandle, adapter: HostAdapter) -> bool:
        """The written block joins the host tier, unless the name was unloaded (or reloaded) meanwhile:
        then the block is freed and False returned."""
        reg = self.registry.get(name)
        if reg is None or reg.load != load:
            self.arena.release(handle)
            return False
        self._blocks[load] = handle
        self.host[name] = adapter
        unpaged = Unpaged.of(adapter, self.pool.device)
        if unpaged is not None:
            self._unpaged[load] = unpaged
        return True

    def host_abandon(self, handle: AdapterHandle) -> None:
        """Free an allocated block that will not be admitted (its read, build or write failed)."""
        self.arena.release(handle)

    def host_handle(self, name: str) -> AdapterHandle | None:
        """The ipc arena handle of the name's host copy (what CPU LoRA workers read); None on disk only."""
        reg = self.registry.get(name)
        return self._blocks.get(reg.load) if reg is not None and name in self.host else None

    def load_ranks(self, load: int) -> list[int]:
        """The ranks of a load (ModelConfig.lora_projections order), also after its name was unloaded or reloaded."""
        return self._ranks[load]

    def load_unpaged(self, load: int) -> Unpaged | None:
        """A load's DoRA scale and vocabulary LoRA on the pool's device while its host block lives, for its
        CPU-assisted rows (None: it has neither)."""
        return self._unpaged.get(load)

    def _release_block(self, load: int) -> None:
        if load not in self._live:
            self._ranks.pop(load, None)
        self._unpaged.pop(load, None)
        handle = self._blocks.pop(load, None)
        if handle is not None:
            self.arena.release(handle)

    def close(self) -> None:
        """Unlink the host arena (at shutdown)."""
        self.host.clear()
        self._blocks.clear()
        self.arena.close()

    # ---- device tier -------------------------------------------------------------------------
    def footprint(self, name: str) -> int:
        """Pages the adapter occupies when resident (asked for every request it serves)."""
        return self.registry[name].footprint

    def registration(self, name: str) -> int | None:
        """The name's current load number: an adapter unloaded and loaded again (maybe other weights
        under the same name) gets a new one, so nothing computed with the old load is reused.
        None once unloaded."""
        reg = self.registry.get(name)
        return reg.load if reg is not None else None

    def pages_needed(self, name: str) -> int:
        """Pages paging the adapter in would take now (0 when already resident)."""
        return 0 if self.is_resident(name) else self.footprint(name)

    def is_resident(self, name: str) -> bool:
        reg = self.registry.get(name)
        return reg is not None and reg.load in self.resident

    def resident_names(self) -> set[str]:
        """Names whose current load is resident."""
        return {name for name, reg in self.registry.items() if reg.load in self.resident}

    def idle_pages(self) -> int:
        return sum(len(a.pages) for load, a in self.resident.items() if self.refs.get(load, 0) == 0
                   and not self._pinned(a.name, load))

    def _pinned(self, name: str, load: int) -> bool:
        reg = self.registry.get(name)
        return reg is not None and reg.pinned and reg.load == load

    def make_room(self, pages: int, keep: frozenset[int] = frozenset()) -> bool:
        """Evict idle, unpinned loads (LRU first, sparing the loads in ``keep``) until ``pages`` are free."""
        for load in list(self.resident):
            if self.pool.num_free >= pages:
                break
            if self.refs.get(load, 0) == 0 and load not in keep and not self._pinned(self.resident[load].name, load):
                self._evict(load)
        return self.pool.num_free >= pages

    def ensure_resident(self, name: str, admission: bool = True) -> DeviceAdapter | None:
        """Page the name's current load in (evicting idle ones if needed); None if the pool cannot fit it
        now. The name must be on the host tier. ``admission``: a request is being admitted (counted as
        a device-tier hit when resident), not a prefetch."""
        load = self.registry[name].load
        if load in self.resident:
            self.resident.move_to_end(load)
            self.host.move_to_end(name)
            if admission:
                self.device_hits[name] = self.device_hits.get(name, 0) + 1
            return self.resident[load]
        adapter = self.host[name]
        self.host.move_to_end(name)
        plan = self._row_plan(adapter.ranks)
        if not self.make_room(plan.pages, frozenset((load,))):
            return None
        try:
            pages = self.pool.allocate(plan.pages, "adapter")
        except PoolExhausted:
            return None
        device = self._place(adapter, pages, plan, self._unpaged.get(load))
        self.resident[load] = device
        self.pending.append(PageIn(load, device, adapter, plan.page_spans, time.perf_counter()))
        self.loads_total += 1
        return device

    def pin(self, name: str) -> None:
        """Keep the name on the device for good (it must be on the host tier); AdapterError if the pool
        cannot take it now."""
        if self.ensure_resident(name, admission=False) is None:
            raise AdapterError(f"adapter {name!r} cannot be pinned: the pool has no room for its "
                               f"{self.footprint(name)} pages now")
        self.registry[name].pinned = True

    def acquire(self, load: int) -> DeviceAdapter:
        """A running sequence holds ``load`` (resident: see ensure_resident) until ``release``."""
        self.refs[load] = self.refs.get(load, 0) + 1
        self.resident.move_to_end(load)
        return self.resident[load]

    def hold(self, load: int) -> None:
        """A running sequence holds ``load`` without it being resident (CPU-assisted): its host block
        stays, and it is never evicted while held, like an acquired one."""
        self.refs[load] = self.refs.get(load, 0) + 1

    def host_block(self, load: int) -> AdapterHandle | None:
        """The arena handle of a load's host copy (held loads keep theirs); None when it has none."""
        return self._blocks.get(load)

    def release(self, load: int) -> None:
        self.refs[load] -= 1
        if self.refs[load] == 0:
            del self.refs[load]
            if load not in self._live:        # unloaded (or replaced) while in use
                self._evict(load)
                self._release_block(load)

    def _evict(self, load: int) -> None:
        device = self.resident.pop(load, None)
        if device is not None:                          # a copy still pending sees it gone and is dropped
            self.pool.release(device.pages)

    def _rows_end_to_end(self, load: int, adapter: HostAdapter) -> torch.Tensor:
        """The adapter's rows in pool packing order, flat: a view of its host block, whose rows lie in
        that order (a copy where the arena's alignment padded them apart, or the block is gone)."""
        handle = self._blocks.get(load)
        rows = self.arena.rows(handle) if handle is not None else None
        if rows is None:
            rows = torch.cat([t.reshape(-1) for *_, t in self._packed_rows(adapter)])
        return rows

    def _packed_rows(self, adapter: HostAdapter):
        """(layer, projection, 0 for A / 1 for B^T, rows [r, length]) in pool packing order
        (HostAdapter.row_lengths)."""
        for layer in range(self.config.num_layers):
            for p in range(len(adapter.ranks)):
                if adapter.ranks[p]:
                    yield layer, p, 0, adapter.a_rows[(layer, p)]
                    yield layer, p, 1, adapter.b_rows[(layer, p)]

    def _place(self, adapter: HostAdapter, pages: list[int], plan: RowPlan, unpaged: Unpaged | None) -> DeviceAdapter:
        """Each row's offset in the pool; the rows are copied later by ``write_pending``. unpaged: the load's
        parts beside its rows, already on the pool's device (host_admit)."""
        self._generation += 1
        return place(adapter.name, adapter.ranks, adapter.scaling, pages, plan, self.pool, self._generation, unpaged)

    def write_pending(self, hold: frozenset[int] = frozenset()) -> list[PageIn]:
        """Copy the rows of adapters paged in since the last call. Runs in the stepper's thread before
        the step that first uses them; the event loop may append meanwhile. The copies of the loads in
        ``hold`` (CPU-assisted this step) wait for the next call, off this step's path. Returns the
        page-ins copied (tensor parallelism's other ranks copy their shards of the same)."""
        held, written = [], []
        while True:
            try:
                page_in = self.pending.popleft()
            except IndexError:
                break
            load, device, adapter, spans, since = page_in
            if self.resident.get(load) is not device:    # evicted before its copy: its pages may hold KV now
                continue
            if load in hold:
                held.append(page_in)
                continue
            # the rows end to end (as the host tier holds them, else one copy out of it), then one copy
            # per page straight into it, on a GPU too: staging whole pages in a fresh host tensor first
            # cost ~3 ms per 7B adapter's page-in on an H100 (BENCHMARKS.md, "third lease")
            if not spans:
                packed = None
            elif self.shard.world == 1:
                packed = self._rows_end_to_end(load, adapter)
            else:
                packed = shard_rows(adapter.a_rows, adapter.b_rows, adapter.ranks, self.pool_config, self.shard)
            copy_rows(self.pool, device.pages, spans, packed)
            written.append(page_in)
            self.record_load("host", device.name, time.perf_counter() - since)
        self.pending.extendleft(reversed(held))
        return written
