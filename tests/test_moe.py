"""Mixtures of experts: Mixtral, Qwen2-MoE (a shared expert beside the routed ones) and Qwen3-MoE
(q/k norms, renormalized top-k) against transformers+PEFT, fp32.

Per family: a tiny random checkpoint made with transformers' own config class (saved as the Hub's
per-expert tensors), adapters on the attention projections (Qwen2-MoE: and its shared expert's
gate/up/down_proj, which is what PEFT's all-linear finds there), base and adapters in one generate
call with a small step budget, on every step path. Then merged mode, GGUF files as llama.cpp's
converter writes them (stacked experts; float and Q8_0 blocks kept quantized), and what is refused:
LoRA on the router, layouts asyncserve does not implement, tensor parallelism. LoRA on the routed
experts: tests/test_moe_lora.py.
"""
import json
import shutil

import numpy as np
import pytest
import torch

from asyncserve import LLM, SamplingParams
from asyncserve.model import llama
from asyncserve.model.config import ModelLoadError, MoeConfig
from asyncserve.model.linear import QuantLinear, make_linear
from asyncserve.model.loader import load_model
from family_models import (ALL, GREEDY_TOKENS, MOE_FAMILIES, FamilyModel, assert_refused_each_alone,
                           build_with_adapters, cases_of, check_greedy, generate_greedy, llm_on_path,
                           loads_as_the_folder, renamed, with_references)
from model_io_helpers import backend_vocab, llama_cpp_permute, write_gguf
from quant_helpers import Q, dequantized, quantize
from reference import TEST_DEVICE, assert_greedy_matches, peft_references, record_calls, record_steps, run_merged

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# family -> adapters: (rank, targets, LoraConfig extras); the first merged in test_merged_mode
ADAPTERS = {
    "mixtral": {"attention": (4, ATTENTION, {}), "qv": (8, ["q_proj", "v_proj"], {"rslora": True})},
    "qwen2_moe": {"all": (4, ALL, {}), "shared_mlp": (8, ["q_proj", "gate_proj", "down_proj"], {"rslora": True})},
    "qwen3_moe": {"attention": (4, ATTENTION, {}), "qv": (8, ["q_proj", "v_proj"], {"rslora": True})},
}


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def moe_model(request, tmp_path_factory):
    return with_references(build_with_adapters(tmp_path_factory.mktemp(request.param), request.param,
                                               ADAPTERS[request.param]))


@pytest.mark.parametrize("path", ["loop", "eager", "triton"])
def test_base_and_adapters_in_one_generate_call(moe_model, path, monkeypatch):
    """Prefill chunks and decodes of the base and both adapters share steps; each token's experts are
    the router's top-k and their outputs sum as transformers sums them. loop: the default settings,
    under which a mixture runs the Python loop over the native kernels (the one-call native layer
    loop has no experts); eager: torch ops; triton: the Triton LoRA kernels (interpreter on CPU)."""
    model, cases, refs = moe_model
    native_loop, python_loop, experts_run = [], [], []
    record_calls(monkeypatch, llama, "_forward_native", lambda *a: native_loop.append(1))
    record_calls(monkeypatch, llama, "_forward_layers", lambda *a: python_loop.append(1))
    record_calls(monkeypatch, llama, "moe_mlp", lambda *a: experts_run.append(1))
    llm = llm_on_path(model, path, monkeypatch)
    outs = llm.generate([c[0] for c in cases], SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0,
                                                              ignore_eos=True), adapters=[c[1] for c in cases])
    tokens = [o.token_ids for o in outs]
    check_greedy(tokens, cases, refs, f"{model.family} {path}")
    assert python_loop and experts_run and not native_loop
    # the adapters change tokens, or this proves nothing about LoRA on a mixture
    base = {tuple(c[0]): t for c, t in zip(cases, tokens) if c[1] is None}
    for adapter in model.adapters:
        assert any(t != base[tuple(c[0])] for c, t in zip(cases, tokens) if c[1] == adapter), adapter
    assert llm.engine.pool.counts().kv == 0


