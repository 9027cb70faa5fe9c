"""DoRA (weight-decomposed LoRA, Liu et al. 2024) as PEFT trains and serves it.

A DoRA projection keeps LoRA's A and B and adds a magnitude m [out]. PEFT's forward is

    y = g * (x W^T + s x A^T B^T) + bias,    g = m / ||W + s B A||, the norm per output row,

so each output of the projection is LoRA's output scaled by a constant of the adapter and the base
weights. g is worked out once, when the adapter is built into the host tier (``DoraBase``), without
forming W + s B A:

    ||W_o + s (BA)_o||^2 = ||W_o||^2 + 2 s sum_r B[o, r] (A W^T)[r, o] + s^2 B_o (A A^T) B_o^T

where ||W_o||^2 is read once per layer from the dense base weight, and A W^T is the base projection
applied to A's rows (any Linear, quantized ones too). A step then multiplies each DoRA adapter's rows
of a projection group's output by its g (``DoraLora``; in the one-call native layer loop, decoder.h),
before the bias (PEFT scales the output without its bias); a merge folds g into the merged rows
(stepper/merge.py).

g lives beside the adapter's pool pages, [layers, all projections' outputs] in float32 (1 where a
projection has no DoRA): 5.4 MB for Llama-2-7B, against 80 MB of bf16 rows for rank 16 on every projection.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from asyncserve.model.config import GROUPS, PROJ_INDEX, ModelConfig
from asyncserve.model.linear import Linear
from asyncserve.model.llama import NativeStepLora
from asyncserve.pager.adapters import AdapterError


# ||W_o + s (BA)_o||^2 below this part of ||W_o||^2 + s^2 ||(BA)_o||^2 is cancellation in float32
NORM2_FLOOR = 1e-5


def group_columns(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection group's columns in a DoRA scale row: the groups' outputs end to end, GROUPS order."""
    shapes = config.projection_shapes()
    columns, start = {}, 0
    for group, projs in GROUPS.items():
        width = sum(shapes[p][1] for p in projs)
        columns[group] = (start, start + width)
        start += width
    return columns


class DoraBase:
    """The base model's side of DoRA's scales: the base projections as they were loaded (an adapter
    merged meanwhile does not count: ``base_linear`` gives the originals) and their rows' squared norms,
    read once per layer and group."""

    def __init__(self, config: ModelConfig, base_linear: Callable[[int, str], Linear],
                 refusal: Callable[[], str | None] = lambda: None):
        self.config = config
        self.base_linear = base_linear
        self.refusal = refusal              # why DoRA (and LoRA on the embeddings) cannot be served here, or None
        self.columns = group_columns(config)
        self.width = max(end for _, end in self.columns.values())
        self._norm2: dict[tuple[int, str], torch.Tensor] = {}

    def _row_norm2(self, layer: int, group: str, linear: Linear) -> torch.Tensor:
        """||W_o||^2 per output row of the group's base weight, float32 [out of the group]."""
        key = (layer, group)
        if key not in self._norm2:
            self._norm2[key] = linear.dense_weight().float().square().sum(1)
        return self._norm2[key]

    def layer_scales(self, name: str, layer: int,
                     rows: dict[int, tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]]) -> torch.Tensor:
        """g for one layer of adapter ``name``, [width] float32 on the CPU (1 outside the DoRA projections).
        rows: projection index -> (A [r, in], B^T [r, out], scaling, magnitude [out])."""
        if (why := self.refusal()) is not None:
            raise AdapterError(f"adapter {name!r} is a DoRA adapter, {why}")
        shapes = self.config.projection_shapes()
        scale = torch.ones(self.width, dtype=torch.float32)
        for group, projs in GROUPS.items():
            present = [p for p in projs if PROJ_INDEX[p] in rows]
            if not present:
                continue
            linear = self.base_linear(layer, group)
            device = linear.weight.device if isinstance(linear.weight, torch.Tensor) else torch.device("cpu")
            norm2 = self._row_norm2(layer, group, linear)
            col = self.columns[group][0]
            offset = 0
            for proj in projs:
                fan_out = shapes[proj][1]
                if proj in present:
                    a, bt, s, magnitude = rows[PROJ_INDEX[proj]]
                    a32, bt32 = a.to(device).float(), bt.to(device).float()          # [r, in], [r, out]
                    wa = linear(a.to(device)).float()[:, offset:offset + fan_out]    # (A W^T): [r, out]
                    cross = (bt32 * wa).sum(0)                                       # [out]
                    ba2 = ((a32 @ a32.T) @ bt32 * bt32).sum(0)                       # ||(BA)_o||^2: [out]
                    terms = norm2[offset:offset + fan_out] + s * s * ba2
                    n2 = terms + 2 * s * cross
                    g = magnitude.to(device).float() / n2.clamp_min(0).sqrt()
                    # a norm lost in the rounding of its terms (a row adapted to ~0) has no scale worth serving
                    g[n2 <= NORM2_FLOOR * terms] = torch.inf
                    scale[col + offset:col + offset + fan_out] = g.cpu()
                offset += fan_out
        if not bool(torch.isfinite(scale).all()):
            raise AdapterError(f"adapter {name!r}: its DoRA scales in layer {layer} (magnitude / the norm of "
                               "W + s·B·A) are not finite: a row of the adapted weight has norm (nearly) 0, "
                               "or the magnitude overflows")
        return scale


