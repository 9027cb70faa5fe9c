"""Decode steps from CUDA graphs (asyncserve/stepper/cuda_graphs.py).

On CPU the CUDA calls sit behind a fake seam whose graph re-runs the captured function over the same
fixed buffers, so the bookkeeping (buckets, padding, buffers, which steps replay, invalidation) and
the graph path's inputs (the Triton paged attention and MBGMV on fixed buffers, in the interpreter)
are checked against the eager path's tokens and transformers+PEFT's. With ASYNCSERVE_TEST_DEVICE=cuda,
real graphs against --enforce-eager and PEFT.
"""
import gc
import itertools
import os
import random
import weakref

import pytest
import torch

import kernels  # noqa: F401  (the interpreter without CUDA)
from asyncserve import LLM, SamplingParams
from asyncserve.stepper.cuda_graphs import DecodeBatch, DecodeGraphs, StepBuffers, buffer_layout, graph_buckets
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
    g = DecodeGraphs(FakeSeam(), torch.device("cpu"), 20, 4, 0, 1, 1, None, None, None, None, None)
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
    g = DecodeGraphs(FakeSeam(), torch.device("cpu"), 8, 3, scratch_page=9, block_size=16, row_stride=100,
                     forward=None, make_inputs=None, lora_step=None, lora_width=None, lora_version=None)
    rows = DecodeBatch([5, 6, 8], [17, 0, 40], [[3, 4], [7], [1, 2, 12]], [2, -1, 0])
    sampling = ([1.0, 0.7, 1.0], [0, 5, 0], [1.0, 0.9, 1.0], [0.0, 0.0, 0.1], [0.25, 0.5, 0.75], [True, False, False])
    assert g.fill(rows, sampling) == 4
    g.buffers.upload()
    d = g.buffers.device
    assert d["input_ids"][:4].tolist() == [5, 6, 8, 0]
    assert d["positions"][:4].tolist() == [17, 0, 40, 0]
    # each token's page (its position // 16 in its table) * 100 + its position % 16
    assert d["write_rows"][:4].tolist() == [401, 700, 1208, 900]
    assert d["token_slots"][:4].tolist() == [2, -1, 0, -1]
    assert d["tables"][:4].tolist() == [[3, 4, 9], [7, 9, 9], [1, 2, 12], [9, 9, 9]]
    assert d["temperature"][:4].tolist() == pytest.approx([1.0, 0.7, 1.0, 1.0])     # the padding row: greedy
    assert d["top_k"][:4].tolist() == [0, 5, 0, 0] and d["greedy"][:4].tolist() == [1, 0, 0, 1]
    assert d["uniform"][:3].tolist() == [0.25, 0.5, 0.75]
    # a smaller step after a larger one leaves no stale rows in its bucket
    assert g.fill(DecodeBatch([5], [17], rows.block_tables[:1], [2]), None) == 1
    g.buffers.upload()
    assert d["tables"][0].tolist() == [3, 4, 9]


