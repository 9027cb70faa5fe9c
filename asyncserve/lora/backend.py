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
Building a set's stacks, reordering them for oneDNN and fusing them into base weights copy bytes
in proportion to the set's ranks: a rank-256 adapter on every projection is 150 MB in bf16 for
SmolLM2, and doing any of the three at once stalled every stream for 0.4-0.9 s on 2 cores. So each
step does at most ``build_bytes_per_step`` of that work, a layer at a time: until a set's stacks
are complete its tokens are computed per adapter straight from its pool rows, and layers not yet
packed or fused run on the plain stacks.
With the native CPU kernels (kernels/cpu, ``cpu_kernels.enabled_for``) and mode "auto", none of
that runs: per group, one ``lora_segments`` call reads each run's A and B^T rows straight from the
pool pages through the step tables and computes only its own rank (no stacks to build or pack, no
mask, no per-adapter GEMM call). For W1 on SmolLM2 in bf16 (scripts/bench_native.py, Zen 4, 2
threads) its LoRA costs 15 and 12 us beyond the base GEMM per layer for q/k/v and o at 16 decodes,
against 55 and 37 us for the packed stacks with the shrink fused into the base GEMM, and 92 and
51 us against 303 and 131 us for a 256-token prefill step. The stacked and loop plans stay the path
without the kernels (ASYNCSERVE_NATIVE=0, no compiler, float16).
The Triton backend (lora/triton_backend.py) reads the pages in place too.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

