"""dLoRA's merged mode (§4): one adapter folded into the base weights, W' = W + s·B·A for every
projection it targets (a DoRA adapter's rows times its scale g: lora/dora.py), so its tokens run the
base GEMMs alone, with no LoRA compute.

Merging builds new Linear objects for the projection groups the adapter targets (of the same kind:
on CPU oneDNN's packed layout is rebuilt from the merged dense weight) and keeps the original
objects; unmerging puts those very objects back. The base weights so return bit for bit, nothing
is ever subtracted, and an unmerge costs next to nothing. The price is one extra copy of the
targeted groups while an adapter is merged. The merge reads the adapter's rows from the pool once;
the engine holds a pager reference on the merged load until it is unmerged, so its pages stay.

Only the stepper's torch thread switches (``WeightMerger.switch``, at the start of a step whose
``StepPlan.merged`` differs from what is merged); the event loop reads the measurements between steps.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from asyncserve.lora.backend import LoraBackend, group_layout
from asyncserve.lora.dora import group_columns
from asyncserve.model.checkpoint import all_finite
from asyncserve.model.config import GROUPS, PROJ_INDEX, ModelConfig
from asyncserve.model.linear import Linear, NativeLinear, OneDnnLinear, QuantLinear
from asyncserve.model.llama import LlamaWeights, pool_rows
from asyncserve.pager.pager import DeviceAdapter
from asyncserve.pager.pool import PagedPool
from asyncserve.step import StepPlan

# The Linear kinds whose weight can be rebuilt exactly from a merged dense copy.
MERGEABLE = (Linear, OneDnnLinear, NativeLinear)
# Seconds per base-weight element a switch rewrites, until this process has measured one. A merge:
# the delta GEMMs, the add and cast and, on CPU, oneDNN's reorders (SmolLM2 with W1's adapters on
# q/k/v/o, 26.5 M elements, bf16, one thread of a busy 2-core EPYC: 81 ms; bench_offline.py --merge).
# An unmerge swaps the original objects back and frees the merged copies (0.2 ms there).
MERGE_PRIOR_S_PER_ELEMENT = 3e-9
UNMERGE_PRIOR_S_PER_ELEMENT = 1e-11


class MergeError(RuntimeError):
    """An adapter cannot be merged into these base weights exactly, or a plan breaks StepPlan.merged's
    contract (a programming error of the policy that made it)."""


def merged_load(plan: StepPlan) -> int | None:
    """The adapter load a plan runs merged, None for an unmerged plan. MergeError unless every chunk
    is that adapter's, all of one load (a name reloaded while its old load still runs has two)."""
    if plan.merged is None:
        return None
    others = {c.seq.adapter for c in plan.chunks if c.seq.adapter != plan.merged}
    if others:
        names = ", ".join(sorted("the base model" if a is None else repr(a) for a in others))
        raise MergeError(f"a plan merging {plan.merged!r} holds chunks of {names}")
    loads = {c.seq.adapter_load for c in plan.chunks}
    if len(loads) != 1:
        raise MergeError(f"a plan merging {plan.merged!r} holds chunks of {len(loads)} loads of it; "
                         "one load can be merged")
    return loads.pop()


def unmergeable_reason(weights: LlamaWeights) -> str | None:
    """Why no adapter can be merged into these base weights, None if any can."""
    for li, lw in enumerate(weights.layers):
        for group in GROUPS:
            linear = getattr(lw, group)
            if linear is None:              # a mixture of experts without a dense MLP: no adapter targets it
                continue
            if isinstance(linear, QuantLinear):
                return (f"layer {li}'s {group} projection is kept in GGUF blocks, which cannot take an adapter "
                        "merged in exactly; adapters run unmerged only (serve without --keep-quantized and "
                        "--quantize to merge)")
            if type(linear) not in MERGEABLE or not linear.weight.dtype.is_floating_point:
                return (f"layer {li}'s {group} projection is a {type(linear).__name__} over {linear.weight.dtype} "
                        "weights, which cannot take an adapter merged in exactly; adapters run unmerged only")
    return None


