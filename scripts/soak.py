"""Soak test: a server under many streams for a long time, with the faults a deployment meets.

Starts `asyncserve serve` on --adapter-dir (made with make_adapters.py when empty) and drives
--streams concurrent streams for --duration seconds over its adapters (S-LoRA's power-law
popularity, workloads.slora_synthetic; bench_serving.send_request per request), while:

  - a fraction of the clients disconnect mid-stream (--disconnect-fraction);
  - adapters are loaded at runtime, streamed to and unloaded again (every --load-every s);
  - a CPU LoRA worker is SIGKILLed (every --kill-every s);
  - a malformed adapter folder is loaded (every --bad-every s, a different kind each time).

It reports every request's end by kind (tokens, a clear error by HTTP status / error code, a
client disconnect, or lost: neither its tokens nor an error), the server's and its workers' RSS and
the pool pages over time (plotted), what each fault got, the pool pages once the streams end, and
the server's /dev/shm entries while it runs and after it exits: a JSON report and a PNG.

    # the issue's soak: 1,000 streams, 30 minutes, 200 adapters
    python scripts/soak.py --model MODEL --adapter-dir /tmp/soak-adapters --out soak
    # a short check (the tests' tiny model shapes work too: --model an HF folder of any Llama)
    python scripts/soak.py --model MODEL --adapter-dir /tmp/a20 --adapters 20 --streams 100 --duration 60 \\
        --kill-every 20 --bad-every 10 --load-every 10 --out /tmp/soak-short
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from bench_serving import send_request
from workloads import Request, slora_synthetic

REPO_ROOT = Path(__file__).resolve().parents[1]
API_KEY = "soak-key"
# malformed adapter folders, one per --bad-every (issue 33's list first): each must get a 4xx, promptly,
# and leave the server serving; the two backtracking keys are regular (the bounded matcher may take
# them, as keys that match no module: 200, then unloaded) but froze `re` for minutes
BAD_KINDS = ("dtype_list", "peft_type_int", "rank_pattern_regex", "rank_pattern_list", "alpha_400_digits",
             "config_not_utf8", "header_brackets", "padded_3gib", "duplicate_names", "overlapping_offsets",
             "rank_pattern_backtrack", "alpha_pattern_backtrack", "header_100mb", "config_not_json", "rank_not_int",
             "no_weights", "truncated_weights", "shape_mismatch", "nan_weights")
LOST = ("short", "no_content", "exception")        # ends that are neither the tokens nor a clear error


# ---- the server -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, work: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncserve.cli", "serve", "--adapter-dir", str(args.adapter_dir),
           "--adapter-root", str(work), "--port", str(port), "--api-key", API_KEY,
           "--cpu-workers", str(args.cpu_workers), "--cpu-assist", "on" if args.cpu_workers else "off",
           "--max-waiting", str(max(1024, 2 * args.streams)), "--step-profile", "off", "--log-level", "WARNING",
           *(["--model", args.model] if args.model else []), *args.server_arg]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    log = open(work / "server.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)


async def wait_healthy(session: aiohttp.ClientSession, base: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode} before it was ready (see server.log)")
        try:
            async with session.get(f"{base}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit("the server did not become ready")


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the process's children."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError):
            continue
    return out


def rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0.0)


def shm_entries(pid: int) -> list[str]:
    """The server's POSIX shared memory segments and semaphores (ipc/names.py: asyncserve-<pid>-...)."""
    return sorted(p.name for p in Path("/dev/shm").iterdir() if re.match(rf"(sem\.)?asyncserve-{pid}-", p.name))


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


# ---- malformed adapters -----------------------------------------------------------------------------

