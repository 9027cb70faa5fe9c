"""Tensor parallelism's split of one decoder over N ranks (Megatron-LM, S-LoRA §6).

Every rank holds a 1/N shard of every layer and runs the same forward over it:

* q/k/v and gate/up are column-parallel: a rank holds its slice of their output rows (its heads and
  KV heads, a KV head never split; its slice of the intermediate size), and their biases' slices.
  Attention needs nothing from other ranks (its heads' K/V are its own), nor does the activation.
* o and down are row-parallel: a rank holds its slice of their input columns and computes a partial
  sum of their outputs; the ranks all-reduce it (the only communication of a layer: two
  all-reduces of [tokens, hidden]). A row-parallel bias would be added on rank 0 alone (no family
  here has one).
* Norms, q/k head norms (one [head_dim] weight for every head) and the embeddings are replicated;
  the final norm and lm_head are needed only where logits are computed (rank 0).

``shard_ranges`` says which slices of a checkpoint tensor (HF names, before or after a fused Phi-3
qkv_proj / gate_up_proj is split) a rank holds, so a loader reads only those; ``shard_weights``
applies it to tensors already read (GGUF, kept-quantized blocks included).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from asyncserve.model.config import ModelConfig, ModelLoadError
from asyncserve.model.linear import QuantizedWeight


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    @property
    def head(self) -> bool:
        """Whether this rank computes logits (final norm and lm_head)."""
        return self.rank == 0


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The decoder one rank runs: heads, KV heads and intermediate size divided by ``world``."""
    if world == 1:
        return config
    if config.moe is not None:
        raise ModelLoadError(f"--tensor-parallel {world}: model {config.name} is a mixture of experts, which "
                             "asyncserve serves on one device (its experts are not sharded)")
    if config.linear_layers:
        raise ModelLoadError(f"--tensor-parallel {world}: model {config.name} has linear-attention layers "
                             f"({config.family.name}), which asyncserve serves on one device")
    if config.family.whole_qk_norm:
        raise ModelLoadError(f"--tensor-parallel {world}: model {config.name} norms q and k over all heads "
                             f"({config.family.name}), which a rank holding some heads cannot; serve it on one device")
    for what, n in (("attention heads", config.num_heads), ("key/value heads", config.num_kv_heads),
                    ("intermediate size", config.intermediate_size)):
        if n % world:
            raise ModelLoadError(f"--tensor-parallel {world}: model {config.name} has {n} {what}, not a multiple "
                                 f"of {world} (a rank holds whole heads, and a KV head is never split)")
    return replace(config, num_heads=config.num_heads // world, num_kv_heads=config.num_kv_heads // world,
                   intermediate_size=config.intermediate_size // world)


# (suffix of the HF name, dim it splits along, its sections as multiples of (q, kv, intermediate) sizes)
_COLUMN = {"self_attn.q_proj.weight": (1, 0, 0), "self_attn.k_proj.weight": (0, 1, 0),
           "self_attn.v_proj.weight": (0, 1, 0), "self_attn.q_proj.bias": (1, 0, 0),
           "self_attn.k_proj.bias": (0, 1, 0), "self_attn.v_proj.bias": (0, 1, 0),
           "mlp.gate_proj.weight": (0, 0, 1), "mlp.up_proj.weight": (0, 0, 1)}
_FUSED = {"self_attn.qkv_proj.weight": ((1, 0, 0), (0, 1, 0), (0, 1, 0)),
          "mlp.gate_up_proj.weight": ((0, 0, 1), (0, 0, 1))}
_ROW = {"self_attn.o_proj.weight": (1, 0, 0), "mlp.down_proj.weight": (0, 0, 1)}
# the LoRA-targetable projections (model/config.py PROJECTIONS) split along their inputs; the others along their outputs
ROW_PARALLEL = ("o_proj", "down_proj")


def shard_ranges(name: str, config: ModelConfig, shard: Shard) -> tuple[int, list[tuple[int, int]]] | None:
    """(dim, [(start, end), ...]): the index ranges along ``dim`` of the full tensor ``name`` that the rank
    holds, concatenated in order; None: the whole tensor (replicated)."""
    if shard.world == 1 or not name.startswith("model.layers."):
        return None
    suffix = name.split(".", 3)[3]
    sizes = (config.q_size, config.kv_size, config.intermediate_size)

    def size(mult: tuple[int, int, int]) -> int:
        return sum(m * s for m, s in zip(mult, sizes))

    if suffix in _ROW:
        dim, sections = 1, [size(_ROW[suffix])]
    elif suffix in _COLUMN:
        dim, sections = 0, [size(_COLUMN[suffix])]
    elif suffix in _FUSED:
        dim, sections = 0, [size(m) for m in _FUSED[suffix]]
    else:
        return None
    ranges, start = [], 0
    for n in sections:
        part = n // shard.world
        ranges.append((start + shard.rank * part, start + (shard.rank + 1) * part))
        start += n
    return dim, ranges


def take_ranges(t: torch.Tensor | QuantizedWeight, dim: int, ranges: list[tuple[int, int]],
                name: str) -> torch.Tensor | QuantizedWeight:
    """The ranges of t along dim, concatenated (a copy, so the full tensor can be freed)."""
    if isinstance(t, QuantizedWeight):
        return _take_blocks(t, dim, ranges, name)
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim).clone()


def _take_blocks(w: QuantizedWeight, dim: int, ranges: list[tuple[int, int]], name: str) -> QuantizedWeight:
    """GGUF blocks: whole rows (column-parallel) or, along the input, whole blocks (row-parallel)."""
    import gguf

    (blocks, qtype), = w.parts
    if dim == 0:
        return QuantizedWeight([(torch.cat([blocks[a:b] for a, b in ranges]).clone(), qtype)], w.in_features)
    elements, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    (a, b), = ranges
    if a % elements or b % elements:
        raise ModelLoadError(f"{name} is kept in {gguf.GGMLQuantizationType(qtype).name} blocks of {elements} "
                             f"inputs; its slice [{a}, {b}) of the inputs under tensor parallelism does not fall on "
                             "block boundaries: serve with fewer ranks or without --keep-quantized")
    return QuantizedWeight([(blocks[:, a // elements * nbytes:b // elements * nbytes].contiguous(), qtype)], b - a)


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor | QuantizedWeight], shard: Shard) -> None:
    """Replace each tensor of ``weights`` (HF names, full tensors of ``config``) by the rank's slices, in
    place; the rank that computes no logits drops lm_head."""
    if shard.world == 1:
        return
    if not shard.head:
        weights.pop("lm_head.weight", None)
    for name, t in weights.items():
        ranges = shard_ranges(name, config, shard)
        if ranges is not None:
            weights[name] = take_ranges(t, *ranges, name)
