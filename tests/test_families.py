"""Qwen2 (tied and untied), Qwen3, Gemma 1, 2 and 3, Phi-3 (and Phi-4-mini's partial RoPE), SmolLM3 and
Granite against transformers+PEFT, fp32.

Per family: a tiny random checkpoint made with transformers' own config class (sharded safetensors,
random norms and biases, sliding windows shorter than the sequences for Gemma), two random PEFT
adapters on the family's target names (Phi-3: the fused qkv_proj and gate_up_proj), and base and
both adapters in ONE generate call with a small step budget, so prefill chunks and decodes of
different adapters share steps: with the native CPU kernels in the native layer loop (default), in
the Python loop (ASYNCSERVE_NATIVE_DECODER=0) and with the eager ops (ASYNCSERVE_NATIVE=0).
"""
import json
import random
import shutil

import pytest
import numpy as np
import torch

import kernels.cpu as cpu_kernels
from asyncserve import LLM, SamplingParams
from asyncserve.model import llama
from asyncserve.model.config import GROUPS, ModelLoadError
from asyncserve.pager.adapters import AdapterError
from family_models import (ALL, FAMILIES, FamilyModel, build_family_model, llama3_rope_divisors, loads_as_the_folder,
                           write_family_gguf)
from reference import (TEST_DEVICE, assert_greedy_matches, bf16_runs_by_layer_loop, make_tiny_tokenizer,
                       peft_references, record_calls, require_native_kernels, run_merged, save_random_adapter,
                       save_tiny_model)

