"""dLoRA's merged mode (stepper/merge.py) on the tiny random Llama in float32: tokens of merged steps
equal unmerged ones and transformers+PEFT's, the base weights come back bit for bit, an adapter
unloaded while merged, the torch backend's fused caches, refusals, metrics and cost estimates.

No scheduling policy here: the tests set ``plan.merged`` on the engine's own plans (see ``generate``).
"""
from __future__ import annotations

import random

import pytest
import torch
from reference import ADAPTERS, TEST_DEVICE, assert_greedy_matches, peft_references, run_merged

from asyncserve import LLM, SamplingParams
from asyncserve.lora.backend import TorchLoraBackend
from asyncserve.metrics import Metrics
from asyncserve.model.linear import Linear
from asyncserve.stepper.merge import MergeError

NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
GROUPS = ("qkv", "o", "gate_up", "down")


def _prompts(tok, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    return [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(4, 30)))) for _ in range(n)]


def _references(tiny_model, cases, new_tokens: int = NEW_TOKENS) -> list:
    return peft_references(tiny_model.base, tiny_model.adapters, cases, new_tokens)


def _llm(tiny_model, names=tuple(ADAPTERS), **kwargs) -> LLM:
    return LLM(model=str(tiny_model.root), adapters={n: str(tiny_model.adapters[n]) for n in names},
               dtype="float32", device=TEST_DEVICE, max_step_tokens=24, **kwargs)


def merge_when_alone(name: str):
    """Merge ``name`` in every step whose chunks are all its requests'."""
    return lambda plan, step: name if all(c.seq.adapter == name for c in plan.chunks) else None


def generate(engine, cases, merged_for, params: SamplingParams = GREEDY, after_step=None) -> list[list[int]]:
    """The cases' output token ids, run through reference.run_merged."""
    return [seq.output_ids for seq in run_merged(engine, cases, merged_for, params, after_step)]


def _assert_matches(outs, refs, cases, label: str) -> None:
    for i, (out, ref, (_, adapter)) in enumerate(zip(outs, refs, cases)):
        assert_greedy_matches(out, ref, tie_tol=1e-3, label=f"{label}: case {i}, adapter {adapter}")


def _base_weights(engine) -> dict:
    """Every weight of the model, dense (packed projections through dense_weight()), cloned."""
    w = engine.runner.weights
    out = {"embed": w.embed.clone(), "norm": w.norm.clone(), "lm_head": w.lm_head.dense_weight().clone()}
    for li, lw in enumerate(w.layers):
        out[f"{li}.input_norm"], out[f"{li}.post_norm"] = lw.input_norm.clone(), lw.post_norm.clone()
        for g in GROUPS:
            out[f"{li}.{g}"] = getattr(lw, g).dense_weight().clone()
    return out


@pytest.fixture(scope="module")
def prompts(tiny_model):
    return _prompts(tiny_model.tokenizer, 3, seed=21)


@pytest.mark.parametrize("adapter", ["r64_all", "r8_attn_rs", "r16_patterns"])
def test_merged_tokens_equal_unmerged_and_peft(tiny_model, prompts, adapter):
    """r64_all targets all seven projections, r8_attn_rs is rsLoRA, r16_patterns has rank and alpha patterns."""
    alone = [(ids, adapter) for ids in prompts]
    mixed = [(ids, a) for ids in prompts for a in (adapter, None, "r2_mlp")]
    refs = _references(tiny_model, mixed)
    llm = _llm(tiny_model)
    engine = llm.engine
    unmerged = generate(engine, alone, lambda plan, step: None)
    merged = generate(engine, alone, merge_when_alone(adapter))
    assert engine.merged_adapter == adapter
    assert engine.merge_stats().step_seconds["merged"] > 0
    assert merged == unmerged
    _assert_matches(merged, refs[::3], alone, "merged")
    # its requests beside others': merged steps only while they run alone, switching back and forth
    switches = engine.merge_stats().switches
    outs = generate(engine, mixed, merge_when_alone(adapter))
    _assert_matches(outs, refs, mixed, "mixed")
    assert engine.merge_stats().switches > switches
    assert engine.pool.counts().kv == 0


