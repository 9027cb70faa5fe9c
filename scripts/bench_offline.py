"""W1 through the offline API, side by side with transformers+PEFT (grouped and mixed batches).

    .venv/bin/python scripts/make_w1.py      # once: W1 into .bench/w1
    .venv/bin/python scripts/bench_offline.py [--systems ours,ours-base,hf-grouped,hf-mixed]

W1 (BENCHMARKS.md): SmolLM2-135M-Instruct in bf16, 64 requests of 64 prompt tokens,
adapter a{i%4} (ranks 8,16,8,16 on q,k,v,o), 64 greedy tokens each with EOS ignored, 16 in flight.
Offline, "16 in flight" is max_running=16: a new request is admitted when one finishes.
Prints how long our engine takes to load (and its GGUF tokenizer), output tokens/s per system and,
with --profile, where the engine's step time goes; with --merge, dLoRA's merged mode: each merge's
and unmerge's time, and decode steps merged against unmerged; with --lora-steps, decode steps with
the native LoRA kernel against the backend's eager plans, alternated. System ours-eager-lora is ours with
the LoRA backend kept on its eager plans where the native lora_segments kernel would run; ours-no-amx
is ours with the native GEMM kept on its vdpbf16ps tiles where it would run AMX tiles (kernels/cpu/gemm.h);
ours-dora serves W1's adapters as DoRA adapters (make_adapters.dora_copy: magnitudes as PEFT initializes
them, so the same tokens, DoRA's work on top), ours-vocab with random LoRA on the embeddings and the head
added (make_adapters.vocab_copy), ours-saved with the embeddings and the head saved whole (modules_to_save,
make_adapters.saved_copy); with --rounds, ours, ours-eager-lora, ours-no-amx, ours-dora, ours-vocab,
ours-saved and ours-base alternate in one process. With
--panel-steps, decode steps with Q4_0/Q4_1/Q4_K/Q6_K in panels against GGUF's blocks; with --build-steps --against
CHECKOUT, this checkout's native kernels against that checkout's (scripts/kernel_builds.py); both alternate
step by step in one engine at batches 1, 4 and 16.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from workloads import w1_file

REPO = Path(__file__).resolve().parents[1]


def load_w1(args):
    """W1's prompts (repeated --repeat times) and adapters (or every adapter folder of --adapter-dir)."""
    prompts = json.loads(w1_file(args.bench_dir, "prompts.json").read_text()) * args.repeat
    folder = args.adapter_dir or w1_file(args.bench_dir, "adapters")
    adapters = {p.name: str(p) for p in sorted(folder.iterdir()) if (p / "adapter_config.json").is_file()}
    return prompts, adapters


def adapter_of(i: int, adapters: dict, prefix: str = "") -> str:
    """Request i's adapter: a{i % n}, as W1 prescribes (prefix: its copy's name, COPIES' systems)."""
    return f"{prefix}a{i % len(adapters)}"


# the systems that serve copies of W1's adapters: system -> the copies' name prefix
COPIES = {"ours-dora": "dora-", "ours-vocab": "vocab-", "ours-saved": "saved-"}


def load_copies(llm, adapters: dict, system: str, args) -> None:
    """W1's adapters again, loaded as PREFIXa0, PREFIXa1, ... beside them: ours-dora as DoRA adapters
    (make_adapters.dora_copy: the same tokens, DoRA's work on top), ours-vocab with LoRA on the
    embeddings and the head added (make_adapters.vocab_copy), ours-saved with both saved whole
    (make_adapters.saved_copy)."""
    import tempfile

    from make_adapters import dora_copy, saved_copy, vocab_copy

    from asyncserve.model.loader import load_model

    loaded = load_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, path) in enumerate(adapters.items()):
            if system == "ours-dora":
                dora_copy(Path(path), Path(tmp) / name, loaded.weights)
            else:
                copy = vocab_copy if system == "ours-vocab" else saved_copy
                copy(Path(path), Path(tmp) / name, loaded.config.vocab_size, loaded.config.hidden_size, seed=i)
            llm.load_adapter(COPIES[system] + name, str(Path(tmp) / name))


