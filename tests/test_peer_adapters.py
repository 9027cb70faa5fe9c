"""Peers' adapters by content (cluster/adapters.py): a request forwarded or migrated to a peer runs there
on its origin's adapter, fetched from the origin if the peer lacks it, and never on another copy of the
same name. First the plain logic against a stub peer (no model), then two servers of the tiny model on
loopback (a at 127.0.0.1 routes round-robin, b at 127.0.0.2 keeps its requests), whose outputs are
checked against the offline engine with the origin's adapters."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from asyncserve import LLM, SamplingParams
from asyncserve.cluster.adapters import ADAPTER_FILE_PATH, AdapterDigests, PeerAdapters, adapter_digest
from asyncserve.cluster.messages import AdapterFileRequest, ForwardedRequest
from asyncserve.cluster.migration import Candidate, CoMigrator
from asyncserve.cluster.routing import NodeLoad
from asyncserve.config import Config
from asyncserve.pager.remote import ADAPTER_FILES, FetchError, FetchLimits
from asyncserve.perf_model import PerfCoefficients
from test_cluster import API_KEY, AUTH, HOSTS, KEY, Node, _stream_with, body, free_port, running_on, streamed

# ---- the logic, against a stub peer -----------------------------------------------------------------


def _adapter_folder(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (root / "adapter_model.safetensors").write_bytes(weights)
    return root


class StubPeer:
    """An aiohttp app on 127.0.0.1 answering POST /cluster/adapter from ``folder``; ``corrupt``: one
    byte of the weights flipped on the way; ``chunked``: no Content-Length; ``stall_s``: wait first."""

    def __init__(self, folder: Path, corrupt: bool = False, chunked: bool = False, stall_s: float = 0.0):
        self.folder, self.corrupt, self.chunked, self.stall_s = folder, corrupt, chunked, stall_s
        self.calls = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        ask = msgspec.json.decode(await request.read(), type=AdapterFileRequest)
        await asyncio.sleep(self.stall_s)
        data = (self.folder / ask.file).read_bytes()
        if self.corrupt and ask.file == "adapter_model.safetensors":
            data = bytes([data[0] ^ 1]) + data[1:]
        if not self.chunked:
            return web.Response(body=data)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(0, len(data), 4096):
            await resp.write(data[i:i + 4096])
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post(ADAPTER_FILE_PATH, self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.2)     # a stalled handler is not waited for
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def _fetching(stub: StubPeer, limits: FetchLimits, *names_and_digests, loaded=None):
    """Run PeerAdapters.adopt for each (name, digest) at once against the stub; their results."""
    import aiohttp

    async with stub as url, aiohttp.ClientSession() as session:
        async def post(peer_url, path, data):
            return await session.post(peer_url + path, data=data)

        async def load(name, folder):
            (loaded if loaded is not None else []).append((name, folder))

        fetcher = PeerAdapters(limits, post, load)
        try:
            return await asyncio.gather(*(fetcher.adopt(url, n, d) for n, d in names_and_digests),
                                        return_exceptions=True)
        finally:
            fetcher.close()


def _cache_entries(cache: Path) -> list[str]:
    return sorted(os.listdir(cache)) if cache.exists() else []


def test_a_fetched_adapter_lands_under_its_digest_once_for_many_callers(tmp_path):
    origin = _adapter_folder(tmp_path / "origin", os.urandom(300_000))
    digest = adapter_digest(origin)
    stub, loaded, cache = StubPeer(origin, chunked=True), [], tmp_path / "cache"
    results = asyncio.run(_fetching(stub, FetchLimits(cache, 10**6, 10.0), *[("x", digest)] * 3, loaded=loaded))
    assert results == [None] * 3
    assert stub.calls == len(ADAPTER_FILES) and loaded == [("x", str(cache / digest))]      # one fetch, one load
    assert _cache_entries(cache) == [digest] and adapter_digest(cache / digest) == digest
    for name in ADAPTER_FILES:
        assert (cache / digest / name).read_bytes() == (origin / name).read_bytes()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_corrupted_transfer_is_refused_and_leaves_nothing(tmp_path, chunked):
    origin = _adapter_folder(tmp_path / "origin", os.urandom(50_000))
    cache = tmp_path / "cache"
    [error] = asyncio.run(_fetching(StubPeer(origin, corrupt=True, chunked=chunked),
                                    FetchLimits(cache, 10**6, 10.0), ("x", adapter_digest(origin))))
    assert isinstance(error, FetchError) and "digest" in str(error), error
    assert _cache_entries(cache) == []


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_adapter_past_the_size_limit_is_refused_and_leaves_nothing(tmp_path, chunked):
    origin = _adapter_folder(tmp_path / "origin", os.urandom(200_000))
    cache = tmp_path / "cache"
    [error] = asyncio.run(_fetching(StubPeer(origin, chunked=chunked), FetchLimits(cache, 100_000, 10.0),
                                    ("x", adapter_digest(origin))))
    assert isinstance(error, FetchError) and "--max-adapter-size" in str(error), error
    assert _cache_entries(cache) == []


def test_a_stalled_peer_times_out_without_stalling_the_event_loop(tmp_path):
    origin = _adapter_folder(tmp_path / "origin", b"w" * 1000)
    cache = tmp_path / "cache"

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        t0 = time.monotonic()
        [error] = await _fetching(StubPeer(origin, stall_s=30), FetchLimits(cache, 10**6, 0.5),
                                  ("x", adapter_digest(origin)))
        task.cancel()
        return error, time.monotonic() - t0, ticks

    error, seconds, ticks = asyncio.run(run())
    assert isinstance(error, FetchError) and error.status == 504, error
    assert 0.4 < seconds < 5 and ticks >= 20          # the loop went on meanwhile
    assert _cache_entries(cache) == []


def test_digests_follow_registrations(tmp_path):
    one = _adapter_folder(tmp_path / "one", b"1" * 100)
    two = _adapter_folder(tmp_path / "two", b"2" * 100)
    sources = {"x": (str(one), 1)}

    async def run():
        digests = AdapterDigests(lambda: dict(sources))
        try:
            assert digests.known("x") is None
            first = await digests.of("x")
            assert first == adapter_digest(one) == digests.known("x")
            sources["x"] = (str(two), 2)                # unloaded and registered again, from other files
            assert digests.known("x") is None
            digests.refresh()                           # hashed in the background
            for _ in range(200):
                if digests.known("x") is not None:
                    break
                await asyncio.sleep(0.01)
            assert digests.known("x") == adapter_digest(two) != first
            del sources["x"]
            digests.refresh()
            assert digests.known("x") is None and await digests.of("x") is None
        finally:
            digests.close()

    asyncio.run(run())


def test_migration_never_plans_a_move_to_a_node_that_refused_the_adapter():
    c = PerfCoefficients(beta=0.02, alpha_token=1e-3, alpha_rank=1e-5)

    def load(node_id: str, pending: float) -> NodeLoad:
        return NodeLoad(node_id=node_id, waiting=0, running=4, pending_seconds=pending, free_pages=10**5,
                        page_tokens=16, max_running=64, rank_sum=0, rank_max=8, device={"x"}, host=set(),
                        coefficients=c)

    def candidates(barred: set[str]) -> list[Candidate]:
        return [Candidate(f"r{i}", "busy", "x", 8, 0, 100, 400, barred=frozenset(barred)) for i in range(4)]

    busy, idle, other = load("busy", 30.0), load("idle", 0.0), load("other", 2.0)
    assert CoMigrator(threshold_s=1.0).plan([busy, idle], candidates(set())).moves          # it would move
    assert CoMigrator(threshold_s=1.0).plan([busy, idle], candidates({"idle"})).moves == []
    plan = CoMigrator(threshold_s=1.0).plan([busy, idle, other], candidates({"idle"}))
    assert plan.moves and all(m.target == "other" for m in plan.moves)
