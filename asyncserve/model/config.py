"""Architecture description of a decoder (Llama and the families that differ from it in small
pieces: Qwen2/2.5, Qwen3, Gemma 1/2/3, Phi-3, SmolLM3, Granite, OLMo 2/3, Qwen3.5 (its linear-attention layers:
linear_attention.py), and the mixture-of-experts Mixtral,
Qwen2-MoE and Qwen3-MoE; the language models of multimodal checkpoints as their text family), filled by the
HF and GGUF loaders."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


class ModelLoadError(ValueError):
    """A model folder or file that cannot be served: unsupported architecture, missing file, bad shape."""


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object")
    return data


# LoRA-targetable projections, PEFT module names, in the order adapters' tables use.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJ_INDEX = {name: i for i, name in enumerate(PROJECTIONS)}
# Each routed expert's projections an adapter may adapt (ModelConfig.lora_projections names them
# experts.{e}.{projection}, after PROJECTIONS).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# RoPE scalings the forward implements: HF's (transformers' _compute_*_parameters) and llama.cpp's
# per-frequency divisors (freq_factors: a GGUF's rope_freqs tensor, Llama 3.1's scaling as it stores it)
ROPE_TYPES = ("linear", "llama3", "longrope", "yarn", "freq_factors")


def check_rope(scaling: dict, source: str) -> None:
    """A scaling the forward implements, its factor (where it has one) a finite number (at least 1 for
    YaRN, as transformers requires) and its original context a positive integer."""
    if scaling["rope_type"] not in ROPE_TYPES:
        raise ModelLoadError(f"model {source} uses {scaling['rope_type']!r} RoPE scaling; asyncserve implements "
                             f"plain RoPE and {', '.join(ROPE_TYPES)}")
    factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
    least = 1.0 if scaling["rope_type"] == "yarn" else 0.0
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or not math.isfinite(factor) or factor <= 0 or factor < least):
        raise ModelLoadError(f"model {source}: the RoPE scaling factor should be a finite number "
                             f"{'of at least 1' if least else 'above 0'}, not {factor!r}")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise ModelLoadError(f"model {source}: original_max_position_embeddings should be a positive integer, "
                             f"not {original!r}")


def rope_context(scaling: dict | None, max_position: int) -> int:
    """The positions a model rotates: YaRN's original context times its factor where that is longer
    than max_position_embeddings (Qwen's long-context recipe leaves that at the original; vLLM serves
    the product), else max_position_embeddings."""
    if scaling and scaling["rope_type"] == "yarn":
        return max(max_position, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return max_position


# Projections that share an input run as one fused base matmul, and their LoRA as one group.
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class Family:
    """What sets a model family's decoder apart from Llama's, as data the one forward (llama.py) reads."""
    name: str
    model_types: tuple[str, ...]          # config.json's model_type
    architectures: tuple[str, ...]        # config.json's architectures
    gguf_architecture: str                # general.architecture in a GGUF file
    qkv_bias: bool = False                # Qwen2: biases on q, k and v
    qk_norm: bool = False                 # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    unit_offset_norms: bool = False       # Gemma: RMSNorm weights stored as w, applied as (1 + w), in float32
    sandwich_norms: bool = False          # Gemma: norms on the attention's and the MLP's outputs as well
    # OLMo 2: no norm before attention and MLP (their outputs' sandwich norms only), and q and k normed
    # whole (RMSNorm over all heads of each), before RoPE
    pre_norms: bool = True
    whole_qk_norm: bool = False
    activation: str = "silu"              # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    scaled_embeddings: bool = False       # Gemma: embeddings times sqrt(hidden), rounded to the weights' dtype
    fused_projections: bool = False       # Phi-3: qkv_proj and gate_up_proj in the checkpoint and PEFT adapters
    # in the order layer_types lists them when config.json does not: "all" layers slide when the config
    # sets a window, "every_other" from layer 0 (Gemma 2), "pattern" (Gemma 3: all but every
    # sliding_window_pattern-th), "from_max_window_layers" (Qwen: layers from max_window_layers on,
    # when use_sliding_window), "nope_layers" (SmolLM3: its NoPE layers, when use_sliding_window)
    sliding_layers: str = "all"
    # SmolLM3: every nope_interval-th layer applies no RoPE (NoPE), unless config.json lists no_rope_layers
    nope_interval: int = 0
    # "pattern": every window_pattern-th layer global where neither config.json nor the GGUF lists them
    window_pattern: int = 6
    # Gemma 3, OLMo 3: the sliding layers rotate with plain RoPE at their own base (rope_parameters'
    # sliding_attention; ModelConfig.rope_local_theta), the RoPE scaling on the global layers only
    local_rope_base: bool = False
    # Phi-3, Qwen3.5: RoPE may rotate only part of each head (partial_rotary_factor; its default here)
    partial_rope: bool = False
    rotary_fraction: float = 1.0
    # Qwen3.5: q_proj gives each head's query and an output gate; the attention's output is multiplied by
    # sigmoid(gate) before o_proj
    gated_attention: bool = False

    def peft_modules(self) -> dict[str, tuple[str, ...]]:
        """PEFT module name -> the projections (PROJECTIONS) whose output slices it covers, in order."""
        if self.fused_projections:
            return {"qkv_proj": GROUPS["qkv"], "o_proj": ("o_proj",), "gate_up_proj": GROUPS["gate_up"],
                    "down_proj": ("down_proj",)}
        return {p: (p,) for p in PROJECTIONS}


LLAMA = Family("llama", ("llama", "mistral", "ministral"), ("LlamaForCausalLM", "MistralForCausalLM",
                                                            "MinistralForCausalLM"), "llama")
FAMILIES = (
    LLAMA,
    # Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's language models (their text_config's model_type) are Qwen2's and Qwen3's
    Family("qwen2", ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text"), ("Qwen2ForCausalLM",), "qwen2", qkv_bias=True,
           sliding_layers="from_max_window_layers"),
    Family("qwen3", ("qwen3", "qwen3_vl_text"), ("Qwen3ForCausalLM",), "qwen3", qk_norm=True,
           sliding_layers="from_max_window_layers"),
    Family("gemma", ("gemma",), ("GemmaForCausalLM",), "gemma", unit_offset_norms=True, activation="gelu_tanh",
           scaled_embeddings=True),
    Family("gemma2", ("gemma2",), ("Gemma2ForCausalLM",), "gemma2", unit_offset_norms=True, sandwich_norms=True,
           activation="gelu_tanh", scaled_embeddings=True, sliding_layers="every_other"),
    Family("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), "gemma3", qk_norm=True, unit_offset_norms=True,
           sandwich_norms=True, activation="gelu_tanh", scaled_embeddings=True, sliding_layers="pattern",
           local_rope_base=True),
    Family("phi3", ("phi3",), ("Phi3ForCausalLM",), "phi3", fused_projections=True, partial_rope=True),
    Family("olmo2", ("olmo2",), ("Olmo2ForCausalLM",), "olmo2", sandwich_norms=True, pre_norms=False,
           whole_qk_norm=True),
    # OLMo 3: OLMo 2's layer, three sliding layers to one global; llama.cpp files it as olmo2 with windows
    Family("olmo3", ("olmo3",), ("Olmo3ForCausalLM",), "olmo2", sandwich_norms=True, pre_norms=False,
           whole_qk_norm=True, sliding_layers="pattern", window_pattern=4, local_rope_base=True),
    Family("smollm3", ("smollm3",), ("SmolLM3ForCausalLM",), "smollm3", sliding_layers="nope_layers", nope_interval=4),
    Family("granite", ("granite",), ("GraniteForCausalLM",), "granite"),
    # Qwen3.5: Gated DeltaNet (linear attention, ModelConfig.linear_attention) in three layers of four, gated
    # full attention with q/k norms and a quarter of each head rotated in the fourth; (1 + w) norms
    Family("qwen3_5", ("qwen3_5_text",), ("Qwen3_5ForCausalLM",), "qwen35", qk_norm=True, unit_offset_norms=True,
           partial_rope=True, rotary_fraction=0.25, gated_attention=True),
    # mixture-of-experts MLPs (ModelConfig.moe); llama.cpp files Mixtral as "llama" with experts
    Family("mixtral", ("mixtral",), ("MixtralForCausalLM",), "llama"),
    Family("qwen2_moe", ("qwen2_moe",), ("Qwen2MoeForCausalLM",), "qwen2moe", qkv_bias=True,
           sliding_layers="from_max_window_layers"),
    Family("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), "qwen3moe", qk_norm=True,
           sliding_layers="from_max_window_layers"),
)


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP in every layer (Mixtral, Qwen2-MoE, Qwen3-MoE): a router [experts,
    hidden] scores each token, softmax in float32, and its top_k experts (SwiGLU MLPs of expert_size)
    run on it, their outputs summed by those probabilities (renormalized to sum 1 where ``normalize``).
    Qwen2-MoE adds a dense shared expert on every token, scaled by sigmoid(x . shared_gate)."""
    num_experts: int
    top_k: int
    expert_size: int
    normalize: bool
    shared_size: int = 0          # the shared expert's intermediate size; 0: none

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"the model routes each token to {self.top_k} of {self.num_experts} experts")


