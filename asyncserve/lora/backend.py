"""The batched-LoRA interface the model calls once per projection group, and the torch backend.

    backend.begin_step(batch)                  # once per step: LoraBatch or None
    backend.apply(layer, group, x, y)          # y += LoRA_group(x) for every token, in place
                                               # x: [tokens, in], y: [tokens, out of the group]
    y = backend.project(layer, group, x, base) # base(x) + LoRA_group(x), what the model calls

The torch backend ("stacked-masked"): for the step's active adapters it stacks, per layer and
group, all their A rows into one matrix ``A_stack [R, in]`` (R = sum of ranks of the group's
projections over the active adapters) and all B^T rows into ``B_stack [R, out]`` placed at each
projection's output columns, with the scaling folded in. Then, for all tokens at once:

    s = x @ A_stack^T          # [tokens, R]
    s *= mask                  # mask[t, j] = 1 if column j belongs to token t's adapter
    y += s @ B_stack           # one GEMM; other adapters' columns contribute zero

Three ops per group whatever the number of adapters, costing tokens x sum(ranks): on CPU it beats
gathers and per-adapter loops for the handful of adapters a step usually carries
(scripts/bench_kernels.py). Once the active set has lasted PACK_AFTER_STEPS steps, the two GEMMs
go through ``make_linear``, i.e. with the stacks reordered into oneDNN's blocked layout on CPU, as
the base projections are, and for small base weights ``project`` makes the shrink part of the
base GEMM (x @ [W; A_stack]^T). The stacked product grows with every adapter in the step —
quadratically with many distinct ones, and by the adapter count for long prefill segments — so
per step and group the backend switches to a segmented loop when that costs less: per run of one
adapter's consecutive rows, those rows times its own A and B columns of the same stacks
(``_loop_is_cheaper``, with the cost of a turn measured on the device). The stacks are gathered
from the pool pages when the active set (in any order) changes and kept until it changes again;
they are a working copy bounded by the running adapters, the pool pages remain the storage.
The Triton backend (lora/triton_backend.py) reads the pages in place instead.
"""
from __future__ import annotations

import time

import torch

from asyncserve.lora.batch import LoraBatch
from asyncserve.model.checkpoint import all_finite
from asyncserve.model.config import GROUPS, PROJ_INDEX, ModelConfig
from asyncserve.model.linear import Linear, make_linear, onednn_packs
from asyncserve.pager.pager import DeviceAdapter
from asyncserve.pager.pool import PagedPool


class LoraBackend:
    name = "none"

    def begin_step(self, batch: LoraBatch | None) -> None:
        raise NotImplementedError

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        raise NotImplementedError

    def project(self, layer: int, group: str, x: torch.Tensor, base: Linear) -> torch.Tensor:
        """The group's base projection plus its LoRA: [tokens, out]."""
        y = base(x)
        self.apply(layer, group, x, y)
        return y

    @property
    def active(self) -> bool:
        """False when no token of this step has a device LoRA: the model then skips the backend."""
        raise NotImplementedError

    def base_weights_changed(self) -> None:
        """The base projections were replaced (an adapter merged or unmerged): drop what was built from them."""


def group_layout(config: ModelConfig) -> dict[str, list[tuple[str, int, int, int]]]:
    """Per group: (projection, in_features, out_features, column offset in the fused output)."""
    shapes = config.projection_shapes()
    layout = {}
    for group, projs in GROUPS.items():
        offset, rows = 0, []
        for p in projs:
            fan_in, fan_out = shapes[p]
            rows.append((p, fan_in, fan_out, offset))
            offset += fan_out
        layout[group] = rows
    return layout


