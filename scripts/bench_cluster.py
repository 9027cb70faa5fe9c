"""Cluster-mode benchmark: three asyncserve peers on this machine, bursty skewed traffic all sent to
the first one, once per dispatch policy (and with migration).

For each policy it starts three `asyncserve serve` processes (each pinned to its own share of the
cores with taskset where the machine has enough, else sharing them, `--threads` each), waits until
they are ready and see each other, runs scripts/bench_serving.py's S-LoRA workload (Gamma arrivals,
power-law adapter popularity) against node 0, reads the nodes' forwarding and migration counters,
and stops the three (SIGTERM, then SIGKILL by PID). Prints one row per policy and writes the
bench_serving reports to --out.

    python scripts/make_adapters.py 40 /tmp/cluster-adapters --model default
    python scripts/bench_cluster.py --adapters /tmp/cluster-adapters --out /tmp/bench-cluster

Run it on a quiet machine: the three servers and the client share its cores. With --cpu-limit C
each server runs in a CPU cgroup of its own capped at C cores (CFS quota: what a Kubernetes
`limits.cpu` does), so the three behave as machines of their own, none able to use what another
leaves idle; it needs a writable cgroup cpu controller (v1 at /sys/fs/cgroup/cpu, or v2), i.e. root.
--cpu-limit C0,C1,C2 caps each node at its own share: servers of unequal size (a smaller machine, a
noisy neighbour), where a request runs decides how fast it is served.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NODES = 3
DEFAULT_POLICIES = "local,round-robin,least-pending,rank-aware,rank-aware+migrate"


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples in a /metrics page: every label set, or those with `label`
    (e.g. 'kind="request"')."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and label in line:
            total += float(line.split()[-1])
    return total


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def linked_adapters(folder: Path, prefix: str, out: Path, count: int | None = None, name: str = "adapters") -> Path:
    """bench_serving names adapters PREFIX0, PREFIX1, ...: a folder out/name of links with those names
    to the first ``count`` adapter folders (default: all)."""
    links = out / name
    shutil.rmtree(links, ignore_errors=True)
    links.mkdir(parents=True)
    sources = sorted(p for p in folder.iterdir() if (p / "adapter_config.json").is_file())
    for k, src in enumerate(sources[:count]):
        (links / f"{prefix}{k}").symlink_to(src.resolve())
    return links


def cpu_limits(text: str) -> list[float]:
    """--cpu-limit: one cap for every node, or one per node."""
    caps = [float(c) for c in text.split(",")]
    if len(caps) not in (1, NODES) or min(caps) <= 0:
        raise argparse.ArgumentTypeError(f"give one positive number of cores, or {NODES} separated by commas")
    return caps * NODES if len(caps) == 1 else caps


def core_sets(args) -> list[str | None]:
    """Each node's own cores for taskset, where the machine has enough and no --cpu-limit shares them."""
    cores = sorted(os.sched_getaffinity(0))
    if args.cpu_limit or shutil.which("taskset") is None or len(cores) < NODES * args.threads:
        return [None] * NODES
    return [",".join(map(str, cores[i * args.threads:(i + 1) * args.threads])) for i in range(NODES)]


