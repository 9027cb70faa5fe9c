"""Decode steps replayed from CUDA graphs (vLLM's decode graphs), the bookkeeping apart from CUDA.

A decode-only step of n sequences is padded up to the smallest bucket >= n (1, 2, 4, 8, then every 8
up to the largest) and replayed from the graph captured for that bucket (with or without LoRA).
Where every row samples plainly (sampler.is_plain: the GPU's usual case), the graph samples too
(sampler.plain_tokens, with or without the top-k/top-p sort) and its output is the tokens: the host
launches one graph and copies the tokens back, instead of some 30 sampler kernels one by one.
Everything such a step reads lives in one fixed device buffer, written by one host-to-device copy
from one pinned host buffer per step (StepBuffers): token ids, positions, KV write rows, block tables,
each token's LoRA slot (TritonLoraBackend's SlotTables) and the plain sampler's inputs. Padding rows
are token 0 at position 0 writing its KV to a page of its own (``scratch_page``), attending to it,
with no adapter: they touch nothing of a real sequence. The host buffer keeps its block tables from
step to step: a row is written again only where its sequence changed or grew a page; the other
columns are a handful of numpy writes per step.

Steps the graphs do not cover run eagerly: steps with prefill chunks, more decodes than the largest
bucket, CPU-assisted rows, merged mode, and LoRA steps when the backend has no fixed-buffer step
(the torch backend). A change of what a graph holds by address invalidates them all: the merged
mode's weights (WeightMerger swaps projection objects), a resize of the slot tables.

The CUDA calls sit behind GraphSeam (CudaSeam on a GPU); tests give a seam whose "graph" re-runs the
captured function, so the bookkeeping runs on CPU.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from asyncserve.stepper.sampler import PlainSampling, plain_tokens


class GraphSeam(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]:
        """Capture ``fn`` (after a warm-up run); returns a graph whose replay() re-runs it into the
        returned output tensor."""

    def pinned(self, numel: int) -> torch.Tensor:
        """An int64 host buffer that copies to the device asynchronously."""


class CudaSeam:
    """torch.cuda's graphs: one memory pool shared by all of them, captured on a side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool = None

    def capture(self, fn):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):       # warm-up: Triton compiles, cuBLAS picks its kernels
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        self._pool = graph.pool()
        return graph, out

    def pinned(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.int64, pin_memory=True)