def write_bad_adapter(kind: str, good: Path, folder: Path) -> None:
    """A copy of a good adapter folder broken in one way."""
    shutil.copytree(good, folder)
    config_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    config = json.loads(config_path.read_text())
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    config_changes = {
        "peft_type_int": {"peft_type": 5}, "rank_not_int": {"r": "eight"},
        "rank_pattern_regex": {"rank_pattern": {"(": 8}}, "rank_pattern_list": {"rank_pattern": [8]},
        "alpha_400_digits": {"lora_alpha": int("9" * 400)},
        "rank_pattern_backtrack": {"rank_pattern": {"(.|.)*X": 8}},
        "alpha_pattern_backtrack": {"alpha_pattern": {"(.|.)*X": 8}},
    }
    if kind in config_changes:
        config_path.write_text(json.dumps({**config, **config_changes[kind]}))
    elif kind == "config_not_json":
        config_path.write_bytes(b'{"r": 8, ')
    elif kind == "config_not_utf8":          # valid JSON but for one Latin-1 byte
        config_path.write_bytes(json.dumps({**config, "base_model_name_or_path": "caf\u00e9"},
                                           ensure_ascii=False).encode("latin-1"))
    elif kind == "no_weights":
        weights.unlink()
    elif kind == "truncated_weights":
        weights.write_bytes(raw[:len(raw) // 2])
    elif kind == "padded_3gib":              # sparse: refused by its length, never read
        os.truncate(weights, 3 << 30)
    elif kind == "header_brackets":
        weights.write_bytes(struct.pack("<Q", 100_000) + b"[" * 100_000)
    elif kind == "header_100mb":             # a header length of 100 MB in a (sparse) file long enough for it
        weights.write_bytes(struct.pack("<Q", 100 << 20) + raw[8:8 + n])
        os.truncate(weights, 8 + (100 << 20) + len(body))
    elif kind == "duplicate_names":          # the second tensor's entry under the first one's name
        encoded = json.dumps(header).replace(json.dumps(tensors[1]) + ":", json.dumps(tensors[0]) + ":", 1).encode()
        weights.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)
    elif kind in ("shape_mismatch", "nan_weights", "dtype_list", "overlapping_offsets"):
        entry = header[next(k for k in tensors if k.endswith("lora_A.weight"))]
        if kind == "shape_mismatch":
            entry["shape"] = [entry["shape"][0] + 1, entry["shape"][1]]
        elif kind == "dtype_list":
            entry["dtype"] = [entry["dtype"]]
        elif kind == "overlapping_offsets":  # the last tensor moved 4 bytes back, over the one before it
            last = header[tensors[-1]]
            last["data_offsets"] = [o - 4 for o in last["data_offsets"]]
        elif kind == "nan_weights":          # the first element of the tensor: float32 NaN
            start = entry["data_offsets"][0]
            body = body[:start] + struct.pack("<f", float("nan")) + body[start + 4:]
        encoded = json.dumps(header).encode()
        weights.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)
    else:
        raise ValueError(f"unknown bad adapter kind {kind!r}")


# ---- the run ----------------------------------------------------------------------------------------

