"""What one step's batched-LoRA computation needs to know, independent of the backend that runs it.

Tokens of a step are ordered so that each adapter's tokens form contiguous segments (a segment per
sequence chunk; neighbouring segments may share an adapter). ``seg_adapter`` indexes the step's
adapter table, -1 meaning "no LoRA" (base model, or deltas supplied from elsewhere, e.g. CPU
workers computing a cold adapter's prefill LoRA).

Adapter weights stay where the pager put them in the unified pool; the step tables below hold each
row's flat element offset into ``pool.flat`` (see pager/pool.py for the layout):

* ``a_ptr[i, l, p, j]``: row j of A (``in_features`` elements) of step adapter i, layer l, projection p
* ``b_ptr[i, l, p, j]``: row j of B^T (``out_features`` elements)
* ``ranks[i, p]``: rank of projection p for adapter i (0: the adapter does not target p)
* ``scaling[i, l, p]``: lora_alpha / r (or / sqrt(r) with rsLoRA), per layer for alpha_pattern
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncserve.pager.pager import DeviceAdapter


@dataclass
class LoraBatch:
    adapters: list[DeviceAdapter]
    seg_starts: list[int]            # [S + 1] token boundaries
    seg_adapter: list[int]           # [S] index into adapters, -1 = no device LoRA
    num_tokens: int
    device: torch.device
    num_decode: int = 0              # tokens [0, num_decode) are decode rows (a drafted decode has several)
    _tensors: dict = field(default_factory=dict, repr=False)

    @property
    def empty(self) -> bool:
        return not self.adapters or all(a < 0 for a in self.seg_adapter)

    def token_adapter(self, table_rows: list[int] | None = None) -> torch.Tensor:
        """[T] int32: each token's step adapter (-1 none), or with ``table_rows`` (per step adapter, its
        row in tables kept across steps: SlotTables.slots) that row."""
        key = ("token_adapter", None if table_rows is None else tuple(table_rows))
        if key not in self._tensors:
            t = np.full(self.num_tokens, -1, dtype=np.int32)
            starts = self.seg_starts
            t[starts[0]:starts[-1]] = np.repeat(self.segment_rows(table_rows), np.diff(starts))
            self._tensors[key] = torch.from_numpy(t).to(self.device)
        return self._tensors[key]

    def segment_rows(self, table_rows: list[int] | None = None) -> list[int]:
        """Each segment's step adapter (-1 none), or its row in tables kept across steps."""
        if table_rows is None:
            return self.seg_adapter
        return [table_rows[a] if a >= 0 else -1 for a in self.seg_adapter]

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ranks [n, P] int32, a_ptr [n, L, P, R] int64, b_ptr [n, L, P, R], scaling [n, L, P] f32)."""
        if "tables" not in self._tensors:
            # filled in numpy from each adapter's host copy of its offsets: padding and stacking 2n
            # tensors took twice as long (32 adapters: 1.1 against 0.5 ms), on every step whose set changed
            r = max(a.r_max for a in self.adapters)
            ptr = np.zeros((2, len(self.adapters), *self.adapters[0].host_ptr.shape[1:3], r), dtype=np.int64)
            for i, a in enumerate(self.adapters):
                ptr[:, i, :, :, :a.r_max] = a.host_ptr
            ptr = torch.from_numpy(ptr).to(self.device)
            self._tensors["tables"] = (
                torch.tensor([a.ranks for a in self.adapters], dtype=torch.int32, device=self.device),
                ptr[0], ptr[1],
                torch.stack([a.scaling for a in self.adapters]),
            )
        return self._tensors["tables"]

    def segments(self, table_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(seg_starts [S+1] int32, seg_adapter [S] int32: as segment_rows) on the device."""
        key = ("segments", None if table_rows is None else tuple(table_rows))
        if key not in self._tensors:
            self._tensors[key] = (
                torch.tensor(self.seg_starts, dtype=torch.int32, device=self.device),
                torch.tensor(self.segment_rows(table_rows), dtype=torch.int32, device=self.device),
            )
        return self._tensors[key]


INITIAL_TABLE_BYTES = 32 << 20


