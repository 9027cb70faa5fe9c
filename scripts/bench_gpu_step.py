"""Decode steps at a model's shapes: wall time against GPU time, CUDA graphs against --enforce-eager,
and the step against the HBM floor (issue 36).

A random checkpoint of the chosen shapes (SmolLM2's tokenizer; weights drawn on the device, written
once to --work, e.g. /dev/shm) and a few random adapter files linked under as many names as a run
needs (each name is its own adapter to the engine: its own pool rows and slot), then per
(running, adapters, mode): `running` requests of a --prompt-len prompt, the i-th on adapter i % adapters
(so a step holds min(running, adapters) distinct ones), stepped until all decode, then --steps decode
steps timed: the engine's schedule / run / postprocess on the host clock, the step's span between
CUDA events, and under torch.profiler the sum of its kernels' GPU time. The HBM floor is the bytes a
decode step must read (weights, and the KV of every context) over the bandwidth of a device copy.

    python scripts/bench_gpu_step.py --shape 7b --running 32 64 --adapters 4 1000 --out /tmp/out/step.json
    python scripts/bench_gpu_step.py --shape tiny --device cpu --steps 3   # the script's own check

--host-only (CPU, any shape; tiny is enough): the graph path's host side alone. Decode steps replay
through a seam whose graphs run nothing (HostOnlySeam), so a step's time is what the host does around
the kernels: schedule; fill (write_pending, the graph's rows and sampling columns, the fixed buffer's
fill and upload, the replay call, the copy of the tokens back); sample (the sampler's host work: the
SampleOutput of the tokens the graph sampled, or for rows not all plain sample() over
HOST_ONLY_COLUMNS logits); postprocess (tokens appended, stop checks, detokenizing, the updates, the
step-time model's record). Medians in microseconds per step of the thread's CPU time (1 torch thread;
other processes' use of the core does not count) and of the wall. --profile FILE: cProfile of as many
steps again, after the timed ones.

    python scripts/bench_gpu_step.py --host-only --shape tiny --device cpu --running 32 64 --adapters 4 1000 \
        --steps 300 --work /tmp/b --out host.jsonl
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_checkpoint import random_adapters, random_weights, write_skeleton  # noqa: E402

SHAPES = {
    # TinyLlama-1.1B and Llama-7B (SmolLM2's vocabulary); tiny: the CPU check of this script
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=2048),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, tie_word_embeddings=False, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=2048),
}


def make_model(shape: str, work: Path, device: torch.device, distinct: int, rank: int) -> tuple[Path, Path]:
    """The checkpoint folder and a folder of `distinct` adapter files (q, v at `rank`), made once."""
    folder = work / shape
    if not (folder / "model.safetensors").is_file():
        t0 = time.perf_counter()
        if not (folder / "config.json").is_file():     # a skeleton made beforehand travels where the default model cannot
            write_skeleton("default", folder, SHAPES[shape])
        size = random_weights(folder, torch.bfloat16, device, seed=0)
        random_adapters(folder, distinct, [rank], ["q_proj", "v_proj"], seed=1)
        print(f"[{shape}] checkpoint of {size / 2**30:.1f} GiB and {distinct} adapters in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    return folder, folder / "adapters"


def link_adapters(sources: Path, out: Path, count: int) -> Path:
    """`count` adapter names a0.. linked to the source folders in turn."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    files = sorted(p for p in sources.iterdir() if (p / "adapter_config.json").is_file())
    for k in range(count):
        (out / f"a{k}").symlink_to(files[k % len(files)].resolve())
    return out


