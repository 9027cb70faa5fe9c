"""--quantize q8_0|q4_0 (model/quantize.py): an HF folder's projections quantized at load into the blocks
gguf.quants (ggml's reference quantizers) makes, the embeddings and head Q8_0; greedy tokens, with adapters,
against transformers+PEFT on the same checkpoint with those blocks dequantized; the settings it refuses."""
import copy

import gguf
import numpy as np
import pytest
import torch

from asyncserve import LLM, SamplingParams
from asyncserve.config import Config
from asyncserve.model.checkpoint import LoadedModel
from asyncserve.model.config import ModelLoadError
from asyncserve.model.linear import QuantEmbedding, QuantizedWeight, QuantLinear
from asyncserve.model.loader import load_model
from asyncserve.model.quantize import quantize_weights
from quant_helpers import assert_quantized_generate_matches
from reference import assert_greedy_matches, peft_references, require_native_kernels, save_tiny_llama

Q = gguf.GGMLQuantizationType
NEW_TOKENS = 6
TIE_TOL = 0.2          # as tests/test_quant_engine.py's: int8 activations against the dequantized weights'


@pytest.fixture(scope="module", autouse=True)
def native():
    require_native_kernels()


def dequantized_reference(base, loaded: LoadedModel):
    """``base`` (transformers) with each weight the loader quantized set to its blocks' values."""
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, weight in loaded.weights.items():
            if isinstance(weight, QuantizedWeight):
                params[name].copy_(weight.dequantize())
    return model


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_blocks_are_ggmls(tiny_model, kind):
    """Every projection's blocks are gguf.quants.quantize's of its float32 weights, in the type asked for; the
    embeddings and the head Q8_0; the norms untouched."""
    dense, loaded = load_model(str(tiny_model.root)), load_model(str(tiny_model.root), quantize=kind)
    assert loaded.weights.keys() == dense.weights.keys()
    for name, weight in loaded.weights.items():
        if not isinstance(weight, QuantizedWeight):
            assert name.endswith("norm.weight") and torch.equal(weight, dense.weights[name]), name
            continue
        qtype = Q.Q8_0 if name in ("model.embed_tokens.weight", "lm_head.weight") else Q[kind.upper()]
        (blocks, got_type), = weight.parts
        assert got_type == qtype and weight.shape == tuple(dense.weights[name].shape), name
        assert np.array_equal(blocks.numpy(), gguf.quants.quantize(dense.weights[name].float().numpy(), qtype)), name
    assert sum(isinstance(w, QuantizedWeight) for w in loaded.weights.values()) == 2 + 7 * 2


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_engine_matches_dequantized_reference(tiny_model, kind):
    adapters = {name: tiny_model.adapters[name] for name in ("r8_attn_rs", "r64_all")}
    llm = LLM(model=str(tiny_model.root), adapters={k: str(v) for k, v in adapters.items()}, dtype="float32",
              device="cpu", max_step_tokens=32, pool_mem="64MiB", quantize=kind)
    weights = llm.engine.runner.weights
    linears = [weights.lm_head] + [getattr(lw, g) for lw in weights.layers for g in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(p, QuantLinear) for p in linears) and isinstance(weights.embed, QuantEmbedding)
    assert "--quantize" in llm.engine.merge_refusal("r64_all")

    reference = dequantized_reference(tiny_model.base, load_model(str(tiny_model.root), quantize=kind))
    assert_quantized_generate_matches(llm, reference, adapters, NEW_TOKENS, TIE_TOL)


def test_tied_checkpoint_keeps_one_copy(tmp_path, tiny_model):
    """A tied checkpoint's table is quantized once: the lookup and the head share its Q8_0 blocks."""
    base = save_tiny_llama(tmp_path / "tied", tiny_model.tokenizer, hidden=128, intermediate=256, tie=True, seed=4)
    llm = LLM(model=str(tmp_path / "tied"), dtype="float32", device="cpu", pool_mem="16MiB", quantize="q4_0")
    weights = llm.engine.runner.weights
    assert isinstance(weights.embed, QuantEmbedding) and weights.lm_head.weight is weights.embed.weight
    loaded = load_model(str(tmp_path / "tied"), quantize="q4_0")
    assert "lm_head.weight" not in loaded.weights
    reference = dequantized_reference(base, loaded)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight     # tied: set once, through the table
    ids = llm.tokenizer.encode("Serving many adapters")
    ref, = peft_references(reference, {}, [(ids, None)], NEW_TOKENS)
    out = llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert_greedy_matches(out.token_ids, ref, TIE_TOL, "tied")


@pytest.mark.parametrize("kwargs, message", [
    ({"quantize": "q5_k"}, "quantize must be q8_0 or q4_0"),
    ({"quantize": "Q8_0"}, "quantize must be q8_0 or q4_0"),
    ({"quantize": "int8"}, "quantize must be q8_0 or q4_0"),
    ({"quantize": "q8_0", "device": "cuda"}, "quantize runs on CPU"),
    ({"quantize": "q4_0", "device": "cuda:1"}, "quantize runs on CPU"),
    ({"quantize": "q8_0", "policy": "merged-only"}, "policy merged-only merges each adapter"),
])
def test_settings_refused(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Config(model=str(tiny_model.root), **kwargs).validate()


def test_gguf_file_refused(tmp_path):
    from model_io_helpers import backend_vocab, write_gguf
    from reference import make_tiny_tokenizer

    tokens, merges, special = backend_vocab(make_tiny_tokenizer().backend_tokenizer)
    path = write_gguf(tmp_path / "m.gguf", tokens=tokens, merges=merges, special=special)
    with pytest.raises(ValueError, match="is a GGUF file, whose quantized tensors stay in their blocks"):
        Config(model=str(path), quantize="q8_0").validate()
    with pytest.raises(ModelLoadError, match="is a GGUF file, whose quantized tensors stay in their blocks"):
        load_model(str(path), quantize="q4_0")


@pytest.mark.parametrize("fan_in", [48, 40, 33])
def test_inputs_not_in_whole_blocks_refused(fan_in):
    loaded = LoadedModel(None, {"model.layers.0.mlp.down_proj.weight": torch.randn(8, fan_in)}, None, "folder")
    with pytest.raises(ModelLoadError, match=f"down_proj.weight has {fan_in} inputs, not a multiple of the 32"):
        quantize_weights(loaded, "q8_0")


@pytest.mark.parametrize("kind, scale", [("q8_0", 1e7), ("q4_0", 6e5), ("q4_0", float(np.finfo(np.float32).max))])
def test_entries_beyond_fp16_scales_refused(kind, scale):
    """A weight so large that its block's fp16 scale would be infinite (max |w| / 127 or / 8 beyond 65504)."""
    w = torch.randn(4, 64)
    w[2, 40] = scale
    loaded = LoadedModel(None, {"model.layers.0.self_attn.o_proj.weight": w}, None, "folder")
    with pytest.raises(ModelLoadError, match="o_proj.weight has entries too large for"):
        quantize_weights(loaded, kind)
