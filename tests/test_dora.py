"""DoRA adapters (lora/dora.py): PEFT folders saved with use_dora=True give transformers+PEFT's tokens
on the tiny random Llama in float32, batched with plain LoRA adapters and the base model, on every
step path (native kernels in the Python loop, eager ops, the Triton kernels in the interpreter),
merged, on Qwen2 (q/k/v biases, which DoRA's scale leaves out) and Phi-3 (fused modules, whose
magnitude is split like B), and on a base kept in GGUF blocks. The scales equal PEFT's own; bad
DoRA folders are refused, each alone; a hostile one never changes another request's tokens; CPU
assist scales its rows as the device does; CUDA graphs leave DoRA steps to the eager path; tensor
parallelism refuses DoRA adapters with the reason."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from family_models import (ALL, FAMILIES, FamilyModel, assert_refused_each_alone, assert_tensor_parallel_refuses,
                           STEP_PATHS, broken_copy, build_with_adapters, cases_of, check_greedy, generate_greedy,
                           llm_on_path, with_references, write_family_gguf)
from reference import (TEST_DEVICE, bf16_runs_by_layer_loop, peft_references, record_native_loop, record_steps,
                       require_native_kernels, run_merged)

from asyncserve import LLM, SamplingParams
from asyncserve.pager.adapters import AdapterError

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# name: (rank, targets, extra LoraConfig arguments); "plain" is no DoRA adapter, batched beside them
DORA_ADAPTERS = {
    "dora_all": (4, ALL, {"use_dora": True}),
    "dora_some": (8, ["q_proj", "v_proj", "down_proj"], {"use_dora": True, "rslora": True,
                                                         "rank_pattern": {"v_proj": 2}}),
    "plain": (4, ALL, {}),
}


@pytest.fixture(scope="module")
def llama_dora(tmp_path_factory):
    return with_references(build_with_adapters(tmp_path_factory.mktemp("dora"), "llama", DORA_ADAPTERS))


def test_scales_equal_peft_magnitude_over_weight_norm(llama_dora):
    """g = m / ||W + s·B·A|| per output row, as PEFT's DoRA layer computes it, for every layer and
    projection (1 where the adapter has none), from the rows built into the host tier."""
    from peft import PeftModel

    model, _, _ = llama_dora
    llm = LLM(model=str(model.folder), adapters={"dora_some": str(model.adapters["dora_some"])}, dtype="float32")
    host = llm.engine.pager.host["dora_some"]
    columns = llm.engine.runner.dora_base.columns
    shapes = llm.engine.model_config.projection_shapes()
    peft_model = PeftModel.from_pretrained(model.base, model.adapters["dora_some"]).eval()
    try:
        for li, layer in enumerate(peft_model.base_model.model.model.layers):
            for group, projs in {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                 "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}.items():
                col = columns[group][0]
                for proj in projs:
                    width = shapes[proj][1]
                    ours = host.dora_scale[li, col:col + width]
                    module = getattr(layer.self_attn if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                                     else layer.mlp, proj)
                    if not hasattr(module, "lora_magnitude_vector"):
                        assert torch.equal(ours, torch.ones(width)), (li, proj)
                    else:
                        lora_weight = module.lora_B["default"].weight @ module.lora_A["default"].weight
                        norm = module.lora_magnitude_vector["default"].get_weight_norm(
                            module.get_base_layer().weight, lora_weight, module.scaling["default"])
                        expected = module.lora_magnitude_vector["default"].weight / norm
                        torch.testing.assert_close(ours, expected.float(), rtol=1e-5, atol=1e-6)
                    col += width
    finally:
        peft_model.unload()


@pytest.mark.parametrize("path", STEP_PATHS)
def test_dora_batched_with_lora_and_base_gives_peft_tokens(llama_dora, path, monkeypatch):
    """loop: the one-call native layer loop (decoder.h scales the DoRA rows); ops: the Python layer loop
    over the native kernels; eager: torch ops; triton: the Triton LoRA kernels in the interpreter (the
    Python loop). Base, two DoRA adapters and a plain one in the same steps, prompts chunked."""
    model, cases, refs = llama_dora
    llm = llm_on_path(model, path, monkeypatch)
    step_has_dora, native_loop_in_dora_step = record_native_loop(
        llm.engine, monkeypatch, lambda plan: any(c.seq.adapter in ("dora_all", "dora_some") for c in plan.chunks))
    outs = llm.generate([c[0] for c in cases], GREEDY, adapters=[c[1] for c in cases])
    check_greedy([o.token_ids for o in outs], cases, refs, path)
    assert sum(step_has_dora) >= NEW_TOKENS
    if path == "loop":
        assert sum(native_loop_in_dora_step) == sum(step_has_dora), "a DoRA step left the native layer loop"
    else:
        assert not native_loop_in_dora_step
    assert llm.engine.pool.counts().kv == 0


def test_native_layer_loop_gives_the_python_loops_bits(llama_dora, monkeypatch):
    """bf16: DoRA's scale in the one-call native loop is the Python loop's multiply, so both give the
    same tokens and top-5 logprobs, DoRA, plain and base requests in one call."""
    require_native_kernels()
    model, cases, _ = llama_dora
    runs = bf16_runs_by_layer_loop(model.folder, model.adapters, cases, monkeypatch, NEW_TOKENS)
    assert runs["1"][1] and not runs["0"][1]
    assert runs["1"][0] == runs["0"][0]


def test_dora_is_not_served_as_plain_lora(llama_dora, tmp_path):
    """The same A and B without the magnitudes (a plain LoRA) give other tokens: the scale matters here."""
    model, cases, _ = llama_dora
    plain = tmp_path / "dora_all_as_lora"
    broken_copy(model.adapters["dora_all"], plain, lambda c: c | {"use_dora": False},
                lambda w: [w.pop(k) for k in list(w) if "magnitude" in k])
    dora_cases = [c for c in cases if c[1] == "dora_all"]
    _, with_dora = generate_greedy(model, dora_cases)
    _, without = generate_greedy(model, dora_cases, adapters={"dora_all": plain})
    assert sum(a != b for a, b in zip(with_dora, without)) >= 2


def test_merged_dora_adapter_gives_peft_tokens(llama_dora):
    """dLoRA's merged mode folds g into the merged rows: g ⊙ (W + s·B·A)."""
    model, cases, refs = llama_dora
    alone = [(case, ref) for case, ref in zip(cases, refs) if case[1] == "dora_all"]
    llm = LLM(model=str(model.folder), adapters={"dora_all": str(model.adapters["dora_all"])}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=16)
    seqs = run_merged(llm.engine, [case for case, _ in alone], lambda plan, step: "dora_all", GREEDY)
    assert llm.engine.merged_adapter == "dora_all"
    check_greedy([s.output_ids for s in seqs], [c for c, _ in alone], [r for _, r in alone], "merged")


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_families_with_biases_and_fused_modules(family, tmp_path):
    """Qwen2: q/k/v biases added after DoRA's scale, as PEFT scales the output without its bias; Phi-3:
    qkv_proj's and gate_up_proj's magnitudes split across their projections like B's rows."""
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if family == "phi3" else ALL
    adapters = {"dora": (4, targets, {"use_dora": True}), "plain": (8, targets[:2], {})}
    served = {"max_model_len": FAMILIES["phi3"]["original_max_position_embeddings"]} if family == "phi3" else {}
    model = build_with_adapters(tmp_path, family, adapters)
    cases = cases_of(model, lengths=(5, 17))
    refs = peft_references(model.base, model.adapters, cases, NEW_TOKENS)
    _, tokens = generate_greedy(model, cases, **served)
    check_greedy(tokens, cases, refs, family)


