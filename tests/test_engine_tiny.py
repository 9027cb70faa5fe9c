"""The engine against transformers+PEFT on a tiny random Llama (GQA, untied embeddings), fp32.

All prompts x adapters x base run in ONE generate call, with a small per-step token budget so
prefill chunks and decodes of different adapters and ranks share steps.
"""
import random

import pytest
import torch

from asyncserve import LLM, SamplingParams
from asyncserve.lora.backend import TorchLoraBackend
from asyncserve.model.llama import PrefillChunk, StepInputs, attention, plan_attention
from reference import ADAPTERS, TEST_DEVICE, assert_greedy_matches, peft_references

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model.root, tiny_model.tokenizer, tiny_model.base, tiny_model.adapters


def prompts_for(tok, n, seed):
    rng = random.Random(seed)
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    return [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))) for _ in range(n)]


def references(base, paths, cases):
    return peft_references(base, paths, cases, NEW_TOKENS)


@pytest.mark.parametrize("stacks", ["default", "packed_at_once", "in_pieces"])
def test_all_adapters_and_base_in_one_generate_call(tiny, stacks):
    """default: on CPU with the native kernels, the torch backend's lora_segments plan. The other two
    keep it on its eager stacks. packed_at_once: the torch backend packs every active set at its first step, so on CPU the
    stacked shrink rides on the base GEMMs (otherwise only sets that last 32 steps do). in_pieces:
    besides, it builds, packs and fuses one layer's stacks per step, computing each set's tokens from
    the pool rows until its stacks are complete (how a large adapter's set is built, issue 12)."""
    root, tok, base, paths = tiny
    prompts = prompts_for(tok, 4, seed=1)
    cases = [(ids, adapter) for ids in prompts for adapter in [None, *ADAPTERS]]
    refs = references(base, paths, cases)
    llm = LLM(model=str(root), adapters={k: str(v) for k, v in paths.items()}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=24)
    lora = llm.engine.runner.lora
    torch_backend = isinstance(lora, TorchLoraBackend)
    fusing = stacks == "packed_at_once" and torch_backend and TEST_DEVICE == "cpu"
    if stacks != "default" and torch_backend:
        lora.native = False
        lora.pack_after_steps = 1
    plan_kinds = set()
    if stacks == "in_pieces" and torch_backend:
        lora.build_bytes_per_step = 0                   # one layer of one group per step
        real_begin = lora.begin_step

        def begin_step(batch):
            real_begin(batch)
            plan_kinds.update(kind for kind, _ in lora._plans.values())
        lora.begin_step = begin_step
    outs = llm.generate([c[0] for c in cases], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        adapters=[c[1] for c in cases])
    exact = 0
    for i, (out, (ids, adapter)) in enumerate(zip(outs, cases)):
        assert out.prompt_token_ids == ids
        assert out.finish_reason == "length"
        exact += assert_greedy_matches(out.token_ids, refs[i], tie_tol=1e-3, label=f"case {i} adapter {adapter}")
    assert exact >= len(cases) - 1, f"only {exact}/{len(cases)} sequences equal the reference end to end"
    # adapters must actually change the output, or this test proves nothing about LoRA
    base_tokens = {tuple(c[0]): o.token_ids for c, o in zip(cases, outs) if c[1] is None}
    changed = sum(o.token_ids != base_tokens[tuple(c[0])] for c, o in zip(cases, outs) if c[1] is not None)
    assert changed >= len(ADAPTERS) * len(prompts) // 2
    assert llm.engine.pool.counts().kv == 0
    if fusing:
        assert any(f is not None for f in lora._fused.values())
    if stacks == "in_pieces" and torch_backend:
        assert "pool" in plan_kinds and plan_kinds & {"stacked", "loop"}, plan_kinds