class Soak:
    def __init__(self, args, base: str, server: subprocess.Popen, work: Path, base_model: str):
        self.args, self.base, self.server, self.work, self.base_model = args, base, server, work, base_model
        self.headers = {"Authorization": f"Bearer {API_KEY}"}
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.duration
        self.ends: Counter = Counter()
        self.examples: dict[str, str] = {}
        self.events: list[dict] = []
        self.samples: list[dict] = []
        self.runtime: dict[str, float] = {}            # runtime adapter -> when it was loaded
        self.in_flight = 0
        self.sent = 0
        requests = slora_synthetic(args.adapters, alpha=1.0, rate=1.0, cv=1.0, input_range=tuple(args.input_range),
                                   output_range=tuple(args.output_range), num_requests=10_000, seed=args.seed,
                                   adapter_prefix=args.adapter_prefix)
        self.requests = [r if self.rng.random() >= args.base_fraction else
                         Request(r.index, 0.0, base_model, r.max_tokens, r.prompt, prompt_len=r.prompt_len)
                         for r in requests]

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def event(self, kind: str, **detail) -> None:
        self.events.append({"t": self.now(), "kind": kind, **detail})
        print(f"[{self.now():8.1f}s] {kind} {detail}", flush=True)

    def record(self, kind: str, example: str = "") -> None:
        self.ends[kind] += 1
        if example and kind not in self.examples:
            self.examples[kind] = example[:300]

    # -- streams ----------------------------------------------------------------------------------
    async def lane(self, session: aiohttp.ClientSession, lane: int) -> None:
        i = lane
        while time.monotonic() < self.deadline:
            request = self.requests[i % len(self.requests)]
            i += self.args.streams
            if self.runtime and self.rng.random() < self.args.runtime_fraction:
                request = Request(request.index, 0.0, self.rng.choice(list(self.runtime)), request.max_tokens,
                                  request.prompt, prompt_len=request.prompt_len)
            leave_after = self.rng.uniform(0.05, 2.0) if self.rng.random() < self.args.disconnect_fraction else None
            self.in_flight += 1
            self.sent += 1
            try:
                call = send_request(session, f"{self.base}/v1/completions", self.headers, request, "completions",
                                    self.t0)
                if leave_after is None:
                    result = await call
                else:
                    try:
                        result = await asyncio.wait_for(call, leave_after)
                    except asyncio.TimeoutError:
                        self.record("client_disconnect")
                        continue
            finally:
                self.in_flight -= 1
            self.classify(request, result)

    def classify(self, request: Request, result) -> None:
        error = result.error
        if error is None:
            self.record("ok" if result.output_tokens == request.max_tokens else "short",
                        f"{result.output_tokens} of {request.max_tokens} tokens")
        elif error.startswith("HTTP "):
            code = re.search(r'"code": ?"([a-z_]+)"', error)
            self.record(f"http_{error[5:8]}:{code.group(1) if code else '?'}", error)
        elif error.startswith("stream error"):
            code = re.search(r'"code": ?"([a-z_]+)"', error)
            self.record(f"stream_error:{code.group(1) if code else '?'}", error)
        elif error == "no content in the response":
            self.record("no_content", error)
        else:
            self.record(f"exception:{error.split(':')[0]}", error)

    # -- faults -----------------------------------------------------------------------------------
    async def every(self, period: float, action) -> None:
        if period <= 0:
            return
        n = 0
        while True:
            await asyncio.sleep(max(0.0, self.t0 + (n + 1) * period - time.monotonic()))
            if time.monotonic() >= self.deadline:
                return
            n += 1
            try:
                await action(n)
            except Exception as e:          # a fault that could not be staged is reported, the run goes on
                self.event("fault_error", error=f"{type(e).__name__}: {e}")

    async def post(self, session, path: str, body: dict) -> tuple[int, str]:
        async with session.post(f"{self.base}{path}", json=body, headers=self.headers) as r:
            return r.status, (await r.text())[:300]

    async def load_cycle(self, session, n: int) -> None:
        """Load a runtime adapter (streams pick it for a while), unload the one loaded two cycles ago."""
        folders = sorted((self.work / "runtime").iterdir())
        name = f"rt-{n}"
        status, text = await self.post(session, "/v1/load_lora_adapter",
                                       {"lora_name": name, "lora_path": str(folders[n % len(folders)])})
        if status == 200:
            self.runtime[name] = time.monotonic()
        self.event("load", adapter=name, status=status, **({} if status == 200 else {"body": text}))
        for old in [a for a, t in self.runtime.items() if time.monotonic() - t > 2 * self.args.load_every]:
            del self.runtime[old]
            status, text = await self.post(session, "/v1/unload_lora_adapter", {"lora_name": old})
            self.event("unload", adapter=old, status=status, **({} if status == 200 else {"body": text}))

    async def kill_worker(self, session, n: int) -> None:
        workers = [pid for pid, cmd in children(self.server.pid) if "ipc.worker" in cmd]
        if not workers:
            self.event("kill_worker", pid=None, note="no CPU worker alive")
            return
        pid = self.rng.choice(workers)
        os.kill(pid, signal.SIGKILL)
        self.event("kill_worker", pid=pid)

    async def bad_load(self, session, n: int) -> None:
        kind = self.args.bad_kinds[(n - 1) % len(self.args.bad_kinds)]
        good = sorted((self.work / "runtime").iterdir())[0]
        folder = self.work / "bad" / f"{kind}-{n}"
        write_bad_adapter(kind, good, folder)
        t = time.monotonic()
        status, text = await self.post(session, "/v1/load_lora_adapter",
                                       {"lora_name": f"bad-{n}", "lora_path": str(folder)})
        self.event("bad_load", adapter_kind=kind, status=status, seconds=round(time.monotonic() - t, 3),
                   body=text[:160])
        if status == 200:              # accepted after all: take it out again
            await self.post(session, "/v1/unload_lora_adapter", {"lora_name": f"bad-{n}"})
        shutil.rmtree(folder)

    # -- sampling ---------------------------------------------------------------------------------
    async def sample(self, session) -> dict:
        workers = [pid for pid, cmd in children(self.server.pid) if "ipc.worker" in cmd]
        t = time.monotonic()
        try:
            async with session.get(f"{self.base}/metrics", headers=self.headers) as r:
                metrics = parse_metrics(await r.text())
            metrics_s = time.monotonic() - t
        except aiohttp.ClientError:
            metrics, metrics_s = {}, None
        return {"t": self.now(), "server_rss_mb": round(rss_mb(self.server.pid), 1),
                "workers_rss_mb": round(sum(rss_mb(p) for p in workers), 1), "worker_processes": len(workers),
                "cpu_workers_gauge": metrics.get("asyncserve_cpu_workers"),
                "kv_pages": metrics.get('asyncserve_pool_pages{kind="kv"}'),
                "adapter_pages": metrics.get('asyncserve_pool_pages{kind="adapter"}'),
                "free_pages": metrics.get('asyncserve_pool_pages{kind="free"}'),
                "running": metrics.get("asyncserve_running_requests"),
                "waiting": metrics.get("asyncserve_waiting_requests"),
                "in_flight": self.in_flight, "sent": self.sent, "metrics_s": metrics_s}

    async def sampler(self, session) -> None:
        while True:
            self.samples.append(await self.sample(session))
            await asyncio.sleep(self.args.sample_every)

    async def run(self) -> None:
        request_timeout = self.args.request_timeout or self.args.duration + 900
        timeout = aiohttp.ClientTimeout(total=request_timeout)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as control:
            background = [asyncio.ensure_future(self.sampler(control))]
            faults = [self.every(self.args.load_every, lambda n: self.load_cycle(control, n)),
                      self.every(self.args.kill_every, lambda n: self.kill_worker(control, n)),
                      self.every(self.args.bad_every, lambda n: self.bad_load(control, n))]
            lanes = [self.lane(session, i) for i in range(self.args.streams)]
            await asyncio.gather(*lanes, *faults)
            self.event("streams_done", sent=self.sent)
            for name in list(self.runtime):
                status, _ = await self.post(control, "/v1/unload_lora_adapter", {"lora_name": name})
                self.event("unload", adapter=name, status=status)
            self.runtime.clear()
            # the pool once the server has let go of the streams (aborted ones free pages after a step)
            deadline = time.monotonic() + 30
            while True:
                final = await self.sample(control)
                if final["kv_pages"] == 0 and final["running"] == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            self.final = final
            background[0].cancel()


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    t = [s["t"] for s in samples]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    top.plot(t, [s["server_rss_mb"] for s in samples], label="server RSS")
    top.plot(t, [s["workers_rss_mb"] for s in samples], label="CPU workers' RSS (sum)")
    top.set_ylabel("MiB")
    bottom.plot(t, [s["in_flight"] for s in samples], label="client streams in flight")
    bottom.plot(t, [s["kv_pages"] or 0 for s in samples], label="KV pages")
    bottom.plot(t, [s["adapter_pages"] or 0 for s in samples], label="adapter pages")
    bottom.set_ylabel("count")
    bottom.set_xlabel("seconds")
    for axis in (top, bottom):
        for e in report["events"]:
            if e["kind"] == "kill_worker":
                axis.axvline(e["t"], color="red", alpha=0.5, linestyle="--")
            elif e["kind"] == "bad_load":
                axis.axvline(e["t"], color="grey", alpha=0.3, linestyle=":")
        axis.grid(alpha=0.3)
        axis.legend(loc="upper left")
    c = report["config"]
    figure.suptitle(f"soak: {c['streams']} streams, {c['adapters']} adapters, {c['duration']:g} s "
                    "(red: a CPU worker SIGKILLed, grey: a malformed adapter loaded)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def make_adapters(count: int, folder: Path, model: str | None, prefix: str, seed: int) -> None:
    from make_adapters import main as make

    make([str(count), str(folder), "--model", model or "default", "--prefix", prefix, "--seed", str(seed),
          "--ranks", "4", "8", "16"])


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="what `asyncserve serve --model` takes (default: its default)")
    ap.add_argument("--adapter-dir", type=Path, required=True, help="made with make_adapters.py when missing or empty")
    ap.add_argument("--adapters", type=int, default=200, help="adapters in --adapter-dir (made: lora0, lora1, ...)")
    ap.add_argument("--adapter-prefix", default="lora")
    ap.add_argument("--streams", type=int, default=1000, help="concurrent client streams")
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of streams")
    ap.add_argument("--input-range", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--output-range", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--base-fraction", type=float, default=0.1, help="requests to the base model")
    ap.add_argument("--disconnect-fraction", type=float, default=0.1,
                    help="requests whose client leaves after 0.05-2 s")
    ap.add_argument("--runtime-fraction", type=float, default=0.05, help="requests to a runtime-loaded adapter")
    ap.add_argument("--load-every", type=float, default=20.0, help="seconds between runtime loads (0: none)")
    ap.add_argument("--kill-every", type=float, default=180.0, help="seconds between CPU worker SIGKILLs (0: none)")
    ap.add_argument("--bad-every", type=float, default=60.0, help="seconds between malformed adapter loads (0: none)")
    ap.add_argument("--bad-kinds", nargs="+", default=list(BAD_KINDS), choices=BAD_KINDS)
    ap.add_argument("--cpu-workers", type=int, default=2)
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS and /metrics samples")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="seconds a client waits for its whole answer (default: --duration + 900; 1,000 streams "
                         "queue for minutes on a small CPU, and no client should give up on a request the server "
                         "still serves: one it forgot shows as lost when this runs out)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--server-arg", action="append", default=[], help="one more `serve` argument; repeat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.png")
    return ap.parse_args(argv)


