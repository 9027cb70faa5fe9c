"""What a loader returns: the checked weights, the config and the tokenizer of a base model."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

from asyncserve.model.config import LinearAttention, ModelConfig, ModelLoadError
from asyncserve.model.linear import QuantizedWeight
from asyncserve.model.tokenizer import Tokenizer

# progress(done, total) in tensors as a loader reads (and dequantizes) the weights
ProgressCallback = Callable[[int, int], None]


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantizedWeight]   # HF Llama names (see config.py); GGUF blocks kept
    tokenizer: Tokenizer
    source: str                          # the file or folder the model was read from


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name, with its shape [out, in]."""
    h, i, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        family = config.family
        if family.pre_norms:
            shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.is_linear(layer):
            shapes.update(_linear_attention_shapes(p + "linear_attn.", h, config.linear_attention))
        else:
            shapes.update({
                p + "self_attn.q_proj.weight": (config.q_proj_size, h),
                p + "self_attn.k_proj.weight": (config.kv_size, h),
                p + "self_attn.v_proj.weight": (config.kv_size, h),
                p + "self_attn.o_proj.weight": (h, config.q_size),
            })
        moe = config.moe
        if moe is not None:
            shapes[p + "mlp.gate.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", h, moe.expert_size))
            if moe.shared_size:
                shapes.update(_mlp_shapes(p + "mlp.shared_expert.", h, moe.shared_size))
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        else:
            shapes.update(_mlp_shapes(p + "mlp.", h, i))
        if config.is_linear(layer):
            pass
        elif family.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (config.q_size,),
                           p + "self_attn.k_proj.bias": (config.kv_size,),
                           p + "self_attn.v_proj.bias": (config.kv_size,)})
        if (family.qk_norm or family.whole_qk_norm) and not config.is_linear(layer):
            shapes.update({p + "self_attn.q_norm.weight": (config.q_size if family.whole_qk_norm else config.head_dim,),
                           p + "self_attn.k_norm.weight": (config.kv_size if family.whole_qk_norm else config.head_dim,)})
        if family.sandwich_norms:
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
            if family.pre_norms:
                shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def _linear_attention_shapes(prefix: str, hidden: int, la: LinearAttention) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (Qwen3.5's linear_attn)."""
    return {prefix + "in_proj_qkv.weight": (la.conv_dim, hidden), prefix + "in_proj_z.weight": (la.value_dim, hidden),
            prefix + "in_proj_b.weight": (la.num_v_heads, hidden), prefix + "in_proj_a.weight": (la.num_v_heads, hidden),
            prefix + "conv1d.weight": (la.conv_dim, 1, la.conv_kernel), prefix + "dt_bias": (la.num_v_heads,),
            prefix + "A_log": (la.num_v_heads,), prefix + "norm.weight": (la.v_head_dim,),
            prefix + "out_proj.weight": (hidden, la.value_dim)}


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


# Mixtral's names for its experts and router -> the names every loader produces (Qwen-MoE's)
_MIXTRAL_EXPERTS = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(?:(gate)|experts\.(\d+)\.(w[123]))\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def expert_names(config: ModelConfig, tensors: dict[str, torch.Tensor], source: str) -> None:
    """A Mixtral checkpoint's block_sparse_moe tensors, in place, under the mlp.gate / mlp.experts names;
    refused unless the checkpoint holds as many experts per layer as the config says (before
    select_weights lists L x experts names: a config's count is not trusted that far)."""
    for name in [n for n in tensors if ".block_sparse_moe." in n]:
        m = _MIXTRAL_EXPERTS.match(name)
        if m is None:
            continue                    # select_weights drops it
        layer, gate, expert, w = m.groups()
        new = f"{layer}mlp.gate.weight" if gate else f"{layer}mlp.experts.{expert}.{_MIXTRAL_PROJ[w]}.weight"
        tensors[new] = tensors.pop(name)
    held = {int(m.group(1)) for name in tensors if (m := _EXPERT.match(name))}
    if len(held) != config.moe.num_experts or max(held, default=-1) != config.moe.num_experts - 1:   # not 0..n-1
        raise ModelLoadError(f"{source} holds experts {_span(held)} per layer; its config says "
                             f"{config.moe.num_experts}")


def _span(numbers: set[int]) -> str:
    return f"0..{max(numbers)} ({len(numbers)} of them)" if numbers else "none"


def split_fused(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """A fused checkpoint's (Phi-3) self_attn.qkv_proj and mlp.gate_up_proj weights, in place, as the
    q/k/v and gate/up tensors every loader produces (the forward fuses them again)."""
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for fused, parts, sizes in (
                ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 (config.q_size, config.kv_size, config.kv_size)),
                ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), (config.intermediate_size,) * 2)):
            weight = tensors.pop(p + fused + ".weight", None)
            if weight is None:
                continue
            if weight.dim() != 2 or weight.shape[0] != sum(sizes):
                raise ModelLoadError(f"tensor {p}{fused}.weight has shape {tuple(weight.shape)}, but the model's "
                                     f"config implies {sum(sizes)} rows ({' + '.join(map(str, sizes))})")
            for part, chunk in zip(parts, weight.split(sizes)):
                tensors[p + part + ".weight"] = chunk


def select_weights(config: ModelConfig, tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The tensors the model needs, checked against the config; others (a tied lm_head, rotary buffers) are dropped."""
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        tensor = tensors.get(name)
        if tensor is None:
            untied = " (the config does not tie it to the embeddings)" if name == "lm_head.weight" else ""
            raise ModelLoadError(f"{source} is missing tensor {name}{untied}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"but the model's config implies {shape}")
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not all_finite(tensor):
            raise ModelLoadError(f"{source}: tensor {name} holds NaN or infinite values")
        weights[name] = tensor
    return weights


def all_finite(t: torch.Tensor) -> bool:
    """No NaN nor infinity in t."""
    lo, hi = torch.aminmax(t)          # NaN propagates; ~15x faster than isfinite().all() on CPU
    return math.isfinite(float(lo)) and math.isfinite(float(hi))