def build_ours(adapters, args):
    """One engine for both of our systems: the base-model run simply names no adapter."""
    from asyncserve import LLM

    # W1 measures computing every prompt: rounds and --repeat send its prompts again, which the
    # prefix cache would otherwise serve from the first round's blocks
    tp = args.tensor_parallel
    return LLM(model=args.model, adapters=adapters, dtype=args.dtype, device=args.device,
               lora_backend=args.lora_backend, max_running=args.in_flight, max_step_tokens=args.step_tokens,
               threads=args.threads if tp == 1 and args.tp_backend is None else None, prefix_caching=False, keep_quantized=args.keep_quantized,
               tensor_parallel=tp, tp_cores=args.tp_cores, tp_backend=args.tp_backend)


def time_loading(adapters, args) -> tuple[object, dict]:
    """Our engine, and how long building it took: in all, and of that the tokenizer read from the GGUF's
    metadata (~0.3 s for SmolLM2's 49k-token vocabulary; the metadata parse itself is GGUFReader's)."""
    import gguf

    from asyncserve.model.loader import default_model_path
    from asyncserve.model.tokenizer import Tokenizer

    times = {}
    path = Path(args.model) if args.model else default_model_path()
    if path.suffix == ".gguf":
        fields = gguf.GGUFReader(path).fields
        t0 = time.perf_counter()
        Tokenizer.from_gguf(fields)
        times["gguf_tokenizer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = build_ours(adapters, args)
    times["engine_s"] = time.perf_counter() - t0
    parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f} s" for k, v in times.items())
    rss = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in Path("/proc/self/status").read_text().splitlines()
           if line.startswith(("VmRSS", "RssAnon"))}
    print(f"load: {parts}; RSS {rss.get('VmRSS', 0):.0f} MiB (anonymous {rss.get('RssAnon', 0):.0f})", flush=True)
    return llm, times


def run_ours(llm, prompts, adapters, use_adapters: bool, args, eager_lora: bool = False, amx: bool = True,
             prefix: str = "") -> dict:
    """eager_lora: the torch LoRA backend on its eager plans (stacks, oneDNN) even where its native
    lora_segments plan runs; amx=False: the native GEMM on its vdpbf16ps tiles where it would run AMX
    tiles; each to measure one against the other in one process. prefix: the adapters' DoRA copies."""
    import kernels.cpu as cpu_kernels

    lora = llm.engine.runner.lora
    native = getattr(lora, "native", None)
    if eager_lora and native is not None:
        lora.native = False
    amx_was = cpu_kernels.set_amx_gemm(amx) if cpu_kernels.bf16_gemm_available() else None
    try:
        return _timed_generate(llm, prompts, adapters, use_adapters, args, prefix)
    finally:
        if native is not None:
            lora.native = native
        if amx_was is not None:
            cpu_kernels.set_amx_gemm(amx_was)