def test_small_pool_evicts_and_repages_adapters_with_identical_outputs(tiny):
    root, tok, base, paths = tiny
    prompts = prompts_for(tok, 3, seed=2)
    cases = [(ids, adapter) for ids in prompts for adapter in [*ADAPTERS, None]]   # adapters interleaved
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    adapters = {k: str(v) for k, v in paths.items()}
    roomy = LLM(model=str(root), adapters=adapters, dtype="float32", device=TEST_DEVICE)
    expected = [o.token_ids for o in roomy.generate([c[0] for c in cases], params, adapters=[c[1] for c in cases])]

    # a pool that holds the biggest adapter and one sequence's KV, but never all adapters at once
    engine = roomy.engine
    sizes = {n: engine.pager.footprint(n) for n in ADAPTERS}
    page = engine.pool.page_numel * engine.pool.data.element_size()
    kv_pages = engine.pool.pages_for_tokens(max(len(p) for p in prompts) + NEW_TOKENS)
    pages = max(sizes.values()) + kv_pages + 2
    assert pages < sum(sizes.values()), "the test pool must be too small for all adapters"
    small = LLM(model=str(root), adapters=adapters, dtype="float32", device=TEST_DEVICE, pool_mem=pages * page,
                max_step_tokens=16)
    got = [o.token_ids for o in small.generate([c[0] for c in cases], params, adapters=[c[1] for c in cases])]
    assert got == expected
    assert small.engine.pager.loads_total > len(ADAPTERS), "adapters should have been evicted and re-paged"
    c = small.engine.pool.counts()
    assert c.kv == 0 and c.free + c.adapter == c.total


def test_thousands_of_short_requests_leak_no_pages(tiny):
    root, tok, base, paths = tiny
    llm = LLM(model=str(root), adapters={k: str(v) for k, v in paths.items()}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=256, max_running=256)
    rng = random.Random(3)
    names = [None, *ADAPTERS]
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randint(1, 6))] for _ in range(2000)]
    adapters = [rng.choice(names) for _ in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), adapters=adapters)
    assert all(len(o.token_ids) == 2 for o in outs)
    c = llm.engine.pool.counts()
    assert c.kv == 0, f"{c.kv} KV pages leaked"
    assert c.free + c.adapter == c.total
    assert not llm.engine.pager.refs


