"""Native CPU kernels for the decode step (C++, built on first use with torch.utils.cpp_extension).

The build is cached per source (and its folder), torch version, Python version and CPU flags under
``$XDG_CACHE_HOME/asyncserve/kernels/<key>`` (``~/.cache`` by default) and compiled with
``-march=native``, so each CPU gets its own vector width (AVX-512, AVX2, ...). ``scripts/setup.sh``
builds it ahead of the first request. Without a compiler, or if the build fails, ``library()`` is
None, the model runs its eager torch ops and the log says so once. ``ASYNCSERVE_NATIVE=0`` keeps
the model on the eager ops (``enabled_for``) without building anything; ``ASYNCSERVE_NATIVE_DECODER=0``
keeps the native kernels but runs the layer loop in Python (``decoder_loop_enabled``), as
``scripts/bench_step_split.py`` does to time each kernel.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("ops.cpp",)
# -fno-trapping-math: without AVX-512's masked ops, gcc will not turn a select next to FP arithmetic into
# a blend while FP traps count, so every loop over exp_nonpositive (softmax, SiLU, GELU, soft-capping)
# stayed scalar on AVX2 (SiLU * mul 4x slower than torch's). Nothing here reads FP exception flags.
# -fno-gnu-unique: the headers' inline variables and function statics (settings such as quant_amx_rows, the
# thread-local row buffers) would otherwise be unique symbols, which the dynamic loader merges across every
# library loaded, so two builds in one process (scripts/kernel_builds.py's --against) shared them, and crashed
# where their layouts differed.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-gnu-unique")
# -fopenmp links libgomp.so.1, which resolves to the copy torch has loaded: one OpenMP pool
LDFLAGS = ("-fopenmp",)
DTYPES = (torch.float32, torch.bfloat16)
# cpp_extension's build lock: a build holds it for a minute or two, and one killed mid-build leaves it
# behind, where torch would wait for it forever; older than this, no live build holds it
STALE_BUILD_LOCK_S = 600.0

_library: ModuleType | None = None
_error: str | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    """What the compiled library depends on: sources, flags, torch, Python and the CPU's features; and
    where the sources are, since the build files name them (two checkouts sharing one folder would
    rebuild it each time the other loads it)."""
    h = hashlib.sha256(str(SOURCE_DIR).encode())
    for path in sorted(SOURCE_DIR.glob("*.[ch]*")):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + path.read_bytes())
    for part in (CFLAGS, LDFLAGS, torch.__version__, sys.version, platform.machine(), _cpu_flags()):
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "asyncserve" / "kernels" / build_key()


def library() -> ModuleType | None:
    """The compiled kernels, built on the first call (None if they cannot be built; see error())."""
    global _library, _error, _tried
    if _tried:
        return _library
    _tried = True
    try:
        from torch.utils import cpp_extension

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        wait_for_build_lock(folder)
        with environment_ninja():
            _library = cpp_extension.load(
                name="asyncserve_cpu_kernels", sources=[str(SOURCE_DIR / s) for s in SOURCES],
                extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(folder),
                verbose=False)
        log.info("native CPU kernels loaded from %s in %.1f s", folder, time.perf_counter() - start)
    except Exception as e:   # no compiler, no ninja, a failed build: the eager path runs
        _error = f"{type(e).__name__}: {e}".strip()
        log.warning("native CPU kernels unavailable, using eager torch ops (%s)", _error.splitlines()[0])
    return _library


@contextlib.contextmanager
def environment_ninja():
    """PATH with this Python environment's ninja (the ninja package, a dependency) first, for a build.
    cpp_extension runs whichever ninja PATH finds; a system ninja and the environment's are different
    versions whose logs each distrust, so a caller with the venv activated and one without (setup.sh,
    .venv/bin/asyncserve) each rebuilt what the other had built: ~50 s at every such start, box G."""
    try:
        import ninja
        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):      # no ninja package: whichever PATH has
        yield
        return
    path = os.environ.get("PATH")
    os.environ["PATH"] = bin_dir + (os.pathsep + path if path else "")
    try:
        yield
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


def wait_for_build_lock(folder: Path, stale_s: float = STALE_BUILD_LOCK_S, poll_s: float = 1.0) -> None:
    """Return once no build holds ``folder``'s lock: when it is gone, or (removed here) once it is older
    than ``stale_s``, left by a build that was killed."""
    lock = folder / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_s:
            log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(min(poll_s, stale_s - age + 0.01))


def error() -> str | None:
    """Why library() is None, once it has been tried."""
    return _error


def disabled() -> bool:
    return os.environ.get("ASYNCSERVE_NATIVE", "1") == "0"


def enabled_for(t: torch.Tensor) -> bool:
    """Whether the model should run the native kernels on tensors like ``t`` (the weights)."""
    return t.device.type == "cpu" and t.dtype in DTYPES and not disabled() and library() is not None


def decoder_loop_enabled() -> bool:
    """Whether forward may run the layers in one native call (NativeDecoder, decoder.h)."""
    return os.environ.get("ASYNCSERVE_NATIVE_DECODER", "1") != "0"


def _lib() -> ModuleType:
    lib = library()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {_error}")
    return lib


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h: [rows, hidden]; with delta, h += delta in place. Returns rms_norm(h) * weight, new [rows, hidden].
    weight: h's dtype (torch's rms_norm's rounding steps) or float32 (Gemma's (1 + w): the product in
    float32, rounded once)."""
    return _lib().add_rms_norm(h, delta, weight, eps)