def _timed_generate(llm, prompts, adapters, use_adapters: bool, args, prefix: str = "") -> dict:
    from asyncserve import SamplingParams

    ids = [llm.tokenizer.encode(p) for p in prompts]
    names = [adapter_of(i, adapters, prefix) for i in range(len(prompts))] if use_adapters else None
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(ids[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 adapters=names[:4] if names else None)            # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(ids, params, adapters=names)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def load_hf(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncserve.model.loader import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    dtype = getattr(torch, args.dtype)
    if path.is_dir():
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return tok, model.to(args.device).eval()


def run_hf(prompts, adapters, mixed: bool, args) -> dict:
    from peft import PeftModel

    tok, model = load_hf(args)
    names = list(adapters)
    model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(adapters[n], adapter_name=n)
    model.eval()
    ids = [tok(p, return_tensors="pt").input_ids[0].to(args.device) for p in prompts]
    batches = []   # (rows, adapter names per row) of up to in_flight requests
    order = list(range(len(prompts)))
    if not mixed:
        order.sort(key=lambda i: i % len(names))
    for s in range(0, len(order), args.in_flight):
        rows = order[s:s + args.in_flight]
        batches.append((rows, [adapter_of(i, adapters) for i in rows]))

    def generate(rows, row_adapters, new_tokens):
        x = torch.stack([ids[i] for i in rows])                  # all W1 prompts are 64 tokens
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        if mixed:
            return model.generate(input_ids=x, adapter_names=row_adapters, **kwargs)
        model.set_adapter(row_adapters[0])
        return model.generate(input_ids=x, **kwargs)

    with torch.inference_mode():
        generate(*batches[0], 4)                                   # warm-up
        t0 = time.perf_counter()
        tokens = 0
        for rows, row_adapters in batches:
            out = generate(rows, row_adapters, args.new_tokens)
            tokens += (out.shape[1] - len(ids[rows[0]])) * out.shape[0]
        wall = time.perf_counter() - t0
    return {"output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def profile_ours(prompts, adapters, args) -> None:
    """Per-op time of 20 decode steps at batch 16 (torch profiler), after 44 that reach the steady
    state (prefill done, the adapter set's stacks packed): W1's adapters, or the base model when
    --systems is ours-base."""
    from torch.profiler import ProfilerActivity, profile

    from asyncserve import SamplingParams

    llm = build_ours(adapters, args)
    ids = [llm.tokenizer.encode(p) for p in prompts[:16]]
    base = args.systems == "ours-base"
    names = [None if base else adapter_of(i, adapters) for i in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i, p in enumerate(ids):
        engine.add(engine.make_sequence(p, params, names[i]))
    for _ in range(44):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        wall = time.perf_counter() - t0
    print(f"decode steps: {steps}, {1000 * wall / steps:.1f} ms/step at batch 16")
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=30))


def bench_lora_steps(prompts, adapters, args) -> None:
    """Decode steps at batch 16 with W1's adapters, the LoRA backend's native plan and its eager plans
    alternated step by step (a busy box's drift then biases neither), after 40 eager steps in which
    the set's stacks are built, packed and fused as in steady serving."""
    import statistics

    from asyncserve import SamplingParams

    llm = build_ours(adapters, args)
    engine, lora = llm.engine, llm.engine.runner.lora
    params = SamplingParams(max_tokens=40 + args.ab_steps, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts[:16]):
        engine.add(engine.make_sequence(llm.tokenizer.encode(p), params, adapter_of(i, adapters)))
    lora.native = False
    for _ in range(40):
        engine.step()
    times = {"native": [], "eager": []}
    for i in range(args.ab_steps):
        kind = "native" if i % 2 == 0 else "eager"
        lora.native = kind == "native"
        t0 = time.perf_counter()
        engine.step()
        times[kind].append(time.perf_counter() - t0)
    native, eager = statistics.median(times["native"]), statistics.median(times["eager"])
    print(f"decode step at batch 16, median of {args.ab_steps // 2} each: native LoRA {1e3 * native:.2f} ms, "
          f"eager LoRA {1e3 * eager:.2f} ms ({100 * (eager / native - 1):+.1f}%)")


def alternated_decode_steps(llm, prompts, variants, args) -> None:
    """Decode steps of the base model at batches 1, 4 and 16, the variants (name -> a call that switches the
    engine to it) swapped step by step after the prompts' prefill; prints each batch's median step of each
    and the others' time over the first's."""
    import statistics

    from asyncserve import SamplingParams

    engine, names = llm.engine, list(variants)
    for batch in (1, 4, 16):
        params = SamplingParams(max_tokens=16 + args.ab_steps, temperature=0.0, ignore_eos=True)
        seqs = [engine.make_sequence(llm.tokenizer.encode(p), params, None) for p in prompts[:batch]]
        for seq in seqs:
            engine.add(seq)
        for _ in range(12):
            engine.step()
        times = {name: [] for name in names}
        for i in range(args.ab_steps):
            name = names[i % len(names)]
            variants[name]()
            t0 = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t0)
        for seq in seqs:
            engine.abort(seq.request_id)
        variants[names[0]]()
        median = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"decode step at batch {batch}, median of {args.ab_steps // len(names)} each: "
              + ", ".join(f"{name} {1e3 * t:.1f} ms" for name, t in median.items())
              + "".join(f" ({name}/{names[0]}: {median[name] / median[names[0]]:.2f}x)" for name in names[1:]), flush=True)


