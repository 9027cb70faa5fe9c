"""Qwen3.5: Gated DeltaNet (linear attention, a recurrent state per sequence) in three layers of four, gated
full attention in the fourth. Greedy tokens against transformers+PEFT on every step path that runs it, with
prompts chunked beside decodes and sequences preempted; the multimodal checkpoint's language model; what
is off or refused for it; the delta rule's closed form against its token-by-token recurrence."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from asyncserve import LLM, SamplingParams
from asyncserve.model import llama
from asyncserve.model.config import ModelLoadError
from asyncserve.model.linear_attention import LinearStates, _decode_rule, _delta_rule
from asyncserve.pager.adapters import AdapterError
from family_models import (GREEDY_TOKENS, HYBRID_FAMILIES, build_family_model, build_multimodal, cases_of,
                           check_greedy, generate_greedy)
from reference import (TEST_DEVICE, assert_greedy_matches, peft_references, record_calls, require_native_kernels,
                       run_merged, save_random_adapter)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """The tiny model, its three adapters (the attention's and MLPs' projections at rank 4; q, v, down at
    rank 8 with rsLoRA; PEFT's all-linear, the Gated DeltaNet's projections included, with a rank and an
    alpha pattern on them) and transformers+PEFT's greedy runs of prompts of 1 to 150 tokens (one token: a
    sequence whose first step is a decode-sized run; two past a 64-token chunk of the delta rule), each with
    the base model and every adapter."""
    model = build_family_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")
    model.adapters["linear"] = model.folder.parent / "adapters" / "linear"
    save_random_adapter(model.base, model.adapters["linear"], r=4, targets="all-linear", seed=77,
                        rank_pattern={"linear_attn.out_proj": 2}, alpha_pattern={"in_proj_qkv": 3.0})
    cases = cases_of(model, lengths=(1, 4, 11, 19, 70, 150))
    return model, cases, peft_references(model.base, model.adapters, cases, GREEDY_TOKENS)


@pytest.mark.parametrize("path", ["ops", "eager"])
def test_base_and_two_adapters_in_one_generate_call(qwen3_5, path, monkeypatch):
    """ops: the Python loop over the native kernels (the attention layer's); eager: torch ops. Prompts are
    chunked 16 tokens a step beside the other sequences' decodes, so states carry across chunks."""
    model, cases, refs = qwen3_5
    monkeypatch.setenv("ASYNCSERVE_NATIVE", "0" if path == "eager" else "1")
    if path == "ops":
        require_native_kernels()
    loop_steps = []
    record_calls(monkeypatch, llama, "_forward_native", lambda *a: loop_steps.append(1))
    llm, tokens = generate_greedy(model, cases)
    check_greedy(tokens, cases, refs, f"qwen3_5 {path}")
    assert not loop_steps, "the native layer loop has no linear-attention layers: the Python loop runs"
    engine = llm.engine
    assert engine.pool.num_layers == 1 and engine.pool.counts().kv == 0     # KV pages for the attention layer only
    assert sorted(engine.scheduler.blocks._free_slots) == list(range(engine.config.max_running))


def test_triton_lora_backend_and_merged_mode(qwen3_5):
    model, cases, refs = qwen3_5
    llm, tokens = generate_greedy(model, cases, lora_backend="triton")
    check_greedy(tokens, cases, refs, "qwen3_5 triton")
    alone = [(case, ref) for case, ref in zip(cases, refs) if case[1] == "all"]
    llm = LLM(model=str(model.folder), adapters={"all": str(model.adapters["all"])}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=16)
    merge = lambda plan, step: "all" if all(c.seq.adapter == "all" for c in plan.chunks) else None   # noqa: E731
    seqs = run_merged(llm.engine, [case for case, _ in alone], merge,
                      SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True))
    assert llm.engine.merged_adapter == "all"
    check_greedy([s.output_ids for s in seqs], [c for c, _ in alone], [r for _, r in alone], "qwen3_5 merged")
    llm.load_adapter("linear", str(model.adapters["linear"]))
    assert "linear-attention layers, which is not merged" in llm.engine.merge_refusal("linear")


