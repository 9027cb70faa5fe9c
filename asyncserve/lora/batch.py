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
    num_decode: int = 0              # tokens [0, num_decode) are single-token decodes, one per sequence
    _tensors: dict = field(default_factory=dict, repr=False)

    @property
    def empty(self) -> bool:
        return not self.adapters or all(a < 0 for a in self.seg_adapter)

    def token_adapter(self) -> torch.Tensor:
        """[T] int32: step-adapter index of each token (-1 none)."""
        if "token_adapter" not in self._tensors:
            t = torch.full((self.num_tokens,), -1, dtype=torch.int32)
            for s, a in enumerate(self.seg_adapter):
                t[self.seg_starts[s]:self.seg_starts[s + 1]] = a
            self._tensors["token_adapter"] = t.to(self.device)
        return self._tensors["token_adapter"]

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

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seg_starts [S+1] int32, seg_adapter [S] int32) on the device."""
        if "segments" not in self._tensors:
            self._tensors["segments"] = (
                torch.tensor(self.seg_starts, dtype=torch.int32, device=self.device),
                torch.tensor(self.seg_adapter, dtype=torch.int32, device=self.device),
            )
        return self._tensors["segments"]


class SlotTables:
    """The step tables kept across steps, for kernels that take each run's adapter as an index into
    them (lora_segments): one slot per adapter placement (``DeviceAdapter.generation``), filled when
    it first runs. A step whose adapters changed fills only the new ones; rebuilding the tables of 32
    adapters was half a millisecond on every such step, and with 1,000 adapters in turn most steps
    are such steps. When every slot is taken, the slot no step has used for longest is reused."""

    def __init__(self, num_layers: int, num_projections: int, slots: int = 64, max_rank: int = 16):
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # generation -> slot, least recently used first
        self._shape = (num_layers, num_projections)
        self._ranks = np.zeros((0, num_projections), dtype=np.int32)
        self._ptr = np.zeros((2, 0, num_layers, num_projections, 0), dtype=np.int64)
        self._scaling = np.zeros((0, num_layers, num_projections), dtype=np.float32)
        self._resize(slots, max_rank)

    def _resize(self, slots: int, max_rank: int) -> None:
        old_slots, old_rank = self._ranks.shape[0], self._ptr.shape[-1]
        ranks = np.zeros((slots, self._shape[1]), dtype=np.int32)
        ptr = np.zeros((2, slots, *self._shape, max_rank), dtype=np.int64)
        scaling = np.zeros((slots, *self._shape), dtype=np.float32)
        ranks[:old_slots], scaling[:old_slots] = self._ranks, self._scaling
        ptr[:, :old_slots, :, :, :old_rank] = self._ptr
        self._ranks, self._ptr, self._scaling = ranks, ptr, scaling
        # torch views of the arrays: filling a slot updates what the kernels read
        self.tensors = (torch.from_numpy(ranks), torch.from_numpy(ptr[0]), torch.from_numpy(ptr[1]),
                        torch.from_numpy(scaling))

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
        for a in new:
            if len(self._slot_of) < self._ranks.shape[0]:
                slot = len(self._slot_of)
            else:                                   # the least recently used: not one of this step's
                slot = self._slot_of.pop(next(iter(self._slot_of)))
            self._slot_of[a.generation] = slot
            self._ranks[slot] = a.ranks
            self._ptr[:, slot] = 0
            self._ptr[:, slot, :, :, :a.r_max] = a.host_ptr
            self._scaling[slot] = a.scaling.cpu().numpy()
        return [self._slot_of[a.generation] for a in adapters]