def bench_panel_steps(prompts, adapters, args) -> None:
    """Decode steps with the Q4_0, Q4_1, Q4_K, Q5_K and Q6_K projections in panels of 8 columns (as QuantLinear
    repacks them on AVX2 builds) and with those of --blocks-types (default: all) in GGUF's blocks,
    swapped step by step in one engine (the native layer loop rebuilt over each): --model a GGUF file with
    such tensors, kept quantized."""
    import gguf

    import kernels.cpu as cpu_kernels
    from asyncserve.model.linear import QuantizedWeight, QuantLinear

    llm = build_ours(adapters, args)
    weights = llm.engine.runner.weights
    linears = [p for p in weights.linears() if isinstance(p, QuantLinear)]
    chosen = {cpu_kernels.PANEL_TYPES[int(gguf.GGMLQuantizationType[name])] for name in args.blocks_types.split(",")}
    ggml = {panels: qtype for qtype, panels in cpu_kernels.PANEL_TYPES.items()}

    def in_blocks(weight: QuantizedWeight) -> QuantizedWeight:
        return QuantizedWeight([(cpu_kernels.from_panels(b, t, weight.in_features), ggml[t]) if t in chosen else (b, t)
                                for b, t in weight.parts], weight.in_features)

    layouts = {"in panels": [p.weight for p in linears], "in GGUF blocks": [in_blocks(p.weight) for p in linears]}
    if all(a is b for a, b in zip(*layouts.values())) or not linears:
        raise SystemExit("no projection in panels here: a Q4_0/Q4_1/Q4_K/Q6_K file, kept quantized, on a build with panels")

    def use(layout: str):
        def switch() -> None:
            for p, weight in zip(linears, layouts[layout]):
                p.weight, p._blocks, p._types = weight, [b for b, _ in weight.parts], [t for _, t in weight.parts]
            weights._decoder = None
        return switch

    alternated_decode_steps(llm, prompts, {layout: use(layout) for layout in layouts}, args)


def bench_build_steps(prompts, adapters, args) -> None:
    """Decode steps with this checkout's native kernels and with --against CHECKOUT's (kernel_builds.py),
    swapped step by step in one engine (the native layer loop rebuilt over each)."""
    import kernels.cpu as cpu_kernels
    from kernel_builds import other_build

    if args.against is None:
        raise SystemExit("--build-steps needs --against CHECKOUT")
    other = other_build(args.against)
    llm = build_ours(adapters, args)
    weights = llm.engine.runner.weights

    def use(library):
        def switch() -> None:
            cpu_kernels._library = library
            weights._decoder = None
        return switch

    alternated_decode_steps(llm, prompts, {"this build": use(cpu_kernels.library()),
                                           f"@{args.against.resolve().name}": use(other)}, args)