NEW_TOKENS = 8
# Phi-3 served no longer than its pretraining context rotates with longrope's short factors, as
# transformers does for these short sequences (longer: the long factors everywhere, as vLLM)
SERVED = {"phi3": {"max_model_len": FAMILIES["phi3"]["original_max_position_embeddings"]}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    model = build_family_model(tmp_path_factory.mktemp(request.param), request.param)
    rng = random.Random(5)
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    prompts = [model.tokenizer.encode(" ".join(rng.choice(words) for _ in range(n))) for n in (3, 10, 18)]
    cases = [(ids, adapter) for ids in prompts for adapter in [None, *model.adapters]]
    refs = peft_references(model.base, model.adapters, cases, NEW_TOKENS)
    return model, cases, refs


def generate(model, cases, **kwargs):
    llm = LLM(model=str(model.folder), adapters={k: str(v) for k, v in model.adapters.items()}, dtype="float32",
              device=TEST_DEVICE, **{"max_step_tokens": 16, **SERVED.get(model.family, {}), **kwargs})
    outs = llm.generate([c[0] for c in cases], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        adapters=[c[1] for c in cases])
    return llm, [o.token_ids for o in outs]


def check(tokens, cases, refs, label):
    exact = 0
    for i, (ours, (_, adapter)) in enumerate(zip(tokens, cases)):
        exact += assert_greedy_matches(ours, refs[i], tie_tol=1e-3, label=f"{label} case {i} adapter {adapter}")
    assert exact >= len(cases) - 1, f"{label}: only {exact}/{len(cases)} sequences equal the reference end to end"
    # the adapters must change tokens, or this proves nothing about LoRA on the family's modules
    base = {tuple(c[0]): t for c, t in zip(cases, tokens) if c[1] is None}
    assert sum(t != base[tuple(c[0])] for c, t in zip(cases, tokens) if c[1] is not None) >= 2, label


@pytest.mark.parametrize("family, layer_types", [
    ("mistral", None), ("ministral", ["sliding_attention", "full_attention", "sliding_attention"])])
def test_mistral_and_ministral_sliding_windows(family, layer_types, tmp_path):
    """Mistral's window shorter than the sequences: every layer slides, so the step has no global
    layers' attention plan and the layer loop stays in Python; Ministral's (8B) layer_types mix
    sliding and global layers. Tokens equal transformers+PEFT's."""
    tok = make_tiny_tokenizer()
    base = save_tiny_model(tmp_path / "base", tok, family, random_vectors=True, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, sliding_window=8, head_dim=16,
                           **({"layer_types": layer_types} if layer_types else {}))
    adapters = {"all": tmp_path / "adapters" / "all"}
    save_random_adapter(base, adapters["all"], r=4, targets=ALL, seed=200)
    model = FamilyModel(family, tmp_path / "base", tok, base, adapters)
    prompts = [tok.encode(" ".join(["the fox jumps over lazy dog adapters serve"] * n)) for n in (1, 2, 3)]
    cases = [(ids, adapter) for ids in prompts for adapter in (None, "all")]
    llm, tokens = generate(model, cases)
    expected = [8 if t == "sliding_attention" else None for t in layer_types] if layer_types else [8] * 3
    assert llm.engine.model_config.layer_windows == expected
    check(tokens, cases, peft_references(base, adapters, cases, NEW_TOKENS), family)


@pytest.mark.parametrize("path", ["loop", "ops", "eager"])
def test_base_and_two_adapters_in_one_generate_call(family_model, path, monkeypatch):
    """loop: every step in the native layer loop (kernels/cpu/decoder.h: Qwen's biases, q/k norms,
    Gemma's (1 + w) and sandwich norms, GeGLU, windows, local RoPE, scale and soft caps as per-layer
    options); ops: the Python loop over the same native kernels; eager: torch ops."""
    model, cases, refs = family_model
    monkeypatch.setenv("ASYNCSERVE_NATIVE", "0" if path == "eager" else "1")
    monkeypatch.setenv("ASYNCSERVE_NATIVE_DECODER", "0" if path == "ops" else "1")
    loop_steps, python_steps, native_ops = [], [], []
    if path != "eager":
        require_native_kernels()
    record_calls(monkeypatch, llama, "_forward_native", lambda *a: loop_steps.append(1))
    record_calls(monkeypatch, llama, "_forward_layers", lambda *a: python_steps.append(1))
    record_calls(monkeypatch, cpu_kernels, "rope_write_kv", lambda *a: native_ops.append(1))
    llm, tokens = generate(model, cases)
    check(tokens, cases, refs, f"{model.family} {path}")
    assert llm.engine.pool.counts().kv == 0
    assert bool(loop_steps) == (path == "loop") and bool(python_steps) == (path != "loop")
    assert bool(native_ops) == (path == "ops")


def test_native_layer_loop_gives_the_python_loops_logits(family_model, monkeypatch):
    """bf16: the layer loop in one native call runs the Python loop's native kernels in its order for
    every family, so every step's logits are the same bits: greedy tokens and the top-5 logprobs of
    each, base and both adapters in one generate call, prompts chunked beside decodes."""
    require_native_kernels()
    model, cases, _ = family_model
    runs = bf16_runs_by_layer_loop(model.folder, model.adapters, cases, monkeypatch, NEW_TOKENS)
    assert runs["1"][1], "the native layer loop did not run"
    assert not runs["0"][1], "ASYNCSERVE_NATIVE_DECODER=0 must run the Python loop"
    assert runs["1"][0] == runs["0"][0]


def test_prefix_cache_keeps_reference_tokens(family_model):
    """Prompts sharing a prefix longer than Gemma's windows hit cached blocks (sliding layers read
    only their window of them) and still produce the reference's tokens."""
    model, cases, refs = family_model
    rng = random.Random(7)
    prefix = [rng.randrange(3, len(model.tokenizer)) for _ in range(36)]
    prompts = [prefix + [rng.randrange(3, len(model.tokenizer)) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    shared = [(ids, adapter) for adapter in (None, "all") for ids in prompts]
    shared_refs = peft_references(model.base, model.adapters, shared, NEW_TOKENS)
    llm = LLM(model=str(model.folder), adapters={k: str(v) for k, v in model.adapters.items()}, dtype="float32",
              device=TEST_DEVICE, prefix_caching=True, **SERVED.get(model.family, {}))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(len(shared)):       # one at a time: each later prompt of an adapter finds the prefix cached
        out = llm.generate([shared[i][0]], params, adapters=[shared[i][1]])[0]
        assert_greedy_matches(out.token_ids, shared_refs[i], tie_tol=1e-3, label=f"{model.family} cached case {i}")
    assert llm.engine.load_snapshot().prefix_hit_tokens >= 4 * 32


def test_triton_lora_backend_keeps_reference_tokens(family_model):
    """The Triton LoRA kernels (MBGMM prefill, MBGMV decode; on CPU in Triton's interpreter) on the family's
    projections, Phi-3's fused qkv_proj and gate_up_proj slices included: transformers+PEFT's tokens."""
    model, cases, refs = family_model
    llm, tokens = generate(model, cases, lora_backend="triton")
    assert llm.engine.lora_backend_name == "triton"
    check(tokens, cases, refs, f"{model.family} triton")


def test_merged_mode_keeps_reference_tokens(family_model):
    """dLoRA's merged mode: the adapter on every projection folded into the base weights (Phi-3: the
    fused modules' slices of each projection; Qwen2: beside the q/k/v biases, which stay apart)."""
    model, cases, refs = family_model
    alone = [(case, ref) for case, ref in zip(cases, refs) if case[1] == "all"]
    llm = LLM(model=str(model.folder), adapters={"all": str(model.adapters["all"])}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=16, **SERVED.get(model.family, {}))
    merge = lambda plan, step: "all" if all(c.seq.adapter == "all" for c in plan.chunks) else None   # noqa: E731
    seqs = run_merged(llm.engine, [case for case, _ in alone], merge,
                      SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert llm.engine.merged_adapter == "all"
    for i, (seq, (_, ref)) in enumerate(zip(seqs, alone)):
        assert_greedy_matches(seq.output_ids, ref, tie_tol=1e-3, label=f"{model.family} merged case {i}")


def test_adapter_naming_a_module_the_family_lacks_is_refused(family_model, tmp_path):
    """The "all" adapter with one module renamed to one the family lacks (Phi-3 has no q_proj: its
    attention input is the fused qkv_proj; the others have no qkv_proj): refused, naming the family's
    targets; the engine then still loads the real adapter."""
    from safetensors.torch import load_file, save_file

    model, _, _ = family_model
    llm = LLM(model=str(model.folder), dtype="float32", device=TEST_DEVICE)
    renames = {"phi3": [("qkv_proj", "q_proj"), ("gate_up_proj", "up_proj"), ("o_proj", "dense")]}.get(
        model.family, [("q_proj", "qkv_proj"), ("up_proj", "gate_up_proj"), ("o_proj", "dense")])
    for old, new in renames:
        folder = tmp_path / new
        shutil.copytree(model.adapters["all"], folder)
        tensors = load_file(folder / "adapter_model.safetensors")
        renamed = {k.replace(f".{old}.", f".{new}."): v for k, v in tensors.items()}
        save_file(renamed, folder / "adapter_model.safetensors")
        message = rf"\.{new}\.lora_.*that {model.family} models do not have.*LoRA targets"
        with pytest.raises(AdapterError, match=message):
            llm.load_adapter(new, str(folder))
    llm.load_adapter("all", str(model.adapters["all"]))


def test_the_step_time_model_gets_the_models_windows(family_model):
    """The step-time model prices sliding layers' attention over their windows (tests/test_step_model.py)."""
    model, _, _ = family_model
    llm = LLM(model=str(model.folder), dtype="float32", device=TEST_DEVICE)
    config = llm.engine.model_config
    assert llm.engine.latency.attention_windows == config.layer_windows
    assert any(config.layer_windows) == (model.family in ("gemma2", "gemma3", "olmo3"))


def test_longrope_tables_equal_transformers_short_and_long():
    """Phi-3's longrope, one set of factors at every position (vLLM's rule): served no longer than
    original_max_position_embeddings, the short factors, transformers' tables for a sequence that
    short; served longer (the default: the model's whole context), the long ones, transformers'
    tables for a sequence longer than that, from position 0 on. The difference from transformers:
    a sequence of at most original_max_position_embeddings tokens served with the longer context
    rotates with the long factors where transformers rotates it with the short ones (and when a
    sequence outgrows that context transformers recomputes its KV with the long factors; here it
    was rotated with them from the start)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from asyncserve.model.llama import Rope
    from asyncserve.model.loader_hf import model_config

    cfg = Phi3Config(**{k: v for k, v in FAMILIES["phi3"].items() if k != "pad_token_id"}, vocab_size=100)
    config = model_config({**cfg.to_dict(), "architectures": ["Phi3ForCausalLM"]}, "phi3")
    original = cfg.original_max_position_embeddings
    x = torch.zeros(1)
    short_cos, short_sin = Phi3RotaryEmbedding(cfg)(x, torch.arange(original)[None])
    long_cos, long_sin = Phi3RotaryEmbedding(cfg)(x, torch.arange(3 * original)[None])
    assert not torch.allclose(short_cos[0, 1:], long_cos[0, 1:original])
    for long_factors in (False, True, None):
        if long_factors is not None:
            config.rope_scaling["long_factors"] = long_factors
        ours = Rope(config, torch.device("cpu"), torch.float32)
        cos, sin = (long_cos, long_sin) if long_factors in (True, None) else (short_cos, short_sin)
        torch.testing.assert_close(ours.cos[:cos.shape[1]], cos[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.sin[:sin.shape[1]], sin[0], rtol=1e-5, atol=1e-5)


def test_longrope_greedy_tokens_equal_transformers(tmp_path):
    """Phi-3 (original_max_position_embeddings 128 of 512) against transformers' generate, base and
    an adapter: served with max_model_len 128, sequences within it (short factors); served with the
    whole context, prompts longer than 128 (transformers rotates those with the long factors too)."""
    model = build_family_model(tmp_path, "phi3")
    rng = random.Random(11)
    original = FAMILIES["phi3"]["original_max_position_embeddings"]
    for max_model_len, lengths in ((original, (60, original - NEW_TOKENS)), (None, (original + 1, original + 40))):
        prompts = [[rng.randrange(3, len(model.tokenizer)) for _ in range(n)] for n in lengths]
        cases = [(ids, adapter) for ids in prompts for adapter in (None, "all")]
        refs = peft_references(model.base, {"all": model.adapters["all"]}, cases, NEW_TOKENS)
        llm = LLM(model=str(model.folder), adapters={"all": str(model.adapters["all"])}, dtype="float32",
                  device=TEST_DEVICE, max_step_tokens=64, max_model_len=max_model_len)
        outs = llm.generate([c[0] for c in cases], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                   ignore_eos=True), adapters=[c[1] for c in cases])
        for i, (out, ref) in enumerate(zip(outs, refs)):
            assert_greedy_matches(out.token_ids, ref, tie_tol=1e-3, label=f"max_model_len {max_model_len} case {i}")


# long-context RoPE: (family, its transformers config arguments) with the pretraining context (64)
# shorter than the tests' sequences; YaRN's beta and attention factor given or transformers' defaults
ROPE_SCALINGS = {
    "llama3": ("llama", dict(max_position_embeddings=512, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "yarn": ("qwen3", dict(max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64})),
    "yarn_betas": ("qwen2", dict(max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 3.0, "original_max_position_embeddings": 64,
        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.2})),
}


def rope_scaled_model(root, scaling: str) -> FamilyModel:
    family, config = ROPE_SCALINGS[scaling]
    shape = {**FAMILIES["qwen3" if family == "qwen3" else "qwen2"], **config}
    tok = make_tiny_tokenizer()
    base = save_tiny_model(root / "base", tok, family, random_vectors=True, **{**shape, "rope_theta": None})
    save_random_adapter(base, root / "adapters" / "all", r=4, targets=ALL, seed=200)
    return FamilyModel(family, root / "base", tok, base, {"all": root / "adapters" / "all"})


@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_long_context_rope_tables_and_tokens_equal_transformers(scaling, tmp_path):
    """Llama 3.1's and YaRN's RoPE (Qwen's long-context recipe: max_position_embeddings left at the
    pretraining context, served to its factor times that, as vLLM does): our cos/sin tables are
    transformers' rotary embedding's, and greedy tokens of prompts longer than the pretraining
    context equal transformers+PEFT's, base and an adapter."""
    from asyncserve.model.llama import Rope
    from asyncserve.model.loader import load_model

    model = rope_scaled_model(tmp_path, scaling)
    config = load_model(str(model.folder)).config
    rope = model.base.config.rope_parameters
    assert config.rope_scaling["rope_type"] == rope["rope_type"]
    if rope["rope_type"] == "yarn":
        assert config.max_position == 64 * rope["factor"]
    positions = torch.arange(config.max_position)[None]
    cos, sin = model.base.model.rotary_emb(torch.zeros(1), positions)
    ours = Rope(config, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(ours.cos, cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sin, sin[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours.cos, torch.cat([torch.outer(positions[0].float(), llama.rope_inv_freq(
        type(config)(**{**vars(config), "rope_scaling": None}))[0])] * 2, -1).cos(), atol=1e-3)

    rng = random.Random(13)
    prompts = [[rng.randrange(3, len(model.tokenizer)) for _ in range(n)] for n in (20, 90, 150)]
    cases = [(ids, adapter) for ids in prompts for adapter in (None, "all")]
    refs = peft_references(model.base, model.adapters, cases, NEW_TOKENS)
    _, tokens = generate(model, cases, max_step_tokens=64)
    for i, (ours, ref) in enumerate(zip(tokens, refs)):
        assert_greedy_matches(ours, ref, tie_tol=1e-3, label=f"{scaling} case {i}")


@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_gguf_long_context_rope_gives_the_hf_folders_tokens(scaling, tmp_path):
    """The same checkpoints as llama.cpp's converter writes them: Llama 3.1's scaling as the rope_freqs
    tensor (one divisor per frequency, what Llama 3.1/3.2/3.3 GGUF files hold), YaRN as
    rope.scaling.* keys (beta and attention factor as yarn_* keys): the same RoPE tables and
    greedy tokens as the HF folder beyond the pretraining context."""
    from asyncserve.model.llama import Rope

    model = rope_scaled_model(tmp_path, scaling)
    path = write_family_gguf(model, tmp_path / f"{scaling}.gguf")
    from_gguf, from_folder = loads_as_the_folder(path, model.folder)
    expected = "freq_factors" if scaling == "llama3" else "yarn"
    assert from_gguf.config.rope_scaling["rope_type"] == expected
    assert from_gguf.config.max_position == from_folder.config.max_position
    ours, theirs = (Rope(m.config, torch.device("cpu"), torch.float32) for m in (from_gguf, from_folder))
    torch.testing.assert_close(ours.cos, theirs.cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sin, theirs.sin, rtol=1e-5, atol=1e-5)
    rng = random.Random(17)
    prompts = [[rng.randrange(3, len(model.tokenizer)) for _ in range(n)] for n in (30, 120)]
    cases = [(ids, adapter) for ids in prompts for adapter in (None, "all")]
    gguf_model = type(model)(model.family, path, model.tokenizer, model.base, model.adapters)
    assert generate(gguf_model, cases, max_step_tokens=64)[1] == generate(model, cases, max_step_tokens=64)[1]


def test_rope_scalings_not_implemented_are_refused_at_load():
    """Dynamic NTK (and any other unknown RoPE scaling) is refused when the model loads, naming what is
    implemented, never at the first step; so are factors that are not finite positive numbers (or below
    1 for YaRN, as transformers refuses them) and original contexts that are not positive integers."""
    from asyncserve.model.loader_hf import model_config

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 2048}
    for scaling in ({"type": "dynamic", "factor": 2.0}, {"rope_type": "ntk-by-parts", "factor": 2.0},
                    {"rope_type": "mrope", "mrope_section": [2, 2]}):
        with pytest.raises(ModelLoadError, match="RoPE scaling; asyncserve implements plain RoPE and linear"):
            model_config({**cfg, "rope_scaling": scaling}, "m")
    yarn = model_config({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "m")
    assert yarn.rope_scaling["original_max_position_embeddings"] == 2048 and yarn.max_position == 8192
    for scaling in ({"rope_type": "yarn", "factor": 0.5}, {"rope_type": "linear", "factor": 0},
                    {"rope_type": "yarn", "factor": float("inf")}, {"rope_type": "llama3", "factor": "8"},
                    {"rope_type": "linear", "factor": True}):
        with pytest.raises(ModelLoadError, match="RoPE scaling factor should be a finite number"):
            model_config({**cfg, "rope_scaling": scaling}, "m")
    for original in (-1, 2.5, "4096"):
        with pytest.raises(ModelLoadError, match="original_max_position_embeddings should be a positive integer"):
            model_config({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                  "original_max_position_embeddings": original}}, "m")


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_granite_logprobs_equal_transformers(source, tmp_path):
    """Granite's multipliers, the logits' included (greedy tokens do not see a positive scale): each
    generated token's logprob and the top-5 equal transformers' log_softmax, base and an adapter,
    from the HF folder and from its GGUF file (the multipliers as granite.*_scale keys)."""
    model = build_family_model(tmp_path, "granite")
    path = model.folder if source == "folder" else write_family_gguf(model, tmp_path / "granite.gguf")
    prompt = model.tokenizer.encode("the fox jumps over lazy dog adapters serve many models")
    llm = LLM(model=str(path), adapters={"all": str(model.adapters["all"])}, dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    for adapter in (None, "all"):
        out = llm.generate([prompt], params, adapters=[adapter])[0]
        refs = peft_references(model.base, model.adapters, [(prompt, adapter)], 4)[0]
        assert out.token_ids == refs.tokens
        for step, (logprob, top, logits) in enumerate(zip(out.logprobs, out.top_logprobs, refs.logits)):
            expected = torch.log_softmax(logits, -1)
            assert logprob == pytest.approx(float(expected[out.token_ids[step]]), abs=2e-4), (adapter, step)
            values, ids = expected.topk(5)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=2e-4)


def test_granite_multipliers_from_config_json():
    """Granite's multipliers from config.json (transformers' defaults 1.0 where absent: the scores'
    scale too, not head_dim ** -0.5); non-numbers, zero and infinities refused."""
    from asyncserve.model.loader_hf import model_config

    cfg = {"architectures": ["GraniteForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 2048}
    plain = model_config(cfg, "m")
    assert (plain.embedding_multiplier, plain.residual_multiplier, plain.logits_scaling, plain.scale) == (1, 1, 1, 1)
    set_ = model_config({**cfg, "embedding_multiplier": 12, "residual_multiplier": 0.22, "logits_scaling": 8.0,
                         "attention_multiplier": 0.0078125}, "m")
    assert (set_.embedding_multiplier, set_.residual_multiplier, set_.logits_scaling, set_.scale) == (
        12.0, 0.22, 8.0, 0.0078125)
    for key, value in (("residual_multiplier", "0.5"), ("logits_scaling", 0), ("embedding_multiplier", float("inf")),
                       ("logits_scaling", True), ("residual_multiplier", None)):
        with pytest.raises(ModelLoadError, match=f"{key} should be a finite non-zero number"):
            model_config({**cfg, key: value}, "m")


def test_olmo2_refusals_and_olmo3_files(tmp_path):
    """OLMo 2 under tensor parallelism (its q and k norms span every head) is refused at load with the
    reason; an olmo2 GGUF file with sliding windows is OLMo 3's, every 4th layer global where the file
    lists no pattern (llama.cpp's default)."""
    from asyncserve.model.loader import load_model
    from asyncserve.model.loader_hf import model_config
    from asyncserve.model.shard import shard_config

    config = model_config({"architectures": ["Olmo2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}, "m")
    assert config.family.whole_qk_norm and shard_config(config, 1) is config
    for world in (2, 4):
        with pytest.raises(ModelLoadError, match="norms q and k over all heads"):
            shard_config(config, world)
    model = build_family_model(tmp_path, "olmo2", num_hidden_layers=5)
    for window, windows in ((4, [4, 4, 4, None, 4]), (4096, [])):
        path = write_family_gguf(model, tmp_path / f"olmo3-{window}.gguf",
                                 metadata_changes={"attention.sliding_window": window})
        config = load_model(str(path)).config
        assert (config.family.name, config.layer_windows, config.rope_local_theta) == ("olmo3", windows,
                                                                                       config.rope_theta)


def test_smollm3_nope_layers_from_config_json():
    """SmolLM3's layers without RoPE: no_rope_layers as config.json lists them (1: RoPE), else every
    no_rope_layer_interval-th; its sliding window (with use_sliding_window) on those layers only, as
    transformers' SmolLM3Config sets layer_types; a malformed list refused."""
    from asyncserve.model.loader_hf import model_config

    cfg = {"architectures": ["SmolLM3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 6, "num_attention_heads": 4, "max_position_embeddings": 2048}
    assert model_config(cfg, "m").nope_layers == [False, False, False, True, False, False]
    assert model_config({**cfg, "no_rope_layer_interval": 2}, "m").nope_layers == [False, True] * 3
    listed = model_config({**cfg, "no_rope_layers": [1, 0, 1, 1, 0, 1]}, "m")
    assert listed.nope_layers == [False, True, False, False, True, False]
    assert [listed.local_rope(i) for i in range(6)] == listed.nope_layers and listed.layer_windows == []
    sliding = model_config({**cfg, "use_sliding_window": True, "sliding_window": 64}, "m")
    assert sliding.layer_windows == [None, None, None, 64, None, None]
    assert model_config({**cfg, "sliding_window": 64}, "m").layer_windows == []     # not without use_sliding_window
    for flags in ([1, 0, 1], [1, 0, 1, 1, 0, 2], "1,0", [True, None, 1, 1, 1, 1]):
        with pytest.raises(ModelLoadError, match="no_rope_layers should hold 1"):
            model_config({**cfg, "no_rope_layers": flags}, "m")


def test_gguf_rope_refusals(tmp_path):
    """A GGUF whose rope_freqs is the wrong length or not positive and finite, or that sets it beside
    another scaling; YaRN without its original context or with another extrapolation factor; a
    scaling type not implemented; partial RoPE on a family transformers rotates whole."""
    from asyncserve.model.loader import load_model

    model = rope_scaled_model(tmp_path, "llama3")
    divisors = llama3_rope_divisors({**model.base.config.rope_parameters}, 16)
    for label, values in {"short": divisors[:-1], "zero": np.where(np.arange(8) == 2, 0, divisors),
                          "nan": np.where(np.arange(8) == 1, np.nan, divisors)}.items():
        path = write_family_gguf(model, tmp_path / f"{label}.gguf",
                                 tensor_changes={"rope_freqs.weight": values.astype(np.float32)})
        with pytest.raises(ModelLoadError, match="rope_freqs should hold 8 positive finite factors"):
            load_model(str(path))
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 2.0}
    cases = {"beside": ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, "rope_freqs beside 'linear'"),
             "no_context": (yarn, "YaRN RoPE scaling without rope.scaling.original_context_length"),
             "ext_factor": ({**yarn, "rope.scaling.original_context_length": 64, "rope.scaling.yarn_ext_factor": 0.5},
                            "yarn_ext_factor"),
             "dynamic": ({"rope.scaling.type": "dynamic", "rope.scaling.factor": 2.0}, "'dynamic' RoPE scaling"),
             "partial": ({"rope.dimension_count": 8}, "partial RoPE.*Phi-3, Phi-4-mini \\(phi3\\) and Qwen3.5")}
    for label, (fields, message) in cases.items():
        path = write_family_gguf(model, tmp_path / f"{label}.gguf", metadata_changes=fields,
                                 tensor_changes={} if label == "beside" else {"rope_freqs.weight": None})
        with pytest.raises(ModelLoadError, match=message):
            load_model(str(path))


def test_quantized_projections_run_in_the_native_layer_loop(tmp_path, monkeypatch):
    """Gemma 2 with GGUF blocks (Q8_0) for every layer's projections, kept quantized: every step, base
    and adapters, runs the native layer loop over the blocks (quant.h's GEMM, as QuantLinear calls
    it); its tokens are transformers+PEFT's on the blocks' values (int8 activations: a token may
    differ where the top two logits are within 0.2, as in test_quant_engine)."""
    from asyncserve.model.linear import QuantLinear
    from quant_helpers import Q

    require_native_kernels()
    name = "gemma2"
    model = build_family_model(tmp_path, name, query_pre_attn_scalar=32)     # a GGUF does not record it
    path = write_family_gguf(model, tmp_path / f"{name}.gguf", projections=Q.Q8_0)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, len(model.tokenizer)) for _ in range(n)] for n in (5, 19)]
    cases = [(ids, adapter) for ids in prompts for adapter in (None, *model.adapters)]
    refs = peft_references(model.base, model.adapters, cases, NEW_TOKENS)
    loop_steps, python_steps = [], []
    record_calls(monkeypatch, llama, "_forward_native", lambda *a: loop_steps.append(1))
    record_calls(monkeypatch, llama, "_forward_layers", lambda *a: python_steps.append(1))
    llm, tokens = generate(type(model)(model.family, path, model.tokenizer, model.base, model.adapters), cases,
                           keep_quantized=True)
    weights = llm.engine.runner.weights
    assert all(isinstance(getattr(lw, g), QuantLinear) for lw in weights.layers for g in GROUPS)
    assert loop_steps and not python_steps
    equal = [assert_greedy_matches(ours, ref, tie_tol=0.2, label=f"{name} Q8_0 case {i}")
             for i, (ours, ref) in enumerate(zip(tokens, refs))]
    assert sum(equal) >= len(cases) - 1, equal


GGUF_CASES = [(name, False) for name in FAMILIES] + [(name, True) for name in ("gemma2", "gemma3", "phi3")]


@pytest.mark.parametrize("name, sentencepiece", GGUF_CASES,
                         ids=[f"{name}{'-spm' if spm else ''}" for name, spm in GGUF_CASES])
def test_gguf_file_gives_the_hf_folders_tokens(name, sentencepiece, tmp_path):
    """The same tiny checkpoint written as llama.cpp's converter writes a GGUF (its tensor names and
    metadata keys, Gemma's 1 + w norms, Phi-3's fused tensors and rope factor tensors): the same
    tokens as its HF folder, base and an adapter on every projection. (Gemma: query_pre_attn_scalar
    is head_dim here, the scale llama.cpp derives; a GGUF does not record it.) Gemma and Phi-3 also
    with their kind of tokenizer, SentencePiece: the GGUF's vocabulary tokenizes text and renders
    the chat template as the HF folder's tokenizer.json (transformers') does."""
    overrides = {"query_pre_attn_scalar": 32} if name.startswith("gemma") else {}
    model = build_family_model(tmp_path, name, sentencepiece=sentencepiece, **overrides)
    path = write_family_gguf(model, tmp_path / f"{name}.gguf")
    from_gguf, from_folder = loads_as_the_folder(path, model.folder)
    assert from_gguf.config.layer_windows == from_folder.config.layer_windows
    if sentencepiece:
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": " Hi there!\n\nHow are  you? 🙂"}]
        prompt = from_gguf.tokenizer.apply_chat_template(messages)
        assert prompt == model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        for text in (prompt, "Hello world", "  two leading spaces", "emoji 🙂🚀 中文", "a\n\n b\t"):
            assert from_gguf.tokenizer.encode(text) == model.tokenizer.encode(text), text
        assert from_gguf.tokenizer.bos_token_id == model.tokenizer.bos_token_id
    rng = random.Random(9)
    prompts = [[rng.randrange(3, len(model.tokenizer)) for _ in range(n)] for n in (4, 20)]
    cases = [(ids, adapter) for ids in prompts for adapter in (None, "all")]
    folder_model = type(model)(model.family, model.folder, model.tokenizer, model.base,
                               {"all": model.adapters["all"]})
    gguf_model = type(model)(model.family, path, model.tokenizer, model.base, {"all": model.adapters["all"]})
    assert generate(gguf_model, cases)[1] == generate(folder_model, cases)[1]


def test_http_chat_on_a_sentencepiece_gguf(tmp_path):
    """A server started on a Phi-3 GGUF with a SentencePiece vocabulary: a chat request over HTTP with
    the openai client gives the offline engine's text from the HF folder; its prompt is the HF
    tokenizer's tokens (Phi-3's template, the whitespace after its control tokens dropped)."""
    import openai

    from asyncserve.config import Config
    from server_harness import ServerThread

    model = build_family_model(tmp_path, "phi3", sentencepiece=True)
    path = write_family_gguf(model, tmp_path / "phi3.gguf")
    messages = [{"role": "user", "content": "the quick brown fox jumps"}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = LLM(model=str(model.folder), dtype="float32", device="cpu").chat(messages, params)[0]
    prompt_ids = model.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                     return_dict=False)
    assert expected.prompt_token_ids == prompt_ids
    srv = ServerThread(Config(model=str(path), dtype="float32", device="cpu", served_model_name="phi3"))
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="phi3", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == expected.text and expected.text
        assert r.usage.prompt_tokens == len(prompt_ids)
    finally:
        srv.stop()


def test_http_with_the_openai_client_equals_the_offline_engine(tmp_path):
    """Gemma 2 (windows, soft-caps, GeGLU) served over HTTP: completions and chat (its chat template)
    for the base model and both adapters give the offline engine's text."""
    import openai

    from asyncserve.config import Config
    from server_harness import ServerThread

    model = build_family_model(tmp_path, "gemma2")
    adapters = {k: str(v) for k, v in model.adapters.items()}
    offline = LLM(model=str(model.folder), adapters=adapters, dtype="float32", device="cpu")
    srv = ServerThread(Config(model=str(model.folder), adapters=adapters, dtype="float32", device="cpu",
                              served_model_name="gemma"))
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        assert {m.id for m in client.models.list().data} == {"gemma", *adapters}
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        messages = [{"role": "user", "content": "the fox jumps over the lazy dog"}]
        for name in ("gemma", *adapters):
            adapter = None if name == "gemma" else name
            prompt = "adapters serve many models"
            expected = offline.generate([prompt], params, adapters=adapter)[0].text
            r = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == expected
            expected = offline.chat(messages, params, adapters=adapter)[0].text
            r = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
            assert r.choices[0].message.content == expected
    finally:
        srv.stop()


def test_random_checkpoint_shapes_are_the_real_models(tmp_path):
    """scripts/random_checkpoint.py --shape (the benchmarks' Qwen2.5-0.5B- and Gemma-2-2B-shaped random
    checkpoints): config.json loads as that family with the real model's dimensions; a small one's
    random weights and four adapters (W1's ranks) serve a mixed generate call."""
    import importlib.util
    from pathlib import Path

    from asyncserve.model.loader_hf import model_config

    script = Path(__file__).resolve().parent.parent / "scripts" / "random_checkpoint.py"
    spec = importlib.util.spec_from_file_location("random_checkpoint", script)
    random_checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(random_checkpoint)
    tok = make_tiny_tokenizer()
    save_tiny_model(tmp_path / "tokenizer_source", tok, "llama", hidden_size=16, intermediate_size=32,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    like = str(tmp_path / "tokenizer_source")
    expected = {"qwen2.5-0.5b": ("qwen2", 896, 4864, 24, 14, 2, 64, 151936, []),
                "gemma-2-2b": ("gemma2", 2304, 9216, 26, 8, 4, 256, 256000, [4096, None] * 13)}
    for shape, (family, *dims, windows) in expected.items():
        random_checkpoint.write_skeleton(like, tmp_path / shape, {}, shape)
        c = model_config(json.loads((tmp_path / shape / "config.json").read_text()), name=shape)
        assert (c.family.name, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
                c.head_dim, c.vocab_size) == (family, *dims)
        assert c.layer_windows == windows and c.tie_word_embeddings
    small = tmp_path / "small"
    random_checkpoint.write_skeleton(like, small, {"num_hidden_layers": 2, "vocab_size": len(tok), "hidden_size": 64,
                                                   "intermediate_size": 128, "head_dim": 32, "sliding_window": 8},
                                     "gemma-2-2b")
    random_checkpoint.random_weights(small, torch.float32, torch.device("cpu"), seed=0)
    random_checkpoint.random_adapters(small, 4, [8, 16], ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    llm = LLM(model=str(small), adapters={f"a{i}": str(small / "adapters" / f"a{i}") for i in range(4)},
              dtype="float32", device="cpu", max_model_len=64)
    assert llm.engine.model_config.family.name == "gemma2" and llm.engine.model_config.layer_windows == [8, None]
    outs = llm.generate(["Story 1: the quick brown fox jumps"] * 4, SamplingParams(max_tokens=12, ignore_eos=True),
                        adapters=["a0", "a1", "a2", "a3"])
    assert [len(o.token_ids) for o in outs] == [12] * 4
    # an 8B model's weights are written in shards as they fill (HF's index layout): same tensors, same tokens
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for path in small.iterdir():        # the skeleton: config and tokenizer files
        if path.is_file() and path.suffix != ".safetensors":
            (sharded / path.name).write_bytes(path.read_bytes())
    random_checkpoint.SHARD_BYTES = 40_000
    random_checkpoint.random_weights(sharded, torch.float32, torch.device("cpu"), seed=0)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((sharded / f).is_file() for f in files)
    assert not list(sharded.glob("*.part")) and not (sharded / "model.safetensors").exists()
    llm2 = LLM(model=str(sharded), adapters={f"a{i}": str(small / "adapters" / f"a{i}") for i in range(4)},
               dtype="float32", device="cpu", max_model_len=64)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts, adapters = ["Story 1: the quick brown fox jumps"] * 4, ["a0", "a1", "a2", "a3"]
    assert ([o.token_ids for o in llm2.generate(prompts, greedy, adapters=adapters)]
            == [o.token_ids for o in llm.generate(prompts, greedy, adapters=adapters)])
