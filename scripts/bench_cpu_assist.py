"""CPU-assist benchmark (CaraServe §4 on S-LoRA's synthetic trace): TTFT and throughput with every
adapter the trace needs warm on the device, with on-demand loading and no assist, and with the CPU
workers assisting cold adapters (``on``, and ``auto``, which assists only where its profile says
it pays).

For each mode it starts one `asyncserve serve` on 127.0.0.1 over --adapters (a folder of PEFT
folders, linked as lora0, lora1, ... as bench_serving.py names them), waits for /health, runs
scripts/bench_serving.py's `slora` workload (power-law popularity, Gamma arrivals), reads the
server's CPU-assist and load counters, and stops it (SIGTERM, then SIGKILL, by PID). Prints one
row per mode and writes the bench_serving reports and summary.json to --out.

    python scripts/make_adapters.py 1000 /tmp/assist-adapters --model default --ranks 8 16 32 64
    python scripts/bench_cpu_assist.py --adapters /tmp/assist-adapters --out /tmp/bench-assist

Modes: warm (the trace's adapters pinned on the device), ondemand (--cpu-assist off), assist-on,
assist-auto (both with --cpu-workers). The host tier (--host-adapter-mem) should hold every adapter
the trace needs, so the modes differ in the host -> device step, the one the workers can cover;
the first request of each adapter still reads it from disk in every mode but warm and preloaded.

Many adapters against few (S-LoRA Table 3: throughput with 1,000 adapters is 0.945 of that with 5):
mode "few" is ondemand's server over only the first --few-adapters adapters, and its trace the same
requests (same seed: arrivals, lengths, prompts) with their adapters drawn among those few. At a
rate the server cannot keep up with, both runs measure the server's own throughput; the summary
prints many/few = ondemand's output tok/s over few's, and each row says whether the run was
saturated (the last request arrived before the first half of the run was over) and whether the
host tier holds every adapter that mode's trace needs. Mode "preloaded" is ondemand's server with
--preload-adapters, the trace started once every adapter is in the host tier: S-LoRA's setting
(all adapters in host memory, paged onto the device on demand); the summary prints its ratio too.

    python scripts/bench_cpu_assist.py --adapters /tmp/assist-adapters --modes few,ondemand \
        --rate 20 --duration 30 --output-range 8 128 --out /tmp/bench-scale
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench_cluster import get, linked_adapters, metric
from asyncserve.config import parse_size
from ipc.profile import cpu_model

REPO = Path(__file__).resolve().parents[1]
MODES = ("warm", "ondemand", "assist-on", "assist-auto", "few", "preloaded")


def trace_args(args, n_adapters: int) -> list[str]:
    return ["--workload", "slora", "--adapter-prefix", "lora", "--n-adapters", str(n_adapters),
            "--alpha", str(args.alpha), "--rate", str(args.rate), "--cv", str(args.cv),
            "--duration", str(args.duration), "--input-range", *map(str, args.input_range),
            "--output-range", *map(str, args.output_range), "--seed", str(args.seed)]


def needed_adapters(args, n_adapters: int) -> list[str]:
    out = subprocess.run([sys.executable, str(REPO / "scripts/bench_serving.py"), *trace_args(args, n_adapters),
                          "--list-adapters"],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


def free_port() -> int:
    """A port nobody listens on now (other servers may share this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, mode: str, adapters: Path, pinned: list[str], log_dir: Path) -> tuple[subprocess.Popen, int]:
    port = args.port or free_port()
    cmd = [sys.executable, "-c", "from asyncserve.cli import main; main()", "serve", "--port", str(port),
           "--adapter-dir", str(adapters), "--pool-mem", args.pool_mem, "--host-adapter-mem", args.host_adapter_mem,
           "--max-running", str(args.max_running), "--log-level", "WARNING",
           "--cpu-profile-dir", str(args.out / "profiles")]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if mode == "warm":
        cmd += [arg for name in pinned for arg in ("--pin-adapter", name)] + ["--cpu-assist", "off"]
    elif mode in ("ondemand", "few"):
        cmd += ["--cpu-assist", "off"]
    elif mode == "preloaded":
        cmd += ["--cpu-assist", "off", "--preload-adapters"]
    else:
        cmd += ["--cpu-assist", mode.removeprefix("assist-"), "--cpu-workers", str(args.cpu_workers)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = open(log_dir / f"{mode}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + args.start_timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            get(f"http://127.0.0.1:{port}/health")
        except OSError:
            time.sleep(0.5)
            continue
        if proc.poll() is None:            # ours answered, not another server that took the port
            warm_up(port)
            while metric(get(f"http://127.0.0.1:{port}/metrics"), "asyncserve_adapters_preloading") and \
                    proc.poll() is None:
                time.sleep(1.0)
            return proc, port
    stop_server(proc)
    raise SystemExit(f"{mode}: the server did not start (log in {log_dir / f'{mode}.log'})")


def warm_up(port: int) -> None:
    """One base-model request before the trace, so that one-time costs (a native kernel build, the
    first GEMMs' setup) land in no mode's numbers; it touches no adapter."""
    base = json.loads(get(f"http://127.0.0.1:{port}/v1/models"))["data"][0]["id"]
    body = json.dumps({"model": base, "prompt": "the " * 64, "max_tokens": 4, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=Path, required=True, help="a folder of adapter folders (make_adapters.py)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-assist"))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=None, help="the server's torch threads")
    ap.add_argument("--cpu-workers", type=int, default=2)
    ap.add_argument("--pool-mem", default="4GiB", help="room for the warm mode's pinned adapters")
    ap.add_argument("--host-adapter-mem", default="4GiB")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--port", type=int, default=None, help="default: a free one")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--n-adapters", type=int, default=1000)
    ap.add_argument("--few-adapters", type=int, default=5, help="mode few: the trace's adapters (S-LoRA: 5)")
    ap.add_argument("--alpha", type=float, default=1.0, help="workloads.py's power law (S-LoRA's α)")
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s (Gamma arrivals)")
    ap.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of inter-arrivals")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--input-range", type=int, nargs=2, default=[8, 256])
    ap.add_argument("--output-range", type=int, nargs=2, default=[8, 64])
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    adapters = linked_adapters(args.adapters, "lora", args.out)
    few = linked_adapters(args.adapters, "lora", args.out, count=args.few_adapters, name="few-adapters")
    pinned = needed_adapters(args, args.n_adapters)
    rows = []
    for mode in args.modes.split(","):
        n_adapters = args.few_adapters if mode == "few" else args.n_adapters
        proc, port = start_server(args, mode, few if mode == "few" else adapters, pinned, args.out)
        try:
            report = args.out / f"{mode}.json"
            subprocess.run([sys.executable, str(REPO / "scripts/bench_serving.py"),
                            "--base-url", f"http://127.0.0.1:{port}/v1", *trace_args(args, n_adapters),
                            "--json-out", str(report), "--no-progress"], check=True, stdout=subprocess.DEVNULL)
            page = get(f"http://127.0.0.1:{port}/metrics")
        finally:
            stop_server(proc)
        results = json.loads(report.read_text())
        summary = results["summary"]
        rows.append({"mode": mode, "saturated": saturated(results["requests"]),
                     "host_tier_holds_trace": host_holds(args, adapters, needed_adapters(args, n_adapters)),
                     "ttft_mean_s": summary["ttft_s"]["mean"], "ttft_p99_s": summary["ttft_s"]["p99"],
                     "output_tokens_per_s": summary["output_tokens_per_s"], "requests_per_s": summary["requests_per_s"],
                     "errors": summary["errors"], "cpu_workers": metric(page, "asyncserve_cpu_workers"),
                     "assisted_tokens": metric(page, "asyncserve_cpu_assist_tokens_total"),
                     "worker_restarts": metric(page, "asyncserve_cpu_worker_restarts_total"),
                     "device_loads": metric(page, "asyncserve_adapter_loads_total"),
                     "disk_loads": metric(page, "asyncserve_adapter_load_seconds_count", 'from="disk"'),
                     "steps": metric(page, "asyncserve_step_duration_seconds_count")})
        r = rows[-1]
        print(f"{mode:<12} TTFT mean {r['ttft_mean_s']:7.3f} s  p99 {r['ttft_p99_s']:7.3f} s  "
              f"{r['output_tokens_per_s']:7.1f} tok/s  errors {r['errors']}  assisted tokens "
              f"{r['assisted_tokens']:.0f}  device loads {r['device_loads']:.0f}  disk loads {r['disk_loads']:.0f}  steps {r['steps']:.0f}  "
              f"saturated {r['saturated']}  host tier holds the trace's adapters {r['host_tier_holds_trace']}",
              flush=True)
    runs: dict[str, list[float]] = {}          # a mode named twice runs twice (interleave them: the box drifts)
    for r in rows:
        runs.setdefault(r["mode"], []).append(r["output_tokens_per_s"])
    mean = {mode: sum(v) / len(v) for mode, v in runs.items()}
    ratios = {many: mean[many] / mean["few"] for many in ("ondemand", "preloaded") if many in mean and mean.get("few")}
    for many, ratio in ratios.items():
        print(f"many/few: {args.n_adapters} adapters ({many}, {len(runs[many])} runs) against {args.few_adapters} "
              f"(few, {len(runs['few'])} runs): {ratio:.3f} of the mean output tok/s (S-LoRA: 0.945; goal >= 0.95)")
    (args.out / "summary.json").write_text(json.dumps({
        "command": " ".join([sys.executable, *sys.argv]), "cpu": cpu_model(),
        "cores": os.cpu_count(), "loadavg": os.getloadavg(), "needed_adapters": len(pinned),
        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "many_over_few": ratios}, indent=2))


def saturated(results: list[dict]) -> bool:
    """Whether the server, not the arrivals, set the pace: the last request was sent before the first
    half of the run was over (a backlog served the rest)."""
    first = min(r["start_s"] for r in results)
    return max(r["start_s"] for r in results) - first < 0.5 * (max(r["end_s"] for r in results) - first)


def host_holds(args, adapters: Path, names: list[str]) -> bool:
    """Whether the host tier (--host-adapter-mem) holds every adapter the trace needs at once (their
    weight files' bytes: the tier's copies are about as large in bf16)."""
    need = sum((adapters / name / "adapter_model.safetensors").stat().st_size for name in names)
    return need <= parse_size(args.host_adapter_mem)


if __name__ == "__main__":
    main()