def head_rms_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
                  num_kv_heads: int, eps: float) -> None:
    """qkv: [T, (nh + 2 nkv) hd]: each q head rms-normed with q_weight [hd], each k head with k_weight, or
    (OLMo 2) q whole with q_weight [nh hd] and k whole with k_weight [nkv hd], in place (weights as
    add_rms_norm takes them); v untouched."""
    _lib().head_rms_norm(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 inter] (gate, then up) -> silu(gate) * up: [rows, inter], new."""
    return _lib().silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 inter] (gate, then up) -> F.gelu(gate, approximate="tanh") * up: [rows, inter], new."""
    return _lib().gelu_tanh_mul(gate_up)


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [rows, vocab] (fp32 or bf16) -> (tokens [rows] int64: torch's argmax, the first maximum
    or the first NaN; finite [rows] bool: whether the chosen logit is finite)."""
    return _lib().greedy_rows(logits)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_rows: torch.Tensor, write_rows: torch.Tensor, k_offset: int, v_offset: int,
                  num_heads: int, num_kv_heads: int) -> None:
    """qkv: [T, (nh + 2 nkv) hd]: RoPE on its q and k heads in place (cos, sin: [max_pos, hd] tables
    indexed by positions [T]); then K to kv_rows[write_rows + k_offset] and V to [write_rows + v_offset]."""
    _lib().rope_write_kv(qkv, positions, cos, sin, kv_rows, write_rows, k_offset, v_offset,
                        num_heads, num_kv_heads)


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, softcap: float | None = None) -> None:
    """out, q: [n, nh, hd]; k_cache, v_cache: [pages, block, nkv * hd] of one layer; block_tables:
    [n, max_pages] int64; context_lens: [n] int64. Attends each query to its first context_lens rows,
    or with a window to the last ``window`` of them; softcap: scores -> tanh(scores / cap) * cap."""
    _lib().paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale, window or 0,
                                  softcap or 0.0)


def paged_prefill_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, first_pos: torch.Tensor,
                            scale: float, window: int | None = None, softcap: float | None = None) -> None:
    """out, q: [T, nh, hd]; k_cache, v_cache: [pages, block, nkv * hd] of one layer, holding the chunks'
    own K/V already; block_tables: [chunks, max_pages] int64; query_starts: [chunks + 1] int64, chunk i's
    rows of q and out; first_pos: [chunks] int64, the position of each chunk's first row. Each row
    attends causally to its sequence's keys, with a window only to the last ``window`` positions (its
    own included); softcap as paged_decode_attention's; rows of out outside the chunks are not written."""
    _lib().paged_prefill_attention(out, q, k_cache, v_cache, block_tables, query_starts, first_pos, scale,
                                   window or 0, softcap or 0.0)


def lora_segments(y: torch.Tensor, x: torch.Tensor, flat: torch.Tensor, runs: torch.Tensor, ranks: torch.Tensor,
                  a_ptr: torch.Tensor, b_ptr: torch.Tensor, scaling: torch.Tensor, layer: int,
                  projections: torch.Tensor) -> None:
    """y: [tokens, out] += each run's LoRA of x: [tokens, in], read from the pool rows of flat: for runs
    [num_runs, 3] int64 (first token, end token, its adapter's index in the tables) and each projections
    [num_projs, 3] int64 (index in the tables, first column of y, width) its adapter targets, y[run, cols] +=
    scaling * (x[run] @ A^T) @ B. ranks [n, P] int32, a_ptr, b_ptr [n, L, P, R], scaling [n, L, P]:
    LoraBatch.tables() or SlotTables.tensors; layer picks the tables' layer."""
    _lib().lora_segments(y, x, flat, runs, ranks, a_ptr, b_ptr, scaling, layer, projections)