def test_preempted_sequences_restart_their_state(qwen3_5):
    """A pool too small for every sequence's KV: the newest are preempted and recomputed from their first
    token, their state slots given back and zeroed on readmission; the tokens are those of a roomy pool.
    Few slots (max_running 2) hold sequences back the same way."""
    model, _, _ = qwen3_5
    rng = random.Random(4)
    prompts = [[rng.randrange(3, len(model.tokenizer)) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    adapters = [None, "all", "some"] * 2
    loaded = {k: str(v) for k, v in model.adapters.items()}
    roomy = LLM(model=str(model.folder), adapters=loaded, dtype="float32", device=TEST_DEVICE)
    expected = [o.token_ids for o in roomy.generate(prompts, params, adapters=adapters)]
    engine = roomy.engine
    page = engine.pool.page_numel * engine.pool.data.element_size()
    mc = engine.model_config
    states = engine.config.max_running * LinearStates.nbytes_per_slot(mc.linear_attention, sum(mc.linear_layers),
                                                                      torch.float32)
    need = sorted(engine.pool.pages_for_tokens(len(p) + 40) for p in prompts)
    pages = engine.pager.footprint("all") + engine.pager.footprint("some") + sum(need[-2:])
    small = LLM(model=str(model.folder), adapters=loaded, dtype="float32", device=TEST_DEVICE,
                pool_mem=pages * page + states)
    seqs = []
    add = small.engine.add
    small.engine.add = lambda seq: (seqs.append(seq), add(seq))[1]
    assert [o.token_ids for o in small.generate(prompts, params, adapters=adapters)] == expected
    assert sum(seq.num_preemptions for seq in seqs) > 0, "the pool should have forced preemptions"
    few = LLM(model=str(model.folder), adapters=loaded, dtype="float32", device=TEST_DEVICE, max_running=2)
    assert [o.token_ids for o in few.generate(prompts, params, adapters=adapters)] == expected


def test_bfloat16_logprobs_as_close_to_float32_as_transformers_bfloat16(qwen3_5):
    """bf16 weights and activations (the states in float32, as transformers keeps them): the first sampled
    position's top-5 logprobs are as far from transformers' float32 ones as transformers' own bf16 run is
    (on average over the prompts, within 2x: both round differently; a wrong path is off by whole units)."""
    model, cases, _ = qwen3_5
    prompts = [ids for ids, adapter in cases if adapter is None]
    llm = LLM(model=str(model.folder), dtype="bfloat16", device=TEST_DEVICE, max_step_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=True))
    ours, theirs = [], []
    bf16 = copy.deepcopy(model.base).to(torch.bfloat16)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            exact = model.base(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
            rounded = bf16(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        top = dict(out.top_logprobs[0])
        ours.append(max(abs(lp - float(exact[t])) for t, lp in top.items()))
        theirs.append(max(abs(float(rounded[t] - exact[t])) for t in top))
    assert sum(ours) <= 2 * sum(theirs), (ours, theirs)


def test_multimodal_checkpoint_language_model(tmp_path):
    """Qwen3.5's checkpoints are Qwen3_5ForConditionalGeneration: its language model, with an all-linear
    adapter trained on the vision tower too (skipped) and on every projection of the language model."""
    from family_models import WRAPPERS

    WRAPPERS["qwen3_5"] = ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5", dict(
        text_config={k: v for k, v in HYBRID_FAMILIES["qwen3_5"].items() if k != "tie_word_embeddings"},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)))
    try:
        model = build_multimodal(tmp_path, "qwen3_5")
    finally:
        del WRAPPERS["qwen3_5"]
    cases = cases_of(model, lengths=(5, 30))
    refs = peft_references(model.base, model.adapters, cases, GREEDY_TOKENS)
    llm, tokens = generate_greedy(model, cases)
    assert llm.engine.model_config.family.name == "qwen3_5"
    check_greedy(tokens, cases, refs, "qwen3_5 multimodal")


def test_gguf_file_gives_the_hf_folders_weights_and_tokens(qwen3_5, tmp_path):
    """The model as llama.cpp's converter writes a qwen35 GGUF (value heads tiled, -exp(A_log), 1 + w norms
    but the gated norm's, the ssm.* keys): the HF folder's weights under its names, and its tokens."""
    from family_models import loads_as_the_folder, write_family_gguf

    model, cases, refs = qwen3_5
    path = write_family_gguf(model, tmp_path / "qwen3_5.gguf")
    from_gguf, from_folder = loads_as_the_folder(path, model.folder)
    for key in ("linear_layers", "linear_attention", "rotary_dim", "head_dim"):
        assert getattr(from_gguf.config, key) == getattr(from_folder.config, key), key
    gguf_model = type(model)(model.family, path, model.tokenizer, model.base, model.adapters)
    _, tokens = generate_greedy(gguf_model, cases)
    check_greedy(tokens, cases, refs, "qwen3_5 gguf")