def hbm_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of a 1 GiB device-to-device copy (reads and writes counted)."""
    if device.type != "cuda":
        return None
    x = torch.empty(2**29, dtype=torch.int16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * 10 * x.numel() * 2 / (start.elapsed_time(end) / 1e3)


def run_case(args, folder: Path, adapters: Path, running: int, n_adapters: int, eager: bool, bandwidth) -> dict:
    from asyncserve import LLM, SamplingParams

    device = torch.device(args.device)
    llm = LLM(model=str(folder), adapter_dir=str(adapters), dtype=args.dtype, device=args.device,
              lora_backend=args.lora_backend, max_running=running, pool_mem=args.pool_mem, enforce_eager=eager,
              cpu_workers=0, max_step_tokens=max(args.prompt_len * running, 512) if device.type == "cuda" else None)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.prompt_len + 10 * args.steps, temperature=0.0, ignore_eos=True)
    for i in range(running):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)]
        name = f"a{i % n_adapters}" if n_adapters else None
        engine.add(engine.make_sequence(prompt, params, name, arrival=time.monotonic()))
    # prefill (and adapter loads) until every request decodes, then warm-up decode steps (graph captures)
    for _ in range(10000):
        engine.step()
        seqs = engine.scheduler.running
        if len(seqs) == running and all(s.num_computed >= args.prompt_len for s in seqs):
            break
    for _ in range(args.warmup):
        plan = engine.schedule()
        engine.postprocess(plan, engine.run(plan))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    timed = {"schedule": [], "run": [], "postprocess": [], "wall": [], "events": []}
    decodes = []
    for _ in range(args.steps):
        sync()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        plan = engine.schedule()
        t1 = time.perf_counter()
        result = engine.run(plan)
        t2 = time.perf_counter()
        engine.postprocess(plan, result)
        t3 = time.perf_counter()
        if device.type == "cuda":
            end.record()
            end.synchronize()
            timed["events"].append(start.elapsed_time(end))
        decodes.append(len(plan.decodes))
        for key, value in (("schedule", t1 - t0), ("run", t2 - t1), ("postprocess", t3 - t2), ("wall", t3 - t0)):
            timed[key].append(value * 1e3)
    kernel_ms = None
    if device.type == "cuda":
        try:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    plan = engine.schedule()
                    engine.postprocess(plan, engine.run(plan))
                sync()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernel_ms = sum(e.time_range.elapsed_us() for e in kernels) / 5 / 1e3
        except Exception as e:                      # the profiler is a measurement aid; its failure is reported
            print(f"profiler failed: {e!r}", flush=True)
    graphs = engine.runner.graphs
    weights_bytes = engine.runner.weights.nbytes()
    mc = engine.runner.config
    ctx = args.prompt_len + args.warmup + args.steps // 2
    kv_bytes = running * ctx * 2 * mc.num_layers * mc.kv_size * engine.pool.dtype.itemsize
    med = {k: statistics.median(v) for k, v in timed.items() if v}
    out = {
        "running": running, "adapters": n_adapters, "mode": "eager" if eager else "graphs",
        "decodes_per_step": statistics.median(decodes), "median_ms": med,
        "kernel_ms_profiler": kernel_ms,
        "graph_replays": graphs.replays if graphs else 0, "graph_captures": graphs.captures if graphs else 0,
        "weights_GB": weights_bytes / 1e9, "kv_GB": kv_bytes / 1e9,
    }
    if bandwidth:
        floor = (weights_bytes + kv_bytes) / bandwidth * 1e3
        out.update(hbm_GBps=bandwidth / 1e9, hbm_floor_ms=floor, wall_over_floor=med["wall"] / floor)
    if kernel_ms:
        out["wall_over_gpu"] = med["wall"] / kernel_ms
    del llm, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# logits the host-only sampler reads per row (token ids below it are plain text in SmolLM2's vocabulary)
HOST_ONLY_COLUMNS = 256


class _NoReplay:
    def replay(self) -> None:
        pass


class HostOnlySeam:
    """GraphSeam with the device out of the picture (--host-only): a capture runs the step once for its
    output's shape and keeps its first HOST_ONLY_COLUMNS logits; a replay runs nothing."""

    def capture(self, fn):
        return _NoReplay(), fn()[:, :HOST_ONLY_COLUMNS].contiguous()

    def pinned(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.int64)


