"""Tenant isolation (issue 12): one request's or adapter's NaN/Inf must never reach another request.

An adapter whose weights turn non-finite after loading (written into its host rows, past the
loader's check) runs beside base and other adapters' requests: its own requests fail with an error,
the others' tokens equal transformers+PEFT, before and after the pages it poisoned are reused.
"""
from __future__ import annotations

import concurrent.futures
import random

import pytest
import torch
from reference import TEST_DEVICE, assert_greedy_matches, peft_references

from asyncserve import LLM, SamplingParams
from asyncserve.config import Config
from asyncserve.lora.backend import TorchLoraBackend
from asyncserve.model.llama import StepInputs, attention, plan_attention
from asyncserve.stepper.sampler import NO_ALLOWED_TOKEN, NON_FINITE, SamplingRow, sample

NEW_TOKENS = 8
CLEAN = ("r8_attn_rs", "r2_mlp", "r16_patterns")   # adapters run beside the poisoned one
POISON_LIKE = "r64_all"                          # the poisoned adapter: these weights, then NaN or Inf


def _prompts(tok, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    return [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(4, 30)))) for _ in range(n)]


def _references(tiny_model, cases) -> list:
    return peft_references(tiny_model.base, tiny_model.adapters, cases, NEW_TOKENS)


def _poison(engine, name: str, value: float) -> None:
    """Every weight of a loaded adapter := value, in its host rows (what the pager copies into the pool)."""
    host = engine.pager.host[name]
    for rows in (host.a_rows, host.b_rows):
        for t in rows.values():
            t.fill_(value)


def _make_llm(tiny_model, poisoned: bool, **kwargs) -> LLM:
    adapters = {name: str(tiny_model.adapters[name]) for name in CLEAN}
    if poisoned:
        adapters["poison"] = str(tiny_model.adapters[POISON_LIKE])
    # few running sequences: the poisoned ones fail early and later admissions take their pages
    llm = LLM(model=str(tiny_model.root), adapters=adapters, dtype="float32", device=TEST_DEVICE,
              max_step_tokens=24, max_running=5, **kwargs)
    if isinstance(llm.engine.runner.lora, TorchLoraBackend):
        # the stacked GEMMs are where one adapter's values meet every token of the step
        llm.engine.runner.lora.mode = "stacked"
    return llm


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, ignore_eos=True, seed=5)


@pytest.fixture(scope="module")
def clean_runs(tiny_model):
    """Base and clean-adapter cases, their transformers+PEFT references, and their sampled tokens
    from an engine without the poisoned adapter."""
    prompts = _prompts(tiny_model.tokenizer, 3, seed=11)
    cases = [(ids, a) for ids in prompts for a in [None, *CLEAN]]
    sampled = _make_llm(tiny_model, poisoned=False).generate([ids for ids, _ in cases], SAMPLED,
                                                             adapters=[a for _, a in cases])
    return prompts, cases, _references(tiny_model, cases), [o.token_ids for o in sampled]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_poisoned_adapter_fails_alone_and_leaves_no_trace(tiny_model, clean_runs, value):
    prompts, cases, refs, clean_sampled = clean_runs
    llm = _make_llm(tiny_model, poisoned=True)
    _poison(llm.engine, "poison", value)
    vocab = llm.engine.model_config.vocab_size
    # every step mixes the poisoned adapter's requests with base and clean-adapter ones
    mixed = [c for ids in prompts for c in [(ids, a) for a in [None, *CLEAN]] + [(ids, "poison")]]
    outs = llm.generate([ids for ids, _ in mixed], GREEDY, adapters=[a for _, a in mixed])
    got = [o for o, (_, a) in zip(outs, mixed) if a != "poison"]
    for i, (out, (_, adapter)) in enumerate(zip(got, cases)):
        assert out.finish_reason == "length", (adapter, out.finish_reason)
        assert_greedy_matches(out.token_ids, refs[i], tie_tol=1e-3, label=f"case {i} beside the poison, {adapter}")
    poisoned = [o for o, (_, a) in zip(outs, mixed) if a == "poison"]
    assert all(o.finish_reason == "error" and o.token_ids == [] for o in poisoned)

    # sampled: the poisoned requests fail, the others draw what they draw without it, all in the vocab
    outs = llm.generate([ids for ids, _ in mixed], SAMPLED, adapters=[a for _, a in mixed])
    assert [o.token_ids for o, (_, a) in zip(outs, mixed) if a != "poison"] == clean_sampled
    assert all(0 <= t < vocab for o in outs for t in o.token_ids)
    assert all(o.finish_reason == "error" for o, (_, a) in zip(outs, mixed) if a == "poison")

    # unloaded, its pages (adapter rows and its requests' KV, NaN) go to new requests' KV first
    llm.unload_adapter("poison")
    outs = llm.generate([ids for ids, _ in cases], GREEDY, adapters=[a for _, a in cases])
    for i, out in enumerate(outs):
        assert_greedy_matches(out.token_ids, refs[i], tie_tol=1e-3, label=f"case {i} after the unload")
    assert llm.engine.pool.counts().kv == 0


