"""Loading a llama.cpp GGUF file: metadata, weights in HF naming (dequantized to float32, or with
keep_quantized the projections and embeddings of the types the CPU kernels run kept as their blocks), tokenizer.

Architectures llama (Mixtral: llama with experts), qwen2, qwen3, gemma, gemma2, gemma3, phi3, smollm3, granite,
olmo2 (OLMo 3: olmo2 with sliding windows), qwen2moe and qwen3moe, with llama.cpp's conventions undone:
Llama's, Mixtral's, SmolLM3's and Granite's Q/K rows interleaved per head (the other families rotate
halves, as HF does), Gemma's norm weights stored as 1 + w, Phi-3's longrope factors and Llama 3.1's RoPE
scaling (rope_freqs: a divisor per frequency) stored as tensors, a mixture's experts stacked in one
tensor per projection."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from asyncserve.model.checkpoint import LoadedModel, ProgressCallback, select_weights, split_fused
from asyncserve.model.config import (FAMILIES, LLAMA, Family, LinearAttention, ModelConfig, ModelLoadError,
                                     MoeConfig, check_rope, rope_context)
from asyncserve.model.linear import QUANT_BLOCKS, QuantizedWeight
from asyncserve.model.tokenizer import Tokenizer

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
    # a mixture of experts: the router, the experts stacked [experts, out, in], the shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# where a family's converter names HF modules otherwise: Gemma's post_attention_layernorm is the
# attention output's norm (post_attention_norm) and its MLP input norm pre_feedforward_layernorm is
# ffn_norm; Phi-3's fused gate_up_proj is ffn_up
_FAMILY_LAYER_TENSORS = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "olmo2": {"post_attention_norm": "post_attention_layernorm"},
    "olmo3": {"post_attention_norm": "post_attention_layernorm"},
    # Qwen3.5's Gated DeltaNet layers (ssm_dt's bias is linear_attn.dt_bias, ssm_a is -exp(A_log): _qwen35_tensors)
    "qwen3_5": {"post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
                "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
                "ssm_alpha": "linear_attn.in_proj_a", "ssm_conv1d": "linear_attn.conv1d",
                "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"},
}
# llama.cpp files Mixtral as llama with experts, OLMo 3 as olmo2 with sliding windows (load_gguf_file tells them apart)
_ARCHITECTURES = {family.gguf_architecture: family for family in FAMILIES if family.name not in ("mixtral", "olmo3")}
_MIXTRAL = next(family for family in FAMILIES if family.name == "mixtral")
_OLMO3 = next(family for family in FAMILIES if family.name == "olmo3")
# whose Q/K rows llama.cpp's converter interleaves per head
_INTERLEAVED = (LLAMA.name, _MIXTRAL.name, "smollm3", "granite")
# llama.cpp renormalizes the top-k router probabilities of these (a GGUF does not record norm_topk_prob)
_NORMALIZED_TOP_K = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")     # Phi-3's longrope, per frequency
_REQUIRED = object()
# what kernels/cpu/quant.h runs: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K (everything a Q4_K_M, Q5_K_M or Q8_0 file holds)
KEPT_QUANTIZED = {gguf.GGMLQuantizationType(t) for t in QUANT_BLOCKS}


def _reader(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:       # the reader raises ValueError, struct errors, ... on a bad file
        raise ModelLoadError(f"cannot read {path} as a GGUF file (truncated or corrupt?): {e}") from None


def load_gguf_file(path: Path, progress: ProgressCallback | None = None, keep_quantized: bool = False) -> LoadedModel:
    reader = _reader(path)
    fields = reader.fields
    architecture = _value(fields, "general.architecture", path)
    family = _ARCHITECTURES.get(architecture)
    if family is None:
        raise ModelLoadError(f"{path} holds a {architecture!r} model; asyncserve serves GGUF files of "
                             f"general.architecture {', '.join(repr(a) for a in _ARCHITECTURES)}")
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ModelLoadError(f"{path} is missing tensor token_embd.weight")
    rope_factors = {name: by_name.pop(name) for name in _ROPE_FACTORS if name in by_name}
    freq_factors = by_name.pop("rope_freqs.weight", None)
    if family is LLAMA and _value(fields, "llama.expert_count", path, 0):
        family = _MIXTRAL
    if family.gguf_architecture == "olmo2" and _value(fields, "olmo2.attention.sliding_window", path, 0):
        family = _OLMO3
    hf_names = {name: hf_name(name, family, path) for name in by_name}   # refuse unknown tensors before dequantizing

    config = _model_config(fields, family, path, vocab_size=int(by_name["token_embd.weight"].shape[1]),
                           tied="output.weight" not in by_name)
    if rope_factors:
        _longrope(config, fields, family, rope_factors, path)
    if freq_factors is not None:
        _freq_factors(config, freq_factors, path)
    tokenizer = Tokenizer.from_gguf(fields)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_ids = tokenizer.eos_token_ids

    tensors = {}
    for name, tensor in by_name.items():
        # Qwen3.5's linear-attention tensors have their value heads reordered below: as float tensors
        keep = keep_quantized and _keeps(tensor) and ".linear_attn." not in hf_names[name]
        weight = _quantized(tensor, config, path) if keep else _dequantize(tensor, config, path)
        tensors.update(_per_expert(hf_names[name], weight, config, path))
        if progress is not None:
            progress(len(tensors), len(by_name))
    if family.unit_offset_norms:       # llama.cpp's converter stores Gemma's norm weights as 1 + w
        for name, tensor in tensors.items():
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):   # Qwen3.5's is w
                tensor -= 1.0
    if config.linear_layers:
        _qwen35_tensors(config, tensors)
    if family.fused_projections:
        split_fused(config, tensors)
    return LoadedModel(config, select_weights(config, tensors, str(path)), tokenizer, str(path))


def _model_config(fields: dict[str, Any], family: Family, path: Path, vocab_size: int, tied: bool) -> ModelConfig:
    def llama(key: str, default: Any = _REQUIRED) -> Any:
        return _value(fields, f"{family.gguf_architecture}.{key}", path, default)

    hidden, heads = llama("embedding_length"), llama("attention.head_count")
    head_dim = llama("attention.key_length", hidden // heads)
    rope_dim = llama("rope.dimension_count", head_dim)
    if rope_dim != head_dim and (not family.partial_rope or not 0 < rope_dim < head_dim or rope_dim % 2):
        raise ModelLoadError(f"{path} rotates {rope_dim} of {head_dim} head dimensions (partial RoPE), which "
                             "asyncserve implements for Phi-3, Phi-4-mini (phi3) and Qwen3.5 (qwen35) only, as "
                             "transformers does")
    num_layers = llama("block_count")
    gemma = family.name.startswith("gemma")
    window = llama("attention.sliding_window", None)
    if family.sliding_layers == "every_other":
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif family.sliding_layers == "pattern":
        # llama.cpp's Gemma 3 and OLMo 3: every sliding_window_pattern-th layer global (6 and 4 unless the
        # file says), or a flag per layer
        pattern = llama("attention.sliding_window_pattern", family.window_pattern)
        sliding = list(pattern) if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    max_position = llama("context_length", ModelConfig.max_position)
    windows = [window if s else None for s in sliding] if window and window < max_position else []
    # llama.cpp scales Gemma's queries by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for the
    # 27B models (query_pre_attn_scalar, which a GGUF does not record)
    big = {"gemma2": 46, "gemma3": 62}.get(family.name) == num_layers
    moe = _moe(llama, family, path)
    scaling = _rope_scaling(llama, path)
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=(moe.shared_size or moe.expert_size) if moe else llama("feed_forward_length"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=llama("attention.head_count_kv", heads),
        head_dim=head_dim,
        rotary_dim=rope_dim if rope_dim != head_dim else None,
        # llama.cpp's SmolLM3: every 4th layer without RoPE (a step of its own, not in the file)
        nope_layers=[(i + 1) % family.nope_interval == 0 for i in range(num_layers)] if family.nope_interval else [],
        # Granite's multipliers (the converter writes each only when non-zero; llama.cpp: none without)
        embedding_multiplier=llama("embedding_scale", None),
        residual_multiplier=llama("residual_scale", 1.0) or 1.0,
        logits_scaling=llama("logit_scale", 1.0) or 1.0,
        rms_norm_eps=llama("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=llama("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position=rope_context(scaling, max_position),
        tie_word_embeddings=tied,
        name=path.stem,          # an id clients can type; general.name is free text with spaces
        family=family,
        # Granite: its attention.scale where the file has one (llama.cpp: head_dim ** -0.5 without)
        attn_scale=((hidden / heads) if big else head_dim) ** -0.5 if gemma else llama("attention.scale", None),
        attn_softcap=llama("attn_logit_softcapping", None) if family.name == "gemma2" else None,
        final_softcap=llama("final_logit_softcapping", None) if gemma else None,
        layer_windows=windows,
        # the sliding layers' plain RoPE: Gemma 3's base of their own, OLMo 3's the global layers' unless set
        rope_local_theta=llama("rope.freq_base_swa", 10000.0 if family.name == "gemma3" else
                               llama("rope.freq_base", 10000.0)) if family.local_rope_base else None,
        moe=moe,
        **_linear_attention(llama, family, num_layers, path),
    )


def _linear_attention(llama, family: Family, num_layers: int, path: Path) -> dict[str, Any]:
    """Qwen3.5's linear-attention layers from qwen35.attention.recurrent_layers (else every
    full_attention_interval-th layer attends) and the ssm.* sizes, as ModelConfig fields."""
    if family.name != "qwen3_5":
        return {}
    recurrent = llama("attention.recurrent_layers", None)
    if recurrent is None:
        interval = llama("full_attention_interval", 4)
        recurrent = [bool((i + 1) % interval) for i in range(num_layers)]
    if len(recurrent) != num_layers:
        raise ModelLoadError(f"{path}: attention.recurrent_layers lists {len(recurrent)} layers of {num_layers}")
    v_heads, k_heads = llama("ssm.time_step_rank"), llama("ssm.group_count")
    if not k_heads or v_heads % k_heads or llama("ssm.inner_size") % v_heads:
        raise ModelLoadError(f"{path}: {v_heads} value heads, {k_heads} key heads and an inner size of "
                             f"{llama('ssm.inner_size')} do not group")
    return dict(linear_layers=[bool(r) for r in recurrent], linear_attention=LinearAttention(
        num_k_heads=k_heads, num_v_heads=v_heads, k_head_dim=llama("ssm.state_size"),
        v_head_dim=llama("ssm.inner_size") // v_heads, conv_kernel=llama("ssm.conv_kernel")))


def _qwen35_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """In place, Qwen3.5's linear-attention tensors as HF holds them. llama.cpp's converter tiles the
    value heads (for ggml's broadcast: value head j of key head i moves from i * per_key + j to
    j * key_heads + i) in in_proj_qkv's v rows, in_proj_z, in_proj_a/b, A_log, dt_bias and the conv's v
    channels, and out_proj's columns; stores -exp(A_log) and the conv's taps [channels, kernel]."""
    la = config.linear_attention
    per_key = la.num_v_heads // la.num_k_heads

    def grouped(t: torch.Tensor, dim: int, head: int) -> torch.Tensor:
        shape = list(t.shape)
        split = t.reshape(*shape[:dim], per_key, la.num_k_heads, head, *shape[dim + 1:])
        return split.transpose(dim, dim + 1).reshape(shape)

    for layer in range(config.num_layers):
        if not config.is_linear(layer):
            continue
        p = f"model.layers.{layer}.linear_attn."
        qk = 2 * la.key_dim
        qkv = tensors[p + "in_proj_qkv.weight"]
        tensors[p + "in_proj_qkv.weight"] = torch.cat([qkv[:qk], grouped(qkv[qk:], 0, la.v_head_dim)])
        conv = tensors[p + "conv1d.weight"]
        tensors[p + "conv1d.weight"] = torch.cat([conv[:qk], grouped(conv[qk:], 0, la.v_head_dim)])[:, None, :]
        tensors[p + "in_proj_z.weight"] = grouped(tensors[p + "in_proj_z.weight"], 0, la.v_head_dim)
        for name in ("in_proj_a.weight", "in_proj_b.weight", "dt_bias"):
            tensors[p + name] = grouped(tensors[p + name], 0, 1)
        tensors[p + "A_log"] = torch.log(-grouped(tensors[p + "A_log"], 0, 1))
        tensors[p + "out_proj.weight"] = grouped(tensors[p + "out_proj.weight"], 1, la.v_head_dim)


def _moe(llama, family: Family, path: Path) -> MoeConfig | None:
    """The mixture of experts from {arch}.expert_* keys (Mixtral: its experts' size is feed_forward_length)."""
    if family.name not in _NORMALIZED_TOP_K:
        return None
    experts, used = llama("expert_count"), llama("expert_used_count")
    size = llama("feed_forward_length") if family is _MIXTRAL else llama("expert_feed_forward_length")
    shared = llama("expert_shared_feed_forward_length", 0) if family.name == "qwen2_moe" else 0
    return MoeConfig(num_experts=experts, top_k=used, expert_size=size, normalize=_NORMALIZED_TOP_K[family.name],
                     shared_size=shared)


def _per_expert(name: str, weight: torch.Tensor | QuantizedWeight, config: ModelConfig,
                path: Path) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A tensor under its HF name; a mixture's stacked experts [experts, out, in] as one [out, in] per
    expert (mlp.experts.{e}.gate_proj.weight ...), the shared expert's gate [hidden] as [1, hidden]."""
    if name.endswith("mlp.shared_expert_gate.weight") and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return {name: weight[None]}
    if ".mlp.experts." not in name:
        return {name: weight}
    prefix, proj = name.split(".mlp.experts.")
    experts = config.moe.num_experts if config.moe else 0
    if isinstance(weight, QuantizedWeight):
        rows = weight.shape[0]
        parts = weight.split([rows // experts] * experts) if experts and rows % experts == 0 else []
    else:
        parts = list(weight) if weight.dim() == 3 else []
    if not experts or len(parts) != experts:
        raise ModelLoadError(f"{path}: {name} does not stack the {experts} experts the metadata says")
    return {f"{prefix}.mlp.experts.{e}.{proj}": part for e, part in enumerate(parts)}


def _longrope(config: ModelConfig, fields: dict[str, Any], family: Family, factors: dict, path: Path) -> None:
    """Phi-3's longrope from its factor tensors and rope.scaling.* keys (llama.cpp's converter)."""
    def key(name: str, default: Any = _REQUIRED) -> Any:
        return _value(fields, f"{family.gguf_architecture}.rope.scaling.{name}", path, default)

    if len(factors) != 2:
        raise ModelLoadError(f"{path} has {', '.join(factors)} without its pair; longrope needs both")
    long, short = (gguf.quants.dequantize(factors[n].data, factors[n].tensor_type).reshape(-1).tolist()
                   for n in _ROPE_FACTORS)
    original = key("original_context_length")
    config.rope_scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                           "original_max_position_embeddings": original,
                           "factor": config.max_position / original, "attention_factor": key("attn_factor", None)}


def _freq_factors(config: ModelConfig, tensor, path: Path) -> None:
    """llama.cpp's rope_freqs: one divisor per rotated frequency (its converter's form of Llama 3.1's
    scaling), applied as llama.cpp applies it: each frequency divided by its factor."""
    factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
    if config.rope_scaling is not None:
        raise ModelLoadError(f"{path} has rope_freqs beside {config.rope_scaling['rope_type']!r} RoPE scaling; "
                             "asyncserve applies one or the other")
    if factors.size != config.rope_dim // 2 or not np.all(np.isfinite(factors)) or not np.all(factors > 0):
        raise ModelLoadError(f"{path}: rope_freqs should hold {config.rope_dim // 2} positive finite factors, "
                             f"one per rotated frequency")
    config.rope_scaling = {"rope_type": "freq_factors", "freq_factors": factors.astype(np.float64).tolist()}


# llama.cpp's YaRN keys (rope.scaling.yarn_*) -> transformers' rope_scaling keys, as its converter writes them
_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor"}


def _rope_scaling(llama, path: Path) -> dict | None:
    """HF-style rope_scaling from llama.rope.scaling.* (or the older llama.rope.scale_linear)."""
    kind, factor = llama("rope.scaling.type", None), llama("rope.scaling.factor", None)
    if kind is None and llama("rope.scale_linear", None) is not None:
        kind, factor = "linear", llama("rope.scale_linear")
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    scaling = {"rope_type": kind, "factor": factor}
    original_context = llama("rope.scaling.original_context_length", None)
    if original_context is not None:
        scaling["original_max_position_embeddings"] = original_context
    if kind == "yarn":
        if original_context is None:
            raise ModelLoadError(f"{path} has YaRN RoPE scaling without rope.scaling.original_context_length")
        if llama("rope.scaling.yarn_ext_factor", 1.0) != 1.0:
            raise ModelLoadError(f"{path} sets rope.scaling.yarn_ext_factor; asyncserve implements YaRN's own (1.0)")
        scaling.update({hf: llama(f"rope.scaling.{key}") for key, hf in _YARN_KEYS.items()
                        if llama(f"rope.scaling.{key}", None) is not None})
    check_rope(scaling, str(path))
    return scaling


def hf_name(gguf_name: str, family: Family, path: Path) -> str:
    """token_embd.weight -> model.embed_tokens.weight, blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight
    (a mixture's stacked experts: mlp.experts.gate_proj); ModelLoadError for a tensor the family lacks."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS and parts[1] == "weight":
        return f"{_GLOBAL_TENSORS[parts[0]]}.weight"
    if family.name == "qwen3_5" and parts[0] == "blk" and parts[2:] in (["ssm_a"], ["ssm_dt", "bias"]):
        return f"model.layers.{parts[1]}.linear_attn.{'A_log' if parts[2] == 'ssm_a' else 'dt_bias'}"
    layer_tensors = {**_LAYER_TENSORS, **_FAMILY_LAYER_TENSORS.get(family.name, {})}
    biased = family.qkv_bias and parts[2:3] in (["attn_q"], ["attn_k"], ["attn_v"])
    if (len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_tensors
            and (parts[3] == "weight" or parts[3] == "bias" and biased)):
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"{path} has tensor {gguf_name}, which is not part of the {family.name} architecture "
                         "asyncserve implements")


def _dequantize(tensor: gguf.ReaderTensor, config: ModelConfig, path: Path) -> torch.Tensor:
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf "
                             "package cannot dequantize; use a file quantized with another type") from None
    # float tensors come back as read-only views of the memory-mapped file: copy those
    weight = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
    weight = weight.reshape([int(d) for d in reversed(tensor.shape)])   # ggml lists dimensions innermost first
    # llama.cpp's converter interleaves the rotary halves of each Q/K head of Llama (only: the other
    # families rotate halves as HF does); undo it for HF's rotate_half layout
    interleaved = config.family.name in _INTERLEAVED
    if interleaved and tensor.name.endswith("attn_q.weight"):
        weight = unpermute(weight, config.num_heads)
    elif interleaved and tensor.name.endswith("attn_k.weight"):
        weight = unpermute(weight, config.num_kv_heads)
    return weight


K_QUANTS = {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K}


def mostly_k_quants(path: Path) -> bool:
    """Whether most of a GGUF file's weights (by count, its 2-D tensors and a mixture's stacked experts) are
    Q4_K, Q5_K or Q6_K, the types the AMX int8 tiles run (a Q4_K_M or Q5_K_M file); reads the header only."""
    counts = {True: 0, False: 0}
    for tensor in _reader(path).tensors:
        if len(tensor.shape) >= 2:
            counts[tensor.tensor_type in K_QUANTS] += int(tensor.n_elements)
    return counts[True] > counts[False]


# IQ4_NL's 16 levels (ggml's kvalues_iq4nl): a block's weights are d times these
_IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _q5_0_values(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [n, 22] (fp16 d, 32 fifth bits, 16 bytes of nibbles) -> their integers q - 16 [n, 32]."""
    high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")          # bit j: weight j's fifth bit
    low = np.concatenate([blocks[:, 6:] & 0x0F, blocks[:, 6:] >> 4], axis=1)  # weights 0..15, then 16..31
    return (low | (high << 4)).astype(np.int16) - 16


def _iq4_nl_values(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks [n, 18] (fp16 d, 16 bytes of nibbles) -> their levels [n, 32]."""
    return _IQ4_NL_LEVELS[np.concatenate([blocks[:, 2:] & 0x0F, blocks[:, 2:] >> 4], axis=1)]


# 32-weight blocks of an fp16 d times small integers: the same values as Q8_0 blocks (d's bits kept, the
# integers as int8), which the kernels run. llama.cpp's K-quant files fall back to Q5_0 and IQ4_NL for
# rows not a multiple of 256 (Qwen2.5-0.5B's 896: most of its Q4_K_M file is Q5_0).
_AS_Q8_0 = {gguf.GGMLQuantizationType.Q5_0: (22, _q5_0_values), gguf.GGMLQuantizationType.IQ4_NL: (18, _iq4_nl_values)}


def _as_q8_0(blocks: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Rows of Q5_0 or IQ4_NL blocks [rows, n * size] -> the same rows of Q8_0 blocks [rows, n * 34]."""
    size, values = _AS_Q8_0[qtype]
    rows = blocks.shape[0]
    flat = np.ascontiguousarray(blocks).reshape(-1, size)
    q8 = np.empty((flat.shape[0], 34), dtype=np.uint8)
    q8[:, :2] = flat[:, :2]
    q8[:, 2:] = values(flat).astype(np.int8).view(np.uint8)
    return q8.reshape(rows, -1)


def _keeps(tensor: gguf.ReaderTensor) -> bool:
    """Projections, the output head and the embeddings (rows dequantized at lookup; a tied model's head
    too) of a kernel type, or of one whose blocks are Q8_0's values (_AS_Q8_0)."""
    return ((tensor.tensor_type in KEPT_QUANTIZED or tensor.tensor_type in _AS_Q8_0)
            and (len(tensor.shape) == 2 or tensor.name.endswith("_exps.weight")))


def _quantized(tensor: gguf.ReaderTensor, config: ModelConfig, path: Path) -> QuantizedWeight:
    """The tensor's blocks copied out of the mapped file, one row of blocks per output: [out, bytes per row]
    (stacked experts: [experts * out, bytes per row], which _per_expert cuts apart)."""
    fan_in, *outs = (int(d) for d in tensor.shape)
    blocks = tensor.data.reshape(int(np.prod(outs)), -1)          # a view of the mapped file
    # whole rows move, so undoing Llama's Q/K interleave (_dequantize) permutes rows of blocks as rows of floats
    interleaved = config.family.name in _INTERLEAVED
    if interleaved and tensor.name.endswith("attn_q.weight"):
        blocks = unpermute(blocks, config.num_heads)
    elif interleaved and tensor.name.endswith("attn_k.weight"):
        blocks = unpermute(blocks, config.num_kv_heads)
    qtype = tensor.tensor_type
    if qtype in _AS_Q8_0:        # copied out of the mapping (which closes with the reader) as it converts
        blocks, qtype = _as_q8_0(blocks, qtype), gguf.GGMLQuantizationType.Q8_0
    weight = QuantizedWeight([(torch.from_numpy(np.array(blocks, dtype=np.uint8)), int(qtype))], fan_in)
    if bad := weight.nonfinite_scales():      # the kernels would spread NaN through every row of x
        raise ModelLoadError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) has a NaN or infinite "
                             f"block scale in {bad} of its {weight.nbytes // QUANT_BLOCKS[qtype][0]} "
                             "blocks; the file is corrupt")
    return weight


def interleaves_qk(family: Family) -> bool:
    """Whether llama.cpp's converter interleaves this family's Q/K rows per head (unpermute undoes it)."""
    return family.name in _INTERLEAVED


def unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a Q or K projection (or its LoRA B) interleaved per head by llama.cpp's converter, in HF's order."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _value(fields: dict[str, Any], key: str, path: Path, default: Any = _REQUIRED) -> Any:
    field = fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"{path} has no {key} in its metadata")
        return default
    return field.contents()
