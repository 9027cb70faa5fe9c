"""Scheduling policies against FCFS on the papers' workloads, one freshly started server per run.

dlora (dLoRA §7.3, Figure 10): W1-like requests (64-token prompts, 64 output tokens, closed loop)
over 8 adapters whose popularity goes from uniform to 90% one adapter; fcfs (unmerged), merged-only
(one adapter at a time) and dlora; throughput and mean latency at each skew.

slora (S-LoRA §7, Figure 10): Gamma arrivals with cv 1..4 and power-law adapter popularity; fcfs,
affinity and slo; TTFT SLO attainment (requests refused with 429 count as misses) and throughput.
--slo-ttft auto sets the SLO to FCFS's 65th-percentile TTFT at the first cv, so FCFS attains about
65% there (the papers set the SLO where FCFS attains 50-80%).

    python scripts/make_adapters.py 8 /tmp/policy-adapters --model default
    python scripts/bench_policies.py dlora --adapters /tmp/policy-adapters --out /tmp/bench-policies --plot
    python scripts/bench_policies.py slora --adapters /tmp/policy-adapters --out /tmp/bench-policies --plot
    python scripts/bench_policies.py slora --adapters /tmp/policy-adapters --policies fcfs,affinity \
        --max-step-adapters 1,2,4,8 --alpha 1       # S-LoRA's Figure 12: affinity's d against FCFS

Each server runs with --log-level WARNING and its log goes to OUT/<run>.log. Run it on a quiet
machine: the server and the client share its cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench_cluster import get, linked_adapters, stop_nodes

REPO = Path(__file__).resolve().parents[1]
SWEEPS = {
    "dlora": {"policies": "fcfs,merged-only,dlora", "points": "0.125,0.3,0.5,0.7,0.9"},   # adapter 0's share
    "slora": {"policies": "fcfs,affinity,slo", "points": "1,2,4"},                       # cv of inter-arrivals
}


def start_server(args, name: str, flags: list[str], adapters: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncserve.cli", "serve", "--port", str(args.port), "--threads", str(args.threads),
           "--pool-mem", args.pool_mem, "--max-running", str(args.max_running), "--adapter-dir", str(adapters),
           "--log-level", "WARNING", *flags]
    if args.model:
        cmd += ["--model", args.model]
    log = open(args.out / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.start_timeout
    while True:
        try:
            get(f"http://127.0.0.1:{args.port}/health")
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                stop_nodes([proc])
                raise SystemExit(f"{name}: the server did not start (log in {args.out / name}.log)")
            time.sleep(0.5)


def bench(args, name: str, workload: list[str]) -> dict:
    """bench_serving.py's report of one run against the server on args.port (it exits 1, report written,
    when no request completed: the slo policy may refuse them all)."""
    report = args.out / f"{name}.json"
    report.unlink(missing_ok=True)
    subprocess.run([sys.executable, str(REPO / "scripts/bench_serving.py"), "--base-url",
                    f"http://127.0.0.1:{args.port}/v1", "--adapter-prefix", "lora", "--seed", str(args.seed),
                    "--json-out", str(report), "--no-progress", *workload], stdout=subprocess.DEVNULL)
    return json.loads(report.read_text())


def runs(policies: list[str], step_adapters: list[int]) -> list[tuple[str, int | None]]:
    """(policy, d) per run: affinity once per --max-step-adapters d, the others once."""
    return [(p, d) for p in policies for d in (step_adapters if p == "affinity" else [None])]


def run_label(policy: str, d: int | None) -> str:
    return policy if d is None else f"{policy}-d{d}"


def policy_flags(args, policy: str, slo_ttft: float | None, d: int | None = None) -> list[str]:
    flags = ["--policy", policy]
    if d is not None:
        flags += ["--max-step-adapters", str(d)]
    if policy == "slo":
        flags += ["--slo-ttft", str(slo_ttft)]
    return flags


def workload(args, point: float, slo_ttft: float | None) -> list[str]:
    if args.sweep == "dlora":
        return ["--workload", "skew", "--top-share", str(point), "--n-adapters", "8", "--num-requests",
                str(args.num_requests), "--max-in-flight", str(args.max_in_flight)]
    flags = ["--workload", "slora", "--cv", str(point), "--n-adapters", str(args.n_adapters), "--alpha",
             str(args.alpha), "--rate", str(args.rate), "--duration", str(args.duration),
             "--input-range", *map(str, args.input_range), "--output-range", *map(str, args.output_range)]
    return flags + (["--slo-ttft", str(slo_ttft)] if slo_ttft is not None else [])


def ttft_percentile(report: dict, q: float) -> float:
    """A TTFT percentile over all requests, a failed one counting as never served."""
    values = [r["ttft_s"] if r["ttft_s"] is not None and r["error"] is None else np.inf for r in report["requests"]]
    return float(np.percentile(values, q))


def plot(rows: list[dict], sweep: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_tokens_per_s", "output tokens/s"), ("mean_latency_s", "mean latency (s)")) if sweep == "dlora" \
        else (("slo_attainment", "TTFT SLO attainment"), ("output_tokens_per_s", "output tokens/s"))
    xlabel = "share of the most popular adapter" if sweep == "dlora" else "cv of inter-arrival times"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, label) in zip(axes, panels):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            ax.plot([r["point"] for r in mine], [r[key] for r in mine], marker="o", label=policy)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{sweep} sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", choices=sorted(SWEEPS))
    ap.add_argument("--adapters", type=Path, required=True, help="a folder of adapter folders (make_adapters.py)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-policies"))
    ap.add_argument("--policies", default=None, help="comma-separated (default: the sweep's three)")
    ap.add_argument("--points", default=None, help="comma-separated skews (dlora) or cvs (slora)")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server (default: all cores)")
    ap.add_argument("--pool-mem", default="1GiB")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--plot", action="store_true", help="OUT/<sweep>.png: the two metrics against the sweep's axis")
    d = ap.add_argument_group("dlora sweep")
    d.add_argument("--num-requests", type=int, default=128)
    d.add_argument("--max-in-flight", type=int, default=32)
    s = ap.add_argument_group("slora sweep")
    s.add_argument("--slo-ttft", default="auto", help="seconds, or auto (FCFS's 65th percentile at the first cv)")
    s.add_argument("--max-step-adapters", default="2", help="affinity's d, comma-separated for a sweep (2,4,8)")
    s.add_argument("--n-adapters", type=int, default=8)
    s.add_argument("--alpha", type=float, default=0.3, help="power law of adapter popularity: smaller is more "
                   "skewed, 1 uniform (S-LoRA's Figures 11-12 use 1)")
    s.add_argument("--rate", type=float, default=2.0, help="requests/s")
    s.add_argument("--duration", type=float, default=60.0)
    s.add_argument("--input-range", type=int, nargs=2, default=[8, 256])
    s.add_argument("--output-range", type=int, nargs=2, default=[8, 128])
    args = ap.parse_args(argv)
    args.threads = args.threads or os.cpu_count()
    args.out.mkdir(parents=True, exist_ok=True)
    adapters = linked_adapters(args.adapters, "lora", args.out)
    policies = (args.policies or SWEEPS[args.sweep]["policies"]).split(",")
    points = [float(p) for p in (args.points or SWEEPS[args.sweep]["points"]).split(",")]
    slo_ttft = None if args.sweep == "dlora" or args.slo_ttft == "auto" else float(args.slo_ttft)
    if args.sweep == "slora" and slo_ttft is None:       # calibrate on FCFS at the first point
        proc = start_server(args, "calibrate", policy_flags(args, "fcfs", None), adapters)
        try:
            report = bench(args, "calibrate", workload(args, points[0], None))
        finally:
            stop_nodes([proc])
        slo_ttft = round(ttft_percentile(report, 65), 3)
        print(f"TTFT SLO: {slo_ttft} s (FCFS's 65th percentile at cv {points[0]:g})", flush=True)
    rows = []
    step_adapters = [int(d) for d in args.max_step_adapters.split(",")]
    for point in points:
        for policy, d in runs(policies, step_adapters):
            label = run_label(policy, d)
            name = f"{args.sweep}-{label}-{point:g}"
            proc = start_server(args, name, policy_flags(args, policy, slo_ttft, d), adapters)
            try:
                summary = bench(args, name, workload(args, point, slo_ttft))["summary"]
            finally:
                stop_nodes([proc])
            rows.append({"policy": label, "point": point, "output_tokens_per_s": summary["output_tokens_per_s"],
                         "mean_latency_s": summary["latency_s"]["mean"], "mean_ttft_s": summary["ttft_s"]["mean"],
                         "errors": summary["errors"],
                         "slo_attainment": summary["slo"]["attainment"]["all"] if "slo" in summary else None})
            r = rows[-1]
            attained = f"  SLO {100 * r['slo_attainment']:5.1f} %" if r["slo_attainment"] is not None else ""
            print(f"{args.sweep} {point:<6g} {label:<12} {r['output_tokens_per_s'] or 0:8.1f} tok/s  mean latency "
                  f"{r['mean_latency_s'] or float('nan'):7.2f} s{attained}  errors {r['errors']}", flush=True)
    (args.out / f"{args.sweep}.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items()}, "slo_ttft_s": slo_ttft, "loadavg": os.getloadavg(),
        "rows": rows}, indent=2))
    if args.plot:
        plot(rows, args.sweep, args.out / f"{args.sweep}.png")


if __name__ == "__main__":
    main()
