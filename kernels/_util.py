"""Launch helpers shared by the LoRA kernels."""
from __future__ import annotations

import functools
import os

import torch
import triton

# Read once, like triton.jit does when the kernel modules are imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_in_fp32(x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """Whether tl.dot runs on fp32 operands (IEEE) instead of the 16-bit weight dtype.

    fp32 models keep fp32 accuracy (no TF32); mixed dtypes need a common type; and the interpreter
    (triton 3.9) computes bf16 dots wrongly, so it gets fp32 operands too (exact products of the
    bf16 values, fp32 sums, like the tensor-core path)."""
    return INTERPRET or w_dtype == torch.float32 or x_dtype != w_dtype


def block_size(n: int, cap: int) -> int:
    """Power-of-two tile edge covering n, at least 16 (tl.dot's minimum) and at most cap."""
    return max(16, min(cap, triton.next_power_of_2(n)))


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_split_k(device: torch.device, programs: int, k_blocks: int) -> int:
    """Split the reduction so the grid holds about two waves of programs (Punica's split-K)."""
    if device.type != "cuda" or programs == 0 or k_blocks < 4:
        return 1          # a short reduction is not worth the atomics and the extra zeroing launch
    target = 2 * num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(k_blocks, -(-target // programs)))


def check_scratch(s: torch.Tensor, tokens: int, r: int) -> None:
    if s.dtype != torch.float32 or s.dim() != 2 or s.shape[0] < tokens or s.shape[1] < r or s.stride(1) != 1:
        raise ValueError(f"scratch s must be float32 [>= {tokens}, >= {r}] with unit column stride, "
                         f"got {s.dtype} {tuple(s.shape)} strides {s.stride()}")
