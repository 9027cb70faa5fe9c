"""Tensor parallelism (docs/tensor-parallel.md, S-LoRA §6).

In one process: every family's shards, each loaded as its rank would (safetensors slices, Phi-3's
fused tensors sliced per section), run one step each in lockstep threads whose all-reduce sums the
ranks' partial outputs of the row-parallel projections; rank 0's logits equal the unsharded model's,
with adapters of different ranks on every projection and base rows in the same step (their shards
paged in as the pager pages them). Then the engine: TP=2 rank processes over shared memory and over
gloo against TP=1 and transformers+PEFT, with CPU assist (each rank's workers computing its shard of
cold adapters' LoRA, workers killed mid-step), over HTTP, a rank killed mid-generation (either
backend), the NCCL path on GPUs (ASYNCSERVE_TEST_DEVICE=cuda: TP=1 through NCCL on one GPU, TP=2 on
two), and the configurations refused.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from asyncserve.lora.backend import TorchLoraBackend
from asyncserve.lora.batch import LoraBatch
from asyncserve.model.config import ModelLoadError
from asyncserve.model.linear import QuantizedWeight
from asyncserve.model.llama import PrefillChunk, Rope, StepInputs, build_weights, decode_masks, forward
from asyncserve.model.loader import load_model
from asyncserve.model.shard import Shard, shard_config, take_ranges
from asyncserve.pager.adapters import build_host_adapter, read_peft_folder
from asyncserve.pager.pager import AdapterPager
from asyncserve.pager.pool import PagedPool
from family_models import FAMILIES, build_family_model
from reference import TEST_DEVICE
from server_harness import ServedProcess

BLOCK = 16


class ThreadGroup:
    """An all-reduce between threads: every rank gets the same float64 sum of the parts, in rank order."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * world
        self.calls = 0

    def reducer(self, rank: int):
        def all_reduce_(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = torch.stack(self.parts).double().sum(0).to(t.dtype)
            self.barrier.wait()
            if rank == 0:
                self.calls += 1
            return t.copy_(total)
        return all_reduce_


class RankModel:
    """One rank's shard, pool, pager and LoRA backend (world 1: the whole model)."""

    def __init__(self, folder, shard: Shard, adapters: dict):
        loaded = load_model(str(folder), shard=shard if shard.world > 1 else None)
        self.full = loaded.config
        self.config = shard_config(self.full, shard.world)
        self.weights = build_weights(self.config, loaded.weights, torch.float32, torch.device("cpu"), head=shard.head)
        self.pool = PagedPool(256, self.config.num_layers, BLOCK, self.config.num_kv_heads, self.config.head_dim,
                              torch.float32, "cpu")
        self.pager = AdapterPager(self.pool, self.full, torch.float32, 32 * 2**20, shard)
        for name, path in adapters.items():
            self.pager.add(build_host_adapter(read_peft_folder(name, path, self.full), torch.float32))
            self.pager.ensure_resident(name)
        self.pager.write_pending()
        self.lora = TorchLoraBackend(self.pool, self.config)
        self.rope = Rope(self.config, self.pool.device, torch.float32)

    def step(self, inputs: StepInputs, segments, reduce) -> torch.Tensor | None:
        adapters = [self.pager.resident[self.pager.registration(name)] for name in dict.fromkeys(segments)
                    if name is not None]
        index = {a.name: i for i, a in enumerate(adapters)}
        starts = [0] + [c.end for c in inputs.prefills] if inputs.prefills else list(range(len(segments) + 1))
        self.lora.begin_step(LoraBatch(adapters, starts, [index.get(s, -1) for s in segments],
                                       len(inputs.input_ids), self.pool.device, inputs.num_decode))
        with torch.inference_mode():
            return forward(self.weights, self.config, self.rope, self.pool.kv_view(), inputs, self.lora, reduce)


KV_PAGE = 200      # prompt i's KV page: KV_PAGE + i, past the adapters' pages (taken from page 0 up)


def prefill_inputs(prompts: list[list[int]]):
    """Each prompt a prefill chunk from position 0 into its own page (prompt i: page KV_PAGE + i): ids,
    positions, (page, position) per token, the chunks."""
    ids, positions, rows, chunks = [], [], [], []
    for i, prompt in enumerate(prompts):
        start = len(ids)
        ids += prompt
        positions += range(len(prompt))
        rows += [(KV_PAGE + i, p) for p in range(len(prompt))]
        chunks.append(PrefillChunk(start, len(ids), 0, torch.tensor([KV_PAGE + i])))
    return ids, positions, rows, chunks


def step_inputs(ids, positions, rows, chunks, num_decode, decode_tables, row_stride) -> StepInputs:
    ctx = torch.tensor(positions[:num_decode], dtype=torch.int64) + 1
    pages = torch.tensor(decode_tables, dtype=torch.int64).flatten()
    mask, padding = decode_masks(ctx, 1, BLOCK)
    return StepInputs(torch.tensor(ids), torch.tensor(positions),
                      torch.tensor([page * row_stride + p % BLOCK for page, p in rows]), num_decode, pages,
                      mask[:, None, None, :], padding, chunks, torch.arange(len(ids)))


def run_lockstep(ranks: list[RankModel], inputs: StepInputs, segments, group: ThreadGroup) -> torch.Tensor:
    out, errors = [None] * len(ranks), []

    def run(r):
        try:
            out[r] = ranks[r].step(inputs, segments, group.reducer(r))
        except BaseException as e:            # surfaced below; the barrier's timeout frees the other rank
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert all(o is None for o in out[1:])      # only rank 0 computes logits
    return out[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "phi3"])
