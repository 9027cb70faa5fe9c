"""PEFT LoRA adapters read from disk into host memory, validated against the base model.

Every registered adapter keeps its weights here (S-LoRA keeps all adapters in host RAM); the pager
copies them into pool pages while requests use them. Rows are stored the way the pool wants them:
A as [r, in] and B transposed, [r, out], per (layer, projection), zero-padded to one rank per
projection (rank_pattern may vary it across layers; zero rows contribute nothing).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from asyncserve.lora.batch import PROJ_INDEX, PROJECTIONS
from asyncserve.model.config import ModelConfig


class AdapterError(ValueError):
    """An adapter that cannot be served with this base model; the message says why."""


_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class HostAdapter:
    name: str
    path: str
    ranks: list[int]                     # per projection (PROJECTIONS order), 0 = not targeted
    scaling: torch.Tensor                # [L, P] float32
    a_rows: dict[tuple[int, int], torch.Tensor]   # (layer, proj) -> [r_p, in]
    b_rows: dict[tuple[int, int], torch.Tensor]   # (layer, proj) -> [r_p, out] (B transposed)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a_rows, self.b_rows) for t in d.values())

    def row_lengths(self, config: ModelConfig) -> list[int]:
        """Row lengths in pool packing order: per layer, per projection, A rows then B^T rows."""
        shapes = config.projection_shapes()
        lengths = []
        for layer in range(config.num_layers):
            for p, proj in enumerate(PROJECTIONS):
                r = self.ranks[p]
                fan_in, fan_out = shapes[proj]
                lengths += [fan_in] * r + [fan_out] * r
        return lengths


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches the module name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


@dataclass
class PeftFolder:
    """A PEFT folder's files read into memory and checked, before any tensor is built."""
    name: str
    path: str
    config: dict
    weights: bytes                       # adapter_model.safetensors


def load_peft_adapter(name: str, path: str | Path, config: ModelConfig, dtype: torch.dtype) -> HostAdapter:
    return build_host_adapter(read_peft_folder(name, path), config, dtype)


def read_peft_folder(name: str, path: str | Path) -> PeftFolder:
    """File reads and config checks only (the server runs this off the torch thread)."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {folder} is not a folder")
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"adapter {name!r}: {cfg_file} is missing (expected a PEFT LoRA folder)")
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(
                f"adapter {name!r}: only adapter_model.bin (a pickle) was found; pickles can run code and "
                "are not loaded. Re-save it with safetensors (PeftModel.save_pretrained(..., "
                "safe_serialization=True)).")
        raise AdapterError(f"adapter {name!r}: {weights_file} is missing")
    try:
        acfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not valid JSON ({e})") from None

    if acfg.get("peft_type", "LORA").upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {acfg.get('peft_type')!r} is not LORA")
    for flag, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA bias")):
        if acfg.get(flag):
            raise AdapterError(f"adapter {name!r}: {what} adapters are not supported")
    if acfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias={acfg['bias']!r} is not supported (only 'none')")
    if acfg.get("modules_to_save"):
        raise AdapterError(f"adapter {name!r}: modules_to_save {acfg['modules_to_save']} would replace base "
                           "weights; only LoRA deltas are supported")
    return PeftFolder(name, str(folder), acfg, weights_file.read_bytes())


def build_host_adapter(folder: PeftFolder, config: ModelConfig, dtype: torch.dtype) -> HostAdapter:
    """Validate the tensors against the base model and lay them out as pool rows."""
    name, acfg = folder.name, folder.config
    alpha = float(acfg.get("lora_alpha", acfg.get("r", 8)))
    use_rslora = bool(acfg.get("use_rslora", False))
    fan_in_fan_out = bool(acfg.get("fan_in_fan_out", False))
    rank_pattern = acfg.get("rank_pattern") or {}
    alpha_pattern = acfg.get("alpha_pattern") or {}

    shapes = config.projection_shapes()
    tensors: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    try:
        state = load_safetensors(folder.weights)
    except SafetensorError as e:
        raise AdapterError(f"adapter {name!r}: adapter_model.safetensors is not a valid safetensors file ({e})") from None
    for key, t in state.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} targets a module that is not supported "
                               f"(supported: {', '.join(PROJECTIONS)} of the decoder layers)")
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= config.num_layers:
            raise AdapterError(f"adapter {name!r}: {key!r} is for layer {layer}, the base model has "
                               f"{config.num_layers} layers")
        if fan_in_fan_out:
            t = t.t()
        tensors.setdefault((layer, PROJ_INDEX[proj]), {})[ab] = t
    if not tensors:
        raise AdapterError(f"adapter {name!r}: no LoRA tensors in {folder.path}/adapter_model.safetensors")

    ranks = [0] * len(PROJECTIONS)
    module_ranks: dict[tuple[int, int], int] = {}
    for (layer, p), ab in tensors.items():
        proj = PROJECTIONS[p]
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {proj} has lora_{''.join(ab)} but not both A and B")
        fan_in, fan_out = shapes[proj]
        r = ab["A"].shape[0]
        if tuple(ab["A"].shape) != (r, fan_in) or tuple(ab["B"].shape) != (fan_out, r):
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {proj} has lora_A {tuple(ab['A'].shape)} and lora_B "
                f"{tuple(ab['B'].shape)}; this base model needs A [r, {fan_in}] and B [{fan_out}, r] — "
                "was it trained for a different base model?")
        module_ranks[(layer, p)] = r
        ranks[p] = max(ranks[p], r)

    scaling = torch.zeros(config.num_layers, len(PROJECTIONS), dtype=torch.float32)
    a_rows, b_rows = {}, {}
    for (layer, p), ab in tensors.items():
        module = f"model.layers.{layer}.{'self_attn' if p < 4 else 'mlp'}.{PROJECTIONS[p]}"
        r = module_ranks[(layer, p)]
        r_cfg = _pattern_value(rank_pattern, module, acfg.get("r", r))
        if r_cfg != r:
            raise AdapterError(f"adapter {name!r}: {module} has rank {r} in the weights but {r_cfg} in the config")
        a = _pattern_value(alpha_pattern, module, alpha)
        scaling[layer, p] = a / math.sqrt(r) if use_rslora else a / r
        pad = ranks[p] - r
        a_rows[(layer, p)] = torch.nn.functional.pad(ab["A"].to(dtype), (0, 0, 0, pad)).contiguous()
        b_rows[(layer, p)] = torch.nn.functional.pad(ab["B"].t().to(dtype), (0, 0, 0, pad)).contiguous()
    # a targeted projection absent from some layers (layers_to_transform) gets zero rows there
    for layer in range(config.num_layers):
        for p, proj in enumerate(PROJECTIONS):
            if ranks[p] and (layer, p) not in a_rows:
                fan_in, fan_out = shapes[proj]
                a_rows[(layer, p)] = torch.zeros(ranks[p], fan_in, dtype=dtype)
                b_rows[(layer, p)] = torch.zeros(ranks[p], fan_out, dtype=dtype)
    return HostAdapter(name=name, path=folder.path, ranks=ranks, scaling=scaling, a_rows=a_rows, b_rows=b_rows)
