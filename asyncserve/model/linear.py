"""Base projections y = x W^T for a fixed checkpoint weight W [out, in], in the fastest form the device has.

Decode steps multiply 1..64 rows by every weight once, so the step is bound by how fast the GEMM
streams weights. On CPU, oneDNN with the weight reordered once into its blocked layout streams
1.5-2.4x faster than MKL's F.linear at 16 rows (lm_head [16x576]x[576x49152]: 9.8 vs 23.8 ms on
the AVX2 EPYC of BENCHMARKS.md). cuBLAS takes the checkpoint layout at full speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """W kept as given, applied with F.linear. weight: [out, in]."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)                            # x: [T, in] -> [T, out]

    def dense_weight(self) -> torch.Tensor:
        """W [out, in] exactly as given."""
        return self.weight


class OneDnnLinear(Linear):
    """W reordered once into oneDNN's blocked layout; only the reordered copy is kept
    (``dense_weight()`` gives W back exactly, e.g. to merge an adapter into it)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        return self.weight.to_dense()


def onednn_packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this CPU has oneDNN kernels for reordered weights of ``dtype``."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def make_linear(weight: torch.Tensor) -> Linear:
    """weight: [out, in] already on its device and in its dtype."""
    if onednn_packs(weight.device, weight.dtype):
        return OneDnnLinear(weight.contiguous())
    return Linear(weight.contiguous())
