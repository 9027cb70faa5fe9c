"""An HF checkpoint's weights quantized at load (--quantize) into GGUF blocks for QuantLinear, by the gguf
package's quantizers, bit for bit ggml's reference ones (quantize_row_q8_0_ref, quantize_row_q4_0_ref): the
blocks llama.cpp's converter would write. The projections take the type asked for; the embeddings and the
head Q8_0 with either (llama.cpp keeps its output tensor at a higher precision than a Q4_0 file's
projections, too)."""
from __future__ import annotations

import gguf
import numpy as np
import torch

from asyncserve.model.checkpoint import LoadedModel
from asyncserve.model.config import ModelLoadError
from asyncserve.model.linear import QuantizedWeight

QUANTIZE_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}  # --quantize
_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def quantize_weights(loaded: LoadedModel, kind: str) -> None:
    """loaded.weights' projections, embeddings and head replaced, in place, by their blocks."""
    for name, weight in loaded.weights.items():
        if not (name.endswith("_proj.weight") or name in _TABLES):
            continue
        if weight.shape[1] % 32:
            raise ModelLoadError(f"{loaded.source}: tensor {name} has {weight.shape[1]} inputs, not a multiple of "
                                 f"the 32-weight blocks of --quantize {kind}")
        qtype = gguf.GGMLQuantizationType.Q8_0 if name in _TABLES else QUANTIZE_TYPES[kind]
        loaded.weights[name] = blocks = quantized(weight, qtype)
        if blocks.nonfinite_scales():         # entries beyond fp16's range times 127 (Q8_0) or 8 (Q4_0)
            raise ModelLoadError(f"{loaded.source}: tensor {name} has entries too large for {qtype.name}'s fp16 "
                                 "block scales; serve it without --quantize")


def quantized(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> QuantizedWeight:
    """weight: [out, in] -> its blocks of qtype (from its float32 values, as llama.cpp's converter takes them)."""
    with np.errstate(over="ignore"):     # an fp16 scale out of range: quantize_weights refuses the tensor
        blocks = gguf.quants.quantize(weight.float().numpy(), qtype)   # [out, in / 32 * bytes] uint8
    return QuantizedWeight([(torch.from_numpy(np.ascontiguousarray(blocks)), int(qtype))], weight.shape[1])
