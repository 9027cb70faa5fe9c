"""ModelRunner: turns a StepPlan into tensors, runs the model on the pool, samples next tokens.

Only this object touches the model weights; the server's stepper runs ``run`` in its own thread.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from asyncserve.lora.backend import LoraBackend, TorchLoraBackend
from asyncserve.lora.batch import LoraBatch
from asyncserve.lora.dora import DoraBase, DoraLora, add_dora_run
from asyncserve.lora.vocab import VocabStep, add_vocab_run
from asyncserve.model.config import ModelConfig
from asyncserve.model.linear_attention import LinearStates, LinearStep, StateRun
from asyncserve.model.llama import LlamaWeights, PrefillChunk, Rope, StepInputs, decode_masks, forward
from asyncserve.pager.pager import AdapterPager, DeviceAdapter
from asyncserve.pager.pool import PagedPool
from asyncserve.step import SampleOutput, StepPlan, StepResult
from asyncserve.stepper.merge import WeightMerger, merged_load
from asyncserve.stepper.assist import AssistedLora, CpuAssist
from asyncserve.sequence import Sequence
from asyncserve.stepper.cuda_graphs import DecodeBatch, DecodeGraphs, GraphSeam
if TYPE_CHECKING:
    from asyncserve.stepper.tp import TensorParallel
from asyncserve.stepper.sampler import (PlainRow, SamplingRow, plain_columns, plain_output, plain_row, sample,
                                        token_logprobs)


@dataclass
class PromptRows:
    """The step's rows whose logits score prompt tokens (params.prompt_logprobs), after the sampled rows."""
    targets: list[int] = field(default_factory=list)              # per row: the prompt token it predicts
    owners: list[tuple[str, int, int]] = field(default_factory=list)   # (request id, rows, top-N) per chunk


