"""HTTP test servers: ServerThread runs an asyncserve Server on a uvloop event loop in a background
thread; ServedProcess runs `asyncserve serve` in a subprocess (for exits, signals and child processes)."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import uvloop

from asyncserve.config import Config
from asyncserve.server import Server


class ServerThread:
    def __init__(self, config: Config, any_port: bool = True, wait: bool = True, resolver=socket.getaddrinfo):
        """any_port: listen on a free port of 127.0.0.1, else at config's host and port; wait: until the
        model is loaded, else see wait_ready; resolver: how cluster mode resolves its dns: peers."""
        if any_port:
            config.port = 0
        self.server = Server(config, resolver=resolver)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.server.start())
        self.base = f"http://127.0.0.1:{self.server.port}" if any_port else f"http://{config.host}:{config.port}"
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while not self.server.ready:
            assert self.server.failed is None, self.server.failed
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.05)

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
        """(status, parsed JSON or text, headers) of a plain HTTP request."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers or {})
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, raw, hdrs = r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            status, raw, hdrs = e.code, e.read(), e.headers
        try:
            return status, json.loads(raw), hdrs
        except ValueError:
            return status, raw.decode(errors="replace"), hdrs

    def greedy_token_ids(self, model: str, prompt: list[int], max_tokens: int) -> list[int]:
        """The token ids of a greedy /v1/completions of ``prompt`` (ids) by ``model``, eos ignored."""
        status, out, _ = self.request("POST", "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert status == 200, out
        return out["choices"][0]["token_ids"]

    def stream(self, path: str, body: dict, done: bool = True) -> list[dict]:
        """The JSON chunks of a server-sent-event response, up to [DONE] (which must come; done=False:
        to the end of the response, as /v1/responses ends its streams, and no [DONE] may come)."""
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        chunks = []
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    data = line[len(b"data: "):].strip()
                    if data == b"[DONE]":
                        assert done, "a data: [DONE] came"
                        return chunks
                    chunks.append(json.loads(data))
        assert not done, "the stream ended without data: [DONE]"
        return chunks

    def metric(self, name: str, labels: str = "") -> float:
        text = self.request("GET", "/metrics")[1]
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        raise KeyError(key)


class ServedProcess:
    """`python -m asyncserve.cli serve <args>` on 127.0.0.1 (pass --port 0): started, its output kept in
    ``log`` by a thread, and waited for until it says ready (a start failure fails the test)."""

    def __init__(self, *args: str, cwd=None, start_timeout_s: float = 120):
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncserve.cli", "serve", *args], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.base = None
        deadline = time.monotonic() + start_timeout_s
        while True:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            if m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
                self.base = m.group(1)
            if "ready:" in line:
                break
            assert "could not start" not in line, line

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)

    @property
    def shm_prefix(self) -> str:
        """The prefix of the server's names in /dev/shm (ipc/names.py)."""
        return f"/asyncserve-{self.proc.pid}-"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        """Send ``sig`` and wait for the exit code."""
        self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def close(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 30 s; a no-op once it has exited."""
        if self.proc.poll() is None:
            try:
                self.stop(signal.SIGTERM, 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
