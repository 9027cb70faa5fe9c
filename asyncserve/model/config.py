"""Architecture description of a Llama-family decoder, filled by the HF and GGUF loaders."""
from __future__ import annotations

import json
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
    # None, or {"rope_type": "linear"|"llama3"|"dynamic"|"yarn"|..., "factor": ..., ...} as in HF config.json
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # name clients see in /v1/models and the PEFT base_model_name_or_path we expect, when known
    name: str = "model"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable projection, PEFT module names."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


# Weight names every loader produces (HF Llama naming, float32 or the file's float dtype, un-permuted):
#   model.embed_tokens.weight                      [vocab, hidden]
#   model.layers.{i}.input_layernorm.weight         [hidden]
#   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight [out, in]
#   model.layers.{i}.post_attention_layernorm.weight [hidden]
#   model.layers.{i}.mlp.{gate,up,down}_proj.weight   [out, in]
#   model.norm.weight                               [hidden]
#   lm_head.weight                                  [vocab, hidden]   (absent when tie_word_embeddings)


# LoRA-targetable projections, PEFT module names, in the order adapters' tables use.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJ_INDEX = {name: i for i, name in enumerate(PROJECTIONS)}
# Projections that share an input run as one fused base matmul, and their LoRA as one group.
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