def test_dora_on_a_base_kept_in_gguf_blocks(tmp_path):
    """Q8_0 projections kept quantized: ||W_o|| from the blocks' values and A·W^T through the quantized
    GEMM; tokens are transformers+PEFT's on the blocks' values (int8 activations: near-ties within 0.2
    may flip, as in test_quant_engine)."""
    from asyncserve.model.linear import QuantLinear
    from quant_helpers import Q

    require_native_kernels()
    model = build_with_adapters(tmp_path, "qwen2", {"dora": (4, ALL, {"use_dora": True})})
    path = write_family_gguf(model, tmp_path / "qwen2.gguf", projections=Q.Q8_0)
    cases = cases_of(model, lengths=(5, 19))
    refs = peft_references(model.base, model.adapters, cases, NEW_TOKENS)
    llm, tokens = generate_greedy(FamilyModel(model.family, path, model.tokenizer, model.base, model.adapters), cases,
                            keep_quantized=True)
    assert isinstance(llm.engine.runner.weights.layers[0].qkv, QuantLinear)
    check_greedy(tokens, cases, refs, "Q8_0", tie_tol=0.2)


def _first(weights, part="q_proj.lora_magnitude_vector"):
    return next(k for k in sorted(weights) if k.endswith(part))


def _set(weights, key, value):
    weights[key] = value


