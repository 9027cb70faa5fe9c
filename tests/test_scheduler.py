"""Batch formation: every step carries each decoding sequence's next token and fills the rest of its
token budget with prefill chunks (Sarathi-style mixed steps), never more than the budget."""
from __future__ import annotations

import random

from reference import TEST_DEVICE

from asyncserve import LLM, SamplingParams

BUDGET = 16
MAX_RUNNING = 6


def test_steps_mix_prefill_and_decode_within_the_token_budget(tiny_model):
    adapters = {name: str(tiny_model.adapters[name]) for name in ("r8_attn_rs", "r2_mlp")}
    llm = LLM(model=str(tiny_model.root), adapters=adapters, dtype="float32", device=TEST_DEVICE,
              max_step_tokens=BUDGET, max_running=MAX_RUNNING, prefix_caching=False)
    engine, sched = llm.engine, llm.engine.scheduler
    rng = random.Random(0)
    prompts = [[rng.randrange(3, len(tiny_model.tokenizer)) for _ in range(rng.randint(3, 40))] for _ in range(12)]
    names = [None, "r8_attn_rs", "r2_mlp"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seqs = [engine.make_sequence(p, params, names[i % 3]) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    outputs = {seq.request_id: [] for seq in seqs}
    mixed = steps = 0
    while engine.has_unfinished():
        decoding = {s.request_id for s in sched.running if not s.in_prefill}
        plan = engine.schedule()
        assert 0 < engine.predict_step_seconds(plan) < 60     # the rank-aware step-time model's estimate
        steps += 1
        assert 0 < plan.num_tokens <= BUDGET
        # every sequence past its prefill gets its next token, one token each
        assert {c.seq.request_id for c in plan.decodes} == decoding
        assert all(c.num_tokens == 1 for c in plan.decodes)
        # prefill work left over after this plan means the budget was used to the last token
        scheduled = {c.seq.request_id: c.num_tokens for c in plan.chunks}
        left = any(s.in_prefill and s.num_computed + scheduled.get(s.request_id, 0) < s.num_tokens
                   for s in sched.running)
        left = left or (sched.waiting and len(sched.running) < MAX_RUNNING)
        if left:
            assert plan.num_tokens == BUDGET, (plan.num_tokens, [c.num_tokens for c in plan.chunks])
        mixed += bool(plan.decodes and plan.prefills)
        for u in engine.postprocess(plan, engine.run(plan)):
            outputs[u.seq.request_id] += u.new_token_ids
    assert mixed >= 5, f"only {mixed} of {steps} steps mixed prefill chunks with decodes"
    assert all(s.num_preemptions == 0 for s in seqs)
    # chunking and mixing change no token: the same requests with a budget that fits every prompt at once
    roomy = LLM(model=str(tiny_model.root), adapters=adapters, dtype="float32", device=TEST_DEVICE,
                max_step_tokens=1024, max_running=len(prompts), prefix_caching=False)
    expected = roomy.generate(prompts, params, adapters=[names[i % 3] for i in range(len(prompts))])
    assert [outputs[s.request_id] for s in seqs] == [o.token_ids for o in expected]
