"""Peers' adapters by content (cluster/adapters.py): a request forwarded or migrated to a peer runs there
on its origin's adapter, fetched from the origin if the peer lacks it, and never on another copy of the
same name. First the plain logic against a stub peer (no model), then two servers of the tiny model on
loopback (a at 127.0.0.1 routes round-robin, b at 127.0.0.2 keeps its requests), whose outputs are
checked against the offline engine with the origin's adapters."""
from __future__ import annotations

import asyncio
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
from test_cluster import (API_KEY, AUTH, HOSTS, KEY, Node, _stream_with, body, free_port, running, running_on,
                          streamed)

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
    """A name registered anew from other files is hashed anew, an unregistered one forgotten; refresh
    walks the names only when the registry changed."""
    one = _adapter_folder(tmp_path / "one", b"1" * 100)
    two = _adapter_folder(tmp_path / "two", b"2" * 100)
    sources = {"x": (str(one), 1)}
    walks = []

    def names():
        walks.append(1)
        return sources.keys()

    async def run():
        digests = AdapterDigests(sources.get, names, lambda: tuple(sources.items()))
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
            walked = len(walks)
            for _ in range(3):                          # the registry as it was: no walk over its names
                digests.refresh()
            assert len(walks) == walked
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


# ---- two servers -------------------------------------------------------------------------------------
# a holds "solo", "big" and "twin"; b holds "moved" and another "twin" (other weights under the same name)
A_ADAPTERS = {"solo": "r2_mlp", "twin": "r1_qv", "big": "r64_all"}
B_ADAPTERS = {"moved": "r8_attn_rs", "twin": "r16_patterns"}


def _digests_known(node: Node, names) -> bool:
    async def known():
        return all(node.cluster.adapter_digests.known(n) is not None for n in names)
    return node.call(known())


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    port = free_port()
    cache = tmp_path_factory.mktemp("peer-caches")
    configs = {name: Config(
        model=str(tiny_model.root), dtype="float32", device="cpu", threads=1, served_model_name="tiny",
        adapters={n: str(tiny_model.adapters[src]) for n, src in adapters.items()},
        host=HOSTS[name], port=port, api_key=API_KEY, peers=f"http://{HOSTS[other]}:{port}", node_id=name,
        cluster_key=KEY, gossip_interval_s=0.1, dispatch=dispatch, migration_threshold_s=0.0,
        max_model_len=512, shutdown_grace_s=2.0, adapter_cache_dir=str(cache / name))
        for name, other, dispatch, adapters in (("a", "b", "round-robin", A_ADAPTERS), ("b", "a", "local", B_ADAPTERS))}

    def settled(nodes):
        return (all(node.peers_alive_soon(1) for node in nodes.values())
                and _digests_known(nodes["a"], A_ADAPTERS) and _digests_known(nodes["b"], B_ADAPTERS))

    yield from running(configs, settled, "find each other, or hash their adapters")