def graph_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, then every 8, up to the first that holds max_batch."""
    buckets = []
    for b in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        buckets.append(b)
        if b >= max_batch:
            return buckets


# the buffer's fields in int64 words, per row (tables: max_pages words per row); float32 fields take
# half a word per row (rounded up), bool ones a word
INT_FIELDS = ("input_ids", "positions", "write_rows", "token_slots", "top_k", "greedy")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "uniform")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "uniform", "greedy")   # plain_columns' order
SAMPLING_PADDING = (1.0, 0, 1.0, 0.0, 0.0, 1)     # a padding row samples greedily, with nothing undefined


def buffer_layout(rows: int, max_pages: int) -> tuple[dict[str, tuple[int, int]], int]:
    """{field: (offset, words)} and the total words of StepBuffers for ``rows`` rows."""
    layout, offset = {}, 0
    for name in INT_FIELDS:
        layout[name] = (offset, rows)
        offset += rows
    for name in FLOAT_FIELDS:
        words = -(-rows // 2)
        layout[name] = (offset, words)
        offset += words
    layout["tables"] = (offset, rows * max_pages)
    return layout, offset + rows * max_pages


class StepBuffers:
    """The fixed inputs of graph steps: one pinned host buffer, one device buffer, views of both."""

    def __init__(self, rows: int, max_pages: int, device: torch.device, seam: GraphSeam):
        self.rows, self.max_pages = rows, max_pages
        self.layout, size = buffer_layout(rows, max_pages)
        self.host_buffer = seam.pinned(size)
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        # the host side as numpy arrays: a step writes its lists into them without a torch op per value
        self.host = {name: v.numpy() for name, v in self._views(self.host_buffer).items()}
        self.device = self._views(self.device_buffer)

    def _views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for name, (offset, words) in self.layout.items():
            v = buffer[offset:offset + words]
            if name in FLOAT_FIELDS:
                v = v.view(torch.float32)[:self.rows]
            views[name] = v
        views["tables"] = views["tables"].view(self.rows, self.max_pages)
        return views

    def upload(self) -> None:
        # the previous step's copy has finished: its tokens came back since
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)


@dataclass
class DecodeBatch:
    """The decodes of a graph step as columns, one entry per row, as the host knows them."""
    tokens: list[int]
    positions: list[int]
    block_tables: list[list[int]]     # each sequence's own list (fill tells a row's sequence by it)
    slots: list[int]                  # LoRA slot (SlotTables), -1: none


SCRATCH = object()        # DecodeGraphs' mark of a table row holding only the scratch page


class _NoLora:
    """LoraHook of a graph without LoRA."""
    active = False


NO_LORA = _NoLora()


class DecodeGraphs:
    """Which decode steps replay, their padding and buffers, and the graphs per (bucket, lora, sampler).

    ``forward(inputs, lora)`` runs the model on StepInputs that ``make_inputs(ids, positions, write_rows,
    tables)`` builds over the buffers (lora: a LoraHook);
    ``lora_step(token_slots, s)`` (TritonLoraBackend.begin_graph_step) puts the LoRA backend on fixed
    buffers and returns the hook; ``lora_width()`` the rank width its launches cover (the slot tables')
    and ``lora_version()`` a value that changes when its tables move."""

    def __init__(self, seam: GraphSeam, device: torch.device, max_batch: int, max_pages: int, scratch_page: int,
                 block_size: int, row_stride: int, forward: Callable, make_inputs: Callable,
                 lora_step: Callable | None, lora_width: Callable[[], int] | None,
                 lora_version: Callable[[], object] | None):
        self.seam = seam
        self.device = device
        self.buckets = graph_buckets(max_batch)
        self.max_pages = max_pages
        self.scratch_page = scratch_page
        self.scratch_row = scratch_page * row_stride        # layer 0's K row of the scratch page, slot 0
        self.block_size, self.row_stride = block_size, row_stride
        self.forward = forward
        self.make_inputs = make_inputs
        self.lora_step, self.lora_width, self.lora_version = lora_step, lora_width, lora_version
        self.buffers = StepBuffers(self.buckets[-1], max_pages, device, seam)
        # per host table row: (the block table list written there, its length then), SCRATCH (padding) or
        # None (unknown); a list held here is never freed, so ``is`` tells it from a new one
        self._table_rows: list[tuple[list[int], int] | object | None] = [None] * self.buckets[-1]
        self._row_index = np.arange(self.buckets[-1])
        # (bucket, lora, sampler) -> (graph, its output, the captured function); sampler: None (the output is
        # the logits), False / True (the plain sampler's tokens, with the top-k/top-p sort or not). A graph
        # reads its inputs by address, so the function's closure (the step's sample index, the LoRA hook's
        # tensors) lives as long as it
        self._graphs: dict[tuple[int, bool, bool | None], tuple[object, torch.Tensor, Callable]] = {}
        self._version = None
        self._scratch: torch.Tensor | None = None
        self.replays = 0          # steps replayed, and graphs captured (for tests and benchmarks)
        self.captures = 0

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n decodes, None past the largest."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if n >= 1 and i < len(self.buckets) else None

    def invalidate(self) -> None:
        """Drop every graph (what they read by address moved)."""
        self._graphs.clear()
        self._scratch = None

    def fill(self, batch: DecodeBatch, sampling: tuple | None) -> int:
        """Write a step's rows into the host buffer, padded to its bucket; returns the bucket.
        sampling: plain_columns' columns, or None where the rows are not all plain."""
        n, bucket = len(batch.tokens), self.bucket(len(batch.tokens))
        h = self.buffers.host
        for name, values, padding in (("input_ids", batch.tokens, 0), ("positions", batch.positions, 0),
                                      ("token_slots", batch.slots, -1)):
            h[name][:n] = values
            h[name][n:bucket] = padding
        tables = self._write_tables(batch.block_tables, bucket)
        positions = h["positions"][:n]
        # each token's KV row: its page's (layer 0, K) row plus its slot in the page
        h["write_rows"][:n] = (tables[self._row_index[:n], positions // self.block_size] * self.row_stride
                               + positions % self.block_size)
        h["write_rows"][n:bucket] = self.scratch_row
        if sampling is not None:
            for name, values, padding in zip(SAMPLING_FIELDS, sampling, SAMPLING_PADDING):
                h[name][:n] = values
                h[name][n:bucket] = padding
        return bucket

    def _write_tables(self, block_tables: list[list[int]], bucket: int) -> np.ndarray:
        """The host tables with row i holding block_tables[i] (the scratch page past its end) and rows up to
        the bucket the scratch page; writes only the rows that differ from what they hold: another
        sequence's table (another list: a preempted sequence readmitted gets a new one too), or pages
        appended to the same list."""
        tables, held = self.buffers.host["tables"], self._table_rows
        for i, table in enumerate(block_tables):
            was = held[i]
            if was is not None and was is not SCRATCH and was[0] is table and was[1] <= len(table):
                if was[1] == len(table):
                    continue
                tables[i, was[1]:len(table)] = table[was[1]:]
            else:
                tables[i, len(table):] = self.scratch_page
                tables[i, :len(table)] = table
            held[i] = (table, len(table))
        for i in range(len(block_tables), bucket):
            if held[i] is not SCRATCH:
                tables[i] = self.scratch_page
                held[i] = SCRATCH
        return tables

    def replay(self, batch: DecodeBatch, lora: bool, sampling: tuple | None, ranked: bool = False) -> torch.Tensor:
        """Run a covered step: fill, one upload, replay (capturing its graph first if need be).
        sampling: the rows' plain_columns where every row is plain, and ranked: whether one has top-k or
        top-p. Returns (a view of the graph's fixed output) the tokens and whether each row has one
        [2, n] (sampler.plain_tokens) where sampling is given, else the logits [n, vocab]."""
        version = self.lora_version() if self.lora_version else None
        if version != self._version:
            self.invalidate()
            self._version = version
        bucket = self.fill(batch, sampling)
        self.buffers.upload()
        key = (bucket, lora, None if sampling is None else ranked)
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
            self.captures += 1
        graph, out, _ = self._graphs[key]
        graph.replay()
        self.replays += 1
        n = len(batch.tokens)
        return out[:n] if sampling is None else out[:, :n]

    def _capture(self, bucket: int, lora: bool, ranked: bool | None) -> tuple[object, torch.Tensor, Callable]:
        d = self.buffers.device
        inputs = self.make_inputs(d["input_ids"][:bucket], d["positions"][:bucket], d["write_rows"][:bucket],
                                  d["tables"][:bucket])
        hook = NO_LORA
        if lora:
            if self._scratch is None:
                # MBGMV's fp32 scratch for up to 3 fused projections at the tables' rank width
                self._scratch = torch.zeros(self.buckets[-1], 3 * max(self.lora_width(), 1), dtype=torch.float32,
                                            device=self.device)
            hook = self.lora_step(d["token_slots"][:bucket], self._scratch[:bucket])
        rows = {name: d[name][:bucket] for name in SAMPLING_FIELDS}

        def step() -> torch.Tensor:
            logits = self.forward(inputs, hook)
            if ranked is None:
                return logits
            return plain_tokens(logits, PlainSampling(rows["temperature"], rows["greedy"].bool(), rows["top_k"],
                                                      rows["top_p"], rows["min_p"], rows["uniform"], ranked))
        return (*self.seam.capture(step), step)
