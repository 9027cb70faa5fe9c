"""A new user's first contact: start-up failures say why in one line (no traceback, no usage dump),
threads follow the CPUs the process may use (affinity mask, cgroup quota), setup.sh picks the torch
build that fits the machine, and the progress of long start-up work is shown."""
from __future__ import annotations

import http.server
import importlib.util
import io
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import asyncserve
from asyncserve.config import Config
from asyncserve.cpus import cgroup_cpu_quota, own_cgroup, usable_cpus
from asyncserve.progress import LOG_EVERY_S, Progress

REPO = Path(asyncserve.__file__).resolve().parents[1]
SERVE = [sys.executable, "-m", "asyncserve.cli", "serve", "--port", "0", "--threads", "1", "--device", "cpu",
         "--dtype", "float32", "--step-profile", "off"]


def _torch_index():
    spec = importlib.util.spec_from_file_location("torch_index", REPO / "scripts/torch_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- start-up failures ---------------------------------------------------------------------------

def test_start_up_failures_are_one_line_without_a_traceback(tmp_path, smollm2_gguf):
    """Each in its own process, all at once (each pays for importing torch): the exit status, the
    reason, and nothing else on stderr where the failure comes before the server listens."""
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    (not_a_model / "README.md").write_text("not a model")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    truncated = tmp_path / "truncated.gguf"       # a real GGUF's first 64 KiB: the header starts well
    with smollm2_gguf.open("rb") as f:
        truncated.write_bytes(f.read(64 * 1024))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    generate = [sys.executable, "-m", "asyncserve.cli", "generate", "--prompt", "hi", "--device", "cpu"]
    # (command, exit status, the reason, whether the reason is all stderr holds)
    cases = [
        (SERVE + ["--model", str(not_a_model)], 2, f"{not_a_model} is not a model folder: config.json is missing",
         True),
        (SERVE + ["--model", str(tmp_path / "nowhere")], 2, f"model path {tmp_path / 'nowhere'} does not exist", True),
        (SERVE + ["--model", str(garbage)], 2, f"cannot read {garbage} as a GGUF file: it does not start with", True),
        (SERVE + ["--model", str(smollm2_gguf), "--port", str(port)], 1,
         f"port {port} on 127.0.0.1 is in use by another process: stop it (`ss -ltnp 'sport = :{port}'` shows "
         "which) or choose another port with --port", True),
        (generate + ["--model", str(tmp_path / "nowhere")], 2, "does not exist", True),
        # found only while loading, after the server listens: the reason is the last line
        (SERVE + ["--model", str(truncated)], 1, f"could not start: cannot read {truncated} as a GGUF file "
                                                 "(truncated or corrupt?)", False),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=env)
             for cmd, *_ in cases]
    try:
        for proc, (cmd, status, reason, alone) in zip(procs, cases):
            _, err = proc.communicate(timeout=120)
            lines = err.decode().splitlines()
            assert proc.returncode == status, (cmd, lines)
            assert not any("Traceback" in line for line in lines), (cmd, lines)
            assert reason in lines[-1], (cmd, lines)
            if alone:
                assert len(lines) == 1, (cmd, lines)
    finally:
        taken.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


# ---- threads ---------------------------------------------------------------------------------------

def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.mark.parametrize("files, cgroup, mask, cpus", [
    ({"cpu.max": "400000 100000"}, "/", range(64), 4),          # a 4-CPU limit on a 64-core node
    ({"cpu.max": "400000 100000"}, "/", range(2), 2),           # the mask is smaller
    ({"cpu.max": "max 100000"}, "/", range(6), 6),              # no quota
    ({"cpu.max": "150000 100000"}, "/", range(8), 1),           # 1.5 CPUs: one thread at full speed
    ({"cpu.max": "20000 100000"}, "/", range(8), 1),            # at least one
    ({"cpu.max": "200000 100000", "pod/app/cpu.max": "max 100000"}, "/pod/app", range(16), 2),  # a parent binds
    ({"cpu.max": "800000 100000", "pod/cpu.max": "300000 100000"}, "/pod/app", range(16), 3),
    ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, "/", range(16), 3),   # cgroup v1
    ({"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, "/", range(5), 5),
    ({}, "/", range(3), 3),                                     # no cgroup files at all
])
def test_threads_follow_the_cgroup_quota_and_the_affinity_mask(tmp_path, files, cgroup, mask, cpus):
    root = _cgroup(tmp_path, files)
    assert usable_cpus(root, cgroup, set(mask)) == cpus


def test_quota_of_this_process_own_group(tmp_path):
    (tmp_path / "proc_cgroup").write_text("0::/user.slice/job\n")
    root = _cgroup(tmp_path / "fs", {"user.slice/cpu.max": "250000 100000"})
    assert own_cgroup(tmp_path / "proc_cgroup") == "/user.slice/job"
    assert cgroup_cpu_quota(root, "/user.slice/job") == 2.5
    assert cgroup_cpu_quota(root, "/") is None


def test_default_threads_follow_a_reduced_affinity_mask(monkeypatch):
    """Config's default (no --threads) under a real one-CPU mask: one thread, whatever the core count."""
    monkeypatch.delenv("ASYNCSERVE_THREADS", raising=False)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})      # this thread only; restored below
    try:
        assert Config(cpu_workers=0).resolved_threads() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert Config(cpu_workers=0).resolved_threads() == usable_cpus() >= 1
    assert Config(threads=3).resolved_threads() == 3


