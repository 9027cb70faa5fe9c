"""LoRA on the token embeddings and the LM head (lora/vocab.py), and those two trained whole (PEFT's
modules_to_save): PEFT folders targeting embed_tokens and lm_head (with the copies of the base weights
PEFT saves beside them), or saving them, give transformers+PEFT's tokens, batched with plain adapters
and the base model, on every step path; on Gemma 2 (embedding scale, final soft cap) and on tied
embeddings; CPU-assisted. Bad folders are refused each alone; merging, CUDA graphs and tensor
parallelism leave them to the paths that serve them."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from family_models import (ALL, FAMILIES, assert_refused_each_alone, assert_tensor_parallel_refuses, broken_copy,
                           STEP_PATHS, build_with_adapters, cases_of, check_greedy, generate_greedy, llm_on_path,
                           with_references)
from reference import (TEST_DEVICE, bf16_runs_by_layer_loop, peft_references, record_native_loop, record_steps,
                       require_native_kernels)
from safetensors.torch import load_file

from asyncserve import LLM, SamplingParams
from asyncserve.pager.adapters import AdapterError

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
VOCAB_ADAPTERS = {
    "embed_head": (4, ["q_proj", "v_proj", "embed_tokens", "lm_head"], {}),
    "head": (8, ["o_proj", "down_proj", "lm_head"], {"rslora": True, "alpha_pattern": {"lm_head": 5.0}}),
    "embed": (2, ["embed_tokens", "gate_proj"], {}),
    "plain": (4, ALL, {}),
}


# modules_to_save: the embeddings or the head trained whole, beside head LoRA
SAVED_ADAPTERS = {
    "saved_both": (4, ["q_proj", "v_proj"], {"modules_to_save": ["embed_tokens", "lm_head"]}),
    "saved_head": (8, ["o_proj", "down_proj"], {"modules_to_save": ["lm_head"]}),
    "saved_embed": (2, ["gate_proj"], {"modules_to_save": ["embed_tokens"]}),
    "lora_head": (4, ["q_proj", "lm_head"], {}),
    "plain": (4, ALL, {}),
}


class Kind(NamedTuple):
    """What the shared tests need of each kind of adapter on the vocabulary's layers."""
    heads: tuple[str, ...]         # adapters with a head of their own (LoRA on it, or saved whole)
    assisted: tuple[str, ...]      # adapters that must run CPU-assisted
    unmerged: tuple[str, ...]      # adapters merged mode refuses
    bad_source: str                # the adapter broken copies are made of
    small: dict                    # the adapters of the Gemma 2 and tied-embeddings test


KINDS = {
    "vocab": Kind(("embed_head", "head"), ("embed_head", "head", "embed"), ("embed_head", "head"), "embed_head",
                  {"both": (4, ["q_proj", "embed_tokens", "lm_head"], {}), "plain": (4, ["q_proj", "v_proj"], {})}),
    "saved": Kind(("saved_both", "saved_head"), ("saved_both", "saved_head"), ("saved_both", "saved_embed"),
                  "saved_both", {"both": (4, ["q_proj"], {"modules_to_save": ["embed_tokens", "lm_head"]}),
                                 "embed": (4, ["v_proj"], {"modules_to_save": ["embed_tokens"]}),
                                 "plain": (4, ["q_proj", "v_proj"], {})}),
}


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory):
    return with_references(build_with_adapters(tmp_path_factory.mktemp("vocab"), "llama", VOCAB_ADAPTERS))


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return with_references(build_with_adapters(tmp_path_factory.mktemp("saved"), "llama", SAVED_ADAPTERS))


def model_of(request, kind: str):
    return request.getfixturevalue(f"{kind}_model")


def test_peft_saves_the_base_weights_beside_the_lora(vocab_model):
    """What the other tests rely on: PEFT's folder holds lora_embedding_A/B, lm_head's lora_A/B and
    copies of the base embedding and head (save_embedding_layers), which the server does not read."""
    model, _, _ = vocab_model
    keys = set(load_file(model.adapters["embed_head"] / "adapter_model.safetensors"))
    assert {"base_model.model.model.embed_tokens.lora_embedding_A", "base_model.model.lm_head.lora_B.weight",
            "base_model.model.model.embed_tokens.base_layer.weight"} <= keys


def test_peft_saves_the_trained_modules_under_their_own_names(saved_model):
    model, _, _ = saved_model
    keys = set(load_file(model.adapters["saved_both"] / "adapter_model.safetensors"))
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= keys