def test_merged_mode_keeps_reference_tokens(moe_model):
    """dLoRA's merged mode: the first adapter folded into the attention projections (Qwen2-MoE: and into
    its shared expert's)."""
    model, cases, refs = moe_model
    first = next(iter(model.adapters))
    alone = [(case, ref) for case, ref in zip(cases, refs) if case[1] == first]
    llm = LLM(model=str(model.folder), adapters={first: str(model.adapters[first])}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=16)
    merge = lambda plan, step: first if all(c.seq.adapter == first for c in plan.chunks) else None   # noqa: E731
    seqs = run_merged(llm.engine, [case for case, _ in alone], merge,
                      SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True))
    assert llm.engine.merged_adapter == first
    check_greedy([s.output_ids for s in seqs], [c for c, _ in alone], [r for _, r in alone], f"{model.family} merged")


def test_cold_adapters_prefill_on_the_workers(moe_model, tmp_path):
    """cpu_assist="on": the CPU workers compute cold adapters' x·A·B on the attention projections
    (Qwen2-MoE: and the shared expert's) while the device runs the experts; every request gives
    transformers+PEFT's tokens."""
    model, cases, refs = moe_model
    llm = LLM(model=str(model.folder), adapters={k: str(v) for k, v in model.adapters.items()}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=24, cpu_workers=1, cpu_assist="on", cpu_profile_dir=str(tmp_path))
    try:
        plans = record_steps(llm.engine)
        outs = llm.generate([c[0] for c in cases], SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0,
                                                                  ignore_eos=True), adapters=[c[1] for c in cases])
        registry = llm.engine.pager.registry
        assert {registry[name].load for name in model.adapters} <= {load for p in plans for load in p.assisted}
        check_greedy([o.token_ids for o in outs], cases, refs, f"{model.family} cpu assist")
    finally:
        llm.engine.close()


def test_lora_on_modules_a_mixture_lacks_is_refused(moe_model, tmp_path):
    """LoRA on what the model does not have is refused at load, naming the targets it has (the routed
    experts and gates among them: tests/test_moe_lora.py), each alone: an MLP projection where the model
    has no dense MLP (Mixtral, Qwen3-MoE) or outside the shared expert (Qwen2-MoE), a shared expert or
    its gate where there is none (or its gate under Mixtral's name), modules no family has; the adapters
    loaded before keep their tokens."""
    model, cases, refs = moe_model
    source = next(iter(model.adapters))
    reason = (r"targets a module that .* models do not have .*the routed experts' mlp\.experts\.\{e\}\.gate_proj.*"
              r"the router mlp\.gate")
    bad = {
        "a dense mlp": (None, renamed(".self_attn.q_proj.", ".mlp.gate_proj."), reason),
        "shared expert gate elsewhere": (None, renamed(".self_attn.q_proj.", ".block_sparse_moe.shared_expert_gate."),
                                         reason),
        "an unknown mlp module": (None, renamed(".self_attn.k_proj.", ".mlp.router_proj."), reason),
        "an expert's unknown module": (None, renamed(".self_attn.k_proj.", ".mlp.experts.0.w4."), reason),
    }
    if model.family != "qwen2_moe":
        bad["no shared expert gate"] = (None, renamed(".self_attn.q_proj.", ".mlp.shared_expert_gate."), reason)
        bad["no shared expert"] = (None, renamed(".self_attn.q_proj.", ".mlp.shared_expert.gate_proj."), reason)
    assert_refused_each_alone(model, cases, refs, source, bad, tmp_path)