import kernels.cpu as cpu_kernels
from asyncserve.lora.batch import LoraBatch, SlotTables
from asyncserve.model.checkpoint import all_finite
from asyncserve.model.config import GROUPS, PROJ_INDEX, PROJECTIONS, ModelConfig
from asyncserve.model.linear import Linear, QuantLinear, make_linear, onednn_packs
from asyncserve.model.llama import ExpertLora, NativeStepLora, pool_rows
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

    def native_step(self) -> NativeStepLora | None:
        """The step's LoRA for the native layer loop, where lora_segments computes all of it (None here:
        the model calls project per group)."""
        return None

    def experts(self) -> ExpertLora | None:
        """The step's LoRA on the routed experts (None here: no adapter has any)."""
        return None

    def base_weights_changed(self) -> None:
        """The base projections were replaced (an adapter merged or unmerged): drop what was built from them."""

    def warm_up(self) -> float:
        """Compile whatever the backend's kernels would compile on first use, before a request waits
        for it; returns the seconds it took (nothing to compile here)."""
        return 0.0


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
# Bytes of stack building, packing and fusing one step may do: W1's four adapters (~16 MB of
# stacks in bf16) are built in one step; larger sets take a few.
STACK_BUILD_BYTES_PER_STEP = 24 * 2**20
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
                 pack_after_steps: int = PACK_AFTER_STEPS, build_bytes_per_step: int | None = None):
        """mode: "auto" (the native kernel where it runs, else per step and group whichever of the stacked
        and loop plans costs less), "stacked" or "loop"."""
        if mode not in ("auto", "stacked", "loop"):
            raise ValueError(f"mode must be 'auto', 'stacked' or 'loop', got {mode!r}")
        self.pool = pool
        self.layout = group_layout(config)
        self.mode = mode
        self.native = cpu_kernels.enabled_for(pool.flat)      # whether lora_segments runs here (mode "auto")
        # per group, what lora_segments needs of its projections: [P_g, 3] (projection, column, width)
        self._native_projections = {
            group: torch.tensor([(PROJ_INDEX[proj], col, fan_out) for proj, _, fan_out, col in rows], dtype=torch.int64)
            for group, rows in self.layout.items()}
        self.pack_after_steps = pack_after_steps
        self.turn_macs = {group: loop_turn_macs(pool.device, pool.dtype, rows[0][1], sum(r[2] for r in rows))
                          for group, rows in self.layout.items()}
        self.build_bytes_per_step = STACK_BUILD_BYTES_PER_STEP if build_bytes_per_step is None else build_bytes_per_step
        self._set_key: tuple | None = None
        self._builds: dict[str, StackBuild] = {}        # the set's stacks under construction, by group
        self._budget_left = 0                            # bytes of stack work this step may still do
        # group -> (A_stack [L, R, in], B_stack [L, R, out] with the scaling folded in, column owner [R]
        #           int64 (place in the stacks), per place its column range (c0, c1), None if untargeted,
        #           whether every value of both stacks is finite)
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, list, bool]] = {}
        # group -> per layer the stacked plan's GEMMs (x -> x @ A_stack^T, s -> s @ B_stack)
        self._linears: dict[str, list[StackLinears]] = {}
        self._set_steps = 0                     # steps the active set has lasted
        # (group, layer) -> Linear over [W; A_stack] (or None: not fused), built once packed; cleared
        # with the stacks (whatever changes the base weights, e.g. merging an adapter, must clear it too)
        self._fused: dict[tuple[str, int], Linear | None] = {}
        # group -> ("stacked", mask [tokens, R]), ("loop", [(row spans, c0, c1)]), while the stacks
        # are built ("pool", [(row spans, adapter, its scalings, [(projection, r, in, out, column)])]),
        # or with the native kernels ("native", (runs [num_runs, 3], the slot tables))
        self._plans: dict[str, tuple[str, object]] = {}
        # the native plans' and the experts' adapter tables, kept across steps
        self.slot_tables = SlotTables(config.num_layers, len(config.lora_projections()))
        self._experts: ExpertLora | None = None

    @property
    def active(self) -> bool:
        return bool(self._plans) or self._experts is not None

    def native_step(self) -> NativeStepLora | None:
        if not self._plans or any(kind != "native" for kind, _ in self._plans.values()):
            return None
        runs, tables = next(iter(self._plans.values()))[1]       # one runs tensor for all groups
        return NativeStepLora([runs if g in self._plans else None for g in GROUPS],
                              [self._native_projections[g] for g in GROUPS], self.pool.flat, tables)

    def experts(self) -> ExpertLora | None:
        return self._experts

    def begin_step(self, batch: LoraBatch | None) -> None:
        self._plans = {}
        self._experts = None
        if batch is None or batch.empty:
            return
        self._experts = expert_step(batch, self.slot_tables, self.pool.flat)
        if self.native and self.mode == "auto":
            self._plans = self._native_plans(batch)
            return
        self._budget_left = self.build_bytes_per_step
        # The stacks hold the active set in a fixed order (by name), so a step that lists the same
        # adapters in another order (e.g. once the oldest request has finished) reuses them.
        order = sorted(range(len(batch.adapters)), key=lambda i: batch.adapters[i].name)
        key = tuple((batch.adapters[i].name, batch.adapters[i].generation) for i in order)
        if key != self._set_key:
            adapters = [batch.adapters[i] for i in order]
            self._builds = {g: b for g in GROUPS if (b := StackBuild.plan(self.pool, self.layout[g], adapters))}
            self._stacks, self._linears, self._fused = {}, {}, {}
            self._set_key, self._set_steps = key, 0
        if self._builds and not self._build_some():
            self._plans = self._pool_plans(batch)
            return
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
                self._linears[group] = self._stack_linears(group, packed)
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

    def _take(self, nbytes: int) -> bool:
        """Whether a piece of stack work of ``nbytes`` may run in this step (then it is counted): while
        the step's budget lasts, and a first piece always, so that every build goes forward."""
        if self._budget_left <= 0 and self._budget_left != self.build_bytes_per_step:
            return False
        self._budget_left -= nbytes
        return True

    def _build_some(self) -> bool:
        """Fill the set's stacks a layer at a time while the step's budget lasts; True once every
        group's stacks are complete (they then move to ``_stacks``)."""
        for group, build in list(self._builds.items()):
            while not build.done and self._take(build.layer_bytes):
                build.fill_next_layer()
            if not build.done:
                return False
            self._stacks[group] = build.stacks()
            del self._builds[group]
        return True

    def _pool_plans(self, batch: LoraBatch) -> dict[str, tuple[str, object]]:
        """While the set's stacks are being built: per group, each adapter's token spans with its
        projections, whose rows apply() reads straight from the pool."""
        spans = adapter_spans(batch)
        plans = {}
        for group, rows in self.layout.items():
            work = []
            for i, runs in spans.items():
                adapter = batch.adapters[i]
                projs = [(PROJ_INDEX[proj], adapter.ranks[PROJ_INDEX[proj]], fan_in, fan_out, col)
                         for proj, fan_in, fan_out, col in rows if adapter.ranks[PROJ_INDEX[proj]]]
                if projs:
                    work.append((runs, adapter, adapter.scaling.tolist(), projs))
            if work:
                plans[group] = ("pool", work)
        return plans

    def _native_plans(self, batch: LoraBatch) -> dict[str, tuple[str, object]]:
        """Per group that some run's adapter targets: the runs of one adapter's consecutive tokens (in token
        order, each naming its adapter's slot) and the slot tables, which lora_segments follows into the pool."""
        spans = adapter_spans(batch)
        data = (slot_runs(batch, self.slot_tables.slots(batch.adapters)), self.slot_tables.tensors)
        return {group: ("native", data) for group, rows in self.layout.items()
                if any(batch.adapters[i].ranks[PROJ_INDEX[proj]] for i in spans for proj, *_ in rows)}

    def _stack_linears(self, group: str, packed: bool) -> list[StackLinears]:
        """Per layer, the stacked plan's shrink and expand: over views of the stacks, or (packed) over
        make_linear's copies, which on CPU are oneDNN's reordered layout; layers are packed while the
        step's budget lasts, the rest on a later step."""
        a_stack, b_stack = self._stacks[group][0], self._stacks[group][1]
        layers = self._linears.get(group) or [StackLinears(Linear(a), Linear(b.t()), False)
                                              for a, b in zip(a_stack, b_stack)]
        if packed and not layers[-1].packed:           # packed in layer order: the last one means all
            nbytes = (a_stack[0].numel() + b_stack[0].numel()) * a_stack.element_size()
            for layer, linears in enumerate(layers):
                if not linears.packed and self._take(nbytes):
                    layers[layer] = StackLinears(make_linear(a_stack[layer]), make_linear(b_stack[layer].t()), True)
        return layers

    def project(self, layer: int, group: str, x: torch.Tensor, base: Linear) -> torch.Tensor:
        if group not in self._plans:        # no step adapter targets the group: the base projection alone
            return base(x)
        fused = self._fused_linear(layer, group, base)
        if fused is None:
            return super().project(layer, group, x, base)
        out = fused(x)                                      # [tokens, out + R]: base output, then s
        y = out[:, :base.out_features]
        y.add_(self._linears[group][layer].expand(out[:, base.out_features:] * self._plans[group][1]))
        return y

    def _fused_linear(self, layer: int, group: str, base: Linear) -> Linear | None:
        plan = self._plans.get(group)
        if plan is None or plan[0] != "stacked" or not self._linears[group][layer].packed:
            return None
        key = (group, layer)
        if key not in self._fused:
            # a quantized base stays in its blocks: fusing would multiply a dense copy of it
            fuse = (onednn_packs(self.pool.device, self.pool.dtype) and base.nbytes <= FUSE_MAX_WEIGHT_BYTES
                    and not isinstance(base, QuantLinear))
            if fuse and not self._take(base.nbytes + self._stacks[group][0][layer].nbytes):
                return None                                 # this layer is fused on a later step
            self._fused[key] = (make_linear(torch.cat([base.dense_weight(), self._stacks[group][0][layer]]))
                                if fuse else None)
        return self._fused[key]

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        plan = self._plans.get(group)
        if plan is None:
            return
        kind, data = plan
        if kind == "native":
            runs, tables = data
            cpu_kernels.lora_segments(y, x, self.pool.flat, runs, *tables, layer, self._native_projections[group])
            return
        if kind == "stacked":
            shrink, expand, _ = self._linears[group][layer]
            s = shrink(x)                         # [tokens, R]
            s.mul_(data)
            y.add_(expand(s))
            return
        if kind == "pool":
            flat = self.pool.flat
            for runs, adapter, scaling, projs in data:
                for p, r, fan_in, fan_out, col in projs:
                    a = pool_rows(flat, adapter.a_ptr[layer, p, :r], fan_in)        # [r, in]
                    b = pool_rows(flat, adapter.b_ptr[layer, p, :r], fan_out)       # [r, out]
                    for sl in runs:
                        y[sl, col:col + fan_out].addmm_(x[sl] @ a.t(), b, alpha=scaling[layer][p])
            return
        a_stack, b_stack = self._stacks[group][0][layer], self._stacks[group][1][layer]
        for rows, c0, c1 in data:
            for sl in rows:
                y[sl].addmm_(x[sl] @ a_stack[c0:c1].t(), b_stack[c0:c1])

    def base_weights_changed(self) -> None:
        self._fused = {}