def test_shards_sum_to_the_whole_model(tmp_path, family):
    """Prefill then decode of three sequences (two adapters, one base) on 2 ranks in lockstep: rank 0's
    logits are the whole model's, every layer's o and down all-reduced."""
    if family == "llama":       # the Llama of tests/reference.py (GQA) with its two largest adapters
        from reference import build_tiny_model
        tiny = build_tiny_model(tmp_path)
        folder, adapters = tiny.root, {k: tiny.adapters[k] for k in ("r64_all", "r16_patterns")}
    else:
        model = build_family_model(tmp_path, family)
        folder, adapters = model.folder, model.adapters
    names = list(adapters)
    whole = RankModel(folder, Shard(0, 1), adapters)
    world = 2
    ranks = [RankModel(folder, Shard(r, world), adapters) for r in range(world)]
    assert ranks[0].config.num_kv_heads * world == whole.config.num_kv_heads
    assert ranks[0].pool.page_numel * world == whole.pool.page_numel
    for r in ranks:       # an adapter takes the same pages on every rank (rank 0's pager decides for all)
        assert max(p for a in r.pager.resident.values() for p in a.pages) < KV_PAGE
        assert [a.pages for a in r.pager.resident.values()] == [a.pages for a in ranks[0].pager.resident.values()]

    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in enumerate((9, 5, 12))]
    segments = [names[0], None, names[1]]
    stride = 2 * whole.config.num_layers * BLOCK
    ids, positions, rows, chunks = prefill_inputs(prompts)
    group = ThreadGroup(world)
    sharded = run_lockstep(ranks, step_inputs(ids, positions, rows, chunks, 0, [], stride), segments, group)
    expected = whole.step(step_inputs(ids, positions, rows, chunks, 0, [], stride), segments, None)
    torch.testing.assert_close(sharded, expected, rtol=1e-4, atol=1e-4)
    assert group.calls == 2 * whole.config.num_layers

    # one decode each, reading the KV the prefill wrote into every rank's pages
    nxt = expected[[c.end - 1 for c in chunks]].argmax(-1).tolist()
    pos = [len(p) for p in prompts]
    decode = step_inputs(nxt, pos, [(KV_PAGE + i, p) for i, p in enumerate(pos)], [], 3,
                         [[KV_PAGE], [KV_PAGE + 1], [KV_PAGE + 2]], stride)
    sharded = run_lockstep(ranks, decode, segments, ThreadGroup(world))
    expected = whole.step(decode, segments, None)
    torch.testing.assert_close(sharded, expected, rtol=1e-4, atol=1e-4)
    for r in [whole, *ranks]:
        r.pager.close()