def make_lora_backend(name: str, pool: PagedPool, config: ModelConfig) -> LoraBackend:
    if name == "torch":
        return TorchLoraBackend(pool, config)
    from asyncserve.lora.triton_backend import TritonLoraBackend
    return TritonLoraBackend(pool, config)


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: LlamaWeights, pool: PagedPool, pager: AdapterPager,
                 lora: LoraBackend, eos_token_ids: list[int], state_slots: int = 0):
        self.config = config
        self.assist: CpuAssist | None = None         # CPU LoRA workers for cold adapters (Engine sets them)
        self.tp: TensorParallel | None = None        # the other tensor-parallel ranks (Engine sets them)
        self.weights = weights
        self.pool = pool
        self.pager = pager
        self.lora = lora
        self.eos_token_ids = eos_token_ids
        self.device = pool.device
        self.rope = Rope(config, self.device, pool.dtype)
        self._row_stride = 2 * config.kv_layers * pool.block_size   # kv rows per page
        # Qwen3.5: the sequences' linear-attention states, by the slots the scheduler hands out
        self.linear_states = LinearStates(config.linear_attention, sum(config.linear_layers), state_slots, pool.dtype,
                                          self.device) if config.linear_layers else None
        self.merger = WeightMerger(config, weights, pool, lora)      # dLoRA's merged mode
        # DoRA adapters' scales are worked out from the base weights as loaded, never merged ones
        self.dora_base = DoraBase(config, self.merger.original, self._tp_refusal)
        # decodes read their KV through kernels.paged_attention on CUDA (ASYNCSERVE_TRITON_ATTENTION=0: SDPA)
        self.paged_attention = self.device.type == "cuda" and os.environ.get("ASYNCSERVE_TRITON_ATTENTION") != "0"
        self.graphs: DecodeGraphs | None = None                    # enable_graphs
        self._plain_rows: dict[Sequence, PlainRow | None] = {}     # the last graph step's sequences' PlainRow

    def enable_graphs(self, seam: GraphSeam, max_batch: int, max_pages: int) -> None:
        """Replay decode steps of up to max_batch sequences (block tables up to max_pages) from graphs;
        takes one pool page for the padding rows' KV."""
        def make_inputs(ids, positions, write_rows, tables):
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return StepInputs(ids, positions, write_rows, len(ids), empty, empty.bool().view(0, 1, 1, 0), empty, [],
                              torch.arange(len(ids), device=self.device), decode_tables=tables)

        fixed = getattr(self.lora, "fixed_step", None)
        tables = getattr(self.lora, "slot_tables", None)
        self.graphs = DecodeGraphs(
            seam, self.device, max_batch, max_pages, self.pool.reserve(), self.pool.block_size, self._row_stride,
            lambda inputs, lora: forward(self.weights, self.config, self.rope, self.pool.kv_view(), inputs, lora),
            make_inputs, fixed, (lambda: tables.tensors[1].shape[-1]) if tables else None,
            (lambda: (tables.version, self.merger.switches)) if tables else (lambda: self.merger.switches))

    def _tp_refusal(self) -> str | None:
        """Why adapters that need whole base rows (DoRA) or the embeddings (LoRA on them) are refused here."""
        return "not served with --tensor-parallel (the ranks hold parts of the rows)" if self.tp is not None else None

    def _graph_batch(self, plan: StepPlan) -> tuple[list[Sequence], DecodeBatch, bool] | None:
        """The step's sequences and rows for DecodeGraphs and whether it has LoRA, or None where it runs eagerly."""
        g, decodes = self.graphs, plan.decodes
        if (g is None or not decodes or plan.prefills or plan.assisted or plan.merged is not None
                or g.bucket(len(decodes)) is None or not all(c.samples and not c.draft for c in decodes)):
            return None
        seqs = [c.seq for c in decodes]
        loads = [s.adapter_load if s.adapter is not None else None for s in seqs]
        distinct = [load for load in dict.fromkeys(loads) if load is not None]
        if distinct and (g.lora_step is None or any(_unpaged_parts(self.pager.resident[a]) for a in distinct)):
            return None
        slot_of = {None: -1}
        if distinct:
            slot_of.update(zip(distinct, self.lora.slot_tables.slots([self.pager.resident[a] for a in distinct])))
        positions = [s.num_computed for s in seqs]
        batch = DecodeBatch([s.token_at(p) for s, p in zip(seqs, positions)], positions,
                            [s.block_table for s in seqs], [slot_of[load] for load in loads])
        return seqs, batch, bool(distinct)

    def _plain_columns(self, seqs: list[Sequence]) -> tuple[tuple, bool] | None:
        """plain_columns of a graph step's rows and whether one is ranked; None unless every row is plain.
        Each sequence's PlainRow is kept from the step before (the mapping is rebuilt over this step's)."""
        known = self._plain_rows
        self._plain_rows = rows = {s: known.get(s) or plain_row(s.params, s.guide, self.eos_token_ids, s.seed)
                                   for s in seqs}
        outputs = [len(s.output_ids) for s in seqs]
        plain = list(rows.values())
        if not all(p is not None and n >= p.plain_from for p, n in zip(plain, outputs)):
            return None
        return plain_columns(plain, outputs), any(p.ranked for p in plain)

    def _sampling_rows(self, plan: StepPlan) -> list[SamplingRow]:
        return [row for c in plan.chunks for row in self._chunk_rows(c)]

    def _chunk_rows(self, chunk) -> list[SamplingRow]:
        """A chunk's rows to sample: none mid-prompt, else one, and one per drafted token, each as if the
        draft before it had been sampled (its penalties, min_tokens and seed position)."""
        seq = chunk.seq
        return [SamplingRow(seq.params, seq.prompt_ids, seq.output_ids + chunk.draft[:j], self.eos_token_ids,
                            seq.seed, seq.guide and seq.guide.after(chunk.draft[:j]), seq.bad_words_ids)
                for j in range(chunk.num_sampled)]

    def _replay(self, plan: StepPlan, seqs: list[Sequence], batch: DecodeBatch, lora: bool) -> SampleOutput:
        """A decode step from its graph, sampled there where every row is plain (one copy of the tokens back)."""
        plain = self._plain_columns(seqs)
        if plain is None:
            return sample(self.graphs.replay(batch, lora, None), self._sampling_rows(plan))
        return plain_output(self.graphs.replay(batch, lora, *plain).tolist())

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        written = self.pager.write_pending(hold=plan.assisted)
        # after the page-ins: a merge reads the adapter's rows; the switch is timed apart from the step
        switch_s = self.merger.switch(merged_load(plan), self.pager.resident)
        graph_step = self._graph_batch(plan)
        if graph_step is not None:
            sampled = self._replay(plan, *graph_step)
            return StepResult(sampled, time.perf_counter() - t0 - switch_s, plan.num_tokens, {})
        inputs, lora_batch, rows, prompt_rows, cold, dora_runs = self._prepare(plan)
        self.lora.begin_step(lora_batch)
        lora = self.lora
        workers = 0
        if self.assist is not None:
            workers = self.assist.workers_for(*cold)
            self.assist.begin_step(*cold, workers)
            if self.assist.active:
                lora = AssistedLora(self.assist, self.lora)
        if dora_runs:
            lora = DoraLora(lora, dora_runs, self.dora_base.columns)
        reduce = None
        if self.tp is not None:          # the other ranks run the same step over their shards
            merged = self.merger.merged.generation if self.merger.merged is not None else None
            self.tp.send_step(inputs, lora_batch, written, merged, self.pager, (*cold, workers))
            reduce = self.tp.all_reduce_
        logits = forward(self.weights, self.config, self.rope, self.pool.kv_view(), inputs, lora, reduce)
        sampled = sample(logits[:len(rows)], rows)
        prompt_logprobs = self._prompt_logprobs(logits[len(rows):], prompt_rows) if prompt_rows.owners else {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.tp is not None:
            self.tp.check()
        return StepResult(sampled, time.perf_counter() - t0 - switch_s, plan.num_tokens, prompt_logprobs)

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, prompt_rows: PromptRows) -> dict:
        widths = [n for _, count, n in prompt_rows.owners for _ in range(count)]
        chosen, tops = token_logprobs(logits, torch.tensor(prompt_rows.targets), widths)
        out, i = {}, 0
        for request_id, count, _ in prompt_rows.owners:
            out[request_id] = (chosen[i:i + count], tops[i:i + count])
            i += count
        return out

    def _prepare(self, plan: StepPlan) -> tuple[StepInputs, LoraBatch | None, list[SamplingRow], PromptRows, tuple,
                                                 list]:
        """Also returns the CPU-assisted rows: (tasks [(host block, row0, row1, ranks)] over the cold
        rows, the cold rows' indices in the step), and the DoRA adapters' runs of rows (DoraLora), cold
        ones included; the inputs carry the runs of LoRA on the embeddings and the head (VocabStep)."""
        bs = self.pool.block_size
        ids, positions, write_rows, sample_index, rows = [], [], [], [], []
        prompt_index, prompt_rows = [], PromptRows()
        prefills = []
        seg_starts, seg_adapter, adapters, adapter_index = [0], [], [], {}
        cold_tasks, cold_rows = [], []
        dora_runs, vocab, prompt_head_runs, linear_lora = [], VocabStep(), [], []
        num_decode_chunks = len(plan.decodes)
        for i, chunk in enumerate(plan.chunks):
            seq = chunk.seq
            start = len(ids)
            for pos in range(seq.num_computed, seq.num_computed + chunk.num_tokens):
                ids.append(chunk.token_at(pos))
                positions.append(pos)
                write_rows.append(seq.block_table[pos // bs] * self._row_stride + pos % bs)
            chunk_rows = self._chunk_rows(chunk)
            sample_start, prompt_start = len(sample_index), len(prompt_index)
            sample_index += range(len(ids) - len(chunk_rows), len(ids))
            rows += chunk_rows
            if seq.params.prompt_logprobs is not None:
                # each position's logits score the next prompt token; a sequence recomputed after a
                # preemption skips the tokens it already has
                first = max(seq.num_computed, len(seq.prompt_logprobs))
                last = min(seq.num_computed + chunk.num_tokens, len(seq.prompt_ids) - 1)
                if last > first:
                    prompt_index += range(start + first - seq.num_computed, start + last - seq.num_computed)
                    prompt_rows.targets += seq.prompt_ids[first + 1:last + 1]
                    prompt_rows.owners.append((seq.request_id, last - first, seq.params.prompt_logprobs))
            if i >= num_decode_chunks:
                prefills.append(PrefillChunk(start, len(ids), seq.num_computed,
                                             torch.tensor(seq.block_table, dtype=torch.int64, device=self.device)))
            # LoRA segments: consecutive chunks of one adapter merge into one segment
            a, unpaged = -1, None
            if seq.adapter_load in plan.assisted:          # the workers add its LoRA: no device LoRA
                ranks = self.pager.load_ranks(seq.adapter_load)
                _add_cold_rows(cold_tasks, cold_rows, self.pager.host_block(seq.adapter_load), start, len(ids), ranks)
                unpaged = self.pager.load_unpaged(seq.adapter_load)
            # by load: a reloaded name may run old and new weights at once; a merged one needs no LoRA
            elif seq.adapter is not None and plan.merged is None:
                if seq.adapter_load not in adapter_index:
                    adapter_index[seq.adapter_load] = len(adapters)
                    adapters.append(self.pager.resident[seq.adapter_load])
                a = adapter_index[seq.adapter_load]
                unpaged, ranks = adapters[a], adapters[a].ranks
            if unpaged is not None:     # what the adapter has beside its pool rows: DoRA, embeddings, head
                add_dora_run(dora_runs, start, len(ids), unpaged.dora_scale, ranks)
                add_vocab_run(vocab.embed_runs, start, len(ids), unpaged.embed)
                add_vocab_run(vocab.head_runs, sample_start, len(sample_index), unpaged.head)
                add_vocab_run(prompt_head_runs, prompt_start, len(prompt_index), unpaged.head)
                add_vocab_run(linear_lora, start, len(ids), unpaged.linear_attn)
            if seg_adapter and seg_adapter[-1] == a:
                seg_starts[-1] = len(ids)
            else:
                seg_adapter.append(a)
                seg_starts.append(len(ids))

        # one decode row per token of the decodes: a drafted decode's rows attend as the decodes that
        # would have sampled its tokens one by one (so the same kernels give the same logits)
        nd = sum(c.num_tokens for c in plan.decodes)
        if nd:
            max_pages = max(len(c.seq.block_table) for c in plan.decodes)
            tables = [c.seq.block_table + [0] * (max_pages - len(c.seq.block_table))
                      for c in plan.decodes for _ in range(c.num_tokens)]
            decode_pages = torch.tensor(tables, dtype=torch.int64).flatten()
        else:
            decode_pages = torch.zeros(0, dtype=torch.int64)
        mask, decode_padding = decode_masks(torch.tensor(positions[:nd], dtype=torch.int64) + 1,
                                            len(decode_pages) // max(nd, 1), bs)
        dev = self.device
        inputs = StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            write_rows=torch.tensor(write_rows, dtype=torch.int64, device=dev),
            num_decode=nd,
            decode_pages=decode_pages.to(dev),
            decode_mask=mask[:, None, None, :].to(dev),
            decode_padding=decode_padding.to(dev),
            prefills=prefills,
            sample_index=torch.tensor(sample_index + prompt_index, dtype=torch.int64, device=dev),
            decode_tables=decode_pages.view(nd, -1).to(dev) if self.paged_attention and nd else None,
        )
        # the prompt rows' logits follow the sampled rows'
        vocab.head_runs += [r._replace(start=r.start + len(sample_index), end=r.end + len(sample_index))
                            for r in prompt_head_runs]
        if vocab.embed_runs or vocab.head_runs:
            inputs.vocab = vocab
        if self.linear_states is not None:
            starts = [0, *itertools.accumulate(c.num_tokens for c in plan.chunks)]
            inputs.linear = LinearStep([StateRun(start, end, c.seq.state_slot, c.seq.num_computed == 0)
                                        for c, start, end in zip(plan.chunks, starts, starts[1:])], self.linear_states,
                                       linear_lora)
        lora_batch = None
        if adapters:
            lora_batch = LoraBatch(adapters=adapters, seg_starts=seg_starts, seg_adapter=seg_adapter,
                                   num_tokens=len(ids), device=dev, num_decode=nd)
        return inputs, lora_batch, rows, prompt_rows, (cold_tasks, cold_rows), dora_runs


def _unpaged_parts(adapter: DeviceAdapter) -> bool:
    """Whether an adapter has parts beside its pool rows (DoRA, LoRA on the embeddings or the head), which
    the captured graphs do not apply."""
    return adapter.dora_scale is not None or adapter.embed is not None or adapter.head is not None


def _add_cold_rows(tasks: list, rows: list[int], handle, start: int, end: int, ranks: list[int]) -> None:
    """Step rows [start, end) of one adapter join the cold rows; a run of its rows right after its
    previous run merges into that task."""
    r0 = len(rows)
    rows.extend(range(start, end))
    if tasks and tasks[-1][0] == handle and tasks[-1][2] == r0:
        tasks[-1] = (handle, tasks[-1][1], len(rows), ranks)
    else:
        tasks.append((handle, r0, len(rows), ranks))
