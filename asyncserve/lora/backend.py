"""The batched-LoRA interface the model calls once per projection group, and the torch backend.

    backend.begin_step(batch)                  # once per step: LoraBatch or None
    backend.apply(layer, group, x, y)          # y += LoRA_group(x) for every token, in place
                                               # x: [tokens, in], y: [tokens, out of the group]

The torch backend ("stacked-masked"): for the step's active adapters it stacks, per layer and
group, all their A rows into one matrix ``A_stack [R, in]`` (R = sum of ranks of the group's
projections over the active adapters) and all B^T rows into ``B_stack [R, out]`` placed at each
projection's output columns, with the scaling folded in. Then, for all tokens at once:

    s = x @ A_stack            # [tokens, R]
    s *= mask                  # mask[t, j] = 1 if column j belongs to token t's adapter
    y += s @ B_stack           # one GEMM; other adapters' columns contribute zero

Three ops per group whatever the number of adapters, costing tokens x sum(ranks) — the MBGMV
cost model (CaraServe §5) with one dense GEMM, which on CPU beats gathers and per-adapter loops
for the handful of adapters a CPU step carries (scripts/bench_kernels.py measures the
alternatives). The stacks are gathered from the pool pages when the active set changes and kept
until it changes again; they are a working copy bounded by the running adapters, the pool pages
remain the storage. The Triton backend (lora/triton_backend.py) reads the pages in place instead.
"""
from __future__ import annotations

import torch

from asyncserve.lora.batch import GROUPS, PROJ_INDEX, LoraBatch
from asyncserve.model.config import ModelConfig
from asyncserve.pager.pool import PagedPool


class LoraBackend:
    name = "none"

    def begin_step(self, batch: LoraBatch | None) -> None:
        raise NotImplementedError

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def active(self) -> bool:
        """False when no token of this step has a device LoRA: the model then skips apply()."""
        raise NotImplementedError


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


class TorchLoraBackend(LoraBackend):
    name = "torch"

    def __init__(self, pool: PagedPool, config: ModelConfig):
        self.pool = pool
        self.layout = group_layout(config)
        self.num_layers = config.num_layers
        self._set_key: tuple | None = None
        # group -> (A_stack [L, in, R], B_stack [L, R, out], column owner [R] int64)
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[str, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return bool(self._masks)

    def begin_step(self, batch: LoraBatch | None) -> None:
        self._masks = {}
        if batch is None or batch.empty:
            return
        key = tuple((a.name, a.generation) for a in batch.adapters)
        if key != self._set_key:
            self._stacks = {g: s for g in GROUPS if (s := self._build_stack(batch, g)) is not None}
            self._set_key = key
        token_adapter = batch.token_adapter().long()
        for group, (a_stack, _, owner) in self._stacks.items():
            # mask: [tokens, R]
            self._masks[group] = (token_adapter[:, None] == owner[None, :]).to(a_stack.dtype)

    def _build_stack(self, batch: LoraBatch, group: str):
        flat = self.pool.flat
        a_offsets, b_offsets, b_cols, owners, scales = [], [], [], [], []
        rows_in = None
        for i, adapter in enumerate(batch.adapters):
            for proj, fan_in, fan_out, col in self.layout[group]:
                p = PROJ_INDEX[proj]
                r = adapter.ranks[p]
                if r == 0:
                    continue
                a_offsets.append(adapter.a_ptr[:, p, :r])          # [L, r]
                b_offsets.append(adapter.b_ptr[:, p, :r])
                scales.append(adapter.scaling[:, p, None].expand(-1, r))
                b_cols.append(torch.full((r,), col, dtype=torch.int64))
                owners.append(torch.full((r,), i, dtype=torch.int64))
                rows_in = fan_in
        if not a_offsets:
            return None
        device = flat.device
        a_off = torch.cat(a_offsets, dim=1)                        # [L, R]
        # [L, in, R]: x @ A_stack is MKL's fast small-batch layout (see model/llama.py)
        a_stack = flat[a_off[..., None] + torch.arange(rows_in, device=device)].transpose(1, 2).contiguous()
        out_total = sum(fan_out for _, _, fan_out, _ in self.layout[group])
        b_stack = torch.zeros(self.num_layers, a_off.shape[1], out_total, dtype=flat.dtype, device=device)
        scale = torch.cat(scales, dim=1).to(device)                # [L, R]
        col0 = torch.cat(b_cols)
        r0 = 0
        for offsets, cols in zip(b_offsets, col0.split([o.shape[1] for o in b_offsets])):
            r = offsets.shape[1]
            fan_out = next(fo for _, _, fo, c in self.layout[group] if c == int(cols[0]))
            rows = flat[offsets[..., None] + torch.arange(fan_out, device=device)]   # [L, r, out_p]
            scaled = rows.float() * scale[:, r0:r0 + r, None]
            b_stack[:, r0:r0 + r, int(cols[0]):int(cols[0]) + fan_out] = scaled.to(flat.dtype)
            r0 += r
        return a_stack, b_stack, torch.cat(owners).to(device)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        mask = self._masks.get(group)
        if mask is None:
            return
        a_stack, b_stack, _ = self._stacks[group]
        s = torch.mm(x, a_stack[layer])           # [tokens, R]
        s.mul_(mask)
        y.addmm_(s, b_stack[layer])
