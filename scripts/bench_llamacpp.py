"""asyncserve against llama.cpp's llama-server on the same GGUF file, same client (bench_serving.py's), interleaved.

Each round starts each server afresh (a cold prefix cache: W1 repeats no prompt), runs W1-shaped loads
(workloads.py's w1: 64-token prompts, 64 greedy tokens, a closed loop of --max-in-flight) on the base model
and/or with 4 adapters chosen per request, and stops it; the systems alternate within a round, so the
box's load drifts over both alike. llama-server takes the adapters as llama.cpp GGUF files (--lora, loaded
at scale 0) and each request names its own (`"lora": [{"id": k, "scale": 1}]`); asyncserve takes the PEFT
folders they were converted from. Build llama-server and convert the adapters as ../shared/bench/README.md
says (llama.cpp's tree inside llama-cpp-python's source distribution); without --llama-server only
asyncserve runs.

    python scripts/make_w1.py --model MODEL.gguf --out /tmp/bench    # /tmp/bench/w1: prompts, PEFT adapters a0..a3
    python scripts/bench_llamacpp.py --gguf MODEL.gguf --bench-dir /tmp/bench \\
        --llama-server BUILD/bin/llama-server --lora-gguf a0.gguf,a1.gguf,a2.gguf,a3.gguf --rounds 3
    # several asyncserve settings (and another checkout of it, e.g. the commit before a change) interleaved
    python scripts/bench_llamacpp.py --gguf MODEL.gguf --loads base --asyncserve-flags="--keep-quantized --dtype float32" \\
        --asyncserve-flags=--no-keep-quantized --baseline-repo /tmp/before

Run it on a quiet machine: the servers' threads spin at barriers, and any other busy process collapses
either one's throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cluster import get, stop_nodes  # noqa: E402
from bench_serving import run_requests, summarize  # noqa: E402
from workloads import W1_NUM_ADAPTERS, adapter_name, w1, w1_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def cpu_description() -> str:
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = [f for f in info.get("flags", "").split() if f.startswith(("avx512", "avx2", "amx", "avx_vnni"))]
    return f"{info.get('model name', platform.processor())}, {os.cpu_count()} CPUs, {' '.join(sorted(flags))}"


def start(name: str, cmd: list[str], port: int, args, repo: Path = REPO) -> subprocess.Popen:
    log = open(args.out / f"{name.replace(' ', '_')}.log", "w")
    env = {**os.environ, "PYTHONPATH": str(repo)}       # repo: this checkout, or --baseline-repo's
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.start_timeout
    while True:
        try:
            get(f"http://127.0.0.1:{port}/health")
            return proc
        except OSError:             # refused while starting; llama-server answers 503 while it loads
            if time.monotonic() > deadline or proc.poll() is not None:
                stop_nodes([proc])
                raise SystemExit(f"{name} did not start (log in {args.out / name}.log)")
            time.sleep(0.5)


def asyncserve_command(args, flags: list[str]) -> list[str]:
    adapters = [f"{adapter_name('a', k)}={w1_file(args.bench_dir, 'adapters') / adapter_name('a', k)}"
                for k in range(W1_NUM_ADAPTERS)]
    cmd = [sys.executable, "-m", "asyncserve.cli", "serve", "--model", str(args.gguf), "--port", str(args.port),
           "--threads", str(args.threads), "--no-prefix-caching", "--log-level", "WARNING", *flags]
    return cmd + [flag for a in adapters for flag in ("--adapter", a)] * ("adapters" in args.loads.split(","))


def llama_server_command(args) -> list[str]:
    cmd = [str(args.llama_server), "-m", str(args.gguf), "-t", str(args.threads), "-np", str(args.max_in_flight),
           "-c", str(args.context), "--no-cache-prompt", "--host", "127.0.0.1", "--port", str(args.port + 1)]
    for lora in args.lora_gguf:
        cmd += ["--lora", str(lora)]
    return cmd + (["--lora-init-without-apply"] if args.lora_gguf else [])


def llama_lora(request) -> dict:
    """llama-server's per-request adapter: W1's a{k} is the k-th --lora file."""
    return {"lora": [{"id": int(request.model[1:]), "scale": 1.0}]}


def run_load(system: str, port: int, load: str, args) -> dict:
    requests = w1(args.bench_dir, args.gguf.stem, use_adapters=load == "adapters", num_requests=args.num_requests)
    extra = llama_lora if system == "llama-server" and load == "adapters" else None
    results = asyncio.run(run_requests(requests, f"http://127.0.0.1:{port}/v1/completions", None, "completions",
                                       False, args.max_in_flight, args.request_timeout, show_progress=False,
                                       extra_body=extra))
    return summarize(results, {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True, help="the GGUF file both servers serve")
    ap.add_argument("--bench-dir", type=Path, default=REPO / ".bench", help="W1's prompts and PEFT adapters (make_w1.py)")
    ap.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary (default: asyncserve alone)")
    ap.add_argument("--lora-gguf", type=lambda s: [Path(p) for p in s.split(",")], default=[],
                    help="a0..a3 converted by llama.cpp's convert_lora_to_gguf.py, comma-separated, in order")
    ap.add_argument("--loads", default="base,adapters", help="base and/or adapters (4 per request, W1's)")
    ap.add_argument("--asyncserve-flags", action="append", default=None,
                    help="more asyncserve serve flags; repeat for several settings, each its own system "
                         "(default: --keep-quantized --dtype float32)")
    ap.add_argument("--baseline-repo", type=Path, help="another checkout of asyncserve (e.g. the commit before a "
                    "change), run with the first --asyncserve-flags as system 'baseline'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-in-flight", type=int, default=16, help="and llama-server's -np")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--context", type=int, default=4096, help="llama-server's -c (shared by its -np slots)")
    ap.add_argument("--port", type=int, default=8103, help="asyncserve's; llama-server's is the next")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, default=Path("bench-llamacpp"), help="logs and results.json")
    args = ap.parse_args()
    settings = [flags.split() for flags in args.asyncserve_flags or ["--keep-quantized --dtype float32"]]
    loads = args.loads.split(",")
    if "adapters" in loads and args.llama_server and len(args.lora_gguf) != W1_NUM_ADAPTERS:
        raise SystemExit(f"--lora-gguf needs W1's {W1_NUM_ADAPTERS} adapters converted for llama-server")
    args.out.mkdir(parents=True, exist_ok=True)
    systems = {"asyncserve" if len(settings) == 1 else f"asyncserve {' '.join(flags)}":
               (asyncserve_command(args, flags), args.port, REPO) for flags in settings}
    if args.baseline_repo:
        systems["baseline"] = (asyncserve_command(args, settings[0]), args.port, args.baseline_repo.resolve())
    if args.llama_server:
        systems["llama-server"] = (llama_server_command(args), args.port + 1, REPO)
    print(f"CPU: {cpu_description()}; {args.gguf.name}; {args.num_requests} requests, {args.max_in_flight} in flight",
          flush=True)

    rows = []
    for round_ in range(args.rounds):
        order = list(systems) if round_ % 2 == 0 else list(reversed(systems))   # neither always runs first
        for system in order:
            cmd, port, repo = systems[system]
            for load in loads:
                proc = start(f"{system}-{load}-{round_}", cmd, port, args, repo)   # a fresh server: a cold cache
                try:
                    loadavg = os.getloadavg()[0]
                    summary = run_load(system, port, load, args)
                finally:
                    stop_nodes([proc])
                row = {"round": round_, "system": system, "load": load, "loadavg_before": loadavg,
                       "tok_s": summary["output_tokens_per_s"], "ttft_mean_s": summary["ttft_s"].get("mean"),
                       "ttft_p50_s": summary["ttft_s"].get("p50"), "tpot_mean_s": summary["tpot_s"].get("mean"),
                       "errors": summary["errors"]}
                rows.append(row)
                nan = float("nan")      # no request completed
                print(f"round {round_} {system:12s} {load:8s}: {row['tok_s'] or nan:.1f} tok/s, TTFT mean "
                      f"{row['ttft_mean_s'] or nan:.2f} s p50 {row['ttft_p50_s'] or nan:.2f} s, TPOT mean "
                      f"{1000 * (row['tpot_mean_s'] or nan):.1f} ms, {row['errors']} "
                      f"errors (load average {loadavg:.2f})", flush=True)
    print("medians over rounds:")
    for load in loads:
        speeds = {s: statistics.median(r["tok_s"] for r in rows if r["system"] == s and r["load"] == load)
                  for s in systems}
        ratio = "".join(f"; {s} / llama-server {v / speeds['llama-server']:.2f}x" for s, v in speeds.items()
                        if s != "llama-server" and "llama-server" in speeds)
        print(f"  {load}: " + ", ".join(f"{s} {v:.1f} tok/s" for s, v in speeds.items()) + ratio)
    (args.out / "results.json").write_text(json.dumps({"cpu": cpu_description(), "gguf": str(args.gguf),
                                                       "args": {k: str(v) for k, v in vars(args).items()},
                                                       "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