def test_poisoned_adapter_over_http_is_an_openai_error_and_others_answer(tiny_model):
    """Concurrent requests: the poisoned adapter's get a 500 in OpenAI's error shape (a non-streamed
    request) or an error event (a stream); base and clean-adapter requests get the offline tokens."""
    from server_harness import ServerThread

    adapters = {"r8_attn_rs": str(tiny_model.adapters["r8_attn_rs"]), "poison": str(tiny_model.adapters[POISON_LIKE])}
    st = ServerThread(Config(model=str(tiny_model.root), adapters=adapters, dtype="float32", device="cpu",
                             served_model_name="tiny"))
    try:
        _poison(st.server.engine, "poison", float("nan"))
        prompt = "the fox jumps over the lazy dog"
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        models = ["tiny", "r8_attn_rs", "poison", "tiny", "r8_attn_rs", "poison"]
        with concurrent.futures.ThreadPoolExecutor(len(models) + 1) as pool:
            stream = pool.submit(st.stream, "/v1/completions", {**body, "model": "poison", "stream": True})
            answers = list(pool.map(lambda m: st.request("POST", "/v1/completions", {**body, "model": m}), models))
        for model, (status, payload, _) in zip(models, answers):
            if model == "poison":
                assert status == 500 and payload["error"]["code"] == NON_FINITE.code, payload
            else:
                assert status == 200, payload
        events = stream.result()
        assert events[-1]["error"]["code"] == NON_FINITE.code
        offline = LLM(model=str(tiny_model.root), adapters={"r8_attn_rs": adapters["r8_attn_rs"]}, dtype="float32",
                      device="cpu")
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        expected = {m: offline.generate(prompt, params, adapters=None if m == "tiny" else m)[0].text
                    for m in ("tiny", "r8_attn_rs")}
        for model, (_, payload, _) in zip(models, answers):
            if model != "poison":
                assert payload["choices"][0]["text"] == expected[model]
        assert st.request("GET", "/health")[0] == 200
    finally:
        st.stop()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_masks_what_padding_slots_hold(dtype):
    """Decodes over padded block tables whose padding (the tails of their last pages, and the pad
    page) holds NaN and Inf, as pages freed by a poisoned sequence do: the outputs are those of
    attention over each sequence's own context, in float64. bf16 on CPU takes the bmm path, float32
    SDPA."""
    g = torch.Generator().manual_seed(0)
    nh, nkv, hd, block, pool_pages = 6, 2, 16, 4, 16
    ctx = torch.tensor([1, 5, 12, 7, 2])
    nd, max_pages = len(ctx), 3
    owned = torch.randperm(pool_pages - 1, generator=g)[:nd * max_pages].view(nd, max_pages) + 1
    tables = []
    for i in range(nd):      # pages past the context are page 0, as the runner pads them
        n_pages = -(-int(ctx[i]) // block)
        tables.append(owned[i, :n_pages].tolist() + [0] * (max_pages - n_pages))
    mask = torch.arange(max_pages * block)[None, :] < ctx[:, None]
    inp = StepInputs(input_ids=torch.zeros(nd, dtype=torch.int64), positions=torch.zeros(nd, dtype=torch.int64),
                     write_rows=torch.zeros(nd, dtype=torch.int64), num_decode=nd,
                     decode_pages=torch.tensor(tables).flatten(), decode_mask=mask[:, None, None, :],
                     decode_padding=(~mask).view(-1).nonzero().squeeze(1), prefills=[],
                     sample_index=torch.zeros(0, dtype=torch.int64))
    plan = plan_attention(inp, nh, nkv, hd, dtype)
    assert plan.bmm == (dtype == torch.bfloat16)
    q, k, v = (torch.randn(nd, heads, hd, generator=g).to(dtype) for heads in (nh, nkv, nkv))
    k_cache, v_cache = (torch.randn(pool_pages, block, nkv * hd, generator=g).to(dtype) for _ in "kv")
    garbage = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    for i, table in enumerate(tables):
        for slot in range(int(ctx[i]), max_pages * block):
            page = table[slot // block]
            for cache in (k_cache, v_cache):
                cache[page, slot % block] = garbage[slot % 3]
    got = attention(q, k, v, k_cache, v_cache, inp, plan).view(nd, nh, hd).double()
    group = nh // nkv
    for i, table in enumerate(tables):
        n = int(ctx[i])
        keys = k_cache[table].reshape(-1, nkv, hd)[:n].double().repeat_interleave(group, 1)      # [n, nh, hd]
        values = v_cache[table].reshape(-1, nkv, hd)[:n].double().repeat_interleave(group, 1)
        probs = torch.einsum("hd,nhd->hn", q[i].double(), keys).mul(hd ** -0.5).softmax(-1)
        want = torch.einsum("hn,nhd->hd", probs, values)
        torch.testing.assert_close(got[i], want, rtol=0, atol=0.02 if dtype == torch.bfloat16 else 1e-5)


def _row(**params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), prompt_ids=[1, 2], output_ids=[], eos_token_ids=[0], seed=3)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_sampler_gives_no_token_to_rows_without_one_and_the_same_to_the_rest(logprobs):
    """Rows holding NaN or +inf, a row of -inf, and a row whose own constraints ban every token get
    no token and their error; the other rows (greedy and sampled) get what they get alone."""
    vocab = 512
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(1)) * 3
    logits[1, 17] = float("nan")
    logits[2, 400] = float("inf")
    logits[4, :] = float("-inf")
    logits[5, 3] = float("nan")
    greedy = {"temperature": 0.0, "logprobs": logprobs}
    sampled = {"temperature": 0.8, "top_p": 0.9, "logprobs": logprobs}
    rows = [_row(**greedy), _row(**greedy), _row(**sampled), _row(**sampled), _row(**greedy), _row(**sampled),
            _row(**sampled, allowed_token_ids=[0], min_tokens=2), _row(**greedy)]
    out = sample(logits, rows)
    failed = {1: NON_FINITE, 2: NON_FINITE, 4: NON_FINITE, 5: NON_FINITE, 6: NO_ALLOWED_TOKEN}
    assert out.errors == failed
    assert [out.token_ids[i] for i in failed] == [None] * len(failed)
    for i in set(range(len(rows))) - set(failed):
        alone = sample(logits[i:i + 1], [rows[i]])
        assert out.token_ids[i] == alone.token_ids[0] and 0 <= out.token_ids[i] < vocab
        if logprobs is not None:
            assert out.logprobs[i] == alone.logprobs[0]
    # the plain greedy path (no logprobs, no penalties) too
    plain = sample(logits, [_row(temperature=0.0) for _ in range(8)])
    assert plain.errors == {i: NON_FINITE for i in (1, 2, 4, 5)}
    assert plain.token_ids[0] == int(logits[0].argmax()) and plain.token_ids[1] is None