def _edited_model(model: FamilyModel, folder, **edits):
    shutil.copytree(model.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(edits)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_layouts_not_implemented_are_refused_with_their_reason(moe_model, tmp_path):
    """Each refused at load with its reason (several instances of each kind): dense layers mixed with
    mixtures (Qwen-MoE's mlp_only_layers, decoder_sparse_step), expert counts that are not positive
    integers or not the checkpoint's (a billion is refused before anything is sized by it), more
    experts per token than there are; and --tensor-parallel."""
    model, _, _ = moe_model
    config = json.loads((model.folder / "config.json").read_text())
    experts_key = "num_experts" if "num_experts" in config else "num_local_experts"
    bad = [({experts_key: 0}, "should be a positive integer"), ({experts_key: "8"}, "should be a positive integer"),
           ({experts_key: True}, "should be a positive integer"), ({experts_key: None}, "should be a positive integer"),
           ({experts_key: 10**9}, r"holds experts 0\.\.\d \(\d of them\) per layer; its config says 1000000000"),
           ({experts_key: 3, "num_experts_per_tok": 1}, r"holds experts .* its config says 3"),
           ({"num_experts_per_tok": 9}, "routes each token to 9 of"),
           ({"num_experts_per_tok": -1}, "should be a positive integer")]
    if model.family != "mixtral":
        bad += [({"mlp_only_layers": [0]}, "mixes dense and mixture-of-experts layers"),
                ({"decoder_sparse_step": 2}, "mixes dense and mixture-of-experts layers")]
    for i, (edit, why) in enumerate(bad):
        with pytest.raises(ModelLoadError, match=why):
            LLM(model=_edited_model(model, tmp_path / f"m{i}", **edit), dtype="float32", device=TEST_DEVICE)
    with pytest.raises(ModelLoadError, match="is a mixture of experts, which asyncserve serves on one device"):
        LLM(model=str(model.folder), dtype="float32", max_step_tokens=24, tensor_parallel=2)


@pytest.mark.parametrize("native", [True, False], ids=["native", "eager"])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_experts_in_bf16_equal_transformers_block(family, native):
    """One layer's mixture in bf16, 40 tokens: moe_mlp's output equals transformers' sparse MoE block's
    within bf16 rounding, its experts in one native call (kernels/cpu/experts.h, over the native GEMMs
    where the CPU has them) or in torch ops."""
    import transformers

    from reference import FAMILY_CLASSES, require_native_kernels

    if native:
        require_native_kernels()

    torch.manual_seed(0)
    config_class, _ = (getattr(transformers, n) for n in FAMILY_CLASSES[family])
    cfg = config_class(vocab_size=32, **MOE_FAMILIES[family])
    module = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe"}[family]
    modeling = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=["x"])
    block_class = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("SparseMoeBlock"))
    block = block_class(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.08)
    block = block.to(torch.bfloat16)
    x = torch.randn(1, 40, cfg.hidden_size, dtype=torch.bfloat16)
    ours = llama.ExpertWeights(
        router=make_linear(block.gate.weight.detach().contiguous()),
        gate_up=[make_linear(w.detach().contiguous()) for w in block.experts.gate_up_proj],
        down=[make_linear(w.detach().contiguous()) for w in block.experts.down_proj],
        shared_gate=make_linear(block.shared_expert_gate.weight.detach()) if family == "qwen2_moe" else None)
    moe = MoeConfig(getattr(cfg, "num_local_experts", None) or cfg.num_experts, cfg.num_experts_per_tok,
                    cfg.intermediate_size if family == "mixtral" else cfg.moe_intermediate_size,
                    family != "qwen2_moe", getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    shared = None
    if family == "qwen2_moe":
        s = block.shared_expert
        shared = s.down_proj(torch.nn.functional.silu(s.gate_proj(x[0])) * s.up_proj(x[0]))
    with torch.no_grad():
        expected = block(x)[0]
        got = llama.moe_mlp(x[0], ours, moe, native=native, shared=shared)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.05, atol=0.02)


# ---- GGUF files: llama.cpp's names, stacked experts, its metadata keys -------------------------------------

