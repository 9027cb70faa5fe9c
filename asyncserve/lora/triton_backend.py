"""The Triton LoRA backend: heterogeneous-rank kernels reading adapter rows in place from the pool.

Per step (begin_step) it picks one kernel family and builds that family's step inputs once for
all layers; per group (apply) it runs, for each projection of the group that some step adapter
targets, a shrink into an fp32 scratch ``s [T, r]`` and an expand into the projection's columns
of the fused output ``y`` (see group_layout).

Kernel choice:
* decode-only steps (every LoRA segment is one token): MBGMV — one program row per token, work
  proportional to the sum of the tokens' ranks, no token tiles wasted on single tokens.
* anything with a longer segment (prefill, mixed prefill + decode): MBGMM by default — every
  segment cut into 32-token tiles, each tile its own programs, so a long prompt spreads over the
  whole GPU while SGMV's per-segment program column walks it serially and needs split-K to fill
  the device. ``prefill_kernel="sgmv"`` selects Punica's SGMV instead. The default is by that
  argument, not by measurement: no GPU was available when this was written;
  scripts/bench_kernels.py compares both on a GPU and this default should follow its result.
* BGMV (padded) exists for the latency-model comparison only; the backend never picks it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import kernels
from asyncserve.lora.backend import LoraBackend, group_layout
from asyncserve.lora.batch import PROJ_INDEX, PROJECTIONS, LoraBatch
from asyncserve.model.config import ModelConfig
from asyncserve.pager.pool import PagedPool


@dataclass
class _Step:
    kernel: str
    ranks: torch.Tensor          # [n, P] int32
    a_ptr: torch.Tensor          # [n, L, P, R] int64
    b_ptr: torch.Tensor
    scaling: torch.Tensor        # [n, L, P] float32
    proj_rank: list[int]         # per projection: max rank over the step's adapters (0: none)
    inputs: dict                 # token_adapter | seg_starts + seg_adapter | tiles
    s: torch.Tensor              # [T, max rank] float32 scratch, reused by every apply


class TritonLoraBackend(LoraBackend):
    name = "triton"

    def __init__(self, pool: PagedPool, config: ModelConfig, prefill_kernel: str = "mbgmm"):
        if prefill_kernel not in ("mbgmm", "sgmv"):
            raise ValueError(f"prefill_kernel must be 'mbgmm' or 'sgmv', got {prefill_kernel!r}")
        if pool.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton LoRA backend needs a CUDA pool, or TRITON_INTERPRET=1 set "
                               "before the kernels are imported (slow; for tests)")
        self.pool = pool
        self.layout = group_layout(config)
        self.prefill_kernel = prefill_kernel
        self._step: _Step | None = None

    @property
    def active(self) -> bool:
        return self._step is not None

    def begin_step(self, batch: LoraBatch | None) -> None:
        self._step = None
        if batch is None or batch.empty:
            return
        ranks, a_ptr, b_ptr, scaling = batch.tables()
        # host-side ints: slicing the tables to each projection's max rank needs no device sync
        proj_rank = [max(adapter.ranks[p] for adapter in batch.adapters) for p in range(len(PROJECTIONS))]
        starts = batch.seg_starts
        decode = all(starts[s + 1] - starts[s] <= 1 for s, a in enumerate(batch.seg_adapter) if a >= 0)
        if decode:
            kernel, inputs = "mbgmv", {"token_adapter": batch.token_adapter()}
        elif self.prefill_kernel == "sgmv":
            seg_starts, seg_adapter = batch.segments()
            kernel, inputs = "sgmv", {"seg_starts": seg_starts, "seg_adapter": seg_adapter}
        else:
            kernel = "mbgmm"
            inputs = {"tiles": kernels.mbgmm_tiles(starts, batch.seg_adapter, self.pool.device)}
        s = torch.empty(batch.num_tokens, max(max(proj_rank), 1), dtype=torch.float32, device=self.pool.device)
        self._step = _Step(kernel, ranks, a_ptr, b_ptr, scaling, proj_rank, inputs, s)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        # x: [tokens, in], y: [tokens, out of the group]
        step = self._step
        if step is None:
            return
        for proj, _, fan_out, col in self.layout[group]:
            p = PROJ_INDEX[proj]
            r = step.proj_rank[p]
            if r == 0:
                continue
            kernels.lora_apply(step.kernel, x, y[:, col:col + fan_out], self.pool.flat,
                               step.a_ptr[:, layer, p, :r], step.b_ptr[:, layer, p, :r],
                               step.ranks[:, p], step.scaling[:, layer, p], step.s, **step.inputs)
