"""GGUF quantized tensors for the tests: random weights quantized by the gguf package (Q4_0, Q4_1, Q8_0),
or random blocks for the K-quants, which gguf.quants can dequantize but not quantize."""
from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
KERNEL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _set_half(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantized(shape: tuple[int, int], qtype: Q, rng: np.random.Generator, std: float = 1.0) -> np.ndarray:
    """Blocks of ``qtype`` for a [out, in] weight with entries of about ``std``: [out, in / block * bytes] uint8."""
    out, fan_in = shape
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        return gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32) * std, qtype)
    # K-quants: every quant and 6-bit scale bit random, the fp16 super-block scales chosen for ~std entries
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = out * fan_in // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype == Q.Q6_K:   # w = d * scale * (q - 32): scale int8, |q - 32| ~ 18
        _set_half(blocks, 208, rng.uniform(0.5, 1.5, n) * std / (18 * 64))
    else:                 # w = d * sc * q - dmin * m: sc, m 6-bit, q 4 or 5 bits
        top = 8 if qtype == Q.Q4_K else 16
        _set_half(blocks, 0, rng.uniform(0.5, 1.5, n) * 2 * std / (32 * top))
        _set_half(blocks, 2, rng.uniform(0.5, 1.5, n) * std / 32)
    return blocks.reshape(out, -1)


def dequantized(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """The gguf package's reference dequantization: [out, in] float32."""
    return gguf.quants.dequantize(blocks, qtype)