class CpuLimit:
    """A CPU cgroup capping its processes at `cores` cores (quota per 100 ms period; None: no cap),
    with ten times a process's CPU weight, so that other work on the box (another engineer's tests)
    takes little of the quota; removed by `remove` once its processes have exited."""
    PERIOD_US = 100_000

    def __init__(self, name: str, cores: float | None):
        quota = int(cores * self.PERIOD_US) if cores is not None else None
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").is_file():
            self.path = v1 / name
            self.path.mkdir()
            (self.path / "cpu.shares").write_text(str(10 * 1024))
            if quota is not None:
                (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in Path("/sys/fs/cgroup/cgroup.subtree_control").read_text().split():
            self.path = Path("/sys/fs/cgroup") / name
            self.path.mkdir()
            (self.path / "cpu.weight").write_text(str(10 * 100))
            if quota is not None:
                (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        else:
            raise SystemExit("--cpu-limit needs a cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 with cpu enabled)")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled_s(self) -> float:
        """Seconds its processes waited for quota so far."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat["throttled_time"]) / 1e9 if "throttled_time" in stat else int(stat["throttled_usec"]) / 1e6

    def remove(self) -> None:
        self.path.rmdir()


def start_nodes(args, policy: str, adapters: Path, log_dir: Path,
                limits: list[CpuLimit | None]) -> list[subprocess.Popen]:
    dispatch, _, extra = policy.partition("+")
    ports = [args.base_port + i for i in range(NODES)]
    peers = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    env = {**os.environ, "ASYNCSERVE_CLUSTER_KEY": secrets.token_hex(32), "ASYNCSERVE_THREADS": str(args.threads)}
    procs = []
    for i, (port, cores, limit) in enumerate(zip(ports, core_sets(args), limits)):
        cmd = [str(REPO / ".venv/bin/asyncserve"), "serve", "--port", str(port), "--node-id", f"n{i}",
               "--threads", str(args.threads), "--pool-mem", args.pool_mem, "--max-running", str(args.max_running),
               "--adapter-dir", str(adapters), "--peers", peers, "--dispatch", dispatch,
               "--migration-threshold", str(args.migration_threshold if extra == "migrate" else 0),
               "--log-level", "INFO"]         # the cluster's moves and peer failures are logged at INFO
        if args.model:
            cmd += ["--model", args.model]
        if cores is not None:
            cmd = ["taskset", "-c", cores] + cmd
        log = open(log_dir / f"{policy}-n{i}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        if limit is not None:
            limit.add(procs[-1].pid)
    deadline = time.monotonic() + args.start_timeout
    for port in ports:
        while True:
            try:
                get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    stop_nodes(procs)
                    raise SystemExit(f"{policy}: the servers did not start (logs in {log_dir})")
                time.sleep(0.5)
    while metric(get(f"http://127.0.0.1:{ports[0]}/metrics"), "asyncserve_peers_alive") < NODES - 1:
        if time.monotonic() > deadline:
            stop_nodes(procs)
            raise SystemExit(f"{policy}: the peers did not find each other")
        time.sleep(0.2)
    return procs


def stop_nodes(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(40)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_policy(args, policy: str, adapters: Path, report: Path) -> tuple[list[str], list[float]]:
    """One policy's run on three fresh servers: their /metrics pages at the end, and with --cpu-limit
    the seconds each server waited for its quota."""
    limits: list[CpuLimit | None] = []
    try:
        for i in range(NODES):
            limits.append(CpuLimit(f"asyncserve-bench-{os.getpid()}-n{i}", args.cpu_limit[i]) if args.cpu_limit else None)
        client = CpuLimit(f"asyncserve-bench-{os.getpid()}-client", None) if args.cpu_limit else None
        limits.append(client)
        procs = start_nodes(args, policy, adapters, args.out, limits[:NODES])
        try:
            client_cmd = [sys.executable, str(REPO / "scripts/bench_serving.py"),
                          "--base-url", f"http://127.0.0.1:{args.base_port}/v1", "--workload", "slora",
                          "--adapter-prefix", "lora", "--n-adapters", str(args.n_adapters), "--alpha", str(args.alpha),
                          "--rate", str(args.rate), "--cv", str(args.cv), "--duration", str(args.duration),
                          "--input-range", *map(str, args.input_range), "--output-range", *map(str, args.output_range),
                          "--slo-latency", str(args.slo_latency), "--json-out", str(report), "--no-progress"]
            procs.append(subprocess.Popen(client_cmd, stdout=subprocess.DEVNULL))
            if client is not None:
                client.add(procs[-1].pid)
            if procs[-1].wait() != 0:
                raise SystemExit(f"{policy}: bench_serving.py failed (exit {procs[-1].returncode})")
            pages = [get(f"http://127.0.0.1:{args.base_port + i}/metrics") for i in range(NODES)]
            return pages, [limit.throttled_s() for limit in limits[:NODES] if limit is not None]
        finally:
            stop_nodes(procs)
    finally:
        for limit in limits:
            if limit is not None:
                limit.remove()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=Path, required=True, help="a folder of adapter folders (make_adapters.py)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-cluster"))
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="dispatch policies; POLICY+migrate adds migration")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per server")
    ap.add_argument("--pool-mem", default="512MiB")
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--migration-threshold", type=float, default=2.0)
    ap.add_argument("--base-port", type=int, default=8100)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--rate", type=float, default=3.0, help="requests/s (Gamma arrivals)")
    ap.add_argument("--cv", type=float, default=3.0, help="coefficient of variation of inter-arrivals: bursts")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--n-adapters", type=int, default=40)
    ap.add_argument("--alpha", type=float, default=0.3, help="power law of adapter popularity: smaller is more skewed")
    ap.add_argument("--input-range", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--output-range", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--slo-latency", type=float, default=20.0, help="seconds")
    ap.add_argument("--cpu-limit", type=cpu_limits, metavar="C[,C,C]",
                    help="cap each server at this many cores (or each at its own), in a cgroup of its own")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    adapters = linked_adapters(args.adapters, "lora", args.out)
    rows = []
    for k, policy in enumerate(args.policies.split(",")):       # a policy named twice runs twice (interleave)
        report = args.out / f"{k:02d}-{policy}.json"
        pages, throttled = run_policy(args, policy, adapters, report)
        summary = json.loads(report.read_text())["summary"]
        rows.append({"policy": policy, "mean_latency_s": summary["latency_s"]["mean"],
                     "p99_latency_s": summary["latency_s"]["p99"],
                     "slo_attainment": summary["slo"]["attainment"]["all"], "errors": summary["errors"],
                     "forwarded": sum(metric(p, "asyncserve_requests_forwarded_total") for p in pages),
                     # requests moved for load; resubmitted after a peer failed; adapter loads moves caused
                     **{column: sum(metric(p, "asyncserve_migrations_total", f'kind="{kind}"') for p in pages)
                        for column, kind in (("migrated", "request"), ("resubmitted", "resubmit"),
                                             ("migration_adapter_loads", "adapter"))},
                     "tokens_by_node": [metric(p, "asyncserve_generated_tokens_total") for p in pages],
                     "cpu_throttled_s": throttled})
        r = rows[-1]
        print(f"{policy:<22} mean {r['mean_latency_s']:7.2f} s  p99 {r['p99_latency_s']:7.2f} s  "
              f"SLO {100 * r['slo_attainment']:5.1f} %  errors {r['errors']}  forwarded {r['forwarded']:.0f}  "
              f"migrated {r['migrated']:.0f}  resubmitted {r['resubmitted']:.0f}  "
              f"adapter loads for moves {r['migration_adapter_loads']:.0f}  "
              f"tokens by node {'/'.join(f'{t:.0f}' for t in r['tokens_by_node'])}"
              + (f"  throttled {'/'.join(f'{t:.0f}' for t in throttled)} s" if throttled else ""), flush=True)
    (args.out / "summary.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "cores": core_sets(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