BAD = {
    "magnitude without use_dora": (lambda c: c | {"use_dora": False}, None, "does not set use_dora"),
    "use_dora without magnitude": (None, lambda w: w.pop(_first(w)), "has no lora_magnitude_vector"),
    "magnitude too short": (None, lambda w: _set(w, k := _first(w), w[k][:-1].clone()), "this base model needs"),
    "magnitude of two dimensions": (None, lambda w: _set(w, k := _first(w), w[k][None].clone()), "needs"),
    "NaN magnitude": (None, lambda w: w[_first(w)].__setitem__(3, float("nan")), "NaN or infinite"),
    "infinite magnitude": (None, lambda w: w[_first(w, "down_proj.lora_magnitude_vector")].__setitem__(
        0, float("inf")), "NaN or infinite"),
    "magnitude without lora_A": (None, lambda w: w.pop(_first(w, "o_proj.lora_A.weight")), "not both A and B"),
}


def test_bad_dora_folders_are_refused_each_alone(llama_dora, tmp_path):
    """Each broken copy of a DoRA folder is refused at load with a reason, and the adapters loaded before
    still give their tokens."""
    model, cases, refs = llama_dora
    assert_refused_each_alone(model, cases, refs, "dora_all", BAD, tmp_path)


def test_a_row_adapted_to_norm_zero_is_refused(llama_dora, tmp_path):
    """W_0 + s·(B·A)_0 = 0 for layer 0's q_proj (A's row 0 is W's row 0, B's row 0 is -1/s there): g would
    divide by zero."""
    model, _, _ = llama_dora
    w = model.base.model.layers[0].self_attn.q_proj.weight.detach()
    config = json.loads((model.adapters["dora_all"] / "adapter_config.json").read_text())
    s = config["lora_alpha"] / config["r"]

    def zero(weights):
        a, b = _first(weights, "layers.0.self_attn.q_proj.lora_A.weight"), _first(weights, "layers.0.self_attn.q_proj.lora_B.weight")
        weights[a] = weights[a].clone()
        weights[a][0] = w[0]
        weights[b] = weights[b].clone()
        weights[b][0] = 0
        weights[b][0, 0] = -1 / s
    folder = broken_copy(model.adapters["dora_all"], tmp_path / "zero", edit_weights=zero)
    llm = LLM(model=str(model.folder), dtype="float32", device=TEST_DEVICE)
    with pytest.raises(AdapterError, match="not finite"):
        llm.load_adapter("zero", str(folder))


def test_hostile_magnitudes_change_no_other_requests_tokens(llama_dora, tmp_path):
    """Finite magnitudes of 1e30 (outputs overflow to inf in that adapter's rows only) and of 0 (its
    projections' outputs all zero), batched with the base, a DoRA and a plain adapter: their tokens
    are as without them."""
    model, cases, refs = llama_dora
    huge = broken_copy(model.adapters["dora_all"], tmp_path / "huge",
                        edit_weights=lambda w: [w[k].fill_(1e30) for k in w if "magnitude" in k])
    zero = broken_copy(model.adapters["dora_all"], tmp_path / "zero",
                        edit_weights=lambda w: [w[k].zero_() for k in w if "magnitude" in k])
    prompts = list(dict.fromkeys(tuple(c[0]) for c in cases))
    hostile = cases + [(list(p), a) for p in prompts for a in ("huge", "zero")]
    llm, tokens = generate_greedy(model, hostile, adapters={**model.adapters, "huge": huge, "zero": zero})
    check_greedy(tokens[:len(cases)], cases, refs, "beside hostile magnitudes")


def test_cold_dora_adapters_prefill_on_the_workers(llama_dora, tmp_path):
    """cpu_assist="on": the workers compute a cold DoRA adapter's x·A·B like a plain one's, and its rows
    of base + delta are scaled by its g from the host tier; every request gives PEFT's tokens."""
    model, cases, refs = llama_dora
    llm = LLM(model=str(model.folder), adapters={k: str(v) for k, v in model.adapters.items()}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=24, cpu_workers=1, cpu_assist="on",
              cpu_profile_dir=str(tmp_path))
    try:
        plans = record_steps(llm.engine)
        outs = llm.generate([c[0] for c in cases], GREEDY, adapters=[c[1] for c in cases])
        registry = llm.engine.pager.registry
        assisted = {load for plan in plans for load in plan.assisted}
        assert {registry[name].load for name in ("plain", "dora_all", "dora_some")} <= assisted
        check_greedy([o.token_ids for o in outs], cases, refs, "cpu assist on")
    finally:
        llm.engine.close()