def run_host_case(args, folder: Path, adapters: Path, running: int, n_adapters: int) -> dict:
    """The host side of graph-replayed decode steps, per phase (see --host-only)."""
    from asyncserve import LLM, SamplingParams
    from asyncserve.stepper import runner as runner_module

    torch.set_num_threads(1)
    llm = LLM(model=str(folder), adapter_dir=str(adapters), dtype="float32", device="cpu", lora_backend="triton",
              max_running=running, pool_mem=args.pool_mem, cpu_workers=0, threads=1,
              max_step_tokens=args.prompt_len * running)
    engine = llm.engine
    engine.runner.enable_graphs(HostOnlySeam(), running, -(-engine.max_model_len // engine.block_size))
    total = args.warmup + args.steps
    params = SamplingParams(max_tokens=engine.max_model_len - args.prompt_len, temperature=0.0, ignore_eos=True)
    for i in range(running):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)]
        engine.add(engine.make_sequence(prompt, params, f"a{i % n_adapters}" if n_adapters else None))
    seqs = engine.scheduler.running
    while len(seqs) < running or any(s.num_computed < args.prompt_len for s in seqs):
        engine.step()                          # adapter loads and the prefills, eagerly
    # the sampler's host work: sample() of a step whose rows are not all plain, else plain_output (the
    # tokens the graph sampled, copied back, as the step's SampleOutput)
    sample_s = []
    samplers = {name: getattr(runner_module, name) for name in ("sample", "plain_output")
                if hasattr(runner_module, name)}

    def timed(fn):
        def call(*a):
            t0 = time.thread_time_ns()
            try:
                return fn(*a)
            finally:
                sample_s.append(time.thread_time_ns() - t0)
        return call

    for name, fn in samplers.items():
        setattr(runner_module, name, timed(fn))
    phases = ("schedule", "fill", "sample", "postprocess", "step")
    cpu = {k: [] for k in phases}
    wall = {k: [] for k in ("schedule", "run", "postprocess", "step")}
    replays = engine.runner.graphs.replays
    try:
        for k in range(total):
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            plan = engine.schedule()
            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            result = engine.run(plan)
            c2, w2 = time.thread_time_ns(), time.perf_counter_ns()
            engine.postprocess(plan, result)
            c3, w3 = time.thread_time_ns(), time.perf_counter_ns()
            assert len(plan.decodes) == running, "every request decodes in every timed step"
            if k < args.warmup:
                continue
            for key, value in zip(phases, (c1 - c0, c2 - c1 - sample_s[-1], sample_s[-1], c3 - c2, c3 - c0)):
                cpu[key].append(value / 1e3)
            for key, value in zip(wall, (w1 - w0, w2 - w1, w3 - w2, w3 - w0)):
                wall[key].append(value / 1e3)
    finally:
        for name, fn in samplers.items():
            setattr(runner_module, name, fn)
    assert engine.runner.graphs.replays - replays == total, "every step replayed its graph"
    if args.profile:                           # more steps, apart from the timed ones (cProfile slows them)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            plan = engine.schedule()
            engine.postprocess(plan, engine.run(plan))
        profiler.disable()
        profiler.dump_stats(f"{args.profile}.{running}r{n_adapters}a")
    out = {"running": running, "adapters": n_adapters, "mode": "host-only", "steps": args.steps,
           "cpu_us": {k: round(statistics.median(v), 1) for k, v in cpu.items()},
           "wall_us": {k: round(statistics.median(v), 1) for k, v in wall.items()}}
    del llm, engine
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/asyncserve-bench"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lora-backend", default="auto")
    ap.add_argument("--pool-mem", default=None, help="default: 16GiB, --host-only 256MiB")
    ap.add_argument("--running", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--adapters", type=int, nargs="+", default=[4, 1000], help="adapters the requests cycle over "
                    "(0: base model)")
    ap.add_argument("--modes", nargs="+", default=["graphs", "eager"], choices=["graphs", "eager"])
    ap.add_argument("--distinct", type=int, default=8, help="adapter files written; names link to them in turn")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--host-only", action="store_true", help="the graph path's host work alone, on CPU (above)")
    ap.add_argument("--profile", default=None, help="--host-only: cProfile stats of the timed steps, FILE.<case>")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per case, appended as each ends")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.host_only and device.type != "cpu":
        ap.error("--host-only runs on CPU (--device cpu)")
    args.pool_mem = args.pool_mem or ("256MiB" if args.host_only else "16GiB")
    folder, sources = make_model(args.shape, args.work, device if device.type == "cuda" else torch.device("cpu"),
                                 args.distinct, args.rank)
    bandwidth = hbm_bandwidth(device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n_adapters in args.adapters:
        adapters = link_adapters(sources, args.work / f"{args.shape}-names{n_adapters}", max(n_adapters, 1))
        for running in args.running:
            for mode in ["host-only"] if args.host_only else args.modes:
                t0 = time.perf_counter()
                if args.host_only:
                    result = run_host_case(args, folder, adapters, running, n_adapters)
                else:
                    result = run_case(args, folder, adapters, running, n_adapters, mode == "eager", bandwidth)
                result.update(shape=args.shape, device=torch.cuda.get_device_name(device) if device.type == "cuda"
                              else "cpu", case_s=round(time.perf_counter() - t0, 1))
                print(json.dumps(result), flush=True)
                with args.out.open("a") as f:
                    f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