_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def write_moe_gguf(model: FamilyModel, path, projections=None, metadata_edits=None):
    """The model as llama.cpp's converter writes it: experts stacked [experts, out, in] per projection,
    Mixtral under architecture llama with its Q/K rows interleaved, the shared expert's gate as [hidden].
    projections: a quantization type for the projections (experts included); their blocks' values then
    replace model.base's weights (the reference runs the file's weights). metadata_edits: keys of the
    architecture's metadata to set (None: to leave out)."""
    loaded = load_model(str(model.folder))
    config, weights = loaded.config, loaded.weights
    arch = _GGUF_ARCH[model.family]
    tensors, values = {}, {}

    def put(hf_name: str, w: torch.Tensor, heads: int = 0) -> np.ndarray:
        """w as the file holds it: its blocks (their values kept for the reference) or floats; heads:
        Mixtral's Q/K rows interleaved for that many heads (rows of blocks move as rows of floats)."""
        data = w
        if projections is not None and hf_name.endswith("proj.weight"):
            data = torch.from_numpy(quantize(w.numpy(), projections))
            values[hf_name] = torch.from_numpy(dequantized(data.numpy(), projections))
        return (llama_cpp_permute(data, heads) if heads else data).numpy()

    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for hf, gguf_name in _GGUF_NAMES.items():
            for kind in ("weight", "bias"):
                w = weights.get(f"{p}{hf}.{kind}")
                if w is None:
                    continue
                heads = 0
                if model.family == "mixtral" and hf in ("self_attn.q_proj", "self_attn.k_proj"):
                    heads = config.num_heads if hf.endswith("q_proj") else config.num_kv_heads
                if hf == "mlp.shared_expert_gate":
                    w = w[0]
                data = put(f"{p}{hf}.{kind}", w, heads)
                tensors[f"blk.{layer}.{gguf_name}.{kind}"] = (data, projections if data.dtype == np.uint8 else None)
        for proj, gguf_name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                ("down_proj", "ffn_down_exps")):
            stacked = [put(f"{p}mlp.experts.{e}.{proj}.weight", weights[f"{p}mlp.experts.{e}.{proj}.weight"])
                       for e in range(config.moe.num_experts)]
            tensors[f"blk.{layer}.{gguf_name}.weight"] = (np.stack(stacked), projections)
    tensors["token_embd.weight"] = (weights["model.embed_tokens.weight"].numpy(), None)
    tensors["output_norm.weight"] = (weights["model.norm.weight"].numpy(), None)
    tensors["output.weight"] = (weights["lm_head.weight"].numpy(), None)
    moe = config.moe
    metadata = {
        "context_length": config.max_position, "embedding_length": config.hidden_size,
        "block_count": config.num_layers, "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_heads, "attention.head_count_kv": config.num_kv_heads,
        "attention.key_length": config.head_dim, "rope.dimension_count": config.head_dim,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps), "rope.freq_base": float(config.rope_theta),
        "expert_count": moe.num_experts, "expert_used_count": moe.top_k,
    }
    if arch != "llama":
        metadata["expert_feed_forward_length"] = moe.expert_size
    if moe.shared_size:
        metadata["expert_shared_feed_forward_length"] = moe.shared_size
    metadata.update(metadata_edits or {})
    metadata = {key: value for key, value in metadata.items() if value is not None}
    if values:
        _load_values(model.base, config, values)
    tokens, merges, special = backend_vocab(model.tokenizer.backend_tokenizer)
    return write_gguf(path, architecture=arch, tokens=tokens, merges=merges, special=special,
                      pre="llama-bpe" if arch == "llama" else "qwen2",    # as the converter names them
                      bos_id=model.tokenizer.bos_token_id, eos_id=model.tokenizer.eos_token_id,
                      chat_template=model.tokenizer.chat_template, llama=metadata, tensors=tensors)