class DoraRun(NamedTuple):
    """A run of one DoRA adapter's rows in a step."""
    start: int
    end: int
    scale: torch.Tensor          # its g [L, width] on the step's device
    groups: int                  # bit i set: GROUPS' i-th group has DoRA projections (the others' g is 1)


def add_dora_run(runs: list[DoraRun], start: int, end: int, scale: torch.Tensor | None, ranks: list[int]) -> None:
    """Rows [start, end) of an adapter with these ranks (PROJECTIONS order) join the step's DoRA runs if
    it has a scale (a run right after the same adapter's previous one extends it)."""
    if scale is None:
        return
    if runs and runs[-1].end == start and runs[-1].scale is scale:
        runs[-1] = runs[-1]._replace(end=end)
    else:
        groups = sum(1 << i for i, projs in enumerate(GROUPS.values()) if any(ranks[PROJ_INDEX[p]] for p in projs))
        runs.append(DoraRun(start, end, scale, groups))


class DoraLora:
    """The LoraHook a step with DoRA adapters runs under: the inner hook's projections, then each DoRA
    adapter's rows of the output scaled by its g; in the one-call native layer loop, the inner hook's
    step with the same runs and scales (kernels/cpu/decoder.h scales them as ``project`` does)."""

    def __init__(self, inner, runs: list[DoraRun], columns: dict[str, tuple[int, int]]):
        self.inner = inner
        self.runs = runs
        self.columns = columns
        self.group_bit = {group: 1 << i for i, group in enumerate(GROUPS)}

    @property
    def active(self) -> bool:
        return self.inner.active

    def native_step(self) -> NativeStepLora | None:
        inner = self.inner.native_step()
        if inner is None:
            return None
        scales = list({id(run.scale): run.scale for run in self.runs}.values())
        index = {id(scale): i for i, scale in enumerate(scales)}
        runs = torch.tensor([(r.start, r.end, index[id(r.scale)], r.groups) for r in self.runs], dtype=torch.int64)
        bounds = [start for start, _ in self.columns.values()] + [max(end for _, end in self.columns.values())]
        return dataclasses.replace(inner, dora_runs=runs, dora_scales=scales, dora_columns=bounds)

    def experts(self):
        return self.inner.experts()      # a DoRA adapter has no LoRA on the experts (adapters.py refuses it)

    def project(self, layer: int, group: str, x: torch.Tensor, base: Linear) -> torch.Tensor:
        y = self.inner.project(layer, group, x, base)          # [T, out of the group]
        c0, c1 = self.columns[group]
        bit = self.group_bit[group]
        for run in self.runs:
            if run.groups & bit:
                y[run.start:run.end] *= run.scale[layer, c0:c1]
        return y
