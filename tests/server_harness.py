"""Runs an asyncserve Server on a uvloop event loop in a background thread, for HTTP tests."""
from __future__ import annotations

import asyncio
import json
import socket
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

    def stream(self, path: str, body: dict) -> list[dict]:
        """The JSON chunks of a server-sent-event response, up to [DONE] (which must come)."""
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        chunks = []
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    data = line[len(b"data: "):].strip()
                    if data == b"[DONE]":
                        return chunks
                    chunks.append(json.loads(data))
        raise AssertionError("the stream ended without data: [DONE]")

    def metric(self, name: str, labels: str = "") -> float:
        text = self.request("GET", "/metrics")[1]
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        raise KeyError(key)
