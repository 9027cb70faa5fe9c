"""Tiny random checkpoints of each supported family (transformers' own config classes) and two random
PEFT adapters on each family's target names, for tests/test_families.py and the GGUF tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reference import make_tiny_tokenizer, save_random_adapter, save_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# family -> transformers config arguments: hidden 64, GQA, windows shorter than the tests' sequences
FAMILIES = {
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False),
    "qwen2_tied": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False),
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=8,
                   query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    "gemma3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=8,
                   query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=128,
                 pad_token_id=0, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                               "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
}
# family -> two adapters: (rank, targets, rsLoRA); the first on every projection
ADAPTERS = {
    "phi3": {"all": (4, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False),
             "fused": (8, ["qkv_proj", "gate_up_proj"], True)},
}
DEFAULT_ADAPTERS = {"all": (4, ALL, False), "some": (8, ["q_proj", "v_proj", "down_proj"], True)}


@dataclass
class FamilyModel:
    family: str
    folder: Path
    tokenizer: object
    base: object                   # the transformers model (reference)
    adapters: dict[str, Path]


def build_family_model(root: Path, name: str) -> FamilyModel:
    """name: a key of FAMILIES (qwen2_tied: Qwen2 with tied embeddings)."""
    family = name.split("_")[0]
    tok = make_tiny_tokenizer()
    base = save_tiny_model(root / "base", tok, family, max_shard_size="100KB", random_vectors=True, **FAMILIES[name])
    paths = {}
    for i, (adapter, (r, targets, rslora)) in enumerate(ADAPTERS.get(family, DEFAULT_ADAPTERS).items()):
        paths[adapter] = root / "adapters" / adapter
        save_random_adapter(base, paths[adapter], r=r, targets=targets, rslora=rslora, seed=200 + i)
    return FamilyModel(family, root / "base", tok, base, paths)
