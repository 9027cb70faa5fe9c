"""Speculative decoding by prompt lookup (scheduler/drafts.py): the drafts themselves against a brute
force search, and the engine's and the server's output with drafts against the output without them
and against transformers+PEFT, on the tiny random Llama in fp32."""
import argparse
import json
import os
import random

import pytest
import torch

from asyncserve import LLM, SamplingParams
from asyncserve.cli import _speculative_config
from asyncserve.config import Config
from asyncserve.sampling_params import StructuredOutputs
from asyncserve.scheduler.block_manager import BlockManager
from asyncserve.scheduler import drafts
from asyncserve.scheduler.drafts import NgramIndex
from reference import ADAPTERS, assert_greedy_matches, peft_references, record_steps
from server_harness import ServerThread

NEW_TOKENS = 24


def brute_force_draft(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix n-gram, searched directly."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_draft_prefers_the_longest_then_the_latest_match():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 9, 6, 7, 8, 1, 6, 7]
    # "6 7" occurred at 1-2 (then 9) and 4-5 (then 8): the latest; "x 6 7" never with x = 1
    assert index.propose(tokens, 3) == [8, 1, 6]
    tokens += [8, 2, 7]     # suffix "2 7": no 2-gram match; the 1-gram "7" last ended at 10 (then 8)
    assert index.propose(tokens, 2) == [8, 2]
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 4) == []            # nothing repeats
    assert NgramIndex(1, 2).propose([3], 4) == []                     # too short to repeat
    assert NgramIndex(1, 1).propose([4, 4], 4) == [4]                 # a draft ends with the known tokens


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("per_step", [1024, 3])
def test_draft_as_tokens_grow_equals_a_brute_force_search(monkeypatch, seed, per_step):
    """Token by token over random low-entropy sequences (so that n-grams repeat), as a decode grows its
    output; per_step 3: a long prompt indexed a few n-gram ends per step, the lookups meanwhile only
    finding occurrences from the part indexed, and equal to the brute force once caught up."""
    monkeypatch.setattr(drafts, "INDEX_PER_STEP", per_step)
    rng = random.Random(seed)
    n_min, n_max = rng.choice([(1, 3), (2, 4), (2, 2)])
    tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
    index = NgramIndex(n_min, n_max)
    caught_up = per_step >= len(tokens)
    for _ in range(200):
        k = rng.randint(1, 5)
        draft = index.propose(tokens, k)
        if caught_up or index.indexed >= len(tokens) - 1:
            caught_up = True
            assert draft == brute_force_draft(tokens, k, n_min, n_max), (tokens, k)
        elif draft:                      # from an earlier occurrence of some suffix n-gram
            assert any(draft == tokens[e:e + k] and tokens[e - n:e] == tokens[-n:]
                       for n in range(n_min, n_max + 1) for e in range(n, len(tokens)))
        tokens.append(rng.randrange(4))
    assert caught_up


