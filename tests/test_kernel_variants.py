"""The LoRA kernels compile at start (TritonLoraBackend.warm_up), never in a request's step.

Triton compiles a kernel for each new set of constexpr values, integer arguments' specializations
(== 1, divisible by 16) and pointers' alignments. On the H100 a split-K factor passed as a constexpr
made each decode batch size compile kernels of its own: 20 steps of a 1,000-adapter trace took
0.2-4.2 s, 15.7 s in all (BENCHMARKS.md, "H100, third lease"). These tests compute each launch's
specialization with Triton's own binder for an sm_90 target, without a GPU and without launching
anything, and check that the steps after warm_up launch nothing it did not: over a sweep of batch
sizes and rank mixes at a 7B model's widths, and over a real engine's trace. They run in a
subprocess: the kernels must be imported as JIT functions, where this suite's other modules set
TRITON_INTERPRET=1 before importing them; the split-K choice is an H100's (132 SMs).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Records each launch's specialization under the current phase, launches nothing.
PRELUDE = r'''
import json, os, sys
import torch
import kernels                                             # JIT functions: TRITON_INTERPRET=0
import kernels._util, kernels.mbgmv, kernels.sgmv
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction, create_function_from_signature

target_backend = CUDABackend(GPUTarget("cuda", 90, 32))
binders, keys, phase = {}, {}, ["start"]

def record(self, *args, grid, warmup, **kwargs):
    if self not in binders:
        binders[self] = create_function_from_signature(self.signature, self.params, target_backend)
    _, specialization, options = binders[self](*args, **kwargs)
    key = json.dumps([specialization, sorted(options.items())], default=str)
    keys.setdefault(self.fn.__name__, {}).setdefault(phase[0], set()).add(key)

JITFunction.run = record
# an H100's split-K choice for CPU tensors (pick_split_k splits only on CUDA devices)
kernels._util.num_sms = lambda index: 132
for module in (kernels.mbgmv, kernels.sgmv):
    module.pick_split_k = lambda device, programs, k_blocks: kernels._util.pick_split_k(
        torch.device("cuda", 0), programs, k_blocks)
os.environ["TRITON_INTERPRET"] = "1"                       # lets the backend take a CPU pool

def report():
    print(json.dumps({kernel: {p: sorted(k) for p, k in by.items()} for kernel, by in keys.items()}))
'''

SWEEP = r'''
from asyncserve.lora.batch import LoraBatch
from asyncserve.lora.backend import group_layout
from asyncserve.lora.triton_backend import TritonLoraBackend
from asyncserve.model.config import GROUPS, PROJECTIONS, ModelConfig
from asyncserve.pager.pager import DeviceAdapter
from asyncserve.pager.pool import PagedPool
from test_kernels import place_adapter

config = ModelConfig(vocab_size=64, hidden_size=4096, intermediate_size=11008, num_layers=2, num_heads=32,
                     num_kv_heads=32, head_dim=128)
pool = PagedPool(128, num_layers=1, block_size=16, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16,
                 device=torch.device("cpu"))
shapes = [config.projection_shapes()[name] for name in PROJECTIONS]
g = torch.Generator().manual_seed(0)
free = list(range(pool.num_pages))
adapters = []
for i, (r, targets) in enumerate([(8, ("q_proj", "v_proj")), (16, ("q_proj", "v_proj")), (1, ("o_proj",)),
                                  (5, ("gate_proj", "down_proj"))]):
    ranks = [r if name in targets else 0 for name in PROJECTIONS]
    a_ptr, b_ptr = place_adapter(pool, free, ranks, shapes, config.num_layers, g)
    adapters.append(DeviceAdapter(f"a{i}", ranks, a_ptr, b_ptr, torch.ones(config.num_layers, len(PROJECTIONS)),
                                  [], generation=i))
lora = TritonLoraBackend(pool, config)
layout = group_layout(config)
lora.warm_up()

def step(name, seg_lengths, step_adapters, decode):
    starts = [0]
    for n in seg_lengths:
        starts.append(starts[-1] + n)
    seg_adapter = [i % len(step_adapters) for i in range(len(seg_lengths))]
    phase[0] = name
    lora.begin_step(LoraBatch(step_adapters, starts, seg_adapter, starts[-1], torch.device("cpu"),
                              num_decode=starts[-1] if decode else 0))
    for layer in range(config.num_layers):
        for group in GROUPS:
            x = torch.empty(starts[-1], layout[group][0][1], dtype=torch.bfloat16)
            y = torch.empty(starts[-1], sum(row[2] for row in layout[group]), dtype=torch.bfloat16)
            lora.apply(layer, group, x, y)

for mix, step_adapters in (("rank 8", adapters[:1]), ("ranks 8 and 16", adapters[:2]), ("all", adapters)):
    for tokens in range(1, 65):
        step(f"decode, {mix}: {tokens} tokens", [1] * tokens, step_adapters, decode=True)
    for segments in range(1, 49):      # prompts of 2..31 tokens: SGMV
        step(f"sgmv, {mix}: {segments} segments", [2 + 7 * s % 30 for s in range(segments)], step_adapters, False)
    for segments in range(1, 9):       # one prompt of 200 tokens among others: MBGMM
        step(f"mbgmm, {mix}: {segments} segments", [200] + [9] * (segments - 1), step_adapters, False)
report()
'''

# a real engine's trace: the forward's own tensors, prompts from 1 to 300 tokens, batches of 1 to 24
ENGINE = r'''
import tempfile
from pathlib import Path
from reference import make_tiny_tokenizer, save_random_adapter, save_tiny_llama
from asyncserve import LLM, SamplingParams

root = Path(tempfile.mkdtemp())
base = save_tiny_llama(root / "base", make_tiny_tokenizer(), hidden=1024, layers=2, heads=8, kv_heads=4,
                       intermediate=2048)
adapters = {}
for i, (r, targets) in enumerate([(8, ["q_proj", "v_proj"]), (16, ["q_proj", "k_proj", "v_proj", "o_proj",
                                  "gate_proj", "up_proj", "down_proj"]), (1, ["o_proj"]), (40, ["down_proj"])]):
    adapters[f"a{i}"] = str(root / f"a{i}")
    save_random_adapter(base, root / f"a{i}", r=r, targets=targets, seed=i)
llm = LLM(model=str(root / "base"), adapters=adapters, lora_backend="triton", device="cpu", dtype="bfloat16",
          threads=2, max_running=24, cpu_workers=0)
phase[0] = "trace"
names = [None, *adapters]
prompts = [[5 + (7 * i + j) % 300 for j in range(1 + (37 * i) % 300)] for i in range(24)]
llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
             adapters=[names[i % len(names)] for i in range(len(prompts))])
report()
'''


def compiles(body: str) -> dict[str, dict[str, set]]:
    """Each kernel's specializations per phase ("start": up to and with warm_up), from a subprocess."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}           # else kernels/__init__ turns it on without CUDA
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", PRELUDE + body], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    keys = json.loads(out.stdout.splitlines()[-1])
    return {kernel: {phase: set(k) for phase, k in by.items()} for kernel, by in keys.items()}


def assert_warm_up_covers(keys: dict[str, dict[str, set]]) -> None:
    assert set(keys) == {"_mbgmv_shrink_kernel", "_mbgmv_expand_kernel", "_sgmv_shrink_kernel",
                         "_sgmv_expand_kernel", "_mbgmm_shrink_kernel", "_mbgmm_expand_kernel"}, sorted(keys)
    for kernel, by_phase in keys.items():
        warmed = by_phase.get("start", set())
        assert warmed, f"{kernel}: warm_up did not launch it"
        steps = [phase for phase in by_phase if phase != "start"]
        assert steps, f"{kernel}: no step after warm_up launched it"
        for phase in steps:
            assert by_phase[phase] <= warmed, (
                f"{kernel}: {phase} compiles what warm_up did not:\n{sorted(by_phase[phase] - warmed)}")


def test_warm_up_compiles_what_any_batch_size_or_rank_mix_launches():
    assert_warm_up_covers(compiles(SWEEP))


def test_warm_up_compiles_what_an_engine_trace_launches():
    assert_warm_up_covers(compiles(ENGINE))