def _load_values(base, config, values: dict) -> None:
    """The quantized projections' values (HF names, per expert) into the transformers model."""
    with torch.no_grad():
        for layer, module in enumerate(base.model.layers):
            p = f"model.layers.{layer}."
            for n in ("q", "k", "v", "o"):
                getattr(module.self_attn, f"{n}_proj").weight.copy_(values[f"{p}self_attn.{n}_proj.weight"])
            experts = module.mlp.experts
            for e in range(config.moe.num_experts):
                q = f"{p}mlp.experts.{e}."
                experts.gate_up_proj[e].copy_(torch.cat([values[q + "gate_proj.weight"], values[q + "up_proj.weight"]]))
                experts.down_proj[e].copy_(values[q + "down_proj.weight"])
            if config.moe.shared_size:
                for n in ("gate", "up", "down"):
                    getattr(module.mlp.shared_expert, f"{n}_proj").weight.copy_(
                        values[f"{p}mlp.shared_expert.{n}_proj.weight"])


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_gguf_file_gives_the_hf_folders_weights_and_tokens(family, tmp_path):
    """The checkpoint written as llama.cpp's converter writes it (float32): the same config, the same
    weights under the same names (the stacked experts cut apart, Mixtral's Q/K rows put back), the same
    tokens as the HF folder, base and an adapter."""
    model = build_with_adapters(tmp_path, family, {"a": (4, ATTENTION, {})})
    path = write_moe_gguf(model, tmp_path / f"{family}.gguf")
    from_gguf, from_folder = loads_as_the_folder(path, model.folder)
    assert from_gguf.config.moe == from_folder.config.moe
    cases = cases_of(model, lengths=(5, 17))
    gguf_model = FamilyModel(model.family, path, model.tokenizer, model.base, model.adapters)
    assert generate_greedy(gguf_model, cases)[1] == generate_greedy(model, cases)[1]


def test_gguf_files_with_broken_expert_metadata_are_refused(tmp_path):
    """Each refused at load with its reason, before any expert runs: more experts per token than
    experts, none per token, no experts, an expert count the stacked tensors do not hold (fewer,
    more), the experts' size left out."""
    model = build_with_adapters(tmp_path, "qwen3_moe", {})
    bad = [({"expert_used_count": 9}, "routes each token to 9 of 8 experts"),
           ({"expert_used_count": 0}, "routes each token to 0 of 8 experts"),
           ({"expert_count": 0}, "routes each token to 2 of 0 experts"),
           ({"expert_count": 4}, "does not stack the 4 experts the metadata says"),
           ({"expert_count": 16}, "does not stack the 16 experts the metadata says"),
           ({"expert_feed_forward_length": None}, "has no qwen3moe.expert_feed_forward_length in its metadata")]
    for i, (edit, why) in enumerate(bad):
        path = write_moe_gguf(model, tmp_path / f"bad{i}.gguf", metadata_edits=edit)
        with pytest.raises(ModelLoadError, match=why):
            load_model(str(path))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_quantized_experts_kept_in_blocks_give_reference_tokens(family, tmp_path):
    """Every projection, the experts' included, in Q8_0 blocks: dequantized at load, the tokens of the base,
    an attention adapter and one on the experts and the router are transformers+PEFT's on the blocks'
    values; kept quantized (a QuantLinear per expert, cut from the stacked tensor, the LoRA on its
    outputs) too, but for tokens at near-ties (the kernels' int8 activations move the router's scores a
    little, and an expert chosen at a near-tie moves the token's output: a token may differ only where
    the reference's top two logits are within 0.2)."""
    from reference import require_native_kernels

    require_native_kernels()
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
    model = build_with_adapters(tmp_path, family, {"a": (4, ATTENTION, {}),
                                                   "x": (4, ["q_proj"], {"target_parameters": experts})})
    path = write_moe_gguf(model, tmp_path / f"{family}.gguf", projections=Q.Q8_0)
    cases = cases_of(model, lengths=(5, 17))
    refs = peft_references(model.base, model.adapters, cases, GREEDY_TOKENS)
    gguf_model = FamilyModel(model.family, path, model.tokenizer, model.base, model.adapters)
    check_greedy(generate_greedy(gguf_model, cases, keep_quantized=False)[1], cases, refs, f"{family} Q8_0 dequantized")
    llm, tokens = generate_greedy(gguf_model, cases, keep_quantized=True)
    layer = llm.engine.runner.weights.layers[0]
    assert all(isinstance(p, QuantLinear) for p in [layer.qkv, *layer.experts.gate_up, *layer.experts.down])
    equal = [assert_greedy_matches(ours, ref, tie_tol=0.2, label=f"{family} Q8_0 case {i}")
             for i, (ours, ref) in enumerate(zip(tokens, refs))]
    assert sum(equal) >= len(cases) // 2, equal