def test_stacked_lora_keeps_a_nan_adapter_to_its_own_tokens(tiny_model):
    """The torch backend's stacked GEMMs see every step adapter's columns for every token: with one
    adapter's weights NaN, the other tokens' projections equal those of a step without it."""
    llm = _make_llm(tiny_model, poisoned=True)
    engine = llm.engine
    _poison(engine, "poison", float("nan"))
    lora = engine.runner.lora
    if not isinstance(lora, TorchLoraBackend):
        pytest.skip("the stacked plan is the torch backend's")
    from asyncserve.lora.batch import LoraBatch

    adapters = [engine.pager.ensure_resident(n) for n in ("r8_attn_rs", "poison")]
    engine.pager.write_pending()
    x = torch.randn(6, engine.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    qkv = engine.runner.weights.layers[0].qkv

    def project(adapters, seg_starts, seg_adapter):
        lora.begin_step(LoraBatch(adapters=adapters, seg_starts=seg_starts, seg_adapter=seg_adapter,
                                  num_tokens=seg_starts[-1], device=engine.pool.device))
        return lora.project(0, "qkv", x[:seg_starts[-1]], qkv)

    # tokens 0-1 base, 2-3 r8_attn_rs, 4-5 poison
    with_poison = project(adapters, [0, 2, 4, 6], [-1, 0, 1])
    without = project(adapters[:1], [0, 2, 4], [-1, 0])
    torch.testing.assert_close(with_poison[:4], without, rtol=1e-5, atol=1e-5)
    assert torch.isnan(with_poison[4:]).all()