def _offline(tiny_model, adapters: dict[str, str]) -> LLM:
    return LLM(model=str(tiny_model.root), adapters={n: str(tiny_model.adapters[src]) for n, src in adapters.items()},
               dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def offline_a(tiny_model):
    return _offline(tiny_model, A_ADAPTERS)


@pytest.fixture(scope="module")
def offline_b(tiny_model):
    return _offline(tiny_model, B_ADAPTERS)


def expected(offline: LLM, req: dict) -> tuple[list[int], str]:
    params = SamplingParams(max_tokens=req["max_tokens"], temperature=req["temperature"], seed=req.get("seed"),
                            ignore_eos=True)
    out = offline.generate([req["prompt"]], params, adapters=req["model"])[0]
    return out.token_ids, out.text


def _listed(node: Node) -> dict[str, str]:
    return {m["id"]: m["root"] for m in node.request("GET", "/v1/models", headers=AUTH)[1]["data"]}


def _forwarded_to_b(a: Node) -> float:
    return a.metric("asyncserve_requests_forwarded_total", 'to="b"')


def _peer_adapters(node: Node, event: str) -> float:
    return node.metric("asyncserve_peer_adapters_total", f'event="{event}"')


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_an_adapter_only_on_the_origin_is_fetched_by_the_peer_its_request_goes_to(pair, offline_a, seed):
    """a routes round-robin: of two requests for "solo" (a's only) one goes to b, which fetches the
    adapter from a, checks it, registers it and streams a's tokens."""
    a, b = pair["a"], pair["b"]
    req = body("solo", 24, seed=seed)
    before, fetched, missing = _forwarded_to_b(a), _peer_adapters(b, "fetched"), "solo" not in _listed(b)
    for _ in range(2):
        ids, text, finish = streamed(a.stream(req))
        assert (ids, text) == expected(offline_a, req) and finish == "length"
    assert _forwarded_to_b(a) == before + 1
    assert _peer_adapters(b, "fetched") == fetched + missing       # fetched once, by the run that found it missing
    digest = a.call(a.cluster.adapter_digests.of("solo"))
    assert _listed(b)["solo"] == str(Path(b.server.config.adapter_cache_dir) / digest)
    assert b.call(b.cluster.adapter_digests.of("solo")) == digest


def test_a_running_request_migrates_to_a_peer_that_fetches_its_adapter(pair, offline_b):
    """b runs its own request for "moved" (b's only); mid-stream it moves to a, which fetches the adapter
    from b: the stream goes on with the tokens of an unmoved run."""
    b = pair["b"]
    moved = []

    def move(rid):
        assert running_on(pair, rid) == "b"
        moved.append(b.call(b.cluster.move(rid, "a")))
        assert running_on(pair, rid) == "a"

    req = body("moved", 120, seed=3)
    ids, text, finish = streamed(_stream_with(b, req, move))
    assert moved == [True] and finish == "length"
    assert (ids, text) == expected(offline_b, req)
    assert "moved" in _listed(pair["a"]) and not b.cluster.forwards


def test_a_peer_with_another_copy_of_the_adapter_refuses_and_the_tokens_stay_the_origins(pair, offline_a, offline_b):
    """a and b both hold "twin", with other weights: b refuses a's requests for it (409), which run on a
    with a's weights, and a sends it none for a while; a migration from b to a comes back to b."""
    a, b = pair["a"], pair["b"]
    req = body("twin", 24, seed=5)
    want = expected(offline_a, req)
    assert want != expected(offline_b, req)            # the copies give other tokens
    before, refusals = _forwarded_to_b(a), (_peer_adapters(a, "refused"), _peer_adapters(b, "adapter_mismatch"))
    for _ in range(2):                                 # round-robin: one tries b, which refuses it
        ids, text, finish = streamed(a.stream(req))
        assert (ids, text) == want and finish == "length"
    assert _forwarded_to_b(a) == before + 1 and a.call(_refusers(a, "twin")) == {"b"}
    assert (_peer_adapters(a, "refused"), _peer_adapters(b, "adapter_mismatch")) == (refusals[0] + 1, refusals[1] + 1)
    for _ in range(2):                                 # b is sent no more "twin" requests
        assert streamed(a.stream(req))[:2] == want
    assert _forwarded_to_b(a) == before + 1
    # b's answer to a's envelope, as a saw it
    envelope = ForwardedRequest(request_id="probe", origin="a", model="tiny", adapter="twin", prompt_ids=[1, 2, 3],
                                params=SamplingParams(max_tokens=2), seed=1,
                                adapter_digest=a.call(a.cluster.adapter_digests.of("twin")))
    status, err = b.signed("POST", "/cluster/forward", msgspec.json.encode(envelope))
    assert status == 409 and err["error"]["code"] == "adapter_mismatch", err
    # a migration the other way: a refuses b's copy, and b goes on with it
    moved = []
    req_b = body("twin", 120, seed=6)
    ids, text, _ = streamed(_stream_with(b, req_b, lambda rid: moved.append(b.call(b.cluster.move(rid, "a")))))
    assert moved == [True] and (ids, text) == expected(offline_b, req_b)
    assert b.call(_refusers(b, "twin")) == {"a"}
    assert _listed(a)["twin"] != _listed(b)["twin"]    # neither copy replaced


async def _refusers(node: Node, adapter: str) -> set[str]:
    return node.cluster.adapter_refusers(adapter)


PATH_LIKE_NAMES = ["../solo", "/etc/passwd", "a/b", "solo/../solo", "./solo", "solo\x00", "solo\x00/../../etc/passwd",
                   "ｓｏｌｏ", "solo\u200b", "SOLO", "", "..", "%2e%2e/solo", "solo\\..\\x", "nope"]


def test_the_adapter_endpoint_serves_only_registered_adapters_files_to_signed_peers(pair, tiny_model):
    a = pair["a"]
    ask = msgspec.json.encode(AdapterFileRequest("solo", "adapter_config.json"))
    status, config = a.signed("POST", ADAPTER_FILE_PATH, ask)
    assert status == 200 and config == json.loads((tiny_model.adapters["r2_mlp"] / "adapter_config.json").read_text())
    for headers in (None, AUTH):                         # unsigned; the client key is no signature
        status, err = a.request("POST", ADAPTER_FILE_PATH, ask, headers)
        assert status == 401 and err["error"]["code"] == "invalid_peer_signature"
    status, _ = a.signed("POST", ADAPTER_FILE_PATH, ask, key="another-key")
    assert status == 401
    for name in PATH_LIKE_NAMES:
        ask = msgspec.json.encode(AdapterFileRequest(name, "adapter_config.json"))
        status, err = a.signed("POST", ADAPTER_FILE_PATH, ask)
        assert status == 404 and err["error"]["code"] == "model_not_found", (name, err)
    for file in ("../../../etc/passwd", "/etc/passwd", "adapter_config.json/..", "README.md", ""):
        raw = json.dumps({"name": "solo", "file": file}).encode()
        status, err = a.signed("POST", ADAPTER_FILE_PATH, raw)
        assert status == 400 and err["error"]["code"] == "invalid_value", (file, err)


async def _limit_fetches(node: Node, max_bytes: int) -> FetchLimits:
    """Set the node's limit on adapters fetched from peers; the limits it had."""
    fetcher = node.cluster.peer_adapters
    old = fetcher.limits
    fetcher.limits = FetchLimits(old.cache_dir, max_bytes, old.timeout_s, old.cache_bytes)
    return old


async def _set_limits(node: Node, limits: FetchLimits) -> None:
    node.cluster.peer_adapters.limits = limits


def test_an_adapter_past_the_peers_size_limit_is_not_fetched_and_its_request_runs_at_the_origin(pair, offline_a,
                                                                                             caplog):
    """b may fetch at most 1 KB: a's request for "big" that goes to b is refused there (503), runs on a
    with a's tokens, and b keeps nothing of it."""
    a, b = pair["a"], pair["b"]
    old = b.call(_limit_fetches(b, 1000))
    try:
        req = body("big", 16)
        before = _forwarded_to_b(a)
        for _ in range(2):
            ids, text, _ = streamed(a.stream(req))
            assert (ids, text) == expected(offline_a, req)
        assert _forwarded_to_b(a) == before + 1 and a.call(_refusers(a, "big")) == {"b"}
        assert "HTTP 503" in caplog.text and "--max-adapter-size" in caplog.text      # a's log of b's refusal
    finally:
        b.call(_set_limits(b, old))
    assert "big" not in _listed(b)
    digest = a.call(a.cluster.adapter_digests.of("big"))
    assert not any(entry == digest or entry.startswith(".fetching-")
                   for entry in os.listdir(b.server.config.adapter_cache_dir))
