"""Decode steps from CUDA graphs (asyncserve/stepper/cuda_graphs.py).

On CPU the CUDA calls sit behind a fake seam whose graph re-runs the captured function over the same
fixed buffers, so the bookkeeping (buckets, padding, buffers, which steps replay, invalidation) and
the graph path's inputs (the Triton paged attention and MBGMV on fixed buffers, in the interpreter)
are checked against the eager path's tokens and transformers+PEFT's. With ASYNCSERVE_TEST_DEVICE=cuda,
real graphs against --enforce-eager and PEFT.
"""
import gc
import os
import weakref

import pytest
import torch

import kernels  # noqa: F401  (the interpreter without CUDA)
from asyncserve import LLM, SamplingParams
from asyncserve.stepper.cuda_graphs import DecodeGraphs, DecodeRow, StepBuffers, buffer_layout, graph_buckets
from reference import TEST_DEVICE, assert_greedy_matches, peft_references

NEW_TOKENS = 6


class FakeGraph:
    """Holds the captured function by a weak reference only: a CUDA graph reads its inputs by address,
    so whatever it reads must be kept alive by its owner (on a GPU a freed input is reused memory)."""
    def __init__(self, fn, out):
        self.fn, self.out = weakref.ref(fn), out

    def replay(self):
        gc.collect()
        fn = self.fn()
        assert fn is not None, "the graph's inputs were freed after its capture"
        self.out.copy_(fn())


class FakeSeam:
    """CudaSeam's contract on CPU: a warm-up run, then a "graph" that re-runs fn into its output."""
    def __init__(self):
        self.captured = 0

    def capture(self, fn):
        fn()
        out = fn()
        self.captured += 1
        return FakeGraph(fn, out), out

    def pinned(self, numel):
        return torch.zeros(numel, dtype=torch.int64)


def test_buckets_pad_up_like_vllm():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(3) == [1, 2, 4]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 24]
    g = DecodeGraphs(FakeSeam(), torch.device("cpu"), 20, 4, 0, 1, None, None, None, None, None)
    assert [g.bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 24, 25, 0)] == [1, 2, 4, 8, 8, 16, 24, 24, None, None]


def test_buffer_layout_fields_are_disjoint_and_sized():
    for rows, pages in ((1, 1), (7, 3), (64, 256)):
        layout, size = buffer_layout(rows, pages)
        spans = sorted(layout.values())
        assert spans[0][0] == 0 and sum(w for _, w in spans) == size
        assert all(a + wa == b for (a, wa), (b, _) in zip(spans, spans[1:]))
        assert layout["tables"][1] == rows * pages
        buffers = StepBuffers(rows, pages, torch.device("cpu"), FakeSeam())
        assert buffers.device["temperature"].dtype == torch.float32 and buffers.device["temperature"].numel() == rows
        assert buffers.device["tables"].shape == (rows, pages)


def test_fill_pads_rows_to_the_scratch_page_and_one_upload_carries_everything():
    g = DecodeGraphs(FakeSeam(), torch.device("cpu"), 8, 3, scratch_page=9, row_stride=100, forward=None,
                     make_inputs=None, lora_step=None, lora_width=None, lora_version=None)
    rows = [DecodeRow(5, 17, 301, [3, 4], 2), DecodeRow(6, 0, 700, [7], -1), DecodeRow(8, 40, 1203, [1, 2, 12], 0)]
    sampling = ([1.0, 0.7, 1.0], [0, 5, 0], [1.0, 0.9, 1.0], [0.0, 0.0, 0.1], [0.25, 0.5, 0.75], [True, False, False])
    assert g.fill(rows, sampling) == 4
    g.buffers.upload()
    d = g.buffers.device
    assert d["input_ids"][:4].tolist() == [5, 6, 8, 0]
    assert d["positions"][:4].tolist() == [17, 0, 40, 0]
    assert d["write_rows"][:4].tolist() == [301, 700, 1203, 900]
    assert d["token_slots"][:4].tolist() == [2, -1, 0, -1]
    assert d["tables"][:4].tolist() == [[3, 4, 9], [7, 9, 9], [1, 2, 12], [9, 9, 9]]
    s = g.device_sampling(3)
    assert s["temperature"].tolist() == pytest.approx([1.0, 0.7, 1.0])
    assert s["top_k"].tolist() == [0, 5, 0] and s["greedy"].tolist() == [1, 0, 0]
    assert s["uniform"].tolist() == [0.25, 0.5, 0.75]
    # a smaller step after a larger one leaves no stale rows in its bucket
    assert g.fill(rows[:1], None) == 1
    g.buffers.upload()
    assert d["tables"][0].tolist() == [3, 4, 9]