@pytest.mark.parametrize("text, why", [
    ("{", "not JSON"),
    ("[4]", "must be a JSON object"),
    ('{"num_speculative_tokens": 4}', "method None"),
    ('{"method": "eagle", "num_speculative_tokens": 4}', "method 'eagle'"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "model": "x"}', "unknown keys"),
    ('{"method": "ngram", "prompt_lookup_max": 4}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0}', "positive integers"),
    ('{"method": "ngram", "num_speculative_tokens": -2}', "positive integers"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "positive integers"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "positive integers"),
])
def test_speculative_config_flag_refuses_what_it_cannot_do(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        _speculative_config(text)


def test_speculative_config_flag_maps_vllm_keys_to_config():
    assert _speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
                               '"disable_by_batch_size": 8}') == dict(
        speculative_tokens=3, prompt_lookup_max=5, prompt_lookup_min=2, speculative_max_batch=8)
    assert _speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1}') == dict(
        speculative_tokens=3, prompt_lookup_max=1, prompt_lookup_min=1)
    for fields, why in ((dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min <= prompt_lookup_max"),
                        (dict(prompt_lookup_min=0), "prompt_lookup_min"),
                        (dict(speculative_max_batch=0), "speculative_max_batch"),
                        (dict(speculative_tokens=-1), "must be 0 to 32"),
                        (dict(speculative_tokens=33), "must be 0 to 32")):
        with pytest.raises(ValueError, match=why):
            Config(speculative_tokens=fields.pop("speculative_tokens", 4), **fields).validate()


def test_drafts_are_on_by_default_on_cpu_and_off_on_cuda(tiny_model):
    assert Config().resolved_speculative_tokens(torch.device("cpu")) == 4
    assert Config().resolved_speculative_tokens(torch.device("cuda")) == 0
    off = _speculative_config('{"method": "ngram", "num_speculative_tokens": 0}')
    assert off == dict(speculative_tokens=0) and Config(**off).resolved_speculative_tokens(torch.device("cpu")) == 0
    assert LLM(model=str(tiny_model.root), dtype="float32", device="cpu").engine.scheduler.drafter.num_tokens == 4
    assert LLM(model=str(tiny_model.root), dtype="float32", device="cpu", **off).engine.scheduler.drafter is None


def repetitive_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, as code edits and quotes do, so that drafts find matches early."""
    rng = random.Random(seed)
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    prompts = []
    for _ in range(n):
        phrase = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        prompts.append(tok.encode(" ".join([phrase] * rng.randint(2, 5))))
    return prompts


@pytest.fixture(scope="module")
def engines(tiny_model):
    adapters = {k: str(v) for k, v in tiny_model.adapters.items()}
    make = lambda **kw: LLM(model=str(tiny_model.root), adapters=adapters, dtype="float32", device="cpu",  # noqa: E731
                            max_step_tokens=48, **kw)
    return make(speculative_tokens=0), make(speculative_tokens=4, prompt_lookup_min=1, speculative_max_batch=64)


def test_greedy_with_drafts_is_the_output_without_and_peft_s(tiny_model, engines):
    """Every adapter and the base in one generate call, as a batch of decodes with drafts of different
    lengths (and plain decodes where none matched) beside prefill chunks."""
    plain, spec = engines
    prompts = repetitive_prompts(tiny_model.tokenizer, 3, seed=5)
    cases = [(ids, adapter) for ids in prompts for adapter in [None, *ADAPTERS]]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    drafter = spec.engine.scheduler.drafter
    before = drafter.drafted, drafter.accepted
    ours = spec.generate([c[0] for c in cases], params, adapters=[c[1] for c in cases])
    without = plain.generate([c[0] for c in cases], params, adapters=[c[1] for c in cases])
    refs = peft_references(tiny_model.base, tiny_model.adapters, cases, NEW_TOKENS)
    exact = 0
    for i, (a, b) in enumerate(zip(ours, without)):
        assert a.token_ids == b.token_ids, f"case {i}"
        assert a.finish_reason == b.finish_reason == "length"
        exact += assert_greedy_matches(a.token_ids, refs[i], tie_tol=1e-3, label=f"case {i}")
    assert exact >= len(cases) - 1
    drafted, accepted = drafter.drafted - before[0], drafter.accepted - before[1]
    assert accepted >= len(cases) and accepted < drafted, (drafted, accepted)
    assert spec.engine.pool.counts().kv == 0        # rejected drafts' pages went back


@pytest.mark.parametrize("name, params", [
    ("hot sampling", SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, seed=11, ignore_eos=True)),
    ("seeded sampling", SamplingParams(max_tokens=NEW_TOKENS, temperature=0.1, seed=11, ignore_eos=True)),
    ("top-k, top-p", SamplingParams(max_tokens=NEW_TOKENS, temperature=0.1, top_k=20, top_p=0.9, seed=3,
                                    ignore_eos=True)),
    ("penalties", SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, repetition_penalty=1.05,
                                 frequency_penalty=0.05, presence_penalty=0.05, ignore_eos=True)),
    ("logprobs", SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)),
    ("min_tokens", SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, min_tokens=10)),
    ("max_tokens 1", SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)),
    ("max_tokens 2", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)),
    ("max_tokens 5", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
])
def test_sampling_with_drafts_is_the_output_without(tiny_model, engines, name, params):
    """Each row of a drafted decode samples as the decode of its position would: the same seed position,
    penalties over the output before it, min_tokens' bans; logprobs per kept token."""
    plain, spec = engines
    prompts = repetitive_prompts(tiny_model.tokenizer, 4, seed=9)
    adapters = [None, "r8_attn_rs", "r2_mlp", None]
    drafter = spec.engine.scheduler.drafter
    before = drafter.accepted
    ours = spec.generate(prompts, params, adapters=adapters)
    if name not in ("hot sampling", "max_tokens 1", "max_tokens 2"):   # which keep no draft here
        assert drafter.accepted > before, name
    without = plain.generate(prompts, params, adapters=adapters)
    for a, b in zip(ours, without):
        assert a.token_ids == b.token_ids, name
        assert a.text == b.text and a.finish_reason == b.finish_reason
        if params.logprobs is not None:
            assert len(a.logprobs) == len(a.token_ids)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]


