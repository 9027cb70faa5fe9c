"""A llama.cpp LoRA adapter file (what ``convert_lora_to_gguf.py`` writes and ``llama-server --lora``
takes) read as a PEFT folder's contents, so that adapters.py checks and lays it out as any other.

The file is a GGUF of general.type "adapter", adapter.type "lora", whose general.architecture is the
base model's; adapter.lora.alpha is the alpha of every tensor (llama.cpp scales each by alpha / its
rank, or by 1 where alpha is 0; it has no rsLoRA). Each adapted base tensor T has T.lora_a [r, in] and
T.lora_b [out, r] (numpy order); a mixture's stacked experts [experts, r, in] and [experts, out, r].
Its names are the base GGUF's (blk.3.attn_q.weight), which loader_gguf maps to HF's; a Llama or
Mixtral file's Q and K lora_b rows come interleaved per head as the converter interleaves the base
weights, and are put back in HF's order here.

What comes back: the AdapterConfig the file implies, its tensors under PEFT's names (per expert for
the stacked experts) as float32 and their bytes laid end to end as a safetensors file's data would be.
Whatever is wrong with the file is a BadAdapterFile (adapters.py makes it an AdapterError).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import gguf
import numpy as np
import torch

from asyncserve.model.config import ModelConfig, ModelLoadError
from asyncserve.model.loader_gguf import hf_name, interleaves_qk, unpermute

GGUF_MAGIC = b"GGUF"
MAX_TENSORS = 1 << 16                 # a LoRA of every projection of a 200-layer mixture holds far fewer
_TENSOR = re.compile(r"(blk\.\d+\.\w+\.weight)\.lora_([ab])")


class BadAdapterFile(ValueError):
    """A file that is not a llama.cpp LoRA adapter for the base model; the message says why."""


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts as a GGUF file does."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf_adapter(name: str, path: Path, config: ModelConfig, weights: bool = True):
    """(alpha, tensors, data): alpha as a PEFT lora_alpha (None: llama.cpp's 1 per tensor), tensors as
    [(PEFT key, shape)] in data order, data the float32 bytes end to end (None unless ``weights``)."""
    def bad(why: str) -> BadAdapterFile:
        return BadAdapterFile(f"adapter {name!r}: {path} is not a llama.cpp LoRA adapter for this model ({why})")

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:       # the reader raises ValueError, struct errors, ... on a bad file
        raise bad(f"unreadable as GGUF: {e}") from None
    fields = reader.fields

    def value(key: str):
        field = fields.get(key)
        try:
            return None if field is None else field.contents()
        except Exception:
            raise bad(f"its {key} cannot be read") from None

    if value("general.type") != "adapter" or value("adapter.type") != "lora":
        raise bad(f"general.type {value('general.type')!r}, adapter.type {value('adapter.type')!r}; a LoRA "
                  "adapter has 'adapter' and 'lora' (is this a model file?)")
    if value("general.architecture") != config.family.gguf_architecture:
        raise bad(f"made for a {value('general.architecture')!r} model; the base model is "
                  f"{config.family.gguf_architecture!r}")
    alpha = value("adapter.lora.alpha")
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or abs(alpha) > 1e6:
        raise bad(f"adapter.lora.alpha is {alpha!r}, not a finite number")
    if len(reader.tensors) > MAX_TENSORS:
        raise bad(f"{len(reader.tensors)} tensors; at most {MAX_TENSORS}")
    pairs: dict[str, dict[str, gguf.ReaderTensor]] = {}
    for tensor in reader.tensors:
        m = _TENSOR.fullmatch(tensor.name)
        if m is None:
            raise bad(f"tensor {tensor.name!r} is not LoRA on a decoder layer's projection (LoRA on the "
                      "embeddings or the output head is not read from GGUF adapters)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor       # the reader refuses a name twice
    tensors, data = [], bytearray() if weights else None
    for base, ab in pairs.items():
        if set(ab) != {"a", "b"}:
            raise bad(f"{base} has lora_{''.join(ab)} but not both lora_a and lora_b")
        try:
            module = hf_name(base, config.family, path).removesuffix(".weight")    # model.layers.3.self_attn.q_proj
        except ModelLoadError:
            raise bad(f"{base} is not a tensor of the {config.family.name} architecture") from None
        for key, t in _peft_tensors(module, base, ab, config, weights, bad):
            tensors.append((key, tuple(t.shape)))
            if weights:
                data += t.numpy().tobytes()
    return (None if alpha == 0 else float(alpha)), tensors, data


def _peft_tensors(module: str, base: str, ab: dict, config: ModelConfig, weights: bool, bad):
    """(PEFT key, float32 tensor or its shape as an empty tensor) of one adapted base tensor: lora_A
    [r, in] and lora_B [out, r], per expert for the stacked experts (mlp.experts.gate_proj ->
    mlp.experts.{e}.gate_proj); Llama's Q/K lora_B rows back in HF's order."""
    shapes = {k: tuple(int(d) for d in reversed(t.shape)) for k, t in ab.items()}
    stacked = ".experts." in module
    if len(shapes["a"]) != 2 + stacked or len(shapes["b"]) != 2 + stacked:
        raise bad(f"{base}'s lora_a is {list(shapes['a'])} and lora_b {list(shapes['b'])}; LoRA on it has "
                  f"{2 + stacked} dimensions")
    values = {k: _floats(t, shapes[k], bad) if weights else torch.empty(shapes[k]) for k, t in ab.items()}
    if weights and interleaves_qk(config.family) and base.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_heads if base.endswith("attn_q.weight") else config.num_kv_heads
        if shapes["b"][0] % (2 * heads):
            raise bad(f"{base}'s lora_b has {shapes['b'][0]} rows, not whole heads of {heads}")
        values["b"] = unpermute(values["b"], heads)
    prefix = f"base_model.model.{module}"
    if not stacked:
        return [(f"{prefix}.lora_A.weight", values["a"]), (f"{prefix}.lora_B.weight", values["b"])]
    container, _, proj = prefix.rpartition(".")            # ...mlp.experts, gate_proj
    if shapes["a"][0] != shapes["b"][0]:
        raise bad(f"{base}'s lora_a holds {shapes['a'][0]} experts and its lora_b {shapes['b'][0]}")
    return [(f"{container}.{e}.{proj}.lora_{x.upper()}.weight", values[x][e])
            for e in range(shapes["a"][0]) for x in ("a", "b")]


def _floats(tensor: gguf.ReaderTensor, shape: tuple[int, ...], bad) -> torch.Tensor:
    """The tensor's values in float32 (F32, F16, BF16 or a quantized type the gguf package reads)."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise bad(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, which cannot be read") from None
    except Exception as e:
        raise bad(f"tensor {tensor.name} cannot be read: {e}") from None
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).reshape(shape)