def test_splits_that_cut_a_head_are_refused(tiny_model):
    config = load_model(str(tiny_model.root)).config     # 4 heads, 2 KV heads, intermediate 128
    for world, what in ((3, "attention heads"), (4, "key/value heads"), (8, "attention heads")):
        with pytest.raises(ModelLoadError, match=what):
            shard_config(config, world)
    assert shard_config(config, 2).num_kv_heads == 1


def test_kept_quantized_blocks_split_on_block_boundaries():
    import gguf

    qtype = int(gguf.GGMLQuantizationType.Q8_0)           # 32 weights in 34 bytes per block
    blocks = torch.arange(6 * 4 * 34, dtype=torch.int64).to(torch.uint8).view(6, 4 * 34)
    w = QuantizedWeight([(blocks, qtype)], 128)
    rows = take_ranges(w, 0, [(2, 4)], "w")                 # column-parallel: whole rows
    assert torch.equal(rows.parts[0][0], blocks[2:4]) and rows.in_features == 128
    cols = take_ranges(w, 1, [(64, 128)], "w")              # row-parallel: blocks 2 and 3 of each row
    assert torch.equal(cols.parts[0][0], blocks[:, 68:136]) and cols.in_features == 64
    for bad in ((16, 48), (32, 80), (100, 128)):
        with pytest.raises(ModelLoadError, match="block boundaries"):
            take_ranges(w, 1, [bad], "w")


# ---- the engine with rank processes ----------------------------------------------------------------

NEW_TOKENS = 8
ADAPTERS = ("r64_all", "r16_patterns", "r8_attn_rs", "r2_mlp")     # ranks 64, 16 (v 4), 8, 2; all seven projections


TEXTS = ["the quick brown fox jumps over the lazy dog and runs far away from home today",
         "LoRA adapters fine-tune large language models with low-rank updates",
         "def add(a, b): return a + b"]


def tp_llm(model, adapters: dict, device: str = "cpu", **kwargs):
    from asyncserve import LLM

    return LLM(model=str(model), adapters={k: str(v) for k, v in adapters.items()}, dtype="float32", device=device,
               max_step_tokens=24, **kwargs)


def greedy(llm, cases):
    from asyncserve import SamplingParams

    outs = llm.generate([ids for ids, _ in cases], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                  ignore_eos=True), adapters=[a for _, a in cases])
    return [o.token_ids for o in outs]


def shm_names() -> set[str]:
    """This process's shared-memory names (earlier tests' engines may still hold theirs)."""
    from ipc import leftovers

    return set(leftovers(f"/asyncserve-{os.getpid()}-"))


def closed(llm, before: set[str]) -> list[str]:
    """Close the engine (its ranks and shared memory); what it added to /dev/shm and left there."""
    llm.engine.close()
    return sorted(shm_names() - before)


class Expected:
    """Cases of mixed adapters with prefix-cache hits, and their greedy tokens: TP=1's and PEFT's."""

    def __init__(self, tiny_model, device: str = "cpu"):
        from reference import peft_references

        prompts = [tiny_model.tokenizer.encode(t) for t in TEXTS]
        self.first = [(prompts[i % 3], a) for i, a in enumerate([*ADAPTERS, None])]
        # the same prompts' first blocks with other endings, one of them under the same adapter (a hit)
        self.second = [(prompts[0][:17] + prompts[2], ADAPTERS[0]), (prompts[0][:17] + prompts[1][:5], None)]
        self.adapters = {k: tiny_model.adapters[k] for k in ADAPTERS}
        self.refs = peft_references(tiny_model.base, self.adapters, self.first + self.second, NEW_TOKENS)
        one = tp_llm(tiny_model.root, self.adapters, device=device, enforce_eager=True)
        self.tp1 = self.generate(one)
        one.engine.close()
        assert sum(t != self.tp1[-3] for t in self.tp1[:4]) >= 2      # the adapters change tokens

    def generate(self, llm) -> list[list[int]]:
        return greedy(llm, self.first) + greedy(llm, self.second)

    def check(self, got: list[list[int]], label: str) -> None:
        """PEFT's tokens (up to near-ties), and TP=1's in all sequences but at most one."""
        from reference import assert_greedy_matches

        exact = 0
        for i, (ours, case, ref, tp1) in enumerate(zip(got, self.first + self.second, self.refs, self.tp1)):
            exact += ours == tp1
            assert_greedy_matches(ours, ref, tie_tol=1e-3, label=f"{label} case {i} adapter {case[1]}")
        assert exact >= len(got) - 1, f"{label} equals TP=1 in only {exact} of {len(got)} sequences"