def test_twenty_merge_cycles_restore_base_weights_bitwise(tiny_model, prompts):
    base_cases = [(ids, None) for ids in prompts]
    adapter_case = [(prompts[0], "r64_all")]
    refs = _references(tiny_model, adapter_case, new_tokens=41)
    llm = _llm(tiny_model, names=("r64_all",), speculative_tokens=0)   # a step per token: 41 steps
    engine = llm.engine
    originals = {(li, g): getattr(lw, g) for li, lw in enumerate(engine.runner.weights.layers) for g in GROUPS}
    before = _base_weights(engine)
    base_before = generate(engine, base_cases, lambda plan, step: None)
    # one request, merged in every other step of its 41 or more: 20 or more merge/unmerge cycles
    params = SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True)
    steps, changed = [], []

    def merged_every_other(plan, step):
        if step == 1:
            changed.append(not torch.equal(engine.runner.weights.layers[0].qkv.dense_weight(), before["0.qkv"]))
        steps.append(step)
        return "r64_all" if step % 2 == 0 else None
    outs = generate(engine, adapter_case, merged_every_other, params)
    merges = (len(steps) + 1) // 2
    assert merges >= 20 and engine.merge_stats().switches == len(steps)
    assert changed == [True]                                      # the merge did change the weights
    _assert_matches(outs, refs, adapter_case, "merged every other step")
    base_after = generate(engine, base_cases, lambda plan, step: None)   # unmerges if the last step merged
    assert engine.merged_adapter is None
    assert engine.runner.merger.elements["unmerge"] == merges * engine.runner.merger.elements_of(
        engine.pager.registry["r64_all"].ranks)
    after = _base_weights(engine)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    for (li, g), linear in originals.items():
        assert getattr(engine.runner.weights.layers[li], g) is linear
    assert base_after == base_before
    _assert_matches(base_after, _references(tiny_model, base_cases), base_cases, "base after 20 cycles")


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the packed bf16 projections are CPU kernels")
def test_bfloat16_merge_over_packed_weights_restores_them_bitwise(tiny_model, prompts):
    """bf16 on CPU: projections in the native packed layout (AVX512-BF16) or oneDNN's; a merged
    step swaps in merged copies of the same kind, and unmerging gives every weight back bit for bit."""
    import kernels.cpu as cpu_kernels
    from asyncserve.model.linear import NativeLinear

    llm = LLM(model=str(tiny_model.root), adapters={"r64_all": str(tiny_model.adapters["r64_all"])},
              dtype="bfloat16", device="cpu", max_step_tokens=24)
    engine = llm.engine
    kind = type(engine.runner.weights.layers[0].qkv)
    assert (kind is NativeLinear) == cpu_kernels.bf16_gemm_available()
    before = _base_weights(engine)
    merged_kinds = []

    def merged_every_other(plan, step):
        merged_kinds.append(type(engine.runner.weights.layers[0].qkv))
        return "r64_all" if step % 2 == 0 else None
    outs = generate(engine, [(prompts[0], "r64_all")], merged_every_other)
    assert len(outs[0]) == NEW_TOKENS and set(merged_kinds) == {kind}
    generate(engine, [(prompts[1], None)], lambda plan, step: None)     # unmerges
    assert engine.merged_adapter is None and engine.merge_stats().switches >= 2
    after = _base_weights(engine)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key


