"""The engine on tiny GGUF files whose projections stay quantized (QuantLinear, kernels/cpu/quant.h):
greedy tokens against transformers+PEFT on the same weights dequantized (a twin file of F32 tensors),
with adapters, a Q4_K_M-shaped file (Q4_K, Q6_K for v, down and the head), a Q8_0/Q4_0/Q4_1 one and one of
the Q5_0 and IQ4_NL that llama.cpp falls back to (kept as Q8_0 blocks);
the weights' size is the blocks' size; --keep-quantized and merged mode."""
import gguf
import numpy as np
import pytest
import torch

import kernels.cpu as cpu_kernels
from asyncserve import LLM, SamplingParams
from asyncserve.config import Config
from asyncserve.model.linear import QuantLinear
from asyncserve.model.loader import gguf_k_quants
from asyncserve.stepper.merge import MergeError, unmergeable_reason
from model_io_helpers import backend_vocab, write_gguf
from quant_helpers import Q, assert_quantized_generate_matches, dequantized, quantize, random_blocks
from reference import (assert_greedy_matches, make_tiny_tokenizer, peft_references, require_native_kernels,
                       save_random_adapter)

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
NEW_TOKENS = 6
# int8 activations move these models' logprobs by up to ~0.09 (median 0.02; logits' spread ~1.3) from the
# dequantized weights' (the kernel tests bound the error per element): a token may differ from the
# reference only where its top two logits are within twice that
TIE_TOL = 0.2
Q4_K_M = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
          "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K}
Q5_K_M = {**Q4_K_M, "attn_q": Q.Q5_K, "attn_k": Q.Q5_K, "attn_output": Q.Q5_K, "ffn_gate": Q.Q5_K, "ffn_up": Q.Q5_K}
# what llama.cpp's K-quant files hold where rows are not a multiple of 256 (Qwen2.5-0.5B's): Q5_0 and IQ4_NL,
# kept as Q8_0 blocks of the same values
FALLBACK = {"attn_q": Q.Q5_0, "attn_k": Q.IQ4_NL, "attn_v": Q.Q8_0, "attn_output": Q.Q5_0, "ffn_gate": Q.Q5_0,
            "ffn_up": Q.IQ4_NL, "ffn_down": Q.Q5_0, "output": Q.Q8_0}
LEGACY = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0,
          "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1, "output": Q.Q8_0}
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
          "ffn_down": (HIDDEN, INTER)}


@pytest.fixture(scope="module", autouse=True)
def native():
    require_native_kernels()


def write_pair(folder, types: dict[str, Q], seed: int, embed_std: float = 1.0):
    """(quantized file, its twin with every tensor dequantized to F32, bytes of the kept blocks). types may
    name token_embd's (else F32); without "output", the model ties its head to the embeddings (the twin
    has an output tensor equal to them)."""
    rng = np.random.default_rng(seed)
    tokens, merges, special = backend_vocab(make_tiny_tokenizer().backend_tokenizer)
    vocab = len(tokens)
    quant, dense = {}, {}

    def add(name: str, shape: tuple, qtype: Q | None, std: float = 0.08):
        if qtype is None:
            quant[name] = dense[name] = ((rng.standard_normal(shape) * std).astype(np.float32), None)
            return
        blocks = quantize((rng.standard_normal(shape) * std).astype(np.float32), qtype)
        quant[name] = (blocks, qtype)
        dense[name] = (dequantized(blocks, qtype), None)

    add("token_embd.weight", (vocab, HIDDEN), types.get("token_embd"), embed_std)
    quant["output_norm.weight"] = dense["output_norm.weight"] = ((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(
        np.float32), None)
    if "output" in types:
        add("output.weight", (vocab, HIDDEN), types["output"])
    else:
        dense["output.weight"] = dense["token_embd.weight"]
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            quant[f"blk.{i}.{norm}.weight"] = dense[f"blk.{i}.{norm}.weight"] = (
                (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), None)
        for name, shape in SHAPES.items():
            add(f"blk.{i}.{name}.weight", shape, types[name])
    llama = {"context_length": 256, "embedding_length": HIDDEN, "block_count": LAYERS, "feed_forward_length": INTER,
             "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
             "attention.layer_norm_rms_epsilon": 1e-5}
    common = dict(tokens=tokens, merges=merges, special=special, llama=llama, bos_id=1, eos_id=2)
    q_path = write_gguf(folder / "tiny-q.gguf", tensors=quant, **common)
    d_path = write_gguf(folder / "tiny-f32.gguf", tensors=dense, **common)
    kept = sum(held_bytes(b, t) for b, t in quant.values() if t is not None)
    return q_path, d_path, kept


def held_bytes(blocks: np.ndarray, qtype: Q) -> int:
    """What the engine holds of a file's quantized tensor: its blocks, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K repacked
    into panels of 8 columns where the build runs them and its rows are a multiple of 8 (Q4_K's 148 bytes per
    144, Q5_K's 180 per 176)."""
    panels = qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K) and len(blocks) % 8 == 0 and cpu_kernels.quant_panels()
    grown = {Q.Q4_K: (148, 144), Q.Q5_K: (180, 176)}.get(qtype) if panels else None
    grown = {Q.Q5_0: (34, 22), Q.IQ4_NL: (34, 18)}.get(qtype, grown)     # kept as Q8_0 blocks
    return blocks.nbytes * grown[0] // grown[1] if grown else blocks.nbytes


