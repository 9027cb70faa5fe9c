"""Base projections y = x W^T for a fixed checkpoint weight W [out, in], in the fastest form the device has.

Decode steps multiply 1..64 rows by every weight once, so the step is bound by how fast the GEMM
streams weights. On CPU, oneDNN with the weight reordered once into its blocked layout streams
1.5-2.4x faster than MKL's F.linear at 16 rows (lm_head [16x576]x[576x49152]: 9.8 vs 23.8 ms on
the AVX2 EPYC of BENCHMARKS.md). The native kernels (kernels/cpu/gemm.h) overlap the weight stream
with the arithmetic that oneDNN runs after it: on CPUs with AVX512-BF16, bf16 at 1.15-1.9x oneDNN at
16 rows and faster at 1..256 rows; on AVX2 CPUs without AVX-512, float32 (BENCHMARKS.md). cuBLAS
takes the checkpoint layout at full speed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels.cpu as cpu_kernels
from asyncserve.model import hugepages

log = logging.getLogger(__name__)


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


class NativeLinear(Linear):
    """W packed once for kernels/cpu/gemm.h as [ceil(out / 16), in / per_lane, 16, per_lane]: 16 output
    columns per block, each column's 32-bit lane holding per_lane consecutive inputs (bf16: a pair,
    float32: one); only the packed copy is kept."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.weight = self.pack(weight)

    # the packed weights share huge pages: every decode step streams all of them
    arena = hugepages.Arena()

    @classmethod
    def pack(cls, weight: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        blocks, per_lane = -(-out_features // 16), 4 // weight.element_size()
        padded = torch.zeros(blocks * 16, in_features, dtype=weight.dtype, device=weight.device)
        padded[:out_features] = weight
        packed = cls.arena.take(padded.numel(), weight.dtype).view(blocks, in_features // per_lane, 16, per_lane)
        return packed.copy_(padded.view(blocks, 16, in_features // per_lane, per_lane).permute(0, 2, 1, 3))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.packed_linear(x, self.weight, self.out_features)   # x: [T, in] -> [T, out]

    def dense_weight(self) -> torch.Tensor:
        blocks = self.weight.shape[0]
        return self.weight.permute(0, 2, 1, 3).reshape(blocks * 16, self.in_features)[:self.out_features]


def native_packs(weight: torch.Tensor) -> bool:
    """Whether NativeLinear runs for this weight here: bf16 (even in_features) on a CPU whose build has
    the AVX512-BF16 GEMM, or float32 on one whose build has the AVX2 fp32 GEMM."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.bfloat16:
        return weight.shape[1] % 2 == 0 and cpu_kernels.bf16_gemm_available()
    return weight.dtype == torch.float32 and cpu_kernels.fp32_gemm_available()


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
    if native_packs(weight):
        return NativeLinear(weight.contiguous())
    if onednn_packs(weight.device, weight.dtype):
        return OneDnnLinear(weight.contiguous())
    return Linear(weight.contiguous())


# the ggml types quant.h runs: bytes per block, and the byte offsets of each block's fp16 scales
# (Q4_0, Q8_0: d; Q4_1: d, m; Q4_K, Q5_K: d, dmin; Q6_K: d at the end)
QUANT_BLOCKS = {2: (18, (0,)), 3: (20, (0, 2)), 8: (34, (0,)), 12: (144, (0, 2)), 13: (176, (0, 2)), 14: (210, (208,))}


_PANEL_ARENA = hugepages.Arena()


def _panels_on_huge_pages(blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """blocks repacked into panels (cpu_kernels.to_panels) on huge pages (hugepages.Arena): every step streams
    them from DRAM, and on 4 KiB pages that is a page walk every 4 KiB (one stream of a 1B Q4_K_M file on an
    AMX Xeon: its projections 1.2x faster; BENCHMARKS.md)."""
    shape = (blocks.shape[0], cpu_kernels.panel_bytes(qtype, in_features))
    out = _PANEL_ARENA.take(shape[0] * shape[1], torch.uint8).view(shape)
    return cpu_kernels.to_panels(blocks, qtype, in_features, out=out)


@dataclass
class QuantizedWeight:
    """A [out, in] weight kept in GGUF blocks: parts stacked by output rows, each a [out_i, bytes per row]
    uint8 tensor of the file's blocks of ggml type ``type`` (an int: gguf.GGMLQuantizationType)."""
    parts: list[tuple[torch.Tensor, int]]
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return sum(blocks.shape[0] for blocks, _ in self.parts), self.in_features

    @property
    def nbytes(self) -> int:
        return sum(blocks.numel() for blocks, _ in self.parts)

    def dim(self) -> int:
        return 2

    def split(self, sizes: list[int]) -> list[QuantizedWeight]:
        """Rows of a one-part weight split as torch.Tensor.split does (a fused checkpoint's q/k/v), as views."""
        (blocks, qtype), = self.parts
        return [QuantizedWeight([(rows, qtype)], self.in_features) for rows in blocks.split(sizes)]

    @staticmethod
    def cat(weights: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of weights stacked (fused q/k/v, gate/up): their parts in order, not copied (the kernel
        takes a list of parts)."""
        return QuantizedWeight([p for w in weights for p in w.parts], weights[0].in_features)

    def nonfinite_scales(self) -> int:
        """How many blocks have a NaN or infinite fp16 scale (d, Q4_1's m, the K-quants' dmin); the
        K-quants' sub-block scales are integers."""
        count = 0
        for blocks, qtype in self.parts:
            size, offsets = QUANT_BLOCKS[qtype]
            scale_bytes = [o + i for o in offsets for i in (0, 1)]
            bits = blocks.reshape(-1, size)[:, scale_bytes].view(torch.int16)   # [blocks, scales] fp16 bits
            count += int(((bits & 0x7C00) == 0x7C00).any(1).sum())            # exponent all ones: NaN or inf
        return count

    def in_panels(self) -> QuantizedWeight:
        """The same weight with its Q4_0, Q4_1, Q4_K, Q5_K and Q6_K parts (out a multiple of 8) repacked into panels of 8
        columns (cpu_kernels.PANEL_TYPES) where the build runs them: the same bits, which quant_linear's
        tiles read without building a panel per call, at any row count; the other parts as they are."""
        if not cpu_kernels.quant_panels():
            return self
        return QuantizedWeight([(_panels_on_huge_pages(blocks, qtype, self.in_features), cpu_kernels.PANEL_TYPES[qtype])
                                if qtype in cpu_kernels.PANEL_TYPES and blocks.shape[0] % 8 == 0 else (blocks, qtype)
                                for blocks, qtype in self.parts], self.in_features)

    def gguf_parts(self) -> list[tuple[torch.Tensor, int]]:
        """The parts as GGUF blocks (panels repacked back, bit for bit)."""
        ggml = {panels: qtype for qtype, panels in cpu_kernels.PANEL_TYPES.items()}
        return [(cpu_kernels.from_panels(blocks, qtype, self.in_features), ggml[qtype]) if qtype in ggml
                else (blocks, qtype) for blocks, qtype in self.parts]

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32 by gguf.quants' reference dequantization."""
        import gguf

        return torch.cat([torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(qtype)))
                          for blocks, qtype in self.gguf_parts()]).reshape(self.shape)


class QuantLinear(Linear):
    """W kept in its GGUF blocks (QuantizedWeight), applied by kernels/cpu/quant.h with int8 activations;
    ``nbytes`` is the blocks' size. x and y in the activation dtype (fp32 or bf16). Where the build runs
    panels (AVX2), Q4_0, Q4_1, Q4_K, Q5_K and Q6_K parts are repacked into them once here
    (QuantizedWeight.in_panels), unless ``panels`` is False (a head tied to the embedding table: it holds
    the one copy of the bits, in panels already where they run)."""

    def __init__(self, weight: QuantizedWeight, panels: bool = True):
        self.weight = weight.in_panels() if panels else weight
        self.out_features, self.in_features = weight.shape
        self.nbytes = self.weight.nbytes
        self._blocks = [blocks for blocks, _ in self.weight.parts]
        self._types = [qtype for _, qtype in self.weight.parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.quant_linear(x, self._blocks, self._types)   # x: [T, in] -> [T, out]

    def dense_weight(self) -> torch.Tensor:
        """W dequantized, [out, in] float32 (the blocks' exact values)."""
        return self.weight.dequantize()


class QuantEmbedding:
    """A [vocab, hidden] embedding table kept in its GGUF blocks (one QuantizedWeight part): a lookup
    dequantizes only the rows it gathers (kernels/cpu/quant.h), to ``dtype``; the table may be in panels
    (QuantizedWeight.in_panels). A tied head is a QuantLinear over the same blocks."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        (self.blocks, self.qtype), = weight.parts
        self.weight, self.dtype, self.device = weight, dtype, self.blocks.device
        self.shape, self.nbytes = weight.shape, weight.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.quant_rows(self.blocks, self.qtype, ids, self.weight.in_features, self.dtype)  # [T] -> [T, hidden]


def make_embedding(weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor | QuantEmbedding:
    """The token embedding table: GGUF blocks stay blocks where QuantLinear runs (rows dequantized at
    lookup); elsewhere, and for a dense checkpoint, a [vocab, hidden] tensor in ``dtype``."""
    if isinstance(weight, QuantizedWeight):
        if quant_kernels_available(device):   # in panels where they run: a head tied to it reads this copy
            return QuantEmbedding(weight.in_panels(), dtype)
        weight = weight.dequantize()
    return weight.to(device=device, dtype=dtype).contiguous()


def quant_kernels_available(device: torch.device) -> bool:
    """Whether QuantLinear runs here: a CPU with the native kernels built (and not turned off)."""
    return device.type == "cpu" and not cpu_kernels.disabled() and cpu_kernels.library() is not None


_dequantized_logged = False


def make_weight_linear(weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, device: torch.device,
                       panels: bool = True) -> Linear:
    """A projection over a checkpoint weight, dense or GGUF blocks: blocks stay blocks where
    QuantLinear runs (CPU, native kernels built; ``panels``: see QuantLinear); elsewhere they are
    dequantized to ``dtype`` (logged once)."""
    global _dequantized_logged
    if isinstance(weight, QuantizedWeight):
        if quant_kernels_available(device):
            return QuantLinear(weight, panels)
        if not _dequantized_logged:
            _dequantized_logged = True
            log.warning("quantized weights are dequantized to %s: the native quantized kernels do not run on %s (%s)",
                        dtype, device, cpu_kernels.error() or "ASYNCSERVE_NATIVE=0" if device.type == "cpu"
                        else "CPU only")
        weight = weight.dequantize()
    return make_linear(weight.to(device=device, dtype=dtype).contiguous())