# ---- setup.sh's torch index ------------------------------------------------------------------------

def test_torch_index_choice():
    ti = _torch_index()
    calls = []

    def probe(name, answer):
        return lambda: calls.append(name) or answer

    cpu_index = ["--index-url", ti.CPU_INDEX]
    for gpu, reachable, args in [(False, True, cpu_index), (False, False, []), (True, True, []), (True, False, [])]:
        calls.clear()
        chosen, reason = ti.choose(None, probe("gpu", gpu), probe("reach", reachable))
        assert chosen == args, (gpu, reachable, reason)
        assert calls == (["gpu"] if gpu else ["gpu", "reach"])      # no network probe on a GPU box
        assert reason.startswith("a CUDA GPU") == gpu
        assert ("cannot be reached" in reason) == (not gpu and not reachable)
    calls.clear()
    chosen, reason = ti.choose("https://mirror.example/torch-cpu", probe("gpu", True), probe("reach", True))
    assert chosen == ["--index-url", "https://mirror.example/torch-cpu"] and calls == []
    assert "ASYNCSERVE_TORCH_INDEX" in reason


def _stub_nvidia_smi(folder: Path, status: int) -> Path:
    folder.mkdir()
    stub = folder / "nvidia-smi"
    stub.write_text(f"#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\nexit {status}\n")
    stub.chmod(0o755)
    return folder


def test_gpu_probe_runs_nvidia_smi(tmp_path, monkeypatch):
    ti = _torch_index()
    monkeypatch.setenv("PATH", str(_stub_nvidia_smi(tmp_path / "gpu", 0)))
    assert ti.has_cuda_gpu()
    monkeypatch.setenv("PATH", str(_stub_nvidia_smi(tmp_path / "broken", 9)))   # no driver: it fails
    assert not ti.has_cuda_gpu()
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert not ti.has_cuda_gpu()


def test_index_reachability_is_probed_fast(tmp_path):
    ti = _torch_index()

    class Index(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200 if self.path == "/whl/cpu/torch/" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.socket()          # accepts connections (the backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))     # bound, not listening: connections are refused
    try:
        assert ti.reachable(f"http://127.0.0.1:{server.server_port}/whl/cpu")
        assert not ti.reachable(f"http://127.0.0.1:{server.server_port}/elsewhere")
        assert not ti.reachable(f"http://127.0.0.1:{closed.getsockname()[1]}/whl/cpu")
        t0 = time.monotonic()
        assert not ti.reachable(f"http://127.0.0.1:{silent.getsockname()[1]}/whl/cpu", timeout_s=0.5)
        assert time.monotonic() - t0 < 3
    finally:
        server.shutdown()
        server.server_close()
        silent.close()
        closed.close()


def test_torch_index_script_prints_pips_arguments(tmp_path):
    """What setup.sh reads: one argument a line on stdout, the reason on stderr."""
    script = [sys.executable, str(REPO / "scripts/torch_index.py")]
    env = {"PATH": str(_stub_nvidia_smi(tmp_path / "gpu", 0))}
    out = subprocess.run(script, capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0 and out.stdout == "" and "a CUDA GPU" in out.stderr
    env["ASYNCSERVE_TORCH_INDEX"] = "https://mirror.example/cpu"
    out = subprocess.run(script, capture_output=True, text=True, env=env, timeout=30)
    assert out.stdout.splitlines() == ["--index-url", "https://mirror.example/cpu"]


# ---- progress --------------------------------------------------------------------------------------

class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal():
    clock, term = _Clock(), _Terminal()
    progress = Progress("loading m.gguf", "tensors", stream=term, clock=clock)
    for done in range(1, 101):
        clock.now += 0.01
        progress(done, 100)
    progress.close()
    frames = term.getvalue().split("\r")[1:]
    assert 5 <= len(frames) <= 13                      # redrawn every 0.1 s and at the end, not per tensor
    assert frames[0].startswith("loading m.gguf [###.") and "/100 tensors" in frames[0]
    assert frames[-1].startswith("loading m.gguf [" + "#" * 30 + "] 100/100 tensors") and frames[-1].endswith("\n")


def test_progress_logs_every_few_seconds_without_a_terminal(caplog):
    clock = _Clock()
    with caplog.at_level(logging.INFO, logger="asyncserve.progress"):
        quick = Progress("preloading adapters", "adapters", stream=io.StringIO(), clock=clock)
        for done in range(1, 11):
            clock.now += 0.1
            quick(done, 10)
        quick.close()
        assert caplog.messages == []                    # done within LOG_EVERY_S: nothing to say
        slow = Progress("measuring the step profile", "steps", stream=io.StringIO(), clock=clock)
        for done in range(1, 37):
            clock.now += 1.0
            slow(done, 36)
        slow.close()
    assert len(caplog.messages) == 36 // LOG_EVERY_S + 1, caplog.messages
    assert caplog.messages[0].startswith("measuring the step profile: 5/36 steps (14%)")
    assert caplog.messages[-1].startswith("measuring the step profile: 36/36 steps (100%)")


def test_model_loading_reports_each_tensor(tiny_model):
    from asyncserve.model.loader import load_model

    calls = []
    loaded = load_model(str(tiny_model.root), lambda done, total: calls.append((done, total)))
    total = len(loaded.weights)
    assert calls == [(done, total) for done in range(1, total + 1)]