def test_bf16_close_to_fp32(tiny):
    """bf16 agrees with fp32 on the first greedy token for nearly every case and on most of the rest.

    Measure: first-token agreement rate and mean fraction of the 12 tokens equal before the first
    divergence (bf16 rounding flips near-ties, after which continuations legitimately drift)."""
    root, tok, base, paths = tiny
    prompts = prompts_for(tok, 6, seed=4)
    cases = [(ids, adapter) for ids in prompts for adapter in [None, *ADAPTERS]]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    adapters = {k: str(v) for k, v in paths.items()}
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=str(root), adapters=adapters, dtype=dtype, device=TEST_DEVICE)
        runs[dtype] = [o.token_ids for o in llm.generate([c[0] for c in cases], params, adapters=[c[1] for c in cases])]
    first = sum(a[0] == b[0] for a, b in zip(runs["float32"], runs["bfloat16"])) / len(cases)
    prefix = []
    for a, b in zip(runs["float32"], runs["bfloat16"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(n / len(a))
    assert first >= 0.9, f"first-token agreement {first:.2f}"
    assert sum(prefix) / len(prefix) >= 0.7, f"mean agreeing prefix {sum(prefix) / len(prefix):.2f}"


def test_cpu_bf16_attention_equals_sdpa():
    """The bf16 CPU attention (bmm's: block-diagonal queries over the decodes' gathered pages, stacked
    query groups per prefill chunk) against SDPA in float64 on the same inputs: GQA, padded block
    tables, decode contexts of 1 to all padded pages, a causal chunk from position 0 and one that
    continues a sequence; two layers in a row, since the query blocks are reused."""
    g = torch.Generator().manual_seed(0)
    nh, nkv, hd, block, pages_per_seq, pool_pages = 6, 2, 16, 4, 3, 20
    ctx = torch.tensor([1, 5, 12, 7, 2])
    nd = len(ctx)
    chunks = [(0, 5), (6, 4)]                       # (first_pos, tokens)
    T = nd + sum(n for _, n in chunks)
    prefills, start = [], nd
    for first_pos, n in chunks:
        table = torch.randperm(pool_pages, generator=g)[:pages_per_seq]
        prefills.append(PrefillChunk(start, start + n, first_pos, table))
        start += n
    mask = (torch.arange(pages_per_seq * block)[None, :] < ctx[:, None])[:, None, None, :]
    inp = StepInputs(input_ids=torch.zeros(T, dtype=torch.int64), positions=torch.zeros(T, dtype=torch.int64),
                     write_rows=torch.zeros(T, dtype=torch.int64), num_decode=nd,
                     decode_pages=torch.randint(0, pool_pages, (nd * pages_per_seq,), generator=g),
                     decode_mask=mask, decode_padding=(~mask).view(-1).nonzero().squeeze(1), prefills=prefills,
                     sample_index=torch.zeros(0, dtype=torch.int64))
    bmm = plan_attention(inp, nh, nkv, hd, torch.bfloat16)
    sdpa = plan_attention(inp, nh, nkv, hd, torch.float64)
    assert bmm.bmm and not sdpa.bmm
    for _ in range(2):
        q, k, v = (torch.randn(T, heads, hd, generator=g).bfloat16() for heads in (nh, nkv, nkv))
        k_cache, v_cache = (torch.randn(pool_pages, block, nkv * hd, generator=g).bfloat16() for _ in "kv")
        got = attention(q, k, v, k_cache, v_cache, inp, bmm)
        expected = attention(*(t.double() for t in (q, k, v, k_cache, v_cache)), inp, sdpa)
        torch.testing.assert_close(got.double(), expected, rtol=0.0, atol=0.02)


def test_prompt_logprobs_equal_transformers_across_chunks_and_adapters(tiny):
    """prompt_logprobs: every prompt token after the first scored from the tokens before it, as
    log_softmax of transformers+PEFT's logits over the whole prompt; prompts split into chunks of 8
    (one sequence scored across several steps, beside others' decodes)."""
    from peft import PeftModel

    root, tok, base, paths = tiny
    prompts = prompts_for(tok, 3, seed=7)
    prompts = [p for p in prompts if len(p) > 10] + [tok.encode("the")]       # long ones, and one of one token
    cases = [(ids, adapter) for ids in prompts for adapter in (None, "r8_attn_rs", "r2_mlp")]
    llm = LLM(model=str(root), adapters={k: str(v) for k, v in paths.items()}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=8)
    outs = llm.generate([c[0] for c in cases], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                              prompt_logprobs=3), adapters=[c[1] for c in cases])
    for (ids, adapter), out in zip(cases, outs):
        model = base if adapter is None else PeftModel.from_pretrained(base, paths[adapter]).eval()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)      # [len, vocab]
        if adapter is not None:
            model.unload()
        assert len(out.prompt_logprobs) == len(ids) - 1 == len(out.prompt_top_logprobs)
        if len(ids) == 1:
            continue
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=2e-4, rtol=0)
        for j, top in enumerate(out.prompt_top_logprobs):
            values, top_ids = ref[j].topk(3)
            assert len(top) == 3
            torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=2e-4, rtol=0)
            assert [t for t, _ in top] == top_ids.tolist() or float(values[0] - values[-1]) < 1e-3
    assert outs[0].logprobs is None and llm.engine.pool.counts().kv == 0