@pytest.mark.parametrize("types", [Q4_K_M, Q5_K_M, LEGACY, FALLBACK],
                         ids=["q4_k_m", "q5_k_m", "q8_0-q4_0-q4_1", "q5_0-iq4_nl"])
def test_quantized_engine_matches_dequantized_reference(tmp_path, types):
    from transformers import AutoModelForCausalLM

    q_path, d_path, kept = write_pair(tmp_path, types, seed=len(types) + int(types["attn_q"]))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=d_path.name, dtype=torch.float32).eval()
    adapters = {"r8_all": tmp_path / "r8_all", "r4_qv": tmp_path / "r4_qv"}
    save_random_adapter(reference, adapters["r8_all"], r=8, seed=1,
                        targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    save_random_adapter(reference, adapters["r4_qv"], r=4, targets=["q_proj", "v_proj"], seed=2)

    llm = LLM(model=str(q_path), adapters={k: str(v) for k, v in adapters.items()}, dtype="float32", device="cpu",
              max_step_tokens=32, pool_mem="64MiB", keep_quantized=True)
    weights = llm.engine.runner.weights
    linears = [weights.lm_head] + [getattr(lw, g) for lw in weights.layers for g in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(p, QuantLinear) for p in linears)
    # the blocks as in the file, the embeddings and norms in float32
    dense_bytes = 4 * (weights.embed.numel() + HIDDEN * (2 * LAYERS + 1))
    assert weights.nbytes() == kept + dense_bytes
    assert "GGUF blocks" in unmergeable_reason(weights)

    assert_quantized_generate_matches(llm, reference, adapters, NEW_TOKENS, TIE_TOL)

    # merged mode refuses the blocks; unmerged the same plan runs
    engine = llm.engine
    assert "GGUF blocks" in engine.merge_refusal("r8_all")
    engine.add(engine.make_sequence(llm.tokenizer.encode("The quick brown fox"), SamplingParams(max_tokens=2, temperature=0.0),
                                    "r8_all"))
    plan = engine.schedule()
    plan.merged = "r8_all"
    with pytest.raises(MergeError, match="layer 0's qkv projection is kept in GGUF blocks"):
        engine.run(plan)
    plan.merged = None
    engine.postprocess(plan, engine.run(plan))


@pytest.mark.parametrize("types", [Q4_K_M, LEGACY], ids=["q4_k_m", "q8_0-q4_0-q4_1"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_layer_loop_gives_the_python_loops_logits(tmp_path, monkeypatch, types, dtype):
    """The native layer loop (kernels/cpu/decoder.h) over the blocks runs QuantLinear's op (quant.h) in
    the Python loop's order: every step's logits are the same bits, base and two adapters in one
    generate call, prompts chunked beside decodes. The fused q/k/v mixes types (Q4_K, Q4_K, Q6_K;
    Q8_0, Q4_0, Q4_1) and the head is in blocks too."""
    from transformers import AutoModelForCausalLM

    from asyncserve.model import llama

    q_path, d_path, _ = write_pair(tmp_path, types, seed=11)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=d_path.name, dtype=torch.float32)
    adapters = {"r8_all": tmp_path / "r8_all", "r4_qv": tmp_path / "r4_qv"}
    save_random_adapter(hf, adapters["r8_all"], r=8, seed=3,
                        targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    save_random_adapter(hf, adapters["r4_qv"], r=4, targets=["q_proj", "v_proj"], seed=4)
    logits = {"native": [], "python": []}     # per step: (the layer loop that ran, its logits)
    for name in ("_forward_native", "_forward_layers"):
        def kept(*args, original=getattr(llama, name), name=name):
            out = original(*args)
            logits[loop].append((name, out.clone()))
            return out
        monkeypatch.setattr(llama, name, kept)
    for loop in logits:
        monkeypatch.setenv("ASYNCSERVE_NATIVE_DECODER", "1" if loop == "native" else "0")
        llm = LLM(model=str(q_path), adapters={k: str(v) for k, v in adapters.items()}, dtype=dtype, device="cpu",
                  max_step_tokens=8, pool_mem="16MiB", keep_quantized=True)
        weights = llm.engine.runner.weights
        assert isinstance(weights.lm_head, QuantLinear)
        qkv = weights.layers[0].qkv.weight
        assert [t for _, t in qkv.gguf_parts()] == [types["attn_q"], types["attn_k"], types["attn_v"]]
        assert [t in cpu_kernels.PANEL_TYPES.values() for _, t in qkv.parts] == [
            cpu_kernels.quant_panels() and types[name] in (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
            for name in ("attn_q", "attn_k", "attn_v")]
        prompts = [llm.tokenizer.encode(p) for p in ["The quick brown fox", "def add(a, b):"]]
        cases = [(ids, a) for ids in prompts for a in [None, *adapters]]
        outs = llm.generate([ids for ids, _ in cases], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                      ignore_eos=True), adapters=[a for _, a in cases])
        # the adapters change the tokens: LoRA runs on top of the blocks in both loops
        assert any(outs[i].token_ids != outs[i + 1].token_ids for i in range(0, len(cases), 3))
    assert {name for name, _ in logits["native"]} == {"_forward_native"}
    assert {name for name, _ in logits["python"]} == {"_forward_layers"}
    assert len(logits["native"]) == len(logits["python"]) > NEW_TOKENS
    for step, ((_, ours), (_, theirs)) in enumerate(zip(logits["native"], logits["python"])):
        assert ours.dtype == getattr(torch, dtype) and torch.equal(ours, theirs), f"step {step}"


def test_keep_quantized_auto_keeps_blocks_on_float32_cpus_and_off_gives_dense_mergeable_weights(tmp_path):
    q_path, _, _ = write_pair(tmp_path, LEGACY, seed=5)
    dense = LLM(model=str(q_path), dtype="float32", device="cpu", pool_mem="16MiB", keep_quantized=False)
    assert not any(isinstance(getattr(lw, g), QuantLinear) for lw in dense.engine.runner.weights.layers
                   for g in ("qkv", "o", "gate_up", "down"))
    assert unmergeable_reason(dense.engine.runner.weights) is None
    kept = LLM(model=str(q_path), dtype="float32", device="cpu", pool_mem="16MiB")      # auto
    assert "--keep-quantized" in unmergeable_reason(kept.engine.runner.weights)
    # both give the same first tokens on a prompt far from ties (the int8 activations aside, the same weights)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = kept.tokenizer.encode("Serving many adapters")
    assert kept.generate([ids], params)[0].token_ids[:1] == dense.generate([ids], params)[0].token_ids[:1]
    # auto is dense where bf16 runs, where a policy merges, across ranks and off the CPU; on and off are kept
    cpu, f32 = torch.device("cpu"), torch.float32
    auto = Config(model=str(q_path))
    assert auto.resolved_keep_quantized(cpu, f32)
    assert not auto.resolved_keep_quantized(cpu, torch.bfloat16)
    assert not auto.resolved_keep_quantized(torch.device("cuda"), f32)
    for merging in ("dlora", "merged-only"):
        assert not Config(model=str(q_path), policy=merging).resolved_keep_quantized(cpu, f32)
    assert not Config(model=str(q_path), tensor_parallel=2).resolved_keep_quantized(cpu, f32)
    assert Config(model=str(q_path), keep_quantized=True).resolved_keep_quantized(cpu, torch.bfloat16)
    assert not Config(model=str(q_path), keep_quantized=False).resolved_keep_quantized(cpu, f32)


def test_keep_quantized_auto_keeps_k_quant_files_in_bf16_where_amx_int8_tiles_run(tmp_path):
    """A file of mostly K-quants (Q4_K_M, Q5_K_M) keeps its blocks under --dtype bfloat16 too where the K-quants
    run on AMX int8 tiles (kernels.cpu.quant_amx_available), and is dequantized where they do not; legacy
    types stay dense in bf16 everywhere; one rank and non-merging policies only, as for float32."""
    (tmp_path / "k").mkdir()
    (tmp_path / "legacy").mkdir()
    k_path, _, _ = write_pair(tmp_path / "k", Q4_K_M, seed=6)
    legacy_path, _, _ = write_pair(tmp_path / "legacy", LEGACY, seed=6)
    assert gguf_k_quants(str(k_path)) and not gguf_k_quants(str(legacy_path))
    assert not gguf_k_quants(None)   # the default model: Q4_1
    cpu, bf16, amx = torch.device("cpu"), torch.bfloat16, cpu_kernels.quant_amx_available()
    assert Config(model=str(k_path)).resolved_keep_quantized(cpu, bf16, k_quants=True) == amx
    assert not Config(model=str(legacy_path)).resolved_keep_quantized(cpu, bf16, k_quants=False)
    assert not Config(model=str(k_path), tensor_parallel=2).resolved_keep_quantized(cpu, bf16, k_quants=True)
    assert not Config(model=str(k_path), policy="dlora").resolved_keep_quantized(cpu, bf16, k_quants=True)
    assert not Config(model=str(k_path), keep_quantized=False).resolved_keep_quantized(cpu, bf16, k_quants=True)
    llm = LLM(model=str(k_path), dtype="bfloat16", device="cpu", pool_mem="16MiB")   # auto
    kept = isinstance(llm.engine.runner.weights.layers[0].gate_up, QuantLinear)
    assert kept == amx


def test_resident_memory_after_loading_is_the_files_size(tmp_path):
    """A 4-layer 1024-wide Q4_K file (~40 MB; 150 MB as float32): the process's anonymous memory grows by
    about the file's size when the engine's weights are built from it (in a fresh process)."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    tokens, merges, special = backend_vocab(make_tiny_tokenizer().backend_tokenizer)
    hidden, inter, layers = 1024, 4096, 4
    shapes = {"attn_q": (hidden, hidden), "attn_k": (hidden, hidden), "attn_v": (hidden, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    tensors = {"token_embd.weight": (rng.standard_normal((len(tokens), hidden)).astype(np.float32), None),
               "output_norm.weight": (np.ones(hidden, np.float32), None),
               "output.weight": (random_blocks((len(tokens), hidden), Q.Q4_K, rng, 0.05), Q.Q4_K)}
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (np.ones(hidden, np.float32), None)
        for name, shape in shapes.items():
            tensors[f"blk.{i}.{name}.weight"] = (random_blocks(shape, Q.Q4_K, rng, 0.05), Q.Q4_K)
    llama = {"context_length": 256, "embedding_length": hidden, "block_count": layers, "feed_forward_length": inter,
             "attention.head_count": 16, "attention.head_count_kv": 16}
    path = write_gguf(tmp_path / "big.gguf", tokens=tokens, merges=merges, special=special, llama=llama,
                      tensors=tensors)
    script = f"""
import gc, torch
from asyncserve.model.loader import load_model
from asyncserve.model.llama import build_weights
import kernels.cpu; kernels.cpu.library()
def anon():
    return int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon')).split()[1]) * 1024
before = anon()
loaded = load_model({str(path)!r}, keep_quantized=True)
weights = build_weights(loaded.config, loaded.weights, torch.float32, torch.device('cpu'))
del loaded; gc.collect()
print(anon() - before, weights.nbytes())
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    grown, nbytes = (int(v) for v in run.stdout.split())
    size = path.stat().st_size
    # the file is the blocks, a small embedding and its metadata; Q4_K in panels holds 148 bytes per 144
    assert size * 0.95 <= nbytes <= size * (148 / 144 if cpu_kernels.quant_panels() else 1)
    assert grown <= 1.3 * size, (grown, size)


def test_blocks_are_dequantized_where_the_kernels_do_not_run(monkeypatch, caplog):
    """ASYNCSERVE_NATIVE=0 (or no compiler, or a GPU): the blocks become a dense projection of the same
    values in --dtype, and the log says so once."""
    from asyncserve.model import linear as linear_module
    from asyncserve.model.linear import QuantizedWeight, make_embedding, make_weight_linear

    rng = np.random.default_rng(6)
    parts = [(random_blocks((8, 256), Q.Q4_K, rng), Q.Q4_K), (random_blocks((4, 256), Q.Q8_0, rng), Q.Q8_0)]
    weight = QuantizedWeight([(torch.from_numpy(b), int(t)) for b, t in parts], 256)
    dense = torch.from_numpy(np.concatenate([dequantized(b, t) for b, t in parts]))
    assert torch.equal(weight.dequantize(), dense) and weight.shape == (12, 256)
    assert isinstance(make_weight_linear(weight, torch.float32, torch.device("cpu")), QuantLinear)
    monkeypatch.setenv("ASYNCSERVE_NATIVE", "0")
    monkeypatch.setattr(linear_module, "_dequantized_logged", False)
    with caplog.at_level("WARNING", logger="asyncserve.model.linear"):
        linears = [make_weight_linear(weight, torch.bfloat16, torch.device("cpu")) for _ in range(3)]
    assert not any(isinstance(p, QuantLinear) for p in linears)
    assert all(torch.equal(p.dense_weight(), dense.bfloat16()) for p in linears)
    assert len([r for r in caplog.records if "dequantized" in r.getMessage()]) == 1
    table = QuantizedWeight(weight.parts[:1], 256)                 # an embedding table: a plain tensor
    assert torch.equal(make_embedding(table, torch.bfloat16, torch.device("cpu")), dense[:8].bfloat16())


@pytest.mark.parametrize("types", [Q4_K_M, FALLBACK], ids=["q4_k_m", "q5_0-iq4_nl"])
def test_kept_blocks_are_the_dequantized_weights(tmp_path, types):
    """load_model(keep_quantized=True): each kept tensor's blocks dequantize to exactly the tensor the
    plain load gives (Q/K rows un-interleaved alike), the rest is identical; Q5_0 and IQ4_NL kept as
    Q8_0 blocks of the very same values."""
    from asyncserve.model.linear import QuantizedWeight
    from asyncserve.model.loader import load_model

    q_path, _, _ = write_pair(tmp_path, types, seed=7)
    kept, dense = load_model(str(q_path), keep_quantized=True).weights, load_model(str(q_path)).weights
    assert kept.keys() == dense.keys()
    quantized_names = {name for name, t in kept.items() if isinstance(t, QuantizedWeight)}
    assert quantized_names == {name for name in dense if name.endswith("proj.weight")} | {"lm_head.weight"}
    for name, tensor in kept.items():
        assert torch.equal(tensor.dequantize() if name in quantized_names else tensor, dense[name]), name
    if types is FALLBACK:
        assert {t for name in quantized_names for _, t in kept[name].parts} == {int(Q.Q8_0)}


@pytest.mark.parametrize("qtype, offset, value", [
    (Q.Q8_0, 0, np.nan), (Q.Q4_K, 2, np.inf), (Q.Q6_K, 208, np.nan), (Q.Q4_1, 2, -np.inf), (Q.Q4_0, 0, np.inf),
    (Q.Q5_K, 0, np.nan), (Q.Q4_K, 0, -np.inf)], ids=lambda v: v.name if isinstance(v, Q) else str(v))
def test_nonfinite_block_scales_are_refused(tmp_path, qtype, offset, value):
    """A file whose quantized tensor has a NaN or infinite fp16 scale (d, dmin, Q4_1's m) in one block is
    refused naming the tensor, kept quantized or dequantized; a finite one (zero, subnormal) loads."""
    from asyncserve.model.config import ModelLoadError
    from asyncserve.model.loader import load_model

    q_path, _, _ = write_pair(tmp_path, dict.fromkeys(Q4_K_M, qtype), seed=8)
    size = gguf.GGML_QUANT_SIZES[qtype][1]

    def set_scale(name: str, block: int, scale: float) -> None:
        tensor = next(t for t in gguf.GGUFReader(q_path, "r+").tensors if t.name == name)
        tensor.data.reshape(-1, size)[block, offset:offset + 2] = np.array([scale], np.float16).view(np.uint8)
        tensor.data.flush()

    set_scale("blk.1.ffn_down.weight", 3, 6e-8)          # fp16's smallest subnormal, and zero: fine
    set_scale("blk.0.attn_k.weight", 0, 0.0)
    assert load_model(str(q_path), keep_quantized=True).weights
    set_scale("blk.1.ffn_down.weight", 5, value)
    with pytest.raises(ModelLoadError, match=rf"tensor blk\.1\.ffn_down\.weight \({qtype.name}\) has a NaN or "
                                             r"infinite block scale in 1 of its \d+ blocks"):
        load_model(str(q_path), keep_quantized=True)
    with pytest.raises(ModelLoadError, match=r"tensor model\.layers\.1\.mlp\.down_proj\.weight holds NaN or infinite"):
        load_model(str(q_path))


@pytest.mark.parametrize("embed_type", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_1], ids=lambda t: t.name)
def test_tied_head_keeps_one_quantized_copy(tmp_path, embed_type):
    """A file without output.weight (SmolLM2's Q4_1 ties its head to a Q8_0 token_embd): one copy of the
    table's blocks, the lookup dequantizing the rows it gathers and the head a QuantLinear over the same
    blocks; greedy tokens as transformers' on the dequantized twin (the head as an explicit copy)."""
    from transformers import AutoModelForCausalLM

    from asyncserve.model.linear import QuantEmbedding

    types = {**{k: v for k, v in LEGACY.items() if k != "output"}, "token_embd": embed_type}
    # a head's scale (as SmolLM2's table is): logits spread as the untied files' heads make them
    q_path, d_path, kept = write_pair(tmp_path, types, seed=20 + int(embed_type), embed_std=0.08)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=d_path.name, dtype=torch.float32).eval()
    adapter = tmp_path / "r8"
    save_random_adapter(reference, adapter, r=8, seed=3, targets=["q_proj", "v_proj", "down_proj"])
    llm = LLM(model=str(q_path), adapters={"r8": str(adapter)}, dtype="float32", device="cpu", max_step_tokens=32,
              pool_mem="64MiB", keep_quantized=True)
    weights = llm.engine.runner.weights
    assert isinstance(weights.embed, QuantEmbedding) and isinstance(weights.lm_head, QuantLinear)
    assert weights.lm_head.weight is weights.embed.weight            # the same blocks, not a copy
    in_panels = cpu_kernels.quant_panels() and embed_type != Q.Q8_0 and weights.embed.shape[0] % 8 == 0
    assert (weights.embed.qtype in cpu_kernels.PANEL_TYPES.values()) == in_panels, weights.embed.qtype
    assert weights.nbytes() == kept + 4 * HIDDEN * (2 * LAYERS + 1)  # counted once; the norms in float32

    prompts = [llm.tokenizer.encode(p) for p in ["The quick brown fox", "def add(a, b):", "Serving adapters"]]
    cases = [(ids, a) for ids in prompts for a in [None, "r8"]]
    refs = peft_references(reference, {"r8": adapter}, cases, NEW_TOKENS)
    outs = llm.generate([ids for ids, _ in cases], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                  ignore_eos=True), adapters=[a for _, a in cases])
    equal = [assert_greedy_matches(o.token_ids, ref, TIE_TOL, f"case {i} ({cases[i][1]})")
             for i, (o, ref) in enumerate(zip(outs, refs))]
    # every difference is at a near-tie (asserted above; these were within 0.03 of one); the head's logits
    # spread ~1.3 over a vocabulary of a few hundred tokens has many
    assert sum(equal) >= len(cases) // 2, equal