@pytest.mark.parametrize("path", STEP_PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_embeddings_and_head_give_peft_tokens(request, kind, path, monkeypatch):
    """loop: the one-call native layer loop (decoder.h adds the head's LoRA, or does a saved head); ops:
    the Python loop over the native kernels; eager: torch ops; triton: the Triton LoRA kernels in the
    interpreter. vocab: the base, three adapters with LoRA on the embeddings, the head or both, and a
    plain one in the same steps; saved: adapters with their own embeddings, head or both, beside one with
    head LoRA, a plain one and the base."""
    model, cases, refs = model_of(request, kind)
    llm = llm_on_path(model, path, monkeypatch)
    head_steps, loop_in_head_step = record_native_loop(llm.engine, monkeypatch, lambda plan: any(
        c.seq.adapter in KINDS[kind].heads and c.num_sampled for c in plan.chunks))
    outs = llm.generate([c[0] for c in cases], GREEDY, adapters=[c[1] for c in cases])
    check_greedy([o.token_ids for o in outs], cases, refs, path)
    assert sum(head_steps) >= NEW_TOKENS
    assert sum(loop_in_head_step) == (sum(head_steps) if path == "loop" else 0)
    assert llm.engine.pool.counts().kv == 0
    base_tokens = [o.token_ids for o, c in zip(outs, cases) if c[1] is None]
    assert all(o.token_ids not in base_tokens for o, c in zip(outs, cases) if c[1] == KINDS[kind].heads[0])


@pytest.mark.parametrize("kind", KINDS)
def test_native_layer_loop_gives_the_python_loops_bits(request, kind, monkeypatch):
    """bf16: the one-call loop adds the head's LoRA (or does a saved head) with the Python loop's calls:
    the same tokens and top-5 logprobs, all the adapters and the base in one call."""
    require_native_kernels()
    model, cases, _ = model_of(request, kind)
    runs = bf16_runs_by_layer_loop(model.folder, model.adapters, cases, monkeypatch, NEW_TOKENS)
    assert runs["1"][1] and not runs["0"][1]
    assert runs["1"][0] == runs["0"][0]


def test_prompt_logprobs_see_the_heads_lora(vocab_model):
    """prompt_logprobs score each prompt token by the logits with the adapter's head LoRA: transformers+
    PEFT's log-softmax at those positions."""
    from peft import PeftModel

    model, cases, _ = vocab_model
    ids = cases[-1][0]
    llm = LLM(model=str(model.folder), adapters={"head": str(model.adapters["head"])}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=8)
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), adapters=["head"])[0]
    peft_model = PeftModel.from_pretrained(model.base, model.adapters["head"]).eval()
    try:
        with torch.no_grad():
            ref = peft_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    finally:
        peft_model.unload()
    ours = torch.tensor(out.prompt_logprobs)                 # entry j: prompt token j + 1
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "qwen2_tied"])
@pytest.mark.parametrize("kind", KINDS)
def test_gemma_scale_and_soft_cap_and_tied_embeddings(kind, family, tmp_path):
    """Gemma 2: the embeddings' LoRA (or saved embeddings) before the sqrt(hidden) scale, the head's
    before the final soft cap; Qwen2 with tied embeddings: LoRA on the embeddings and on the head are
    apart, and a saved embed_tokens leaves the head the base's, as PEFT keeps them."""
    adapters = KINDS[kind].small
    model = build_with_adapters(tmp_path, family.split("_")[0], adapters) if family == "gemma2" else \
        _tied_qwen(tmp_path, adapters)
    cases = cases_of(model, lengths=(5, 17))
    _, tokens = generate_greedy(model, cases)
    check_greedy(tokens, cases, peft_references(model.base, model.adapters, cases, NEW_TOKENS), family)


def _tied_qwen(root, adapters):
    from family_models import FamilyModel
    from reference import make_tiny_tokenizer, save_random_adapter, save_tiny_model

    tok = make_tiny_tokenizer()
    base = save_tiny_model(root / "base", tok, "qwen2", random_vectors=True, **FAMILIES["qwen2_tied"])
    paths = {}
    for i, (name, (r, targets, extra)) in enumerate(adapters.items()):
        paths[name] = root / "adapters" / name
        save_random_adapter(base, paths[name], r=r, targets=targets, seed=400 + i, **extra)
    return FamilyModel("qwen2", root / "base", tok, base, paths)