def test_tables_kept_across_steps_equal_a_fresh_fill():
    """The host buffer's rows as requests grow pages, finish, join, get preempted and readmitted (a new
    table, possibly as long as the old), reorder, and the batch shrinks and grows across buckets:
    after every step, what a graph reads equals a fill from scratch."""
    rng = random.Random(3)

    def graphs():
        return DecodeGraphs(FakeSeam(), torch.device("cpu"), 24, 8, scratch_page=99, block_size=4, row_stride=10,
                            forward=None, make_inputs=None, lora_step=None, lora_width=None, lora_version=None)

    g = graphs()
    next_page = itertools.count()
    running = {}                                     # request -> (block table, position)
    for step in range(300):
        for name in list(running):
            table, pos = running[name]
            event = rng.random()
            if event < 0.05 or pos + 1 == 4 * 8:
                del running[name]                    # finished (or at the context's end: 8 pages of 4)
            elif event < 0.1:                        # preempted and readmitted: a new list of the same length
                running[name] = ([next(next_page) for _ in table], pos)
            else:
                pos += 1
                if pos // 4 >= len(table):
                    table.append(next(next_page))   # in place, as BlockManager.reserve grows it
                running[name] = (table, pos)
        while len(running) < rng.choice([1, 3, 9, 17, 24]):
            pos = rng.randrange(4 * 7)
            running[f"r{step}.{len(running)}"] = ([next(next_page) for _ in range(pos // 4 + 1)], pos)
        order = sorted(running, key=lambda _: rng.random())  # the plan's order changes as adapters sort
        batch = DecodeBatch([rng.randrange(50) for _ in order], [running[r][1] for r in order],
                            [running[r][0] for r in order], [rng.randrange(-1, 4) for _ in order])
        sampling = tuple([rng.random() for _ in order] for _ in range(6))
        bucket = g.fill(batch, sampling)
        fresh = graphs()
        assert fresh.fill(batch, sampling) == bucket
        for name, view in g.buffers.host.items():
            assert (view[:bucket] == fresh.buffers.host[name][:bucket]).all(), (step, name)
    assert len(set(map(id, (r[0] for r in running.values())))) == len(running)


def test_graphs_capture_once_per_bucket_lora_and_sampler_and_recapture_when_invalidated():
    version = [0]

    def forward(inputs, lora):
        return torch.nn.functional.one_hot(inputs, 16).float() * 2      # logits [rows, 16]: argmax = the token

    g = DecodeGraphs(FakeSeam(), torch.device("cpu"), 16, 2, 0, 1, 1, forward, lambda ids, *_: ids,
                     lambda slots, s: "hook", lambda: 16, lambda: version[0])

    def batch(tokens):
        return DecodeBatch(tokens, [0] * len(tokens), [[1]] * len(tokens), [-1] * len(tokens))

    def tokens(logits):
        return logits.argmax(-1).tolist()

    rows = batch([3, 4, 5])
    assert tokens(g.replay(rows, False, None)) == [3, 4, 5]
    assert tokens(g.replay(batch([3, 4]), False, None)) == [3, 4]       # bucket 2: a new graph
    assert tokens(g.replay(rows, True, None)) == [3, 4, 5]              # bucket 4 with LoRA
    assert tokens(g.replay(batch([5, 4, 3]), False, None)) == [5, 4, 3]
    assert (g.captures, g.replays) == (3, 4)
    # every row plain: the graph samples too and gives the tokens and their validity, one graph per sort or not
    greedy = ([1.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3, [0.5] * 3, [True] * 3)
    assert g.replay(rows, False, greedy).tolist() == [[3, 4, 5], [1, 1, 1]]
    top_k_1 = ([1.0] * 3, [1] * 3, [1.0] * 3, [0.0] * 3, [0.5] * 3, [False] * 3)   # drawn, from one token each
    assert g.replay(batch([5, 4, 3]), False, top_k_1, ranked=True).tolist() == [[5, 4, 3], [1, 1, 1]]
    assert g.replay(rows, False, greedy).tolist() == [[3, 4, 5], [1, 1, 1]]
    assert (g.captures, g.replays) == (5, 7)
    version[0] += 1                 # the LoRA tables moved (or the merged mode switched): capture again
    g.replay(rows, False, None)
    assert g.captures == 6


def _cases(tok, adapters, texts=("the fox jumps over", "many adapters serve a batch token", "rank step")):
    prompts = [tok.encode(t) for t in texts]
    return [(ids, a) for ids in prompts for a in [None, *adapters]]


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fake seam's test; on a GPU the real graphs' test runs")
def test_graph_steps_on_fixed_buffers_give_the_eager_tokens_and_peft(tiny_model):
    """The triton backend (interpreter) with DecodeGraphs over a fake seam: the same tokens as the eager
    engine and transformers+PEFT, base and mixed-rank adapters in the same decode steps; prefill steps
    run eagerly, decode steps replay and sample in the graph (greedy, and seeded top-k/top-p draws,
    which the eager engine on CPU draws on its general path: the same tokens)."""
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
        seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
        outs[graphs, "seeded"] = [o.token_ids for o in llm.generate([c[0] for c in cases], seeded,
                                                                    adapters=[c[1] for c in cases])]
        if graphs:
            assert any(key[2] is True for key in runner.graphs._graphs)     # the sort's graphs replayed
        assert llm.engine.pool.counts().kv == 0
    assert outs[True] == outs[False]
    assert outs[True, "seeded"] == outs[False, "seeded"]
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
