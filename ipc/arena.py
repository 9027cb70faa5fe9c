"""The host tier's shared arena: adapters' A and B^T rows in one POSIX shared-memory segment.

The server process is the only writer: ``store`` copies an adapter in and returns a handle,
``release`` frees it, ``view`` gives zero-copy tensors of a stored adapter (what the pager copies
into device pages). Workers map the same segment read-only in effect and find an adapter's tensors
through the directory (ipc/layout.py) by the handle's slot and generation; another process that reads
adapters itself (a tensor-parallel rank) attaches an ``ArenaReader``.

The allocator is first-fit over a sorted free list with coalescing, in ALIGN-byte units: an LRU host
tier of bounded size evicts (``release``) until ``store`` fits. ``ArenaFull`` says so when it does
not; ``fits``/``block_bytes`` let the tier plan evictions before copying anything.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from ipc import names
from ipc.layout import ALIGN, DIR_ENTRY, DTYPE_CODE, DTYPES, INDEX_ENTRY, align, element_size


class ArenaFull(MemoryError):
    """No free run of the arena is large enough; release adapters and try again."""


@dataclass(frozen=True)
class AdapterHandle:
    slot: int
    generation: int
    nbytes: int          # bytes the adapter's block takes in the arena


@dataclass
class AdapterView:
    """Zero-copy tensors of a stored adapter, keyed like HostAdapter: (layer, projection)."""
    ranks: list[int]                                  # per projection, 0 = not targeted
    scaling: torch.Tensor                             # [L, P] float32 (a copy)
    a_rows: dict[tuple[int, int], torch.Tensor]       # [r, in]
    b_rows: dict[tuple[int, int], torch.Tensor]       # [r, out] (B transposed)


class Allocator:
    """First-fit allocation of byte ranges in [start, end), in multiples of ALIGN."""

    def __init__(self, start: int, end: int):
        start, end = align(start), end // ALIGN * ALIGN
        self.free_runs: list[tuple[int, int]] = [(start, end - start)] if end > start else []
        self.used: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        size = align(max(nbytes, 1))
        for i, (offset, run) in enumerate(self.free_runs):
            if run >= size:
                if run == size:
                    del self.free_runs[i]
                else:
                    self.free_runs[i] = (offset + size, run - size)
                self.used[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self.used.pop(offset)
        i = bisect.bisect(self.free_runs, (offset, 0))
        # merge with the following and the preceding free run
        if i < len(self.free_runs) and self.free_runs[i][0] == offset + size:
            size += self.free_runs.pop(i)[1]
        if i > 0 and sum(self.free_runs[i - 1]) == offset:
            offset, prev = self.free_runs[i - 1]
            self.free_runs[i - 1] = (offset, prev + size)
        else:
            self.free_runs.insert(i, (offset, size))

    @property
    def free_bytes(self) -> int:
        return sum(run for _, run in self.free_runs)

    @property
    def largest_free(self) -> int:
        return max((run for _, run in self.free_runs), default=0)


def block_bytes(num_layers: int, num_projections: int, ranks: list[int], shapes: list[tuple[int, int]],
                dtype: torch.dtype) -> int:
    """Arena bytes one adapter takes: index table plus every layer's A and B^T of targeted projections.
    shapes[p] = (fan_in, fan_out)."""
    size = align(num_layers * num_projections * INDEX_ENTRY.itemsize)
    per_layer = sum(align(r * fi * element_size(dtype)) + align(r * fo * element_size(dtype))
                    for r, (fi, fo) in zip(ranks, shapes) if r)
    return size + num_layers * per_layer


class ArenaReader:
    """A process's reading view of an arena another process writes (a tensor-parallel rank > 0 and its
    CPU LoRA workers' pool): stored adapters by handle. Attaches, never unlinks."""

    def __init__(self, name: str, slots: int):
        self.name = name
        self.buffer = names.attach_shm(name)
        self.directory = np.frombuffer(self.buffer, dtype=DIR_ENTRY, count=slots)

    def _check(self, handle: AdapterHandle) -> None:
        d = self.directory[handle.slot]
        if not d["live"] or int(d["generation"]) != handle.generation:
            raise KeyError(f"arena slot {handle.slot} generation {handle.generation} is not stored")

    def view(self, handle: AdapterHandle) -> AdapterView:
        """Zero-copy tensors of a stored adapter; KeyError once it was released."""
        self._check(handle)
        return read_adapter(self.buffer, self.directory[handle.slot])

    def close(self) -> None:
        self.directory = None
        names.close_map(self.buffer)