@pytest.mark.parametrize("kind", KINDS)
def test_cold_adapters_with_vocab_lora_prefill_on_the_workers(request, kind, tmp_path):
    """cpu_assist="on": the workers compute the projections' LoRA of cold adapters; their embeddings' and
    head's LoRA, or those saved whole, come from the host tier's copy; every request gives PEFT's tokens."""
    model, cases, refs = model_of(request, kind)
    llm = LLM(model=str(model.folder), adapters={k: str(v) for k, v in model.adapters.items()}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=24, cpu_workers=1, cpu_assist="on", cpu_profile_dir=str(tmp_path))
    try:
        plans = record_steps(llm.engine)
        outs = llm.generate([c[0] for c in cases], GREEDY, adapters=[c[1] for c in cases])
        registry = llm.engine.pager.registry
        assert {registry[n].load for n in KINDS[kind].assisted} <= {l for p in plans for l in p.assisted}
        check_greedy([o.token_ids for o in outs], cases, refs, "cpu assist on")
    finally:
        llm.engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_such_adapters_are_never_merged(request, kind):
    model, _, _ = model_of(request, kind)
    llm = LLM(model=str(model.folder), adapters={k: str(v) for k, v in model.adapters.items()}, dtype="float32")
    for name in KINDS[kind].unmerged:
        assert "embeddings or the head" in llm.engine.merge_refusal(name)
    assert llm.engine.merge_refusal("plain") is None


@pytest.mark.parametrize("kind", KINDS)
def test_such_adapters_loaded_over_http_are_never_merged(request, kind, tmp_path):
    """/v1/load_lora_adapter (the pager actor) registers them as offline loading does: merged mode refuses
    them (it once did not, and a merged step would have dropped their vocabulary's LoRA)."""
    import shutil

    from server_harness import ServerThread

    from asyncserve.config import Config

    model, _, _ = model_of(request, kind)
    root = tmp_path / "root"
    for name in KINDS[kind].unmerged:
        shutil.copytree(model.adapters[name], root / name)
    st = ServerThread(Config(model=str(model.folder), dtype="float32", device="cpu", adapter_root=str(root)))
    try:
        for name in KINDS[kind].unmerged:
            status, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": name})
            assert status == 200, body
            assert "embeddings or the head" in st.server.engine.merge_refusal(name)
    finally:
        st.stop()


def test_decode_steps_with_them_run_eagerly_beside_graphs(vocab_model):
    """DecodeGraphs over test_cuda_graphs' fake seam capture the embedding and the head without LoRA, so a
    decode step with such an adapter runs eagerly."""
    from test_cuda_graphs import FakeSeam

    if TEST_DEVICE != "cpu":
        pytest.skip("the fake seam's test")
    model, cases, refs = vocab_model
    chosen = [i for i, c in enumerate(cases) if c[1] in (None, "embed_head")]
    llm = LLM(model=str(model.folder), adapters={"embed_head": str(model.adapters["embed_head"])}, dtype="float32",
              device="cpu", lora_backend="triton", max_running=4, cpu_workers=0)
    llm.engine.runner.enable_graphs(FakeSeam(), 4, 8)
    outs = llm.generate([cases[i][0] for i in chosen], GREEDY, adapters=[cases[i][1] for i in chosen])
    check_greedy([o.token_ids for o in outs], [cases[i] for i in chosen], [refs[i] for i in chosen], "graphs")
    assert not [key for key in llm.engine.runner.graphs._graphs if key[1]]


def test_tensor_parallel_refuses_them_with_a_reason(vocab_model, saved_model):
    assert_tensor_parallel_refuses(vocab_model[0], ["embed", "head"])
    assert_tensor_parallel_refuses(saved_model[0], ["saved_both"])


def _key(weights, end):
    return next(k for k in weights if k.endswith(end))


def _resize(weights, end, rows):
    k = _key(weights, end)
    weights[k] = weights[k][:rows].clone()


def _put(weights, end, fn):
    k = _key(weights, end)
    weights[k] = fn(weights[k].clone())


def _nan(t):
    t.view(-1)[5] = float("nan")
    return t


BAD = {    # label: (config edit, tensors edit, the reason)
    "embedding A of another vocabulary": (None, lambda w: _put(w, "lora_embedding_A", lambda t: t[:, :-3].contiguous()),
                                          "this base model needs"),
    "head B of another vocabulary": (None, lambda w: _resize(w, "lm_head.lora_B.weight", 100), "this base model needs"),
    "head A of another hidden size": (None, lambda w: _put(w, "lm_head.lora_A.weight", lambda t: t[:, :-1].contiguous()),
                                      "needs"),
    "embedding B without A": (None, lambda w: w.pop(_key(w, "lora_embedding_A")), "not both A and B"),
    "NaN in the embedding B": (None, lambda w: _put(w, "lora_embedding_B", _nan), "NaN or infinite"),
    "infinity in the head A": (None, lambda w: _put(w, "lm_head.lora_A.weight", lambda t: t.fill_(float("inf"))),
                               "NaN or infinite"),
    "a resized vocabulary": (None, lambda w: _resize(w, "embed_tokens.base_layer.weight", 300), "resized vocabulary"),
    "the embedding named as a Linear's": (None, lambda w: w.update({_key(w, "lora_embedding_A").replace(
        "lora_embedding_A", "lora_A.weight"): w.pop(_key(w, "lora_embedding_A"))}), "not how PEFT names"),
    "ensure_weight_tying": (lambda c: c | {"ensure_weight_tying": True}, None, "ensure_weight_tying"),
    "rank pattern against the weights": (lambda c: c | {"rank_pattern": {"lm_head": 2}}, None, "in the config"),
}