def test_adapter_unloaded_and_reloaded_while_merged(tiny_model, prompts):
    """A merged adapter counts as in use: unloading it keeps its pages until a step unmerges it."""
    cases_old = [(prompts[0], "r64_all")]
    cases_new = [(prompts[1], "r8_attn_rs")]
    refs = _references(tiny_model, cases_old + cases_new)
    llm = _llm(tiny_model, names=())
    engine, pager = llm.engine, llm.engine.pager
    llm.load_adapter("x", str(tiny_model.adapters["r64_all"]))
    old = pager.registry["x"].load

    def unload_at_third(step: int) -> None:
        if step == 2:
            assert engine.unload_adapter("x") == []          # its one request runs on
    outs = generate(engine, [(ids, "x") for ids, _ in cases_old], merge_when_alone("x"), after_step=unload_at_third)
    _assert_matches(outs, refs[:1], cases_old, "unloaded while merged")
    # finished and unloaded, but still merged: its pages stay, held by the merge alone
    assert engine.merged_adapter == "x" and "x" not in pager.registry
    assert old in pager.resident and pager.refs == {old: 1}
    assert engine.pool.counts().adapter == len(pager.resident[old].pages)
    # the name again, other weights: the old load is unmerged, the new one merged, the old pages freed
    llm.load_adapter("x", str(tiny_model.adapters["r8_attn_rs"]))
    new = pager.registry["x"].load
    assert engine.merge_switch_seconds("x") > 0                 # a new load: unmerge, then merge
    outs = generate(engine, [(ids, "x") for ids, _ in cases_new], merge_when_alone("x"))
    _assert_matches(outs, refs[1:], cases_new, "reloaded and merged")
    assert engine.runner.merger.merged_load == new
    assert old not in pager.resident and pager.refs == {new: 1}
    # unmerged by a base step: nothing holds the new load any more
    generate(engine, [(prompts[2], None)], lambda plan, step: None)
    assert engine.merged_adapter is None and pager.refs == {}
    engine.unload_adapter("x")
    assert engine.pool.counts().adapter == 0


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fused base + A GEMMs are oneDNN's (CPU)")
def test_fused_caches_rebuilt_after_a_switch(tiny_model, prompts):
    """Packed from the first step, the torch backend's fused [W; A_stack] GEMMs are built from the base
    weights: a switch drops them, and the unmerged steps after a merged one rebuild them."""
    other = [(ids, "r8_attn_rs") for ids in prompts]
    merged_cases = [(ids, "r64_all") for ids in prompts]
    refs = _references(tiny_model, other + merged_cases)
    llm = _llm(tiny_model, names=("r8_attn_rs", "r64_all"))
    engine = llm.engine
    lora = engine.runner.lora
    assert isinstance(lora, TorchLoraBackend)
    lora.pack_after_steps = 1
    lora.mode = "stacked"
    _assert_matches(generate(engine, other, lambda plan, step: None), refs[:3], other, "before")
    assert any(f is not None for f in lora._fused.values())
    seen = []
    outs = generate(engine, merged_cases, merge_when_alone("r64_all"),
                    after_step=lambda step: seen.append(dict(lora._fused)))
    _assert_matches(outs, refs[3:], merged_cases, "merged")
    assert seen[0] == {}                                          # cleared by the merge
    outs = generate(engine, other, lambda plan, step: None)       # unmerges, then fuses anew
    _assert_matches(outs, refs[:3], other, "after")
    assert engine.merged_adapter is None
    assert any(f is not None for f in lora._fused.values())


class Int8Linear(Linear):
    """Stands for a quantized base projection (here over the same float weight, so outputs stay)."""


def test_merge_refused_where_it_cannot_be_exact(tiny_model, prompts):
    llm = _llm(tiny_model, names=("r64_all", "r1_qv"))
    engine = llm.engine
    layers = engine.runner.weights.layers
    assert engine.merge_refusal("r64_all") is None
    originals = [getattr(lw, g) for lw in layers for g in GROUPS]
    # a base projection of a kind that cannot be updated
    packed = layers[1].o
    layers[1].o = Int8Linear(packed.dense_weight())
    assert "Int8Linear" in engine.merge_refusal("r64_all")
    seq = engine.make_sequence(prompts[0], GREEDY, "r64_all")
    engine.add(seq)
    plan = engine.schedule()
    plan.merged = "r64_all"
    with pytest.raises(MergeError, match="layer 1's o projection is a Int8Linear .* cannot take an adapter merged"):
        engine.run(plan)
    assert [getattr(lw, g) for lw in layers for g in GROUPS] == originals[:5] + [layers[1].o] + originals[6:]
    assert engine.merged_adapter is None
    plan.merged = None
    engine.postprocess(plan, engine.run(plan))                    # unmerged it runs
    layers[1].o = packed
    # a merge that overflows the weights' dtype: refused, nothing swapped in
    host = engine.pager.host["r1_qv"]
    for rows in (*host.a_rows.values(), *host.b_rows.values()):
        rows.fill_(1e30)                                           # finite, but their product is not
    engine.abort(engine.unfinished()[0].request_id)
    engine.add(engine.make_sequence(prompts[1], GREEDY, "r1_qv"))
    plan = engine.schedule()
    plan.merged = "r1_qv"
    with pytest.raises(MergeError, match="cannot merge adapter 'r1_qv': it overflows layer 0's qkv weights"):
        engine.run(plan)
    assert [getattr(lw, g) for lw in layers for g in GROUPS] == originals
    assert engine.merged_adapter is None
    assert "overflows" in engine.merge_refusal("r1_qv") and engine.merge_refusal("r64_all") is None
    with pytest.raises(MergeError, match="overflows"):           # remembered: refused before any work
        engine.run(plan)
    assert engine.runner.merger.elements["merge"] == 0