class HostArena(ArenaReader):
    """One shared segment of ``capacity`` bytes holding up to ``slots`` adapters."""

    def __init__(self, capacity: int, slots: int = 4096):
        self.prefix = names.new_prefix()
        self.name = self.prefix + "-arena"
        dir_bytes = align(slots * DIR_ENTRY.itemsize)
        if capacity <= dir_bytes:
            raise ValueError(f"arena capacity {capacity} B leaves no room after its {dir_bytes} B directory")
        self.capacity = capacity
        self.buffer = names.create_shm(self.name, capacity)
        self.directory = np.frombuffer(self.buffer, dtype=DIR_ENTRY, count=slots)
        self.allocator = Allocator(dir_bytes, capacity)
        self._free_slots = list(range(slots - 1, -1, -1))
        self._allocated: dict[int, int] = {}       # slot -> generation of allocated blocks

    # -- writing (server) -----------------------------------------------------------------------

    def fits(self, nbytes: int) -> bool:
        return bool(self._free_slots) and self.allocator.largest_free >= align(nbytes)

    def store(self, ranks: list[int], scaling: torch.Tensor, a_rows: dict[tuple[int, int], torch.Tensor],
              b_rows: dict[tuple[int, int], torch.Tensor]) -> AdapterHandle:
        """Copy an adapter in (HostAdapter's layout: ranks per projection, scaling [L, P], A [r, in] and
        B^T [r, out] per (layer, projection) for every layer of each targeted projection)."""
        num_layers, num_projections = scaling.shape
        dtype = next(iter(a_rows.values())).dtype
        shapes = [(a_rows[(0, p)].shape[1], b_rows[(0, p)].shape[1]) if r else (0, 0) for p, r in enumerate(ranks)]
        handle = self.allocate(num_layers, ranks, shapes, dtype)
        self.write(handle, ranks, scaling, a_rows, b_rows)
        return handle

    def allocate(self, num_layers: int, ranks: list[int], shapes: list[tuple[int, int]],
                 dtype: torch.dtype) -> AdapterHandle:
        """The first half of ``store``: a slot and a block for the adapter, not yet live. A server that
        keeps its bookkeeping in one thread allocates there and lets another thread ``write``."""
        num_projections = len(ranks)
        nbytes = block_bytes(num_layers, num_projections, ranks, shapes, dtype)
        if not self._free_slots:
            raise ArenaFull(f"all {len(self.directory)} arena slots are in use")
        offset = self.allocator.allocate(nbytes)
        if offset is None:
            raise ArenaFull(f"no free run of {nbytes} B in the arena ({self.allocator.free_bytes} B free in "
                            f"runs of at most {self.allocator.largest_free} B)")
        slot = self._free_slots.pop()
        d = self.directory[slot]
        d["offset"], d["nbytes"], d["num_layers"] = offset, nbytes, num_layers
        d["num_projections"], d["dtype"] = num_projections, DTYPE_CODE[dtype]
        handle = AdapterHandle(slot, int(d["generation"]), nbytes)
        self._allocated[slot] = handle.generation
        return handle

    def write(self, handle: AdapterHandle, ranks: list[int], scaling: torch.Tensor,
              a_rows: dict[tuple[int, int], torch.Tensor], b_rows: dict[tuple[int, int], torch.Tensor]) -> None:
        """The second half of ``store``: the tensors into an allocated block, then the slot goes live.
        Touches only that block and slot, so it may run beside the allocating thread."""
        if self._allocated.get(handle.slot) != handle.generation:
            raise KeyError(f"arena slot {handle.slot} generation {handle.generation} is not allocated")
        d = self.directory[handle.slot]
        offset, num_layers, num_projections = int(d["offset"]), int(d["num_layers"]), int(d["num_projections"])
        dtype = DTYPES[int(d["dtype"])]
        index = np.frombuffer(self.buffer, dtype=INDEX_ENTRY, count=num_layers * num_projections, offset=offset)
        index[:] = 0
        cursor = offset + align(index.nbytes)
        for layer in range(num_layers):
            for p, r in enumerate(ranks):
                if not r:
                    continue
                entry = index[layer * num_projections + p]
                a, bt = a_rows[(layer, p)], b_rows[(layer, p)]
                entry["rank"], entry["fan_in"], entry["fan_out"] = r, a.shape[1], bt.shape[1]
                entry["scaling"] = float(scaling[layer, p])
                entry["a_offset"] = cursor
                cursor += self._write(cursor, a, dtype)
                entry["b_offset"] = cursor
                cursor += self._write(cursor, bt, dtype)
        d["live"] = 1      # last: a worker only follows live entries

    def _write(self, offset: int, t: torch.Tensor, dtype: torch.dtype) -> int:
        dst = torch.frombuffer(self.buffer, dtype=dtype, count=t.numel(), offset=offset)
        dst.copy_(t.reshape(-1))
        return align(t.numel() * element_size(dtype))

    def release(self, handle: AdapterHandle) -> None:
        """Free a stored (or allocated, not yet written) adapter's block and slot."""
        if self._allocated.get(handle.slot) != handle.generation:
            raise KeyError(f"arena slot {handle.slot} generation {handle.generation} is not stored")
        del self._allocated[handle.slot]
        d = self.directory[handle.slot]
        d["live"] = 0
        d["generation"] += 1
        self.allocator.free(int(d["offset"]))
        self._free_slots.append(handle.slot)

    # -- reading ---------------------------------------------------------------------------------

    def rows(self, handle: AdapterHandle) -> torch.Tensor | None:
        """A stored adapter's rows end to end, in the order ``write`` lays them (per layer, per targeted
        projection, A then B^T), as one flat zero-copy tensor; None where alignment padded two of
        them apart (a block of rows whose bytes are not a multiple of ALIGN)."""
        self._check(handle)
        d = self.directory[handle.slot]
        num_entries = int(d["num_layers"]) * int(d["num_projections"])
        dtype = DTYPES[int(d["dtype"])]
        index = np.frombuffer(self.buffer, dtype=INDEX_ENTRY, count=num_entries, offset=int(d["offset"]))
        index = index[index["rank"] > 0]
        if not len(index):
            return None
        size = element_size(dtype)
        a_end = index["a_offset"] + index["rank"].astype(np.int64) * index["fan_in"] * size
        b_end = index["b_offset"] + index["rank"].astype(np.int64) * index["fan_out"] * size
        if (a_end != index["b_offset"]).any() or (b_end[:-1] != index["a_offset"][1:]).any():
            return None
        first = int(index["a_offset"][0])
        return torch.frombuffer(self.buffer, dtype=dtype, count=(int(b_end[-1]) - first) // size, offset=first)

    @property
    def free_bytes(self) -> int:
        return self.allocator.free_bytes

    def close(self) -> None:
        """Unlink the segment (workers' mappings stay valid) and unmap it unless views are alive."""
        names.unlink(self.name)
        super().close()

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_adapter(buffer, entry) -> AdapterView:
    """Zero-copy tensors of the adapter a directory entry describes (server or worker side)."""
    num_layers, num_projections = int(entry["num_layers"]), int(entry["num_projections"])
    dtype = DTYPES[int(entry["dtype"])]
    index = np.frombuffer(buffer, dtype=INDEX_ENTRY, count=num_layers * num_projections,
                          offset=int(entry["offset"])).reshape(num_layers, num_projections)
    ranks = [int(r) for r in index["rank"].max(axis=0)]
    a_rows, b_rows = {}, {}
    for layer in range(num_layers):
        for p in range(num_projections):
            e = index[layer, p]
            if e["rank"]:
                a_rows[(layer, p)], b_rows[(layer, p)] = tensors(buffer, e, dtype)
    return AdapterView(ranks, torch.from_numpy(index["scaling"].copy()), a_rows, b_rows)


def tensors(buffer, e, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], B^T [r, out]) of one index entry, viewing the mapping."""
    r, fan_in, fan_out = int(e["rank"]), int(e["fan_in"]), int(e["fan_out"])
    a = torch.frombuffer(buffer, dtype=dtype, count=r * fan_in, offset=int(e["a_offset"])).view(r, fan_in)
    bt = torch.frombuffer(buffer, dtype=dtype, count=r * fan_out, offset=int(e["b_offset"])).view(r, fan_out)
    return a, bt


def shard_tensors(a: torch.Tensor, bt: torch.Tensor, rank: int, world: int,
                  row_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor parallelism's shard of one projection's A [r, in] and B^T [r, out] (S-LoRA §6): a
    row-parallel projection's A columns of the rank's inputs (x_r · A_r · B is its part of a sum the
    ranks all-reduce), a column-parallel one's B^T columns of its outputs. Views, no copy."""
    if world == 1:
        return a, bt
    whole = a if row_parallel else bt
    if whole.shape[1] % world:
        raise ValueError(f"{whole.shape[1]} {'inputs' if row_parallel else 'outputs'} do not split over {world} ranks")
    n = whole.shape[1] // world
    part = whole[:, rank * n:(rank + 1) * n]
    return (part, bt) if row_parallel else (a, part)