def lora_prefetch_lines(y: torch.Tensor, x: torch.Tensor, flat: torch.Tensor, runs: torch.Tensor,
                        ranks: torch.Tensor, a_ptr: torch.Tensor, b_ptr: torch.Tensor, scaling: torch.Tensor,
                        layer: int, projections: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """The cache lines that the native decoder's GEMM before a LoRA call asks for, for lora_segments
    with these arguments, as ``parts`` threads split them: per part, the lines' byte offsets from
    flat's first element, in the order asked (int64)."""
    return _lib().lora_prefetch_lines(y, x, flat, runs, ranks, a_ptr, b_ptr, scaling, layer, projections, parts)


def set_lora_rows_ahead(on: bool) -> bool:
    """Let the native decoder's GEMMs ask for the next LoRA call's pool rows as they compute (on at
    start), or not, to compare; returns the previous setting."""
    return _lib().set_lora_rows_ahead(on)


def bf16_gemm_available() -> bool:
    """Whether packed_linear runs bf16 here: the native kernels are on and were built for a CPU with AVX512-BF16."""
    return not disabled() and library() is not None and library().bf16_gemm_available()


def fp32_gemm_available() -> bool:
    """Whether packed_linear runs float32 here: the native kernels are on and were built for a CPU with
    AVX2 and FMA but no AVX-512 (gemm.h, packed_linear_fp32)."""
    return not disabled() and library() is not None and library().fp32_gemm_available()


def amx_gemm_available() -> bool:
    """Whether packed_linear has AMX tiles here: the build has them (a CPU with AMX-BF16) and Linux
    granted the process their state. It runs them for K a multiple of 32 while set_amx_gemm is on."""
    return bf16_gemm_available() and library().amx_gemm_available()


def set_amx_gemm(on: bool) -> bool:
    """Let packed_linear run AMX tiles where it can (on at start), or keep it on its vdpbf16ps tiles;
    returns the previous setting."""
    return _lib().set_amx_gemm(on)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x: [rows, in] bf16 (in even) or float32 -> x W^T: [rows, out_features] of x's dtype, for W packed by
    asyncserve.model.linear.NativeLinear as [ceil(out / 16), in / 2, 16, 2] (bf16) or [ceil(out / 16), in,
    16, 1] (float32); where bf16_gemm_available() or fp32_gemm_available() says so for that dtype."""
    return _lib().packed_linear(x, packed, out_features)


def native_decoder(layer_tensors: list[torch.Tensor | None], weights: list[list[torch.Tensor]], types: list[list[int]],
                   out_features: list[int], windows: list[int], local_rope: list[bool], final_norm: torch.Tensor,
                   num_heads: int,
                   num_kv_heads: int, head_dim: int, eps: float, scale: float, softcap: float | None, gelu: bool,
                   residual_scale: float = 1.0):
    """The layer loop of one step in one call (decoder.h). layer_tensors: per layer input_norm, post_norm,
    qkv_bias, q_norm, k_norm, attn_out_norm, mlp_out_norm (None where the family has none); weights,
    types, out_features: the projections, qkv, o, gate_up, down per layer, then lm_head's: each its
    Linear's one weight (packed, oneDNN's or dense) and no types, or its GGUF parts and their ggml
    types (QuantLinear, as quant_linear takes them); windows: per layer its sliding window, 0 for
    global; local_rope: per layer, whether it rotates with forward's local tables (ModelConfig.local_rope);
    scale, softcap: the attention scores'; gelu: GeGLU, else SwiGLU; residual_scale: each attention and MLP
    output's factor before its residual add (Granite's residual_multiplier)."""
    return _lib().NativeDecoder(layer_tensors, weights, types, out_features, windows, local_rope, final_norm, num_heads,
                                num_kv_heads, head_dim, eps, scale, softcap or 0.0, gelu, residual_scale)


def native_experts(weights: list[list[torch.Tensor]], types: list[list[int]], out_features: list[int]):
    """One layer's mixture of experts in one call (experts.h): weights, types, out_features as
    native_decoder takes projections, each expert's gate_up then each expert's down. Its
    forward(x [T, hidden], chosen [T, k] int64, probs [T, k] float32) -> [T, hidden] sums each token's
    experts' SwiGLU outputs times their probabilities; forward_lora(x, chosen, probs, flat, token_rows [T]
    int32, ranks, a_ptr, b_ptr, scaling, layer, first) adds each token's LoRA on its experts, read as
    lora_segments reads it (token_rows: each token's row of the tables, -1 none; expert e's gate, up and
    down projections are the tables' columns first + 3e, + 1, + 2)."""
    return _lib().NativeExperts(weights, types, out_features)


# ggml type ids (gguf.GGMLQuantizationType) that quant_linear runs: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K
QUANT_TYPES = (2, 3, 8, 12, 13, 14)


def quant_linear(x: torch.Tensor, parts: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    """x: [rows, in] fp32 or bf16 -> x W^T: [rows, sum of out_i] in x's dtype, for W stacked from parts,
    each [out_i, bytes per row] uint8: a GGUF tensor's rows of blocks of ggml type types[i] (quant.h).
    The activations are quantized to int8 per 32, per 256 against Q4_K and Q5_K (as llama.cpp does)."""
    return _lib().quant_linear(x, parts, types)


def quant_rows(blocks: torch.Tensor, qtype: int, ids: torch.Tensor, in_features: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Rows ids [n] (int64) of a weight kept as blocks [rows, bytes per row] uint8 of ggml type qtype,
    dequantized: [n, in_features] in dtype (fp32 or bf16); an index out of range raises."""
    out = torch.empty(ids.numel(), in_features, dtype=dtype)
    _lib().quant_rows(out, blocks, qtype, ids.long().contiguous())
    return out


def set_quant_fused_rows(rows: int) -> int:
    """The most rows for which quant_linear's int8 strategy runs its fused kernels, each block decoded in
    registers straight into the dot products (AVX2 builds; default 8; Q4_0 / Q4_1 at most 4), instead of decoding each
    column once for all rows (0: never fused); returns the previous setting. Both give the same bits."""
    return _lib().set_quant_fused_rows(rows)


def set_quant_int8(on: bool) -> bool:
    """Let quant_linear quantize the activations to int8 (on at start), or run them in fp32 against each
    weight column dequantized to fp32 (exact activations; to compare); returns the previous setting.
    Parts in panels (PANEL_TYPES) run int8 either way (they have no other kernel)."""
    return _lib().set_quant_int8(on)


def set_quant_panel_rows(rows: int) -> int:
    """Rows from which quant_linear's int8 strategy runs the panel GEMM (8 columns decoded once, tiles of
    rows x 8 columns) instead of a column at a time (default 8; AVX2 builds, see
    quant_panels); returns the previous setting. Parts in panels (PANEL_TYPES) take them at any row count."""
    return _lib().set_quant_panel_rows(rows)


def set_quant_q5k_decoded_rows(rows: int) -> int:
    """Rows from which quant_linear decodes each Q5_K panel (PANEL_TYPES) once per call into a buffer that
    its row tiles read, instead of decoding the fifth bits in every tile (default 12); returns the previous
    setting."""
    return _lib().set_quant_q5k_decoded_rows(rows)


def set_quant_amx_rows(rows: int) -> int:
    """Rows from which quant_linear runs Q4_K, Q5_K and Q6_K panels (PANEL_TYPES) on AMX's int8 tiles where
    quant_amx_available (the vpdpbusd tiles below, and at any row count with 2**62); returns the previous
    setting."""
    return _lib().set_quant_amx_rows(rows)


def quant_amx_available() -> bool:
    """Whether quant_linear has AMX tiles here: the build has them (a CPU with AMX-INT8) and Linux granted
    the process their state."""
    return _lib().quant_amx_available()


def quant_panels() -> bool:
    """Whether quant_linear runs panels on this build (AVX2 and F16C; vpdpbusd in them with VNNI)."""
    return _lib().quant_panels()


# The type ids quant_linear takes for a Q4_0, Q4_1, Q4_K, Q5_K or Q6_K part repacked into panels of 8 columns
# (quant.h's kQ4_0_Panels .. kQ6_K_Panels: not ggml types), by the ggml type; they run where quant_panels() holds.
PANEL_TYPES = {2: 0x102, 3: 0x103, 12: 0x10C, 13: 0x10D, 14: 0x10E}
# per type: the weights of a block, and one column's bytes per block in panels
PANEL_BLOCKS = {2: (32, 18), 3: (32, 20), 12: (256, 148), 13: (256, 180), 14: (256, 210)}


def to_panels(blocks: torch.Tensor, qtype: int, in_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """One weight's blocks [out, in/block * bytes] uint8 of ggml type qtype (Q4_0, Q4_1, Q4_K, Q5_K or Q6_K; out a
    multiple of 8) repacked into panels of 8 columns, [out, in/block * (18, 20, 148, 180 or 210)] uint8 of type
    PANEL_TYPES[qtype]: the same bits in the order quant_linear's tiles read them (and quant_rows reads rows of);
    written into ``out`` where given (a contiguous uint8 tensor of that shape)."""
    return _lib().panels(blocks, qtype, in_features, True, out)


def panel_bytes(qtype: int, in_features: int) -> int:
    """The bytes of one output column of a qtype weight in panels (to_panels' row length)."""
    block, nbytes = PANEL_BLOCKS[qtype]
    return in_features // block * nbytes


def from_panels(panels: torch.Tensor, panel_type: int, in_features: int) -> torch.Tensor:
    """to_panels undone: the blocks bit for bit."""
    return _lib().panels(panels, panel_type, in_features, False)


def quant_path() -> str:
    """The integer dot products quant_linear runs on this build: avx2+vnni, avx2 or scalar."""
    return _lib().quant_path()