@pytest.mark.parametrize("prompt_logprobs", [None, 1])
def test_preempted_sequences_recompute_to_the_same_tokens_and_prompt_logprobs(tiny, prompt_logprobs):
    """A pool too small for every running sequence's KV: decodes preempt the newest sequences, which
    are recomputed from their tokens when readmitted (cancel + recompute, from their blocks still in
    the prefix cache when not asked for prompt logprobs) and end as if never preempted, with each
    prompt token scored once."""
    root, tok, base, paths = tiny
    prompts = [p for p in prompts_for(tok, 12, seed=9) if len(p) > 12][:6]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    adapters = [None, "r8_attn_rs"] * 3
    loaded = {"r8_attn_rs": str(paths["r8_attn_rs"])}
    roomy = LLM(model=str(root), adapters=loaded, dtype="float32", device=TEST_DEVICE)
    expected = roomy.generate(prompts, params, adapters=adapters)
    engine = roomy.engine
    page = engine.pool.page_numel * engine.pool.data.element_size()
    need = [engine.pool.pages_for_tokens(len(p) + 40) for p in prompts]
    pages = engine.pager.footprint("r8_attn_rs") + sum(sorted(need)[-3:])    # about three sequences at a time
    small = LLM(model=str(root), adapters=loaded, dtype="float32", device=TEST_DEVICE, pool_mem=pages * page)
    seqs = []
    add = small.engine.add
    small.engine.add = lambda seq: (seqs.append(seq), add(seq))[1]
    got = small.generate(prompts, params, adapters=adapters)
    assert sum(seq.num_preemptions for seq in seqs) > 0, "the pool should have forced preemptions"
    if prompt_logprobs is None:
        assert small.engine.load_snapshot().prefix_hit_tokens > 0, "readmissions should find their blocks cached"
    for out, exp in zip(got, expected):
        assert out.token_ids == exp.token_ids
        if prompt_logprobs is not None:
            assert len(out.prompt_logprobs) == len(exp.prompt_token_ids) - 1
            torch.testing.assert_close(out.prompt_logprobs, exp.prompt_logprobs, atol=1e-5, rtol=0)
    assert small.engine.pool.counts().kv == 0


def test_prefix_cache_reuses_blocks_per_adapter_with_reference_tokens(tiny, tmp_path):
    """Prompts sharing a 40-token prefix: later ones take its cached blocks (three full blocks of 16)
    and still produce transformers+PEFT's tokens. Blocks are per adapter, and per load of a name."""
    import shutil

    root, tok, base, paths = tiny
    rng = random.Random(11)
    prefix = [rng.randrange(3, len(tok)) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, len(tok)) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    cases = [(ids, adapter) for adapter in (None, "r8_attn_rs", "r16_patterns") for ids in prompts]
    refs = references(base, paths, cases)
    swapped = tmp_path / "swapped"                    # other weights, to be loaded under the name r8_attn_rs
    shutil.copytree(paths["r16_patterns"], swapped)
    llm = LLM(model=str(root), adapters={k: str(v) for k, v in paths.items()}, dtype="float32", device=TEST_DEVICE)
    engine = llm.engine
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def run(selected):
        hits = engine.load_snapshot().prefix_hit_tokens
        outs = llm.generate([cases[i][0] for i in selected], params, adapters=[cases[i][1] for i in selected])
        for i, out in zip(selected, outs):
            assert_greedy_matches(out.token_ids, refs[i], tie_tol=1e-3, label=f"case {i}")
        return engine.load_snapshot().prefix_hit_tokens - hits

    assert run([0]) == 0                                   # a cold cache
    assert run([1, 2, 3]) == 3 * 32                        # blocks 0 and 1 hit; block 2 holds tokens past the prefix
    assert run([4]) == 0                                   # the same tokens under an adapter: not the base's KV
    assert run([5, 6, 7, 8]) == 3 * 32                     # ... but its own, and not r16's
    assert llm.engine.pool.counts().cached > 0 and llm.engine.pool.counts().kv == 0
    exact = prefix[:32]                                    # two full blocks: the second is recomputed for its
    first = llm.generate([exact], params)[0]               # last token's logits
    hits = engine.load_snapshot().prefix_hit_tokens
    assert llm.generate([exact], params)[0].token_ids == first.token_ids
    assert engine.load_snapshot().prefix_hit_tokens - hits == 16
    llm.unload_adapter("r8_attn_rs")
    llm.load_adapter("r8_attn_rs", str(swapped))
    hits = engine.load_snapshot().prefix_hit_tokens
    got = llm.generate([prompts[0]], params, adapters="r8_attn_rs")[0]
    assert engine.load_snapshot().prefix_hit_tokens == hits, "a reloaded name must not reuse the old weights' KV"
    assert got.token_ids == llm.generate([prompts[0]], params, adapters="r16_patterns")[0].token_ids