class WeightMerger:
    """Swaps the base weights between their originals and one adapter merged in."""

    def __init__(self, config: ModelConfig, weights: LlamaWeights, pool: PagedPool, lora: LoraBackend):
        self.weights = weights
        self.pool = pool
        self.lora = lora
        self.layout = group_layout(config)
        self.columns = group_columns(config)
        self.num_layers = config.num_layers
        self.merged: DeviceAdapter | None = None
        self.merged_load: int | None = None
        self._originals: dict[tuple[int, str], Linear] = {}      # (layer, group) -> the base Linear it replaced
        self.refused: dict[int, str] = {}                         # load -> why its merge failed (an overflow)
        # switches so far (changes of what is merged), and per kind ("merge" | "unmerge") the seconds
        # measured and the base-weight elements rewritten
        self.switches = 0
        self.seconds = {"merge": 0.0, "unmerge": 0.0}
        self.elements = {"merge": 0, "unmerge": 0}

    @property
    def unsupported(self) -> str | None:
        """Why no adapter can be merged into the base weights, None if any can."""
        return unmergeable_reason(self.weights)

    def groups_of(self, ranks: list[int]) -> list[str]:
        """The projection groups an adapter with these ranks (PROJECTIONS order) changes."""
        return [g for g, rows in self.layout.items() if any(ranks[PROJ_INDEX[proj]] for proj, *_ in rows)]

    def elements_of(self, ranks: list[int]) -> int:
        """Base-weight elements that merging an adapter with these ranks rewrites."""
        # a group's weight: its projections' outputs stacked, [sum of out, in]
        return self.num_layers * sum(rows[0][1] * sum(fan_out for _, _, fan_out, _ in rows)
                                     for g, rows in self.layout.items() if g in self.groups_of(ranks))

    def estimate_seconds(self, kind: str, ranks: list[int]) -> float:
        """A merge's or unmerge's time for an adapter with these ranks: at the rate measured so far,
        or the prior rate before any."""
        done = self.elements[kind]
        if done:
            rate = self.seconds[kind] / done
        else:
            rate = MERGE_PRIOR_S_PER_ELEMENT if kind == "merge" else UNMERGE_PRIOR_S_PER_ELEMENT
        return rate * self.elements_of(ranks)

    def switch(self, load: int | None, resident: Mapping[int, DeviceAdapter]) -> float:
        """Make ``load`` the merged adapter (None: the original weights); returns the seconds it took."""
        if load == self.merged_load:
            return 0.0
        t0 = time.perf_counter()
        if self.merged is not None:
            self._timed("unmerge", self.merged, self._unmerge)
        if load is not None:
            adapter = resident[load]
            self._timed("merge", adapter, lambda: self._merge(adapter, load))
            self.merged, self.merged_load = adapter, load
        self.switches += 1
        return time.perf_counter() - t0

    def _timed(self, kind: str, adapter: DeviceAdapter, fn) -> None:
        t0 = time.perf_counter()
        fn()
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        self.seconds[kind] += time.perf_counter() - t0
        self.elements[kind] += self.elements_of(adapter.ranks)

    def original(self, layer: int, group: str) -> Linear:
        """The base projection as loaded, also while an adapter is merged into it."""
        return self._originals.get((layer, group)) or getattr(self.weights.layers[layer], group)

    def refusal(self, load: int) -> str | None:
        """Why the adapter load cannot be merged: the base weights take no merge, or it overflowed them."""
        return self.unsupported or self.refused.get(load)

    def _merge(self, adapter: DeviceAdapter, load: int) -> None:
        """W + s·B·A per targeted projection, in float32, rounded once to the weights' dtype. All merged
        groups are built before any is swapped in, so a refusal leaves the base weights as they were."""
        if (refusal := self.refusal(load)) is not None:
            raise MergeError(f"cannot merge adapter {adapter.name!r}: {refusal}")
        flat = self.pool.flat
        scaling = adapter.scaling.tolist()                              # [L][P]
        merged: dict[tuple[int, str], Linear] = {}
        for li, lw in enumerate(self.weights.layers):
            for group in self.groups_of(adapter.ranks):
                base = getattr(lw, group)
                if base is None:        # a linear-attention layer's q/k/v/o (Qwen3.5): no adapter targets it
                    continue
                dense = base.dense_weight()
                w = dense.to(torch.float32, copy=True)                  # [out, in]
                for proj, fan_in, fan_out, col in self.layout[group]:
                    p = PROJ_INDEX[proj]
                    r = adapter.ranks[p]
                    if r == 0:
                        continue
                    a = pool_rows(flat, adapter.a_ptr[li, p, :r], fan_in).float()      # [r, in]
                    bt = pool_rows(flat, adapter.b_ptr[li, p, :r], fan_out).float()    # [r, out] (B^T)
                    w[col:col + fan_out].addmm_(bt.t(), a, alpha=scaling[li][p])
                if adapter.dora_scale is not None:          # DoRA: each output row times its g
                    c0, c1 = self.columns[group]
                    w.mul_(adapter.dora_scale[li, c0:c1, None])
                w = w.to(dense.dtype)
                if not all_finite(w):
                    self.refused[load] = f"it overflows layer {li}'s {group} weights in {w.dtype}"
                    raise MergeError(f"cannot merge adapter {adapter.name!r}: {self.refused[load]}; it can run "
                                     "unmerged only")
                merged[(li, group)] = type(base)(w)
        for (li, group), linear in merged.items():
            self._originals[(li, group)] = getattr(self.weights.layers[li], group)
            self.weights.set_projection(li, group, linear)
        self.lora.base_weights_changed()

    def _unmerge(self) -> None:
        for (li, group), linear in self._originals.items():
            self.weights.set_projection(li, group, linear)
        self._originals.clear()
        self.merged, self.merged_load = None, None
        self.lora.base_weights_changed()