def test_graphs_capture_once_per_bucket_and_lora_and_recapture_when_invalidated():
    calls = []
    version = [0]

    def forward(inputs, lora):
        calls.append(len(inputs))
        return inputs.float()[:, None] * 2

    g = DecodeGraphs(FakeSeam(), torch.device("cpu"), 16, 2, 0, 1, forward, lambda ids, *_: ids,
                     lambda slots, s: "hook", lambda: 16, lambda: version[0])
    rows = [DecodeRow(t, 0, 0, [1], -1) for t in (3, 4, 5)]
    assert g.replay(rows, False, None).flatten().tolist() == [6, 8, 10]
    assert g.replay(rows[:2], False, None).flatten().tolist() == [6, 8]       # bucket 2: a new graph
    assert g.replay(rows, True, None).flatten().tolist() == [6, 8, 10]        # bucket 4 with LoRA
    assert g.replay(list(reversed(rows)), False, None).flatten().tolist() == [10, 8, 6]
    assert (g.captures, g.replays) == (3, 4)
    version[0] += 1                 # the LoRA tables moved (or the merged mode switched): capture again
    g.replay(rows, False, None)
    assert g.captures == 4


def _cases(tok, adapters, texts=("the fox jumps over", "many adapters serve a batch token", "rank step")):
    prompts = [tok.encode(t) for t in texts]
    return [(ids, a) for ids in prompts for a in [None, *adapters]]


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fake seam's test; on a GPU the real graphs' test runs")
def test_graph_steps_on_fixed_buffers_give_the_eager_tokens_and_peft(tiny_model):
    """The triton backend (interpreter) with DecodeGraphs over a fake seam: the same tokens as the eager
    engine and transformers+PEFT, base and mixed-rank adapters in the same decode steps; prefill steps
    run eagerly, decode steps replay."""
    adapters = ["r1_qv", "r16_patterns"]
    paths = {a: str(tiny_model.adapters[a]) for a in adapters}
    cases = _cases(tiny_model.tokenizer, adapters, ("the fox jumps over", "many adapters serve a batch token"))
    refs = peft_references(tiny_model.base, tiny_model.adapters, cases, NEW_TOKENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(model=str(tiny_model.root), adapters=paths, dtype="float32", device="cpu", lora_backend="triton",
                  max_running=4, cpu_workers=0)
        runner = llm.engine.runner
        if graphs:
            seam = FakeSeam()
            runner.enable_graphs(seam, 4, 8)
        outs[graphs] = [o.token_ids for o in llm.generate([c[0] for c in cases], params,
                                                          adapters=[c[1] for c in cases])]
        if graphs:
            # 6 sequences, at most 4 running: steps of 4 and of 2 decodes, with and without LoRA
            assert runner.graphs.replays >= NEW_TOKENS - 1 and seam.captured >= 2
            assert llm.engine.pool.counts().kv == 0
    assert outs[True] == outs[False]
    for i, (tokens, (_, adapter)) in enumerate(zip(outs[True], cases)):
        assert_greedy_matches(tokens, refs[i], tie_tol=1e-3, label=f"case {i} adapter {adapter}")


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="real CUDA graphs need ASYNCSERVE_TEST_DEVICE=cuda")
@pytest.mark.parametrize("lora_backend", ["triton", "torch"])
def test_cuda_graph_decode_equals_eager_and_peft(tiny_model, lora_backend):
    adapters = ["r1_qv", "r2_mlp", "r8_attn_rs", "r64_all", "r16_patterns"]
    paths = {a: str(tiny_model.adapters[a]) for a in adapters}
    cases = _cases(tiny_model.tokenizer, adapters)
    refs = peft_references(tiny_model.base, tiny_model.adapters, cases, NEW_TOKENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(model=str(tiny_model.root), adapters=paths, dtype="float32", device="cuda",
                  lora_backend=lora_backend, enforce_eager=eager, max_running=16)
        outs[eager] = [o.token_ids for o in llm.generate([c[0] for c in cases], params,
                                                         adapters=[c[1] for c in cases])]
        # base-only steps replay with either backend (the torch one runs its LoRA steps eagerly)
        base_only = [o.token_ids for o in llm.generate([c[0] for c in cases if c[1] is None], params)]
        assert base_only == [outs[eager][i] for i, c in enumerate(cases) if c[1] is None]
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        if not eager:
            assert graphs.replays > 0
        # seeded sampling on the device: the same tokens with and without graphs
        seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
        outs[(eager, "seeded")] = [o.token_ids for o in llm.generate([c[0] for c in cases], seeded,
                                                                     adapters=[c[1] for c in cases])]
        del llm
    assert outs[False] == outs[True]
    assert outs[(False, "seeded")] == outs[(True, "seeded")]
    exact = sum(assert_greedy_matches(t, refs[i], tie_tol=1e-3, label=f"case {i}") for i, t in enumerate(outs[False]))
    assert exact >= len(cases) - 1