def test_stop_strings_and_tokens_end_a_drafted_decode_where_they_would(tiny_model, engines):
    """A stop met inside a drafted run ends the request there: the kept tokens after it are dropped."""
    plain, spec = engines
    prompts = repetitive_prompts(tiny_model.tokenizer, 4, seed=13)
    free = plain.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, free):
        token = out.token_ids[len(out.token_ids) // 2]
        text = tiny_model.tokenizer.decode(out.token_ids[6:9])
        for params in (SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[token]),
                       SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stop=[text])):
            a, b = spec.generate([prompt], params)[0], plain.generate([prompt], params)[0]
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert b.finish_reason == "stop"


def test_drafts_stay_within_pages_the_context_and_the_batch_limit(tiny_model, monkeypatch):
    """A pool too small for every draft (drafts never evict or preempt), a context limit drafts would
    pass, structured output beside unconstrained requests, and a batch above speculative_max_batch (no
    drafts at all)."""
    root = str(tiny_model.root)
    prompts = repetitive_prompts(tiny_model.tokenizer, 6, seed=17)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(model=root, dtype="float32", device="cpu", pool_mem=160 * 1024, max_model_len=96, speculative_tokens=0)
    spec = LLM(model=root, dtype="float32", device="cpu", pool_mem=160 * 1024, max_model_len=96,
               speculative_tokens=6, prompt_lookup_min=1, speculative_max_batch=64)
    refused = []
    reserve_free = BlockManager.reserve_free
    monkeypatch.setattr(BlockManager, "reserve_free", lambda *a: reserve_free(*a) or refused.append(a) or False)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
    assert spec.engine.scheduler.drafter.accepted > 0 and refused
    assert any(len(p) + len(o.token_ids) == 96 for p, o in zip(prompts, outs))     # the context limit bound
    assert spec.engine.pool.counts().kv == 0

    choice = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputs(choice=("fox over dog", "rank")))
    mixed = [params, choice, params]
    a = [spec.generate([p], q)[0] for p, q in zip(prompts, mixed)]
    assert a[1].text in ("fox over dog", "rank")
    assert [o.token_ids for o in a] == [plain.generate([p], q)[0].token_ids for p, q in zip(prompts, mixed)]

    narrow = LLM(model=root, dtype="float32", device="cpu", speculative_tokens=4, prompt_lookup_min=1,
                 speculative_max_batch=2)
    narrow.generate(prompts, params)
    assert narrow.engine.scheduler.drafter.drafted == 0     # six decoding at once: over the limit


def test_server_streams_drafted_tokens_and_counts_them(tiny_model):
    """Over HTTP with --speculative-config's fields: a stream carries several tokens per event where
    drafts were kept, its text is the offline engine's without drafts, and /metrics counts the drafts."""
    prompt = tiny_model.tokenizer.decode(repetitive_prompts(tiny_model.tokenizer, 1, seed=21)[0])
    config = Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                    **_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'))
    st = ServerThread(config)
    try:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events = st.stream("/v1/completions", body)
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        offline = LLM(model=str(tiny_model.root), dtype="float32", device="cpu", speculative_tokens=0)
        want = offline.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
        assert text == want.text
        assert st.metric("asyncserve_spec_decode_accepted_tokens_total") > 0
        assert st.metric("asyncserve_spec_decode_draft_tokens_total") >= st.metric(
            "asyncserve_spec_decode_accepted_tokens_total")
    finally:
        st.stop()