SAVED_BAD = {    # label: (config edit, tensors edit, the reason)
    "a saved norm": (lambda c: c | {"modules_to_save": ["embed_tokens", "lm_head", "norm"]}, None,
                     "only embed_tokens and lm_head"),
    "a saved classifier": (lambda c: c | {"modules_to_save": ["score"]}, None, "only embed_tokens and lm_head"),
    "listed, not saved": (None, lambda w: w.pop(_key(w, "model.lm_head.weight")), "holds no weight"),
    "saved, not listed": (lambda c: c | {"modules_to_save": ["embed_tokens"]}, None, "does not name lm_head"),
    "a resized vocabulary": (None, lambda w: _resize(w, "model.embed_tokens.weight", 300), "resized vocabulary"),
    "another hidden size": (None, lambda w: _put(w, "lm_head.weight", lambda t: t[:, :-2].contiguous()),
                            "the base's is"),
    "NaN in the saved head": (None, lambda w: _put(w, "lm_head.weight", _nan), "NaN or infinite"),
    "infinity in the saved embeddings": (None, lambda w: _put(w, "embed_tokens.weight", lambda t: t.fill_(float("inf"))),
                                         "NaN or infinite"),
    "saved and given LoRA": (lambda c: c | {"target_modules": c["target_modules"] + ["lm_head"]},
                             lambda w: w.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                                                 "base_model.model.lm_head.lora_B.weight": torch.zeros(384, 4)}),
                             "both saved whole and given LoRA"),
    "ensure_weight_tying": (lambda c: c | {"ensure_weight_tying": True}, None, "ensure_weight_tying"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_bad_folders_are_refused_each_alone(request, kind, tmp_path):
    """Each broken copy is refused at load with its reason; the adapters loaded before still give PEFT's
    tokens."""
    model, cases, refs = model_of(request, kind)
    assert_refused_each_alone(model, cases, refs, KINDS[kind].bad_source, BAD if kind == "vocab" else SAVED_BAD,
                              tmp_path)


def test_lora_on_the_embeddings_alone_is_refused(vocab_model, tmp_path):
    model, _, _ = vocab_model
    folder = broken_copy(model.adapters["embed"], tmp_path / "embed_only",
                         edit_weights=lambda w: [w.pop(k) for k in list(w) if "layers." in k])
    llm = LLM(model=str(model.folder), dtype="float32", device=TEST_DEVICE)
    with pytest.raises(AdapterError, match="embeddings or the head alone"):
        llm.load_adapter("embed_only", str(folder))


def test_dora_on_the_embeddings_is_refused_with_its_reason(vocab_model, tmp_path):
    """PEFT's DoRA embedding layer's magnitude (as it names it) beside the LoRA: refused with the reason."""
    model, _, _ = vocab_model
    key = "base_model.model.model.embed_tokens.lora_magnitude_vector"
    folder = broken_copy(model.adapters["embed"], tmp_path / "dora", lambda c: c | {"use_dora": True},
                         lambda w: w.update({key: torch.ones(64)}))
    llm = LLM(model=str(model.folder), dtype="float32", device=TEST_DEVICE)
    with pytest.raises(AdapterError, match="DoRA on embed_tokens is not served"):
        llm.load_adapter("dora", str(folder))


@pytest.mark.parametrize("copy", ["vocab_copy", "saved_copy"])
def test_make_adapters_copies_give_peft_tokens(vocab_model, copy, tmp_path):
    """scripts/make_adapters.py's vocab_copy (bench_offline.py's ours-vocab) adds LoRA on the embeddings
    and the head to a plain folder, its saved_copy (ours-saved) the two saved whole, as PEFT saves them:
    each loads in PEFT and here, with the same tokens."""
    import importlib.util
    from pathlib import Path

    model, cases, _ = vocab_model
    spec = importlib.util.spec_from_file_location("make_adapters", Path(__file__).parents[1] / "scripts/make_adapters.py")
    make_adapters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_adapters)
    config = model.base.config
    getattr(make_adapters, copy)(model.adapters["plain"], tmp_path / "copy", config.vocab_size, config.hidden_size)
    copied = type(model)(model.family, model.folder, model.tokenizer, model.base, {"copy": tmp_path / "copy"})
    chosen = [(ids, "copy") for ids, a in cases if a == "plain"]
    _, tokens = generate_greedy(copied, chosen)
    check_greedy(tokens, chosen, peft_references(model.base, copied.adapters, chosen, NEW_TOKENS), copy)