def test_quantized_gguf_keeps_the_attention_and_mlp_blocks(tmp_path):
    """Q8_0 projections: the attention layer's and the MLPs' kept in blocks (the quantized kernels), the
    linear-attention ones dequantized to reorder their heads; tokens of transformers+PEFT on the blocks'
    values (int8 activations, whose rounding the recurrent layers carry further than attention does here:
    each sequence equal, or different only after a near-tie of 0.2, and most equal to the end)."""
    from asyncserve.model.linear import QuantLinear
    from family_models import write_family_gguf
    from quant_helpers import Q

    require_native_kernels()
    model = build_family_model(tmp_path, "qwen3_5")
    path = write_family_gguf(model, tmp_path / "q8.gguf", projections=Q.Q8_0)
    cases = cases_of(model, lengths=(5, 40))
    refs = peft_references(model.base, model.adapters, cases, GREEDY_TOKENS)
    gguf_model = type(model)(model.family, path, model.tokenizer, model.base, model.adapters)
    llm, tokens = generate_greedy(gguf_model, cases, keep_quantized=True)
    layers = llm.engine.runner.weights.layers
    assert all(isinstance(lw.down, QuantLinear) for lw in layers) and isinstance(layers[3].qkv, QuantLinear)
    assert not isinstance(layers[0].linear.in_proj, QuantLinear)
    equal = [assert_greedy_matches(ours, ref, tie_tol=0.2, label=f"Q8_0 case {i}")
             for i, (ours, ref) in enumerate(zip(tokens, refs))]
    assert sum(equal) >= len(equal) // 2, equal


def test_step_profile_times_steps_with_state_slots(qwen3_5):
    """step_profile.py's hand-placed sequences (the step-time model's measurements) hold state slots like
    admitted ones, and give them back."""
    from asyncserve.step_profile import ChunkSpec, timed_step

    model, _, _ = qwen3_5
    engine = LLM(model=str(model.folder), adapters={"all": str(model.adapters["all"])}, dtype="float32",
                 device=TEST_DEVICE).engine
    specs = [ChunkSpec(1, 30, "all"), ChunkSpec(1, 12, None), ChunkSpec(40, 0, "all"), ChunkSpec(24, 16, None)]
    assert timed_step(engine, "mixed", specs, repeats=2).seconds > 0
    assert len(engine.scheduler.blocks._free_slots) == engine.config.max_running
    assert engine.pool.counts().kv == 0


def test_bad_linear_attention_lora_is_refused_with_the_reason(qwen3_5, tmp_path):
    """Each alone, on a copy of the all-linear adapter: LoRA on a linear-attention module of a layer that
    attends, on a module it lacks, on the attention of a linear-attention layer, with lora_A only, of the
    wrong shape, and DoRA on it."""
    from family_models import broken_copy, renamed

    model, _, _ = qwen3_5
    source = model.adapters["linear"]

    def drop_b(weights):
        for key in [k for k in weights if "layers.1.linear_attn.in_proj_z.lora_B" in k]:
            del weights[key]

    def widen(weights):
        key = next(k for k in weights if "layers.2.linear_attn.in_proj_a.lora_B" in k)
        weights[key] = torch.cat([weights[key], weights[key]])

    def magnitudes(weights):
        key = next(k for k in weights if "layers.0.linear_attn.out_proj.lora_B" in k)
        weights[key.replace("lora_B.weight", "lora_magnitude_vector")] = torch.ones(64)

    bad = {"layers.0.linear_attn": (dict(edit_weights=renamed("layers.0.linear_attn", "layers.3.linear_attn")),
                                    "layer 3, which is not a linear-attention layer"),
           "missing module": (dict(edit_weights=renamed("in_proj_b", "in_proj_c")), "targets a module"),
           "self_attn of a linear layer": (dict(edit_weights=renamed("layers.3.self_attn", "layers.2.self_attn")),
                                           "layer 2, a linear-attention layer, which has no self_attn"),
           "A only": (dict(edit_weights=drop_b), "lora_A but not both A and B"),
           "shape": (dict(edit_weights=widen), r"in_proj_a has lora_A .* this base model needs"),
           "DoRA": (dict(edit_weights=magnitudes, edit_config=lambda c: {**c, "use_dora": True}),
                    "DoRA on the linear-attention layers' out_proj is not served")}
    llm = LLM(model=str(model.folder), dtype="float32", device=TEST_DEVICE)
    for i, (label, (edits, match)) in enumerate(bad.items()):
        with pytest.raises(AdapterError, match=match):
            llm.load_adapter(f"bad{i}", str(broken_copy(source, tmp_path / f"bad{i}", **edits)))
    llm.load_adapter("linear", str(source))         # the engine goes on with the real one