def _shm_names() -> set[str]:
    from ipc import leftovers

    return set(leftovers(f"/asyncserve-{os.getpid()}-"))


@pytest.mark.parametrize("kind", ["tensor parallel", "cpu assist"])
def test_drafted_decodes_on_tp_ranks_and_cpu_workers(tiny_model, engines, kind):
    """Two ranks over shared memory run the drafted decode rows over their shards; with CPU assist, an
    adapter kept off the device for its first steps has its drafted decode rows' LoRA computed on the
    workers. Both give the engine's tokens without drafts, and leave nothing in /dev/shm."""
    plain, _ = engines
    prompts = repetitive_prompts(tiny_model.tokenizer, 4, seed=23)
    adapters = ["r8_attn_rs", None, "r64_all", "r8_attn_rs"]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    before = _shm_names()
    extra = dict(tensor_parallel=2, tp_backend="shm") if kind == "tensor parallel" else dict(cpu_workers=2, cpu_assist="on")
    llm = LLM(model=str(tiny_model.root), adapters={k: str(v) for k, v in tiny_model.adapters.items()},
              dtype="float32", device="cpu", max_step_tokens=48, speculative_tokens=4, prompt_lookup_min=1,
              speculative_max_batch=64, **extra)
    engine = llm.engine
    try:
        cold_drafted = []
        if kind == "cpu assist":
            ensure_resident, steps = engine.pager.ensure_resident, record_steps(engine)

            def no_room_at_first(name, admission=True):
                return None if name == "r8_attn_rs" and len(steps) < 10 else ensure_resident(name, admission)
            engine.pager.ensure_resident = no_room_at_first
        outs = llm.generate(prompts, params, adapters=adapters)
        if kind == "cpu assist":
            cold_drafted = [c for p in steps for c in p.decodes if c.draft and c.seq.adapter_load in p.assisted]
            assert cold_drafted, "no drafted decode ran on the workers"
            assert engine.assist.fallbacks == 0
        assert engine.scheduler.drafter.accepted > 0
    finally:
        engine.close()
    assert sorted(_shm_names() - before) == []
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params, adapters=adapters)]


@pytest.mark.parametrize("constraint", [
    StructuredOutputs(choice=("the fox jumps over the lazy dog and the adapters serve many models", "rank")),
    StructuredOutputs(regex=r"(fox|dog|rank|the|over)( (fox|dog|rank|the|over)){6,14}"),
    StructuredOutputs(json={"type": "object", "properties": {"animal": {"enum": ["the lazy dog", "the fox"]},
                                                             "count": {"enum": [3, 12]}},
                            "required": ["animal", "count"]}),
])
def test_structured_output_drafts_walk_the_guide(tiny_model, engines, constraint):
    """A constrained request is drafted too: the draft is cut where its constraint refuses a token (or
    ends), and each drafted row is sampled under the state the draft walks its guide to (the guide
    itself is walked back): the text is the one without drafts, valid, and drafted tokens were kept."""
    plain, _ = engines
    tok = tiny_model.tokenizer
    spec = LLM(model=str(tiny_model.root), dtype="float32", device="cpu", speculative_tokens=4, prompt_lookup_min=1)
    prompts = [tok.encode(t) for t in ("the fox jumps over the lazy dog and the adapters serve many models " * 3,
                                       '{"animal": "the fox", "count": 3} {"animal": "the lazy dog", "count": 12} ' * 2,
                                       "fox dog rank the over fox dog rank the over fox dog")]
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=constraint)
    ours, without = spec.generate(prompts, params), plain.generate(prompts, params)
    assert [o.text for o in ours] == [o.text for o in without]
    assert [o.token_ids for o in ours] == [o.token_ids for o in without]
    if constraint.choice:
        assert all(o.text in constraint.choice for o in ours)
    elif constraint.json:           # a complete object where it ended (else max_tokens cut it)
        done = [o for o in ours if o.finish_reason == "stop"]
        assert done and all(json.loads(o.text)["animal"] in ("the lazy dog", "the fox") for o in done)
    assert spec.engine.scheduler.drafter.accepted > 0