class StackBuild:
    """One group's stacks for a set of adapters, as ``TorchLoraBackend._stacks`` holds them, filled
    one layer per call: A_stack [L, R, in] gathered from the pool, B_stack [L, R, out] with each
    projection's B^T rows, scaled, at its output columns and zeros elsewhere."""

    def __init__(self, flat: torch.Tensor, fan_in: int, out_total: int, num_layers: int, a_offsets: torch.Tensor,
                 b_parts: list, owner: torch.Tensor, ranges: list):
        self.flat, self.fan_in = flat, fan_in
        self.a_offsets = a_offsets           # [L, R] flat offsets of the A rows
        # per targeted projection: (out, column, B^T row offsets [L, R_p], scalings [L, R_p], stack rows [R_p])
        self.b_parts = b_parts
        self.owner, self.ranges = owner, ranges
        width = a_offsets.shape[1]
        # empty, not zeros: each layer is zeroed as it is filled, so that cost is spread over steps too
        self.a_stack = torch.empty(num_layers, width, fan_in, dtype=flat.dtype, device=flat.device)
        self.b_stack = torch.empty(num_layers, width, out_total, dtype=flat.dtype, device=flat.device)
        self.layer_bytes = width * (fan_in + out_total) * flat.element_size()
        self.next_layer, self.finite = 0, True

    @classmethod
    def plan(cls, pool: PagedPool, layout, adapters: list[DeviceAdapter]) -> StackBuild | None:
        """Where the set's rows of the group are (offsets, owners, column ranges; nothing copied yet),
        or None if no adapter targets the group."""
        device = pool.flat.device
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
        parts = [(fan_out, col, torch.cat(b_parts[proj][0], dim=1), torch.cat(b_parts[proj][1], dim=1).to(device),
                  torch.tensor(b_parts[proj][2], device=device))
                 for proj, _, fan_out, col in layout if b_parts[proj][0]]
        a_offsets = torch.cat(a_offsets, dim=1)
        return cls(pool.flat, layout[0][1], sum(fan_out for _, _, fan_out, _ in layout), a_offsets.shape[0],
                   a_offsets, parts, torch.cat(owners).to(device), ranges)

    @property
    def done(self) -> bool:
        return self.next_layer == self.a_stack.shape[0]

    def fill_next_layer(self) -> None:
        layer = self.next_layer
        a, b = self.a_stack[layer], self.b_stack[layer]
        a.copy_(pool_rows(self.flat, self.a_offsets[layer], self.fan_in))
        b.zero_()
        for fan_out, col, offsets, scales, stack_rows in self.b_parts:
            rows = pool_rows(self.flat, offsets[layer], fan_out)                  # [R_p, out_p]
            b[stack_rows, col:col + fan_out] = (rows.float() * scales[layer, :, None]).to(b.dtype)
        self.finite = self.finite and all_finite(a) and all_finite(b)
        self.next_layer += 1

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list, bool]:
        return self.a_stack, self.b_stack, self.owner, self.ranges, self.finite


class StackLinears(NamedTuple):
    """One layer's stacked-plan GEMMs of a group."""
    shrink: Linear        # x -> x @ A_stack^T
    expand: Linear        # s -> s @ B_stack
    packed: bool          # over make_linear's copies (oneDNN's layout on CPU), not views of the stacks


def expert_step(batch: LoraBatch, slot_tables: SlotTables, flat: torch.Tensor) -> ExpertLora | None:
    """The step's LoRA on a mixture's routed experts and gates, over the slot tables, if a step adapter
    has any."""
    if not any(any(a.ranks[len(PROJECTIONS):]) for a in batch.adapters):
        return None
    slots = slot_tables.slots(batch.adapters)
    return ExpertLora(flat, batch.token_adapter(slots), slot_runs(batch, slots), slot_tables.tensors)


def slot_runs(batch: LoraBatch, slots: list[int]) -> torch.Tensor:
    """[num_runs, 3] int64: each run of one adapter's consecutive tokens (first, end, its adapter's slot),
    in token order, as lora_segments takes them."""
    spans = adapter_spans(batch)
    return torch.tensor(sorted((sl.start, sl.stop, slots[i]) for i, slices in spans.items() for sl in slices),
                        dtype=torch.int64).view(-1, 3)


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