@pytest.fixture(scope="module")
def expected_cpu(tiny_model):
    return Expected(tiny_model)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_tp2_generates_tp1s_and_pefts_tokens(tiny_model, expected_cpu, backend):
    """Mixed adapters of ranks 2..64 on all seven projections and base rows in the same steps, then
    requests sharing the first requests' prefixes (prefix cache hits): TP=2's greedy tokens over shared
    memory and over gloo are TP=1's and transformers+PEFT's."""
    before = shm_names()
    two = tp_llm(tiny_model.root, expected_cpu.adapters, tensor_parallel=2, tp_backend=backend)
    try:
        assert two.engine.tp is not None and two.engine.tp.world == 2 and two.engine.tp.backend == backend
        got = expected_cpu.generate(two)
        assert two.engine.load_snapshot().prefix_hit_tokens >= 16        # the second requests' first block
        stats = two.engine.tp.stats()
        assert stats["reduce_bytes"] > 0 and stats["broadcast_bytes"] > 0
    finally:
        left = closed(two, before)
    assert left == []
    expected_cpu.check(got, f"TP=2 over {backend}")


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="NCCL needs ASYNCSERVE_TEST_DEVICE=cuda and a GPU")
def test_nccl_on_gpus_generates_tp1s_and_pefts_tokens(tiny_model):
    """The NCCL path: TP=1 through a world-1 NCCL group on one GPU (every all-reduce a real NCCL call),
    and TP=2 on two GPUs where the machine has them, against TP=1 without a group (eager) and PEFT."""
    expected = Expected(tiny_model, device="cuda")
    worlds = [1, 2] if torch.cuda.device_count() >= 2 else [1]
    for world in worlds:
        before = shm_names()
        llm = tp_llm(tiny_model.root, expected.adapters, device="cuda", tensor_parallel=world, tp_backend="nccl")
        try:
            assert llm.engine.tp is not None and llm.engine.tp.world == world and llm.engine.tp.backend == "nccl"
            assert llm.engine.runner.graphs is None               # eager under TP
            got = expected.generate(llm)
            assert llm.engine.tp.stats()["reduce_bytes"] > 0
        finally:
            left = closed(llm, before)
            del llm                     # its GPU memory, before the next engine sizes its pool
        assert left == []
        expected.check(got, f"TP={world} over nccl")


def test_tp2_gemma2_merged(tmp_path):
    """Gemma 2 (sandwich norms after the all-reduce, soft-capping, sliding windows) with its adapters
    merged per shard (dLoRA's merged mode; unmerged Gemma 2 LoRA: the lockstep test above)."""
    from family_models import build_family_model
    from reference import assert_greedy_matches, peft_references

    model = build_family_model(tmp_path, "gemma2")
    prompts = [model.tokenizer.encode(t) for t in ("the fox jumps over the lazy dog again and again",
                                                    "serve many models batch token step rank")]
    cases = [(p, a) for p in prompts for a in [None, *model.adapters]]
    refs = peft_references(model.base, model.adapters, cases, NEW_TOKENS)
    before = shm_names()
    llm = tp_llm(model.folder, model.adapters, tensor_parallel=2, policy="merged-only")
    try:
        got = greedy(llm, cases)
        assert llm.engine.merge_stats().switches >= 2
    finally:
        assert closed(llm, before) == []
    for i, (ours, case, ref) in enumerate(zip(got, cases, refs)):
        assert_greedy_matches(ours, ref, tie_tol=1e-3, label=f"merged case {i} adapter {case[1]}")


