"""GGUF quantized tensors for the tests: random blocks (every bit random, for the kernels), or weights
quantized: by the gguf package (Q4_0, Q4_1, Q8_0), by the plain round-to-nearest quantizers below for the
K-quants, which gguf.quants can dequantize but not quantize (llama.cpp searches scales better; the bits
mean the same)."""
from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
KERNEL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _set_half(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """[out, in] float32 -> [out, in / block * bytes] uint8 blocks of qtype."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0):
        return gguf.quants.quantize(w, qtype)
    out = w.shape[0]
    if qtype == Q.IQ4_NL:
        return _quantize_iq4_nl(w.reshape(-1, 32).astype(np.float32)).reshape(out, -1)
    x = w.reshape(-1, 256).astype(np.float32)
    if qtype == Q.Q6_K:
        return _quantize_q6_k(x).reshape(out, -1)
    return _quantize_q45_k(x, 15 if qtype == Q.Q4_K else 31).reshape(out, -1)


# ggml's kvalues_iq4nl
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """[n, 32] -> IQ4_NL blocks [n, 18]: d = max |x| / 127, each weight its nearest level (valid blocks,
    not llama.cpp's searched scales)."""
    d = _half(np.abs(x).max(axis=1) / 127).astype(np.float32)
    safe = np.where(d == 0, 1, d)[:, None, None]
    idx = np.abs(x[:, :, None] / safe - IQ4_NL_LEVELS).argmin(axis=2).astype(np.uint8)      # [n, 32]
    blocks = np.empty((x.shape[0], 18), dtype=np.uint8)
    blocks[:, :2] = _half(d)[:, None].view(np.uint8)
    blocks[:, 2:] = idx[:, :16] | (idx[:, 16:] << 4)
    return blocks


def _half(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _quantize_q45_k(x: np.ndarray, qmax: int) -> np.ndarray:
    """w = d sc q - dmin m per chunk of 32 (sc, m 6-bit, q 4 or 5 bits)."""
    n = len(x)
    chunks = x.reshape(n, 8, 32)
    lo, hi = np.minimum(chunks.min(-1), 0), chunks.max(-1)
    scale, offset = (hi - lo) / qmax, -lo                                      # [n, 8]
    d, dmin = _half(scale.max(-1) / 63), _half(offset.max(-1) / 63)            # [n]
    sc = np.clip(np.rint(scale / np.maximum(d.astype(np.float32), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(offset / np.maximum(dmin.astype(np.float32), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    step = np.maximum(d.astype(np.float32)[:, None] * sc, 1e-30)[..., None]
    q = np.clip(np.rint((chunks + (dmin.astype(np.float32)[:, None] * m)[..., None]) / step), 0, qmax).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
    qs = ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).reshape(n, 128)     # chunk pairs share bytes
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales]
    if qmax == 31:                                                             # Q5_K: bit j of qh[i], chunk j's
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8))
    return np.concatenate(parts + [qs], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """w = d sc (q - 32) per group of 16 (sc int8, q 6 bits)."""
    n = len(x)
    groups = x.reshape(n, 16, 16)
    scale = np.abs(groups).max(-1) / 31                                        # [n, 16]
    d = _half(scale.max(-1) / 127)
    sc = np.clip(np.rint(scale / np.maximum(d.astype(np.float32), 1e-30)[:, None]), -128, 127).astype(np.int8)
    step = np.maximum(d.astype(np.float32)[:, None] * sc, 1e-30)[..., None]
    q = (np.clip(np.rint(groups / step), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)   # [n, half, j, i]
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(n, 128)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(2, dtype=np.uint8).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)


def random_blocks(shape: tuple[int, int], qtype: Q, rng: np.random.Generator, std: float = 1.0) -> np.ndarray:
    """Blocks of ``qtype`` for a [out, in] weight with entries of about ``std``: [out, in / block * bytes] uint8;
    every bit random but the fp16 scales (the gguf package's quantization for the legacy types)."""
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


EXACT_TIE = 0.01   # logits: a random tiny model's top two are this close a few times in a test's tokens


def divergence_gap(ours: list[int], ref) -> float:
    """The reference's logit gap between its token and ours where they first differ."""
    i = next(i for i, (a, b) in enumerate(zip(ours, ref.tokens)) if a != b)
    return float(ref.logits[i][ref.tokens[i]] - ref.logits[i][ours[i]])


def assert_quantized_generate_matches(llm, reference, adapters: dict, new_tokens: int, tie_tol: float) -> None:
    """Base and each adapter on two prompts in one generate call: greedy tokens equal reference's
    (transformers+PEFT on the blocks' values) but for at most one near-tie (besides exact ties, where
    the reference's top two logits are within EXACT_TIE: the int8 activations' rounding decides those),
    and the adapters' LoRA changes the tokens (it runs on top of the quantized base)."""
    from asyncserve import SamplingParams
    from reference import assert_greedy_matches, peft_references

    prompts = [llm.tokenizer.encode(p) for p in ["The quick brown fox", "def add(a, b):"]]
    cases = [(ids, a) for ids in prompts for a in [None, *adapters]]
    refs = peft_references(reference, adapters, cases, new_tokens)
    outs = llm.generate([ids for ids, _ in cases], SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                  ignore_eos=True), adapters=[a for _, a in cases])
    equal = [assert_greedy_matches(o.token_ids, ref, tie_tol, f"case {i} ({cases[i][1]})")
             for i, (o, ref) in enumerate(zip(outs, refs))]
    near_ties = [i for i, same in enumerate(equal) if not same and divergence_gap(outs[i].token_ids, refs[i]) > EXACT_TIE]
    assert len(near_ties) <= 1, (equal, near_ties)
    step = 1 + len(adapters)
    assert any(outs[i].token_ids != outs[i + 1].token_ids for i in range(0, len(cases), step))