def test_plan_merging_beside_other_chunks_is_an_error(tiny_model, prompts):
    llm = _llm(tiny_model, names=("r64_all", "r1_qv"))
    engine = llm.engine
    for ids, adapter in [(prompts[0], "r64_all"), (prompts[1], None), (prompts[2], "r1_qv")]:
        engine.add(engine.make_sequence(ids[:6], GREEDY, adapter))      # all three in the first step
    plan = engine.schedule()
    plan.merged = "r64_all"
    with pytest.raises(MergeError, match="a plan merging 'r64_all' holds chunks of 'r1_qv', the base model"):
        engine.run(plan)
    assert engine.merged_adapter is None and engine.merge_stats().switches == 0


def test_switch_estimates_step_model_and_metrics(tiny_model, prompts):
    llm = _llm(tiny_model, names=("r64_all", "r1_qv"))
    engine = llm.engine
    merger = engine.runner.merger
    # before any switch: the prior, by the base weights a merge rewrites (r1_qv: q/k/v alone)
    assert engine.merge_switch_seconds(None) == 0.0
    assert engine.merge_switch_seconds("r64_all") > engine.merge_switch_seconds("r1_qv") > 0
    metrics = Metrics()
    cases = [(ids, "r64_all") for ids in prompts]
    plans = []

    def merged_and_kept(plan, step):
        plans.append(plan)
        return "r64_all"
    generate(engine, cases, merged_and_kept)
    assert engine.merged_adapter == "r64_all"
    assert engine.merge_switch_seconds("r64_all") == 0.0
    measured = merger.seconds["merge"] / merger.elements["merge"]
    assert engine.merge_switch_seconds("r1_qv") == pytest.approx(
        merger.estimate_seconds("unmerge", engine.pager.registry["r64_all"].ranks)
        + measured * merger.elements_of(engine.pager.registry["r1_qv"].ranks))
    # a merged step costs what the base model's does
    plan = plans[-1]
    merged_estimate = engine.predict_step_seconds(plan)
    assert merged_estimate == engine.latency.predict([(c.num_tokens, 0) for c in plan.chunks])
    metrics.observe_engine(engine)
    text = metrics.render().decode()
    assert 'asyncserve_merged_adapter{adapter="r64_all"} 1.0' in text
    assert "asyncserve_merge_switches_total 1.0" in text
    merged_seconds = engine.merge_stats().step_seconds["merged"]
    assert merged_seconds > 0
    assert f'asyncserve_step_mode_seconds_total{{mode="merged"}} {merged_seconds!r}' in text
    generate(engine, [(prompts[0], None)], lambda plan, step: None)
    metrics.observe_engine(engine)
    text = metrics.render().decode()
    assert "asyncserve_merged_adapter{" not in text
    assert "asyncserve_merge_switches_total 2.0" in text
    assert 'asyncserve_merge_switch_seconds_total{kind="unmerge"}' in text


def test_prefix_cache_keeps_merged_kv_to_its_adapter(tiny_model):
    """KV written by merged steps is the merged adapter's: the prefix cache keys it under that adapter's
    load, so its own later requests reuse it, merged or not, while the base model's and another
    adapter's requests with the same prompt never do (nor does the merged adapter reuse theirs). Each
    request's greedy tokens equal transformers+PEFT's with the cache on."""
    tok = tiny_model.tokenizer
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    rng = random.Random(31)
    first, second = (tok.encode(" ".join(rng.choice(words) for _ in range(60)))[:40] for _ in range(2))
    merged, other = "r64_all", "r8_attn_rs"
    # first: the merged adapter's KV is written first; second: the base model's and the other's first
    runs = [(first, merged, True), (first, None, False), (first, other, False), (first, merged, False),
            (second, None, False), (second, other, True), (second, merged, True), (second, merged, False)]
    refs = _references(tiny_model, [(ids, adapter) for ids, adapter, _ in runs])
    llm = _llm(tiny_model, names=(merged, other), prefix_caching=True)
    engine = llm.engine
    blocks = engine.scheduler.blocks
    hits = []
    for (ids, adapter, as_merged), ref in zip(runs, refs):
        before = blocks.prefix_hit_tokens
        out = generate(engine, [(ids, adapter)], merge_when_alone(adapter) if as_merged else lambda plan, step: None)
        assert engine.merged_adapter == (adapter if as_merged else None)
        assert_greedy_matches(out[0], ref, tie_tol=1e-3, label=f"{adapter} merged={as_merged}")
        hits.append(blocks.prefix_hit_tokens - before)
    # only a request of an adapter (or the base model) that ran the prompt before finds it cached
    assert hits == [0, 0, 0, 32, 0, 0, 0, 32]