def test_loaded_over_http_serves_the_offline_engines_tokens(qwen3_5, tmp_path):
    """/v1/load_lora_adapter (the pager actor, built in pieces between steps) registers the all-linear adapter
    as offline loading does, its LoRA on the linear-attention layers kept unmerged, and its completions are
    the offline engine's tokens."""
    import shutil

    from server_harness import ServerThread

    from asyncserve.config import Config

    model, cases, _ = qwen3_5
    root = tmp_path / "root"
    shutil.copytree(model.adapters["linear"], root / "linear")
    prompts = [c[0] for c in cases if c[1] is None][:3]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    offline = LLM(model=str(model.folder), adapters={"linear": str(root / "linear")}, dtype="float32")
    expected = [o.token_ids for o in offline.generate(prompts, params, adapters=["linear"] * len(prompts))]
    st = ServerThread(Config(model=str(model.folder), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_root=str(root)))
    try:
        status, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": "linear", "lora_path": "linear"})
        assert status == 200, body
        assert st.server.engine.pager.registry["linear"].linear_attn
        assert "linear-attention layers" in st.server.engine.merge_refusal("linear")
        assert [st.greedy_token_ids("linear", ids, GREEDY_TOKENS) for ids in prompts] == expected
    finally:
        st.stop()


def test_what_rests_on_pages_is_off_or_refused(qwen3_5):
    model, _, _ = qwen3_5
    llm = LLM(model=str(model.folder), dtype="float32", device="cpu")
    engine = llm.engine
    assert not engine.scheduler.blocks.prefix_caching and engine.scheduler.drafter is None and engine.assist is None
    for settings, match in (({"speculative_tokens": 2}, "speculative decoding: not served"),
                            ({"cpu_assist": "on"}, "--cpu-assist on: not served"),
                            ({"tensor_parallel": 2}, "linear-attention layers.*one device")):
        with pytest.raises((ValueError, ModelLoadError), match=match):
            LLM(model=str(model.folder), dtype="float32", device="cpu", **settings)


def test_delta_rule_closed_form_is_the_recurrence():
    """Chunks of 64 tokens solved at once give the token-by-token rule's outputs and final state (float64),
    across chunk boundaries and from a nonzero starting state."""
    torch.manual_seed(0)
    B, n, H, dk, dv = 2, 150, 3, 8, 5
    q = torch.randn(B, n, H, dk, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, n, H, dk, dtype=torch.float64), dim=-1)
    v = torch.randn(B, n, H, dv, dtype=torch.float64)
    g, beta = -torch.rand(B, n, H, dtype=torch.float64), torch.rand(B, n, H, dtype=torch.float64)
    start = torch.randn(B, H, dk, dv, dtype=torch.float64)
    out, state = _delta_rule(q, k, v, g, beta, start)
    s, want = start.clone(), torch.empty_like(v)
    for t in range(n):
        s = s * g[:, t].exp()[..., None, None]
        written = (v[:, t] - (s * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * written[:, :, None, :]
        want[:, t] = (s * q[:, t, :, :, None]).sum(-2)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, s, rtol=0, atol=1e-12)


def test_decode_rule_updates_its_slots_in_place_and_no_others():
    """The decodes' step over the block of slots up to the highest: the slots decoded get the rule's one
    token (as _delta_rule gives it), every other slot in the block and past it is left bit for bit."""
    torch.manual_seed(1)
    slots_total, H, dk, dv = 7, 2, 4, 3
    states = torch.randn(slots_total, H, dk, dv)
    before = states.clone()
    slots = torch.tensor([4, 1, 2])
    q, k = torch.randn(3, H, dk), torch.nn.functional.normalize(torch.randn(3, H, dk), dim=-1)
    v, g, beta = torch.randn(3, H, dv), -torch.rand(3, H), torch.rand(3, H)
    out = _decode_rule(states, slots, q, k, v, g, beta)
    want, final = _delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], before[slots])
    torch.testing.assert_close(out, want[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[slots], final, rtol=1e-5, atol=1e-5)
    others = [s for s in range(slots_total) if s not in slots.tolist()]
    assert torch.equal(states[others], before[others])