@dataclass(frozen=True)
class LinearAttention:
    """Qwen3.5's Gated DeltaNet layers: q, k (num_k_heads) and v (num_v_heads) from in_proj_qkv through a
    causal depthwise conv1d of conv_kernel taps and SiLU; per v head a recurrent state [k_head_dim,
    v_head_dim] decayed by exp(g) and updated by the delta rule with rate beta; the read RMS-normed and
    gated by SiLU(z) before out_proj. Each sequence carries its conv window and its states (LinearStates)."""
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or {"rope_type": one of ROPE_TYPES, "factor": ..., ...} as in HF config.json
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # name clients see in /v1/models and the PEFT base_model_name_or_path we expect, when known
    name: str = "model"
    family: Family = LLAMA
    attn_scale: float | None = None        # the scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None      # Gemma 2: scores -> tanh(scores / cap) * cap before the mask
    final_softcap: float | None = None     # Gemma 2: the same on the logits
    # per layer, its sliding window (a query sees the last `window` positions, its own included), None
    # for global attention; an empty list: every layer global
    layer_windows: list[int | None] = field(default_factory=list)
    # Gemma 3, OLMo 3: the sliding layers' RoPE base (plain RoPE); None: they rotate as the others
    rope_local_theta: float | None = None
    # Phi-4-mini: RoPE on each head's first rotary_dim dimensions only (partial_rotary_factor); None: on all
    rotary_dim: int | None = None
    # SmolLM3: per layer, True where it applies no RoPE; empty: every layer rotates
    nope_layers: list[bool] = field(default_factory=list)
    # Granite: embeddings times embedding_multiplier, each attention and MLP output times
    # residual_multiplier before its residual add, logits divided by logits_scaling
    embedding_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # a mixture-of-experts MLP in every layer; intermediate_size is then its shared expert's (the dense
    # MLP that LoRA on gate/up/down_proj adapts), or, with none, the experts' (nothing dense to adapt)
    moe: MoeConfig | None = None
    # a multimodal checkpoint's language model: the modules outside it (loader_hf.TOWERS), whose LoRA an
    # adapter may carry and text never runs; empty for a text model
    towers: tuple[str, ...] = ()
    # Qwen3.5: per layer, True where it is linear attention (Gated DeltaNet: no q/k/v/o, no KV); the
    # others are full attention. Empty: every layer attends.
    linear_layers: list[bool] = field(default_factory=list)
    linear_attention: LinearAttention | None = None

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def local_rope(self, layer: int) -> bool:
        """Whether the layer rotates with Rope's local tables: SmolLM3's NoPE layers (identity tables),
        else the sliding layers (Gemma 3's own base; the other families' local tables are the global ones)."""
        return self.nope_layers[layer] if self.nope_layers else self.window(layer) is not None

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def q_proj_size(self) -> int:
        """q_proj's outputs: the queries, and with gated attention each head's gate after its query."""
        return self.q_size * (2 if self.family.gated_attention else 1)

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def kv_layers(self) -> int:
        """The layers that keep KV in the pool's pages: all but the linear-attention ones."""
        return self.num_layers - sum(self.linear_layers)

    def state_indices(self) -> list[int]:
        """Per layer, an attention layer's index among the kv_layers, a linear-attention layer's among those."""
        counts, indices = [0, 0], []
        for layer in range(self.num_layers):
            kind = int(self.is_linear(layer))
            indices.append(counts[kind])
            counts[kind] += 1
        return indices

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def dense_mlp(self) -> bool:
        """Whether the layers have a dense MLP (gate_up and down projection groups): all but the
        mixture-of-experts models without a shared expert."""
        return self.moe is None or self.moe.shared_size > 0

    def mlp_module(self) -> str:
        """Where PEFT finds the dense MLP's projections in a layer: mlp, or Qwen2-MoE's mlp.shared_expert."""
        return "mlp.shared_expert" if self.moe is not None else "mlp"

    def peft_modules(self) -> dict[str, tuple[str, ...]]:
        """The family's PEFT modules (Family.peft_modules) that this model's layers have."""
        modules = self.family.peft_modules()
        if not self.dense_mlp:
            mlp = set(GROUPS["gate_up"] + GROUPS["down"])
            modules = {m: projs for m, projs in modules.items() if not set(projs) & mlp}
        return modules

    def lora_projections(self) -> tuple[str, ...]:
        """The projections an adapter's tables have a column for, in order: PROJECTIONS, then with a
        mixture of experts each expert's (EXPERT_PROJECTIONS), named experts.{e}.{projection} (expert
        e's gate_proj is column expert_column(e)), then the router (column expert_column(experts))
        and a shared expert's gate (the next)."""
        if self.moe is None:
            return PROJECTIONS
        experts = tuple(f"experts.{e}.{p}" for e in range(self.moe.num_experts) for p in EXPERT_PROJECTIONS)
        return PROJECTIONS + experts + ("router",) + ("shared_expert_gate",) * (self.moe.shared_size > 0)

    @staticmethod
    def expert_column(expert: int) -> int:
        """The tables' column of an expert's gate_proj (up_proj and down_proj follow it); of the router
        for expert = the number of experts."""
        return len(PROJECTIONS) + len(EXPERT_PROJECTIONS) * expert

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable projection (lora_projections' names)."""
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (h, self.q_proj_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if self.moe is not None:
            e = self.moe.expert_size
            expert = {"gate_proj": (h, e), "up_proj": (h, e), "down_proj": (e, h),
                      "router": (h, self.moe.num_experts), "shared_expert_gate": (h, 1)}
            names = self.lora_projections()[len(PROJECTIONS):]
            shapes.update({name: expert[name.rpartition(".")[2]] for name in names})
        return shapes


# Weight names every loader produces (HF Llama naming, float32 or the file's float dtype, un-permuted):
#   model.embed_tokens.weight                      [vocab, hidden]
#   model.layers.{i}.input_layernorm.weight         [hidden]
#   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight [out, in]
#   model.layers.{i}.post_attention_layernorm.weight [hidden]
#   model.layers.{i}.mlp.{gate,up,down}_proj.weight   [out, in]
#   model.norm.weight                               [hidden]
#   lm_head.weight                                  [vocab, hidden]   (absent when tie_word_embeddings)
# and as the family has them (HF names; a fused checkpoint's qkv_proj / gate_up_proj come split):
#   model.layers.{i}.self_attn.{q,k,v}_proj.bias     [out]             qkv_bias
#   model.layers.{i}.self_attn.{q,k}_norm.weight     [head_dim]        qk_norm
#   model.layers.{i}.{pre,post}_feedforward_layernorm.weight [hidden]  sandwich_norms (Gemma: then
#       post_attention_layernorm is the attention output's norm, pre_feedforward_layernorm the MLP input's)
# and with a mixture of experts (moe), in place of the mlp's (Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2
# and block_sparse_moe.gate come under these names):
#   model.layers.{i}.mlp.gate.weight                 [experts, hidden]  the router
#   model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight [out, in]
#   model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight [out, in]  shared_size > 0
#   model.layers.{i}.mlp.shared_expert_gate.weight   [1, hidden]        shared_size > 0
