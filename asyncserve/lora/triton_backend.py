"""The Triton LoRA backend: heterogeneous-rank kernels reading adapter rows in place from the pool.

Per step (begin_step) it picks one kernel family and builds that family's step inputs once for
all layers (the adapter tables are SlotTables, kept on the device across steps: a step copies there
only the slots of adapters placed since they last ran); per group (apply) it runs a shrink into an fp32 scratch ``s [T, r]`` and an expand
into the projection's columns of the fused output ``y`` (see group_layout): in decode steps once
for the whole group (q, k, v together), otherwise per projection that some step adapter targets.

Kernel choice (measured on an H100, BENCHMARKS.md, scripts/bench_kernels.py):
* decode-only steps (every token a sequence's decode, or every LoRA segment one token): MBGMV —
  one program row per token, work proportional to the sum of the tokens' ranks.
* steps with longer segments (prefill, mixed prefill + decode), ``prefill_kernel="auto"``: SGMV
  while the longest LoRA segment is shorter than SGMV_MAX_SEGMENT tokens, else MBGMM. SGMV walks a
  segment serially in one program column: 3x faster than MBGMM at 16-token segments, 4x slower at
  512, where MBGMM's 32-token tiles spread one long prompt over the whole GPU.
  ``prefill_kernel="sgmv"|"mbgmm"`` forces one.
* BGMV (padded) exists for the latency-model comparison only; the backend never picks it.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch

import kernels
from asyncserve.lora.backend import LoraBackend, expert_step, group_layout
from asyncserve.lora.batch import LoraBatch, SlotTables
from asyncserve.model.config import PROJ_INDEX, PROJECTIONS, ModelConfig
from asyncserve.model.llama import ExpertLora
from asyncserve.pager.pager import DeviceAdapter
from asyncserve.pager.pool import PagedPool
from kernels._util import INTERPRET


# Longest LoRA segment below which SGMV beats MBGMM (H100, bf16, hidden 4096, rank 16: 128 tokens
# about even, 16 tokens SGMV 3x faster, 512 tokens MBGMM 4x faster).
SGMV_MAX_SEGMENT = 128
# warm_up's steps, as segment lengths: decodes, short prompts (SGMV) and a long one (MBGMM); one
# segment and 512 of them, so that both the split-K and the unsplit shrink compile (a shrink is
# split while its grid holds fewer than two waves of programs: 264 on an H100)
WARM_UP_STEPS = (([1], True), ([1] * 512, True), ([2], False), ([2] * 512, False), ([SGMV_MAX_SEGMENT], False))


@dataclass
class _Step:
    kernel: str
    ranks: torch.Tensor          # [slots, P] int32: SlotTables, kept across steps
    a_ptr: torch.Tensor          # [slots, L, P, R] int64
    b_ptr: torch.Tensor
    scaling: torch.Tensor        # [slots, L, P] float32
    proj_rank: list[int]         # per projection: max rank over the step's adapters (0: none)
    inputs: dict                 # token_adapter | seg_starts + seg_adapter | tiles
    s: torch.Tensor              # [T, max rank] float32 scratch, reused by every apply


class TritonLoraBackend(LoraBackend):
    name = "triton"

    def __init__(self, pool: PagedPool, config: ModelConfig, prefill_kernel: str = "auto"):
        if prefill_kernel not in ("auto", "mbgmm", "sgmv"):
            raise ValueError(f"prefill_kernel must be 'auto', 'mbgmm' or 'sgmv', got {prefill_kernel!r}")
        if pool.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton LoRA backend needs a CUDA pool, or TRITON_INTERPRET=1 set "
                               "before the kernels are imported (slow; for tests)")
        self.pool = pool
        self.num_layers = config.num_layers
        self.layout = group_layout(config)
        self.prefill_kernel = prefill_kernel
        # group -> (first projection index, projections, their widths): a group's projections are
        # neighbours in PROJECTIONS and its fused output, so one table slice covers them
        self._fused = {}
        for group, rows in self.layout.items():
            p0 = PROJ_INDEX[rows[0][0]]
            assert [PROJ_INDEX[proj] for proj, *_ in rows] == list(range(p0, p0 + len(rows)))
            self._fused[group] = (p0, len(rows), tuple(fan_out for _, _, fan_out, _ in rows))
        self.slot_tables = SlotTables(config.num_layers, len(config.lora_projections()), pool.device)
        self._step: _Step | None = None
        self._experts: ExpertLora | None = None

    @property
    def active(self) -> bool:
        return self._step is not None

    def experts(self) -> ExpertLora | None:
        return self._experts

    def begin_step(self, batch: LoraBatch | None) -> None:
        self._step = None
        self._experts = None
        if batch is None or batch.empty:
            return
        self._experts = expert_step(batch, self.slot_tables, self.pool.flat)
        # the kernels index the tables kept across steps by each token's (or segment's) slot
        slots = self.slot_tables.slots(batch.adapters)
        ranks, a_ptr, b_ptr, scaling = self.slot_tables.tensors
        # host-side ints: slicing the tables to each projection's max rank needs no device sync
        proj_rank = [max(adapter.ranks[p] for adapter in batch.adapters) for p in range(len(PROJECTIONS))]
        starts = batch.seg_starts
        # decodes of one adapter share a segment, so "every segment one token" alone would miss them
        decode = batch.num_decode == batch.num_tokens or all(
            starts[s + 1] - starts[s] <= 1 for s, a in enumerate(batch.seg_adapter) if a >= 0)
        if decode:
            kernel, inputs = "mbgmv", {"token_adapter": batch.token_adapter(slots)}
        elif self.prefill_kernel == "sgmv" or (self.prefill_kernel == "auto" and max(
                starts[s + 1] - starts[s] for s, a in enumerate(batch.seg_adapter) if a >= 0) < SGMV_MAX_SEGMENT):
            seg_starts, seg_adapter = batch.segments(slots)
            kernel, inputs = "sgmv", {"seg_starts": seg_starts, "seg_adapter": seg_adapter}
        else:
            kernel = "mbgmm"
            inputs = {"tiles": kernels.mbgmm_tiles(starts, batch.segment_rows(slots), self.pool.device)}
        # fused decode groups keep up to 3 projections' results side by side in s
        width = max(max(proj_rank), 1) * (max(n for _, n, _ in self._fused.values()) if decode else 1)
        s = torch.empty(batch.num_tokens, width, dtype=torch.float32, device=self.pool.device)
        self._step = _Step(kernel, ranks, a_ptr, b_ptr, scaling, proj_rank, inputs, s)

    def fixed_step(self, token_slots: torch.Tensor, s: torch.Tensor) -> "FixedStepLora":
        """The LoRA of a decode step over fixed buffers (asyncserve/stepper/cuda_graphs.py): MBGMV for
        every token over the slot tables' whole rank width, so that no launch depends on the step's
        adapters (rows past an adapter's rank cost a program that returns). token_slots: [T] int64, each
        token's slot (-1: none); s: [T, >= 3 * width] float32 scratch. Valid until the tables resize
        (SlotTables.version)."""
        ranks, a_ptr, b_ptr, scaling = self.slot_tables.tensors
        width = a_ptr.shape[-1]
        return FixedStepLora(self, _Step("mbgmv", ranks, a_ptr, b_ptr, scaling, [width] * len(PROJECTIONS),
                                         {"token_adapter": token_slots}, s))

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if self._step is not None:
            self.apply_step(self._step, layer, group, x, y)

    def apply_step(self, step: _Step, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        # x: [tokens, in], y: [tokens, out of the group]
        if step.kernel == "mbgmv":
            # decode: the group's projections (q, k, v share x) in one shrink and one expand launch;
            # at decode sizes the launches, not the GPU, bound the step
            p0, n, out_sizes = self._fused[group]
            r = max(step.proj_rank[p0:p0 + n])
            if r:
                token_adapter = step.inputs["token_adapter"]
                kernels.mbgmv_shrink(x, self.pool.flat, step.a_ptr[:, layer, p0:p0 + n, :r],
                                     step.ranks[:, p0:p0 + n], token_adapter, step.s)
                kernels.mbgmv_expand(step.s, self.pool.flat, step.b_ptr[:, layer, p0:p0 + n, :r],
                                     step.ranks[:, p0:p0 + n], step.scaling[:, layer, p0:p0 + n],
                                     token_adapter, y, out_sizes=out_sizes)
            return
        for proj, _, fan_out, col in self.layout[group]:
            p = PROJ_INDEX[proj]
            r = step.proj_rank[p]
            if r == 0:
                continue
            kernels.lora_apply(step.kernel, x, y[:, col:col + fan_out], self.pool.flat,
                               step.a_ptr[:, layer, p, :r], step.b_ptr[:, layer, p, :r],
                               step.ranks[:, p], step.scaling[:, layer, p], step.s, **step.inputs)

    def warm_up(self) -> float:
        """Run every kernel launch a step can make, so that Triton compiles them at start and not in
        the first requests' steps (on an H100, 20 steps of 0.2-4.2 s; BENCHMARKS.md "H100, third
        lease"). The kernels leave what follows the step unspecialized (kernels/mbgmv.py), so the
        steps of WARM_UP_STEPS through every layer and group compile what any step will launch
        (tests/test_kernel_variants.py). The adapter is synthetic: rank 16 on every projection, each
        row pointing at the pool's first elements, scaling 0; the outputs are thrown away. The
        interpreter compiles nothing, so there it returns at once."""
        if INTERPRET:
            return 0.0
        t0 = time.perf_counter()
        device, dtype, rank = self.pool.device, self.pool.dtype, 16
        projections = self.slot_tables.tensors[0].shape[1]
        rows = torch.zeros(self.num_layers, projections, rank, dtype=torch.int64, device=device)
        adapter = DeviceAdapter("warm-up", [rank] * projections, rows, rows,
                                torch.zeros(self.num_layers, projections, device=device), [], generation=-1)
        for lengths, decode in WARM_UP_STEPS:
            starts = list(itertools.accumulate(lengths, initial=0))
            tokens = starts[-1]
            self.begin_step(LoraBatch([adapter], starts, [0] * len(lengths), tokens, device,
                                      num_decode=tokens if decode else 0))
            for group, projections in self.layout.items():
                x = torch.zeros(tokens, projections[0][1], dtype=dtype, device=device)
                y = torch.zeros(tokens, sum(fan_out for _, _, fan_out, _ in projections), dtype=dtype, device=device)
                for layer in range(self.num_layers):
                    self.apply(layer, group, x, y)
        self.begin_step(None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0


class FixedStepLora:
    """LoraHook of TritonLoraBackend.fixed_step: its own step, apart from the backend's eager one."""
    active = True

    def __init__(self, backend: TritonLoraBackend, step: _Step):
        self.backend, self.step = backend, step

    def project(self, layer: int, group: str, x: torch.Tensor, base) -> torch.Tensor:
        y = base(x)
        self.backend.apply_step(self.step, layer, group, x, y)
        return y

    def native_step(self):
        return None