def bench_merge(prompts, adapters, args) -> None:
    """Per W1 adapter, 16 of its requests decode in blocks of 8 steps, alternately unmerged and with the
    adapter merged into the base weights (StepPlan.merged, set here as a policy would): the median
    decode step of each mode (a block's first step left out: it rebuilds what the switch dropped)
    and each switch's time as the engine measured it."""
    from asyncserve import SamplingParams
    from asyncserve.stepper.merge import MERGE_PRIOR_S_PER_ELEMENT

    llm = build_ours(adapters, args)
    engine, merger = llm.engine, llm.engine.runner.merger
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    steps = {"merged": [], "unmerged": []}
    switches = {"merge": [], "unmerge": []}
    for name in adapters:
        seqs = [engine.make_sequence(llm.tokenizer.encode(p), params, name) for p in prompts[:16]]
        for seq in seqs:
            engine.add(seq)
        step = 0
        while engine.has_unfinished():
            plan = engine.schedule()
            decoding = all(not s.in_prefill for s in seqs)
            mode = "merged" if decoding and (step // 8) % 2 else "unmerged"
            plan.merged = name if mode == "merged" else None
            before = dict(merger.seconds)
            result = engine.run(plan)
            engine.postprocess(plan, result)
            for kind in switches:
                if merger.seconds[kind] > before[kind]:
                    switches[kind].append(merger.seconds[kind] - before[kind])
            if decoding and step % 8:
                steps[mode].append(result.duration_s)
            step += decoding
    median = lambda xs: sorted(xs)[len(xs) // 2]   # noqa: E731
    elements = merger.elements_of(engine.pager.registry[next(iter(adapters))].ranks)
    print(f"merge: median {1000 * median(switches['merge']):.1f} ms of {len(switches['merge'])} "
          f"({elements / 1e6:.1f} M base weights rewritten each; prior estimate "
          f"{1000 * elements * MERGE_PRIOR_S_PER_ELEMENT:.1f} ms), "
          f"unmerge: median {1000 * median(switches['unmerge']):.3f} ms")
    print(f"decode step at batch 16: merged {1000 * median(steps['merged']):.2f} ms, unmerged "
          f"{1000 * median(steps['unmerged']):.2f} ms (medians of {len(steps['merged'])} and "
          f"{len(steps['unmerged'])} steps)")


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput (the upper middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r["tok_s"])
    return dict(ordered[len(ordered) // 2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-dir", type=Path, default=REPO / ".bench",
                    help="the folder holding w1/ (default: .bench, where scripts/make_w1.py writes it)")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--adapter-dir", type=Path, help="serve every adapter folder in it (named a0, a1, ...) "
                                                      "instead of W1's four")
    ap.add_argument("--repeat", type=int, default=1, help="run W1's 64 requests this many times")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--lora-backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--systems", default="ours,ours-base,hf-grouped,hf-mixed")
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--step-tokens", type=int, default=None, help="default: the engine's per-device default")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--keep-quantized", action=argparse.BooleanOptionalAction, default=None,
                    help="ours with a GGUF file's blocks kept quantized, or dequantized with --no-keep-quantized "
                         "(Config.keep_quantized; default: the server's auto)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="W1 prescribes bfloat16; CPUs without AMX/AVX512-BF16 run float32 faster")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run ours and ours-base alternately this many times in one process and report "
                         "medians: a VM whose speed drifts within minutes then biases neither")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--merge", action="store_true", help="time dLoRA's merged mode instead (see bench_merge)")
    ap.add_argument("--lora-steps", action="store_true", help="decode steps, native LoRA against eager, alternated")
    ap.add_argument("--panel-steps", action="store_true",
                    help="decode steps, Q4_0/Q4_1/Q4_K/Q6_K in panels against GGUF blocks, alternated (see bench_panel_steps)")
    ap.add_argument("--blocks-types", default="Q4_0,Q4_1,Q4_K,Q5_K,Q6_K",
                    help="--panel-steps: the ggml types its second layout holds in GGUF's blocks")
    ap.add_argument("--build-steps", action="store_true",
                    help="decode steps, this checkout's kernels against --against CHECKOUT's, alternated")
    ap.add_argument("--against", type=Path, default=None, help="the other checkout of --build-steps")
    ap.add_argument("--ab-steps", type=int, default=120,
                    help="steps --lora-steps, --panel-steps and --build-steps alternate")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="ranks (each one core's threads of --tp-cores); "
                    "prints each step's broadcast and all-reduce time and bytes")
    ap.add_argument("--tp-cores", default=None, help="the ranks' cores, e.g. 0;1 (default: an even split)")
    ap.add_argument("--tp-backend", default=None, choices=["shm", "gloo", "nccl"],
                    help="the ranks' collectives (default: shm on CPU, nccl on CUDA)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts, adapters = load_w1(args)
    if args.profile:
        profile_ours(prompts, adapters, args)
        return
    if args.merge:
        bench_merge(prompts, adapters, args)
        return
    if args.lora_steps:
        bench_lora_steps(prompts, adapters, args)
        return
    if args.panel_steps:
        bench_panel_steps(prompts, adapters, args)
        return
    if args.build_steps:
        bench_build_steps(prompts, adapters, args)
        return
    print(f"load average before: {os.getloadavg()}")
    systems = args.systems.split(",")
    ours = [name for name in systems if name in ("ours", "ours-eager-lora", "ours-no-amx", "ours-base", *COPIES)]
    llm, load_times = time_loading(adapters, args) if ours else (None, None)
    for system in COPIES:
        if system in systems:
            load_copies(llm, adapters, system, args)
    runners = {
        "ours": lambda: run_ours(llm, prompts, adapters, True, args),
        "ours-base": lambda: run_ours(llm, prompts, adapters, False, args),
        "ours-eager-lora": lambda: run_ours(llm, prompts, adapters, True, args, eager_lora=True),
        "ours-no-amx": lambda: run_ours(llm, prompts, adapters, True, args, amx=False),
        **{system: (lambda prefix=prefix: run_ours(llm, prompts, adapters, True, args, prefix=prefix))
           for system, prefix in COPIES.items()},
        "hf-grouped": lambda: run_hf(prompts, adapters, False, args),
        "hf-mixed": lambda: run_hf(prompts, adapters, True, args),
    }
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    schedule = [name for _ in range(args.rounds) for name in ours] + [n for n in systems if n not in ours]
    for name in schedule:
        r = runners[name]()
        runs[name].append(r)
        print(f"{name:12s} {r['output_tokens']:6d} tokens in {r['wall_s']:6.2f} s = {r['tok_s']:7.1f} tok/s", flush=True)
    results = {name: {**median_run(rs), "runs": rs} for name, rs in runs.items()}
    if args.rounds > 1:
        for name in ours:
            print(f"{name:12s} median of {args.rounds}: {results[name]['tok_s']:7.1f} tok/s")
    overheads = {}
    for name in ("ours", "ours-eager-lora"):
        if name in results and "ours-base" in results:
            # per round, from the runs next to each other in time; then the median round
            per_round = sorted(b["tok_s"] / a["tok_s"] - 1 for a, b in zip(runs[name], runs["ours-base"]))
            overheads[name] = per_round[len(per_round) // 2]
            rounds = f" (median of rounds: {', '.join(f'{100 * o:.1f}%' for o in per_round)})" if args.rounds > 1 else ""
            print(f"{name} LoRA overhead vs base: {100 * overheads[name]:.1f}%{rounds}")
    overhead = overheads.get("ours")
    tp = llm.engine.tp_stats() if llm is not None else None
    if tp:
        print(f"tensor parallel {args.tensor_parallel} over {llm.engine.tp.backend}: {tp['steps']} steps; per step broadcast "
              f"{tp['broadcast_bytes']:.0f} B in {1e3 * tp['broadcast_s']:.3f} ms, all-reduces "
              f"{tp['reduce_bytes'] / 1024:.1f} KiB in {1e3 * tp['reduce_s']:.3f} ms")
    if args.json_out:
        args.json_out.write_text(json.dumps({"load_before": os.getloadavg(), "load_times": load_times,
                                              "results": results, "lora_overhead": overhead, "tensor_parallel": tp},
                                             indent=2))
    if llm is not None:
        llm.engine.close()          # tensor-parallel ranks stop here, not by seeing this process gone


if __name__ == "__main__":
    main()
