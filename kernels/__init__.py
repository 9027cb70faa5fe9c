"""Triton kernels for heterogeneous-rank batched LoRA over the unified paged pool.

Every kernel reads adapter weights in place from ``pool.flat`` through per-row element offsets
(``a_ptr[i, j]``: row j of A, ``in`` elements; ``b_ptr[i, j]``: row j of B^T, ``out`` elements),
runs adapters of different ranks in one launch, and computes

    y[t, :] += scaling[a] * (x[t] @ A_a[:r_a]^T) @ B^T_a[:r_a]     for tokens t of adapter a >= 0

as a shrink into an fp32 scratch ``s [T, R]`` then an expand, accumulating in fp32.

    decode (one token per row):  mbgmv_shrink / mbgmv_expand   (S-LoRA MBGMV, work ~ sum of ranks)
                                 bgmv_shrink / bgmv_expand     (padded BGMV, work ~ |S| * max rank)
    segments of tokens:          sgmv_shrink / sgmv_expand     (Punica SGMV, split-K shrink)
                                 mbgmm_shrink / mbgmm_expand   (S-LoRA MBGMM, per-tile grid)

Triton has no CPU backend: without CUDA, the interpreter is switched on here (it must be set
before any @triton.jit module is imported), so the kernels run on CPU tensors, slowly.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.mbgmm import MbgmmTiles, mbgmm_expand, mbgmm_shrink, mbgmm_tiles  # noqa: E402
from kernels.mbgmv import bgmv_expand, bgmv_shrink, mbgmv_expand, mbgmv_shrink  # noqa: E402
from kernels.sgmv import sgmv_expand, sgmv_shrink  # noqa: E402

KERNELS = ("mbgmv", "bgmv", "sgmv", "mbgmm")


def lora_apply(kernel: str, x: torch.Tensor, y: torch.Tensor, flat: torch.Tensor,
               a_ptr: torch.Tensor, b_ptr: torch.Tensor, ranks: torch.Tensor, scaling: torch.Tensor,
               s: torch.Tensor, *, token_adapter: torch.Tensor | None = None,
               seg_starts: torch.Tensor | None = None, seg_adapter: torch.Tensor | None = None,
               tiles: MbgmmTiles | None = None, split_k: int | None = None) -> None:
    """Shrink then expand with one kernel family: y += LoRA(x) for one (layer, projection).

    mbgmv/bgmv need token_adapter [T]; sgmv needs seg_starts [S+1] and seg_adapter [S];
    mbgmm needs tiles (mbgmm_tiles). s: float32 scratch [>=T, >=R].
    """
    if kernel in ("mbgmv", "bgmv"):
        padded = kernel == "bgmv"
        mbgmv_shrink(x, flat, a_ptr, ranks, token_adapter, s, split_k=split_k, padded=padded)
        mbgmv_expand(s, flat, b_ptr, ranks, scaling, token_adapter, y, padded=padded)
    elif kernel == "sgmv":
        sgmv_shrink(x, flat, a_ptr, ranks, seg_starts, seg_adapter, s, split_k=split_k)
        sgmv_expand(s, flat, b_ptr, ranks, scaling, seg_starts, seg_adapter, y)
    elif kernel == "mbgmm":
        mbgmm_shrink(x, flat, a_ptr, ranks, tiles, s)
        mbgmm_expand(s, flat, b_ptr, ranks, scaling, tiles, y)
    else:
        raise ValueError(f"unknown LoRA kernel {kernel!r}; expected one of {KERNELS}")


__all__ = [
    "KERNELS", "MbgmmTiles", "bgmv_expand", "bgmv_shrink", "lora_apply", "mbgmm_expand",
    "mbgmm_shrink", "mbgmm_tiles", "mbgmv_expand", "mbgmv_shrink", "sgmv_expand", "sgmv_shrink",
]