def test_tp2_language_model_of_a_multimodal_checkpoint(tmp_path):
    """Gemma 3's multimodal checkpoint: each rank reads its slices of the language model under the
    checkpoint's language_model.model.* names, and none of the vision tower; the all-linear adapter's
    tower LoRA is skipped on every rank."""
    from family_models import build_multimodal
    from reference import assert_greedy_matches, peft_references

    model = build_multimodal(tmp_path, "gemma3")
    prompts = [[5, 17, 33, 60, 91, 120, 7], [200, 3, 44, 150]]
    cases = [(p, a) for p in prompts for a in [None, *model.adapters]]
    refs = peft_references(model.base, model.adapters, cases, NEW_TOKENS)
    before = shm_names()
    llm = tp_llm(model.folder, model.adapters, tensor_parallel=2)
    try:
        got = greedy(llm, cases)
    finally:
        assert closed(llm, before) == []
    for i, (ours, case, ref) in enumerate(zip(got, cases, refs)):
        assert_greedy_matches(ours, ref, tie_tol=1e-3, label=f"case {i} adapter {case[1]}")


def child_pids(pid: int, module: str) -> list[int]:
    """The children of process ``pid`` (started by any of its threads) running ``python -m module``."""
    children = [c for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    return [int(c) for c in children if module in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]


def gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    """Whether every one of pids has exited (a zombie counts) within timeout_s."""
    from ipc.names import pid_alive

    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    """The CPU workers' profile, measured by the first engine with workers and read by the others."""
    return tmp_path_factory.mktemp("cpu-profiles")


def assist_llm(model, adapters: dict, profile_dir, **kwargs):
    """One CPU LoRA worker (per rank under tensor parallelism); every adapter cold at start."""
    return tp_llm(model, adapters, cpu_assist="on", cpu_workers=1, cpu_profile_dir=str(profile_dir), **kwargs)


def assisted_names(plans) -> set[str]:
    """The adapters whose LoRA the CPU workers computed in some step of plans."""
    loads = {load for p in plans for load in p.assisted}
    return {c.seq.adapter for p in plans for c in p.chunks if c.seq.adapter_load in loads}


def test_tp2_cpu_assist_gives_tp1s_and_pefts_tokens(tiny_model, profile_dir, capfd):
    """--cpu-assist on, TP=2: each rank's own worker (on the rank's cores) computes its shard of the
    cold adapters' LoRA (ranks 64 on all seven projections and 16, beside a base row): TP=1-with-assist's
    and transformers+PEFT's greedy tokens. Then both ranks' workers die inside an assisted step (stopped
    first, so each rank's job is surely in flight or yet to come): each rank recomputes its shard in
    torch, tokens unchanged. Nothing is left running or in /dev/shm after close."""
    from reference import assert_greedy_matches, peft_references, record_steps

    from ipc import leftovers

    prompts = [tiny_model.tokenizer.encode(t) for t in TEXTS]
    first = [(prompts[i], a) for i, a in enumerate(("r64_all", "r16_patterns", None))]
    second = [(prompts[(i + 1) % 3], a) for i, a in enumerate(("r8_attn_rs", "r2_mlp", None))]
    adapters = {k: tiny_model.adapters[k] for k in ADAPTERS}
    refs = peft_references(tiny_model.base, adapters, first + second, NEW_TOKENS)
    one = assist_llm(tiny_model.root, adapters, profile_dir)
    try:
        expected = greedy(one, first) + greedy(one, second)
        assert one.engine.assist.tokens_total > 0
    finally:
        one.engine.close()
    before = shm_names()
    two = assist_llm(tiny_model.root, adapters, profile_dir, tensor_parallel=2)
    engine = two.engine
    rank1 = engine.tp.processes.pids[1]
    workers = {0: [w.proc.pid for w in engine.assist.pool.workers], 1: child_pids(rank1, "ipc.worker")}
    try:
        assert engine.pager.resident_names() == set() and len(workers[1]) == 1
        for rank, pids in workers.items():        # each rank's workers on its own cores
            assert all(os.sched_getaffinity(pid) == set(engine.tp.cores[rank]) for pid in pids)
        plans = record_steps(engine)
        got = greedy(two, first)
        assert assisted_names(plans) == {"r64_all", "r16_patterns"}
        assert engine.assist.fallbacks == 0

        victims = [pid for pids in workers.values() for pid in pids]
        for pid in victims:
            os.kill(pid, signal.SIGSTOP)
        pool, killed = engine.assist.pool, []
        submit = pool.submit

        def submit_after_the_kill(*args, **kwargs):
            if not killed:              # rank 0's first job of the step: rank 1's is stuck or yet to come
                for pid in victims:
                    os.kill(pid, signal.SIGKILL)
                killed.append(args[0])
            return submit(*args, **kwargs)
        pool.submit = submit_after_the_kill
        steps = len(plans)
        got += greedy(two, second)
        # the first request's adapter is assisted (r2_mlp's may be paged in while its request waits)
        assert killed and "r8_attn_rs" in assisted_names(plans[steps:]) <= {"r8_attn_rs", "r2_mlp"}
        assert engine.assist.fallbacks >= 1 and engine.assist.restarts >= 1
        assert engine.assist.tokens_total == sum(c.num_tokens for p in plans for c in p.chunks
                                                 if c.seq.adapter_load in p.assisted)
        workers[1] = child_pids(rank1, "ipc.worker")          # the replacement
    finally:
        left = closed(two, before)
    assert left == [] and leftovers(f"/asyncserve-{rank1}-") == []
    assert gone([rank1, *workers[0], *workers[1]])
    err = capfd.readouterr().err
    assert re.search(r"tp rank 1: WARNING layer \d+ \w+: .*; computing those deltas in torch", err), err[-3000:]
    exact = 0
    for i, (ours, case, ref, tp1) in enumerate(zip(got, first + second, refs, expected)):
        exact += ours == tp1
        assert_greedy_matches(ours, ref, tie_tol=1e-3, label=f"TP=2 assisted case {i} adapter {case[1]}")
    assert exact >= len(got) - 1, f"TP=2 equals TP=1 in only {exact} of {len(got)} sequences"


def test_tp2_phi3_cpu_assist(tmp_path, profile_dir):
    """Phi-3's fused qkv_proj and gate_up_proj under TP=2 with CPU assist: each rank's worker reads its
    slice of each section's B (q, k, v; gate, up) from the arena; transformers+PEFT's tokens."""
    from reference import assert_greedy_matches, peft_references, record_steps

    model = build_family_model(tmp_path, "phi3")
    prompts = [model.tokenizer.encode(t) for t in TEXTS[:2]]
    cases = [(p, a) for p in prompts for a in [*model.adapters, None]]
    refs = peft_references(model.base, model.adapters, cases, NEW_TOKENS)
    before = shm_names()
    # sequences within the pretraining context: rotated with longrope's short factors, as transformers does
    llm = assist_llm(model.folder, model.adapters, profile_dir, tensor_parallel=2,
                     max_model_len=FAMILIES["phi3"]["original_max_position_embeddings"])
    try:
        plans = record_steps(llm.engine)
        got = greedy(llm, cases)
        assert assisted_names(plans) == set(model.adapters)
    finally:
        assert closed(llm, before) == []
    for i, (ours, case, ref) in enumerate(zip(got, cases, refs)):
        assert_greedy_matches(ours, ref, tie_tol=1e-3, label=f"phi3 assisted case {i} adapter {case[1]}")


SERVE_ARGS = ("--port", "0", "--device", "cpu", "--dtype", "float32", "--step-profile", "off", "--tensor-parallel",
              "2", "--host-adapter-mem", "64MiB")   # --tp-backend: shm


def rank_pids(server: ServedProcess) -> list[int]:
    """The server's tp_rank children (the stepper thread starts them)."""
    return child_pids(server.proc.pid, "asyncserve.stepper.tp_rank")


def test_tp2_over_http_with_the_openai_client(tiny_model):
    from openai import OpenAI

    name = "r64_all"
    prompt = "the quick brown fox jumps over"
    one = tp_llm(tiny_model.root, {name: tiny_model.adapters[name]})
    from asyncserve import SamplingParams
    expected = [o.text for o in one.generate([prompt] * 2, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                          ignore_eos=True), adapters=[name, None])]
    one.engine.close()
    server = ServedProcess(*SERVE_ARGS, "--model", str(tiny_model.root), "--adapter", f"{name}={tiny_model.adapters[name]}")
    try:
        client = OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
        for model, text in zip((name, "base"), expected):
            model = model if model == name else client.models.list().data[0].id
            out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == text
        chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    finally:
        server.close()
    assert server.proc.returncode == 0
    from ipc import leftovers
    assert leftovers(f"/asyncserve-{server.proc.pid}-") == []


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_rank_killed_mid_generation_ends_the_server_with_503s(tiny_model, backend):
    """SIGKILL of rank 1 while two requests generate: the open requests get 503 (engine_failed) in
    OpenAI's error shape, the server exits 1 within seconds and leaves nothing in /dev/shm."""
    from ipc import leftovers

    server = ServedProcess(*SERVE_ARGS, "--model", str(tiny_model.root), "--tp-backend", backend)
    try:
        body = {"model": str(tiny_model.root.name), "prompt": "the fox", "max_tokens": 400, "ignore_eos": True}
        models = json.loads(urllib.request.urlopen(server.base + "/v1/models", timeout=30).read())
        body["model"] = models["data"][0]["id"]
        blocking: list = []
        thread = threading.Thread(target=lambda: blocking.append(_post(server.base, body)))
        thread.start()
        stream = urllib.request.urlopen(urllib.request.Request(
            server.base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(), method="POST",
            headers={"Content-Type": "application/json"}), timeout=60)
        events = [stream.readline() for _ in range(6)]           # generating: a few chunks are out
        assert any(e.startswith(b"data: {") for e in events)
        ranks = rank_pids(server)
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        rest = stream.read().decode()
        assert '"engine_failed"' in rest and '"server_error"' in rest, rest[-2000:]     # the 503's error shape
        thread.join(30)
        status, answer = blocking[0]
        assert status == 503 and answer["error"]["code"] == "engine_failed", answer
        assert server.proc.wait(30) == 1
        assert time.monotonic() - killed < 15
    finally:
        server.close()
    assert leftovers(f"/asyncserve-{server.proc.pid}-") == []
    assert any("tensor-parallel rank 1" in line for line in server.log), "".join(server.log[-20:])