class SlotTables:
    """The step tables kept across steps, for kernels that take each run's adapter as an index into
    them (lora_segments, and the Triton kernels through token_adapter / segments): one slot per adapter
    placement (``DeviceAdapter.generation``), filled when it first runs, on the device the kernels read
    them from. A step whose adapters changed copies only the new ones' slots there; building the tables
    of 32 adapters was half a millisecond on every such step (CPU), and with 1,000 adapters in turn
    most steps are such steps; on a GPU the whole tables were copied to it again as well. When every
    slot is taken, the slot no step has used for longest is reused: on a GPU its copy is queued
    behind the kernels of earlier steps that may still read it."""

    def __init__(self, num_layers: int, num_projections: int, device: torch.device = torch.device("cpu"),
                 slots: int = 64, max_rank: int = 16):
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # generation -> slot, least recently used first
        self._shape = (num_layers, num_projections)
        # fewer slots to start with where a slot is large: a mixture of experts has a column per expert
        # projection (Qwen3-30B-A3B: 48 layers x 391 columns, 4.8 MB a slot at rank 16); more come as needed
        slot_bytes = num_layers * num_projections * max_rank * 2 * 8
        slots = min(slots, max(4, INITIAL_TABLE_BYTES // slot_bytes))
        self.device = device
        self._ranks, self._ptr, self._scaling = self._allocate(slots, max_rank)
        self.version = 0            # counts the resizes: kernels captured over the old tables must not run

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ranks [slots, P] int32, a_ptr [slots, L, P, R] int64, b_ptr, scaling [slots, L, P] float32)."""
        return self._ranks, self._ptr[0], self._ptr[1], self._scaling

    def _allocate(self, slots: int, max_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.zeros(slots, self._shape[1], dtype=torch.int32, device=self.device),
                torch.zeros(2, slots, *self._shape, max_rank, dtype=torch.int64, device=self.device),
                torch.zeros(slots, *self._shape, dtype=torch.float32, device=self.device))

    def _resize(self, slots: int, max_rank: int) -> None:
        old_slots, old_rank = self._ranks.shape[0], self._ptr.shape[-1]
        ranks, ptr, scaling = self._allocate(slots, max_rank)
        ranks[:old_slots], scaling[:old_slots] = self._ranks, self._scaling
        ptr[:, :old_slots, :, :, :old_rank] = self._ptr
        self._ranks, self._ptr, self._scaling = ranks, ptr, scaling
        self.version += 1

    def slots(self, adapters: list[DeviceAdapter]) -> list[int]:
        """Each adapter's slot, filling those of adapters placed since they last ran."""
        capacity, max_rank = self._ranks.shape[0], self._ptr.shape[-1]
        new = [a for a in adapters if a.generation not in self._slot_of]
        if len(adapters) > capacity or any(a.r_max > max_rank for a in new):
            self._resize(capacity if len(adapters) <= capacity else 2 * len(adapters),
                         max([max_rank] + [a.r_max for a in new]))
        for a in adapters:
            if a.generation in self._slot_of:
                self._slot_of.move_to_end(a.generation)
        if new:
            self._fill(new)
        return [self._slot_of[a.generation] for a in adapters]

    def _fill(self, new: list[DeviceAdapter]) -> None:
        """Give each new adapter a slot and write its rows there: built on the host, one copy per table."""
        filled = []
        for a in new:
            if len(self._slot_of) < self._ranks.shape[0]:
                slot = len(self._slot_of)
            else:                                   # the least recently used: not one of this step's
                slot = self._slot_of.pop(next(iter(self._slot_of)))
            self._slot_of[a.generation] = slot
            filled.append(slot)
        ptr = np.zeros((2, len(new), *self._shape, self._ptr.shape[-1]), dtype=np.int64)
        for i, a in enumerate(new):
            ptr[:, i, :, :, :a.r_max] = a.host_ptr
        index = torch.tensor(filled, device=self.device)
        self._ranks.index_copy_(0, index, torch.tensor([a.ranks for a in new], dtype=torch.int32).to(self.device))
        self._ptr.index_copy_(1, index, torch.from_numpy(ptr).to(self.device))
        scaling = torch.stack([a.host_scaling for a in new]).to(self.device, torch.float32)
        self._scaling.index_copy_(0, index, scaling)