# A GPU launch is worth far more arithmetic than a CPU call, so there the single stacked GEMM nearly
# always wins (multiply-adds one launch is worth, as measured on an H100).
CUDA_TURN_MACS = 20_000_000
# Reordering a set's stacks for oneDNN takes ~14 ms (W1's four adapters, SmolLM2, Zen5) and saves
# ~0.46 ms per decode step, so it waits until the set has lasted a while: with many distinct
# adapters the set changes every few steps, and each change would pay it again.
PACK_AFTER_STEPS = 32
# Once packed, the stacked shrink can also ride on the base GEMM: x @ [W; A_stack]^T gives the
# base output and s in one call (W1, SmolLM2, Zen5: 0.36-0.46 ms less per decode step, ~32 ms to
# build, 53 MB for q/k/v and o). That copies W per layer, so only for small ones, where one GEMM
# call's fixed cost (~11 us in bf16 on CPU) is a good part of the base GEMM's time.
FUSE_MAX_WEIGHT_BYTES = 4 * 2**20
_turn_macs: dict[tuple[torch.dtype, int, int], float] = {}


def loop_turn_macs(device: torch.device, dtype: torch.dtype, fan_in: int, fan_out: int) -> float:
    """What one span's turn in the segmented loop (two GEMMs on a slice of rows) costs beyond its own
    multiply-adds, in multiply-adds of stacked GEMM work that take as long.

    Measured once per process, dtype and shape on CPU, where it varies too much for a constant:
    skinny GEMMs run far below the stacked GEMM's rate, and how far depends on the instruction set
    and dtype."""
    if device.type != "cpu":
        return CUDA_TURN_MACS
    key = (dtype, fan_in, fan_out)
    if key not in _turn_macs:
        tokens, rank, stack_rank, stack_tokens = 16, 16, 128, 256
        x = torch.randn(2 * tokens, fan_in, dtype=dtype)
        y = torch.zeros(2 * tokens, fan_out, dtype=dtype)
        a, b = torch.randn(rank, fan_in, dtype=dtype), torch.randn(rank, fan_out, dtype=dtype)   # as in the stacks
        rows = slice(tokens // 2, tokens // 2 + tokens)
        turn = _median_seconds(lambda: y[rows].addmm_(x[rows] @ a.t(), b))
        xs, a_s = torch.randn(stack_tokens, fan_in, dtype=dtype), torch.randn(fan_in, stack_rank, dtype=dtype)
        seconds_per_mac = _median_seconds(lambda: torch.mm(xs, a_s)) / (stack_tokens * fan_in * stack_rank)
        _turn_macs[key] = max(turn / seconds_per_mac - tokens * rank * (fan_in + fan_out), 0.0)
    return _turn_macs[key]


def _median_seconds(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


class TorchLoraBackend(LoraBackend):
    name = "torch"

    def __init__(self, pool: PagedPool, config: ModelConfig, mode: str = "auto",
                 pack_after_steps: int = PACK_AFTER_STEPS):
        """mode: "auto" (per step and group, whichever costs less), "stacked" or "loop"."""
        if mode not in ("auto", "stacked", "loop"):
            raise ValueError(f"mode must be 'auto', 'stacked' or 'loop', got {mode!r}")
        self.pool = pool
        self.layout = group_layout(config)
        self.num_layers = config.num_layers
        self.mode = mode
        self.pack_after_steps = pack_after_steps
        self.turn_macs = {group: loop_turn_macs(pool.device, pool.dtype, rows[0][1], sum(r[2] for r in rows))
                          for group, rows in self.layout.items()}
        self._set_key: tuple | None = None
        # group -> (A_stack [L, R, in], B_stack [L, R, out] with the scaling folded in, column owner [R]
        #           int64 (place in the stacks), per place its column range (c0, c1), None if untargeted,
        #           whether every value of both stacks is finite)
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, list, bool]] = {}
        # group -> (packed, per layer (x -> x @ A_stack^T, s -> s @ B_stack)) for the stacked plan
        self._linears: dict[str, tuple[bool, list[tuple[Linear, Linear]]]] = {}
        self._set_steps = 0                     # steps the active set has lasted
        # (group, layer) -> Linear over [W; A_stack] (or None: not fused), built once packed; cleared
        # with the stacks (whatever changes the base weights, e.g. merging an adapter, must clear it too)
        self._fused: dict[tuple[str, int], Linear | None] = {}
        # group -> ("stacked", mask [tokens, R]) or ("loop", [(row spans, c0, c1)])
        self._plans: dict[str, tuple[str, object]] = {}

    @property
    def active(self) -> bool:
        return bool(self._plans)

    def begin_step(self, batch: LoraBatch | None) -> None:
        self._plans = {}
        if batch is None or batch.empty:
            return
        # The stacks hold the active set in a fixed order (by name), so a step that lists the same
        # adapters in another order (e.g. once the oldest request has finished) reuses them.
        order = sorted(range(len(batch.adapters)), key=lambda i: batch.adapters[i].name)
        key = tuple((batch.adapters[i].name, batch.adapters[i].generation) for i in order)
        if key != self._set_key:
            adapters = [batch.adapters[i] for i in order]
            self._stacks = {g: s for g in GROUPS if (s := self._build_stack(adapters, g)) is not None}
            self._linears, self._fused = {}, {}
            self._set_key, self._set_steps = key, 0
        self._set_steps += 1
        packed = self._set_steps >= self.pack_after_steps
        place = {i: pos for pos, i in enumerate(order)}             # step adapter -> its place in the stacks
        spans = adapter_spans(batch)
        token_place = None
        for group, (a_stack, b_stack, owner, ranges, finite) in self._stacks.items():
            loop = [(spans[i], *ranges[place[i]]) for i in spans if ranges[place[i]] is not None]
            # a NaN or infinity in one adapter's columns would reach every token through the stacked
            # GEMMs (the mask multiplies it by 0, and 0 * NaN is NaN); the loop keeps it to that adapter's
            if not finite or self._loop_is_cheaper(group, batch, a_stack, b_stack, loop):
                self._plans[group] = ("loop", loop)
            else:
                if token_place is None:
                    lookup = torch.tensor([place[i] for i in range(len(order))] + [-1], device=owner.device)
                    token_place = lookup[batch.token_adapter().long()]           # -1 (no LoRA) stays -1
                if self._linears.get(group, (None,))[0] != packed:
                    self._linears[group] = (packed, _stack_linears(a_stack, b_stack, packed))
                # mask: [tokens, R]
                self._plans[group] = ("stacked", (token_place[:, None] == owner[None, :]).to(a_stack.dtype))

    def _loop_is_cheaper(self, group: str, batch: LoraBatch, a_stack: torch.Tensor, b_stack: torch.Tensor,
                         loop: list) -> bool:
        if self.mode != "auto":
            return self.mode == "loop"
        rank, width = a_stack.shape[1], a_stack.shape[2] + b_stack.shape[2]     # R; in + out
        stacked = batch.num_tokens * rank * width
        per_adapter = sum((sl.stop - sl.start) * (c1 - c0) * width for rows, c0, c1 in loop for sl in rows)
        turns = sum(len(rows) for rows, _, _ in loop)
        return per_adapter + turns * self.turn_macs[group] < stacked

    def _build_stack(self, adapters: list[DeviceAdapter], group: str):
        """The set's rows of ``group`` gathered from the pool, as _stacks holds them, or None if no
        adapter targets the group. One gather for A and one per projection for B."""
        flat = self.pool.flat
        device = flat.device
        layout = self.layout[group]
        a_offsets, owners, ranges = [], [], []
        b_parts = {proj: ([], [], []) for proj, _, _, _ in layout}   # B row offsets, scalings, stack rows
        width = 0
        for i, adapter in enumerate(adapters):
            c0 = width
            for proj, _, _, _ in layout:
                p = PROJ_INDEX[proj]
                r = adapter.ranks[p]
                if r == 0:
                    continue
                a_offsets.append(adapter.a_ptr[:, p, :r])                    # [L, r]
                offsets, scales, stack_rows = b_parts[proj]
                offsets.append(adapter.b_ptr[:, p, :r])
                scales.append(adapter.scaling[:, p, None].expand(-1, r))
                stack_rows.extend(range(width, width + r))
                owners.append(torch.full((r,), i, dtype=torch.int64))
                width += r
            ranges.append((c0, width) if width > c0 else None)
        if not a_offsets:
            return None
        a_stack = _rows(flat, torch.cat(a_offsets, dim=1), layout[0][1])       # [L, R, in]
        out_total = sum(fan_out for _, _, fan_out, _ in layout)
        b_stack = torch.zeros(self.num_layers, width, out_total, dtype=flat.dtype, device=device)
        for proj, _, fan_out, col in layout:
            offsets, scales, stack_rows = b_parts[proj]
            if not offsets:
                continue
            rows = _rows(flat, torch.cat(offsets, dim=1), fan_out)             # [L, R_p, out_p]
            scaled = rows.float() * torch.cat(scales, dim=1).to(device)[..., None]
            b_stack[:, torch.tensor(stack_rows, device=device), col:col + fan_out] = scaled.to(flat.dtype)
        finite = all_finite(a_stack) and all_finite(b_stack)
        return a_stack, b_stack, torch.cat(owners).to(device), ranges, finite

    def project(self, layer: int, group: str, x: torch.Tensor, base: Linear) -> torch.Tensor:
        fused = self._fused_linear(layer, group, base)
        if fused is None:
            return super().project(layer, group, x, base)
        out = fused(x)                                      # [tokens, out + R]: base output, then s
        y = out[:, :base.out_features]
        y.add_(self._linears[group][1][layer][1](out[:, base.out_features:] * self._plans[group][1]))
        return y

    def _fused_linear(self, layer: int, group: str, base: Linear) -> Linear | None:
        plan = self._plans.get(group)
        if plan is None or plan[0] != "stacked" or not self._linears[group][0]:
            return None
        key = (group, layer)
        if key not in self._fused:
            fuse = onednn_packs(self.pool.device, self.pool.dtype) and base.nbytes <= FUSE_MAX_WEIGHT_BYTES
            self._fused[key] = (make_linear(torch.cat([base.dense_weight(), self._stacks[group][0][layer]]))
                                if fuse else None)
        return self._fused[key]

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        plan = self._plans.get(group)
        if plan is None:
            return
        kind, data = plan
        if kind == "stacked":
            shrink, expand = self._linears[group][1][layer]
            s = shrink(x)                         # [tokens, R]
            s.mul_(data)
            y.add_(expand(s))
            return
        a_stack, b_stack = self._stacks[group][0][layer], self._stacks[group][1][layer]
        for rows, c0, c1 in data:
            for sl in rows:
                y[sl].addmm_(x[sl] @ a_stack[c0:c1].t(), b_stack[c0:c1])

    def base_weights_changed(self) -> None:
        self._fused = {}