def _post(base: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel": 3}, "3 attention heads|needs a core per rank|not a multiple of 3"),
    ({"tensor_parallel": 4}, "key/value heads|needs a core per rank"),
    ({"tensor_parallel": 0}, "at least 1"),
    ({"tensor_parallel": 2, "threads": 2}, "threads does not apply"),
    ({"tensor_parallel": 1, "tp_backend": "gloo", "threads": 2}, "threads does not apply"),
    ({"tensor_parallel": 2, "tp_backend": "mpi"}, "unknown tp_backend"),
    ({"tensor_parallel": 2, "tp_backend": "NCCL"}, "unknown tp_backend"),
    ({"tensor_parallel": 2, "device": "cpu", "tp_backend": "nccl"}, "between GPUs"),
    ({"tensor_parallel": 1, "device": "cpu", "tp_backend": "nccl"}, "between GPUs"),
    ({"tensor_parallel": 2, "device": "cuda", "tp_backend": "shm"}, "connects CPU ranks"),
    ({"tensor_parallel": 2, "device": "cuda:0", "tp_backend": "gloo"}, "connects CPU ranks"),
    ({"tensor_parallel": 64, "device": "cuda"}, "needs a GPU per rank"),
    ({"tensor_parallel": 2, "device": "cuda:63"}, "needs a GPU per rank"),
])
def test_bad_tensor_parallel_configs_are_refused(tiny_model, kwargs, message):
    from asyncserve.engine import Engine
    from asyncserve.config import Config

    with pytest.raises(ValueError, match=message):
        Engine(Config(model=str(tiny_model.root), dtype="float32", **kwargs))


def test_cpu_workers_are_per_rank():
    """Under tensor parallelism --cpu-workers is per rank; by default one with --cpu-assist on (it shares
    the rank's cores), none with auto (the rank's threads leave no core spare)."""
    from asyncserve.config import Config

    cpu = torch.device("cpu")
    for kwargs, workers in (({"cpu_assist": "on"}, 1), ({"cpu_assist": "auto"}, 0), ({"cpu_workers": 3}, 3),
                            ({"cpu_assist": "on", "cpu_workers": 2}, 2), ({"cpu_assist": "off", "cpu_workers": 2}, 0)):
        config = Config(tensor_parallel=2, device="cpu", **kwargs)
        config.validate_tensor_parallel()
        assert config.resolved_cpu_workers(cpu) == workers, kwargs