def test_decode_steps_with_dora_run_eagerly_beside_graphs(llama_dora):
    """DecodeGraphs (over the fake seam of test_cuda_graphs) replay the base and plain steps; a decode
    step holding a DoRA adapter runs eagerly, and every request gives PEFT's tokens."""
    from test_cuda_graphs import FakeSeam

    if TEST_DEVICE != "cpu":
        pytest.skip("the fake seam's test")
    model, cases, refs = llama_dora
    for adapters, replays in (({"plain"}, True), ({"dora_all"}, False)):
        chosen = [i for i, c in enumerate(cases) if c[1] is None or c[1] in adapters]
        llm = LLM(model=str(model.folder), adapters={a: str(model.adapters[a]) for a in adapters}, dtype="float32",
                  device="cpu", lora_backend="triton", max_running=4, cpu_workers=0)
        llm.engine.runner.enable_graphs(FakeSeam(), 4, 8)
        outs = llm.generate([cases[i][0] for i in chosen], GREEDY, adapters=[cases[i][1] for i in chosen])
        check_greedy([o.token_ids for o in outs], [cases[i] for i in chosen], [refs[i] for i in chosen], str(adapters))
        lora_graphs = [key for key in llm.engine.runner.graphs._graphs if key[1]]
        assert bool(lora_graphs) == replays, (adapters, llm.engine.runner.graphs._graphs.keys())


def test_tensor_parallel_refuses_dora_with_a_reason(llama_dora):
    assert_tensor_parallel_refuses(llama_dora[0], ["dora_all"])


def test_dora_loaded_over_http_serves_the_offline_engines_tokens(llama_dora, tmp_path):
    """/v1/load_lora_adapter builds a DoRA folder in pieces between steps (the pager actor), in bf16, and
    its completions are the offline engine's tokens; broken DoRA folders get 400 on lora_path and the
    server goes on."""
    from server_harness import ServerThread

    from asyncserve.config import Config

    model, cases, _ = llama_dora
    root = tmp_path / "root"
    shutil.copytree(model.adapters["dora_some"], root / "good")
    broken_copy(model.adapters["dora_all"], root / "nan", edit_weights=BAD["NaN magnitude"][1])
    broken_copy(model.adapters["dora_all"], root / "short", edit_weights=BAD["magnitude too short"][1])
    prompts = [c[0] for c in cases if c[1] is None]
    offline = LLM(model=str(model.folder), adapters={"good": str(root / "good")}, dtype="bfloat16")
    expected = [o.token_ids for o in offline.generate(prompts, GREEDY, adapters=["good"] * len(prompts))]
    st = ServerThread(Config(model=str(model.folder), dtype="bfloat16", device="cpu", served_model_name="tiny",
                             adapter_root=str(root)))
    try:
        for bad, why in (("nan", "NaN or infinite"), ("short", "this base model needs")):
            status, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": bad, "lora_path": bad})
            assert status == 400 and body["error"]["param"] == "lora_path" and why in body["error"]["message"], body
        status, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": "good", "lora_path": "good"})
        assert status == 200, body
        assert [st.greedy_token_ids("good", ids, NEW_TOKENS) for ids in prompts] == expected
    finally:
        st.stop()


def test_make_adapters_dora_folders_give_the_plain_adapters_tokens(llama_dora, tmp_path):
    """scripts/make_adapters.py --dora, and dora_copy of its plain folders (bench_offline.py's ours-dora),
    write magnitudes as PEFT initializes them (the adapted rows' norms), so g is 1 and the DoRA adapters
    give the plain ones' tokens."""
    import importlib.util
    from pathlib import Path

    from asyncserve.model.loader import load_model

    model, cases, _ = llama_dora
    spec = importlib.util.spec_from_file_location("make_adapters", Path(__file__).parents[1] / "scripts/make_adapters.py")
    make_adapters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_adapters)
    for kind, flags in (("plain", []), ("dora", ["--dora"])):
        make_adapters.main(["2", str(tmp_path / kind), "--model", str(model.folder), "--ranks", "4", "8", *flags])
    assert json.loads((tmp_path / "dora" / "a0001" / "adapter_config.json").read_text())["use_dora"]
    weights = load_model(str(model.folder)).weights
    for name in ("a0000", "a0001"):
        make_adapters.dora_copy(tmp_path / "plain" / name, tmp_path / "copy" / name, weights)
    prompts = list(dict.fromkeys(tuple(c[0]) for c in cases))
    tokens = {}
    for kind in ("plain", "dora", "copy"):
        llm = LLM(model=str(model.folder), adapter_dir=str(tmp_path / kind), dtype="float32", device=TEST_DEVICE)
        outs = llm.generate([list(p) for p in prompts] * 2, GREEDY, adapters=["a0000"] * 3 + ["a0001"] * 3)
        tokens[kind] = [o.token_ids for o in outs]
        assert (llm.engine.pager.host["a0000"].dora_scale is not None) == (kind != "plain")
    assert tokens["dora"] == tokens["plain"] == tokens["copy"]