def _stack_linears(a_stack: torch.Tensor, b_stack: torch.Tensor, packed: bool) -> list[tuple[Linear, Linear]]:
    """Per layer, the stacked plan's shrink and expand: over views of the stacks, or (packed) over
    make_linear's copies, which on CPU are oneDNN's reordered layout."""
    make = make_linear if packed else Linear
    return [(make(a), make(b.t())) for a, b in zip(a_stack, b_stack)]


def _rows(flat: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """flat[offsets[..., None] + arange(width)], i.e. the ``width`` elements at each offset, gathered
    through a view of flat's overlapping windows rather than an index tensor of every element."""
    windows = flat.as_strided((flat.numel() - width + 1, width), (1, 1))
    return windows.index_select(0, offsets.reshape(-1)).view(*offsets.shape, width)


def adapter_spans(batch: LoraBatch) -> dict[int, list[slice]]:
    """Per step adapter with tokens: its runs of consecutive token rows (the scheduler groups each
    adapter's decodes and its prefill chunks, so usually one or two)."""
    spans: dict[int, list[slice]] = {}
    for s, a in enumerate(batch.seg_adapter):
        lo, hi = batch.seg_starts[s], batch.seg_starts[s + 1]
        if a < 0 or hi <= lo:
            continue
        runs = spans.setdefault(a, [])
        if runs and runs[-1].stop == lo:
            runs[-1] = slice(runs[-1].start, hi)
        else:
            runs.append(slice(lo, hi))
    return spans