async def amain(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="asyncserve-soak-"))
    if not args.adapter_dir.is_dir() or not any(args.adapter_dir.iterdir()):
        make_adapters(args.adapters, args.adapter_dir, args.model, args.adapter_prefix, args.seed)
    make_adapters(4, work / "runtime", args.model, "rt", args.seed + 1)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(args, work, port)
    report: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "work": str(work)}
    try:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, base, server, args.start_timeout)
            async with session.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                models = (await r.json())["data"]
        base_model = next(m["id"] for m in models if not m.get("parent"))
        soak = Soak(args, base, server, work, base_model)
        await soak.run()
        shm_live = shm_entries(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            exit_code = server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
            exit_code = server.wait()
    ends = dict(soak.ends.most_common())
    rss = [s["server_rss_mb"] for s in soak.samples]
    warm = rss[len(rss) // 4:] or rss
    report.update({
        "requests": {"sent": soak.sent, "ends": ends, "examples": soak.examples,
                     "lost": sum(n for kind, n in ends.items() if kind.split(":")[0] in LOST)},
        "rss_mb": {"start": rss[0] if rss else None, "max": max(rss, default=None), "end": rss[-1] if rss else None,
                   "after_warmup_min": min(warm, default=None), "after_warmup_max": max(warm, default=None)},
        "faults": {kind: [e for e in soak.events if e["kind"] == kind] for kind in ("kill_worker", "bad_load")},
        "final": {"pool": {k: soak.final[k] for k in ("kv_pages", "adapter_pages", "free_pages", "running", "waiting",
                                                        "cpu_workers_gauge", "worker_processes")},
                  "dev_shm_while_running": shm_live, "dev_shm_after_exit": shm_entries(server.pid),
                  "server_exit_code": exit_code},
        "events": soak.events, "samples": soak.samples,
    })
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = asyncio.run(amain(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, Path(f"{args.out}.png"))
    summary = {k: report[k] for k in ("requests", "rss_mb")}
    summary["final"] = report["final"]
    summary["faults"] = {k: [(e["t"], e.get("status", e.get("pid")), e.get("adapter_kind")) for e in v]
                         for k, v in report["faults"].items()}
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
