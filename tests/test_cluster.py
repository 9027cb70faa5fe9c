"""Cluster mode on loopback: three servers of the tiny model in this process (a, b, c at 127.0.0.1,
127.0.0.2 and 127.0.0.3, one port), a finding its peers by URL, b and c through a stub DNS resolver
(a headless Service's answer). a routes round-robin, b rank-aware, c keeps its requests (local).
Every output is checked against the offline engine: forwarded, migrated and resubmitted requests
give the tokens and text of an unmoved run."""
from __future__ import annotations

import functools
import http.server
import json
import re
import socket
import threading
import time
import urllib.request

import msgspec
import pytest

from asyncserve import LLM, SamplingParams, StructuredOutputs
from asyncserve.cli import main as cli_main
from asyncserve.cluster.auth import NONCE_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, PeerSigner
from asyncserve.cluster.messages import AdapterTiers, Digest
from asyncserve.cluster.migration import CoMigrator
from asyncserve.config import Config
from asyncserve.perf_model import PerfCoefficients
from server_harness import ServerThread

KEY = "test-cluster-key"
API_KEY = "client-key"
DNS_NAME = "asyncserve-peers.test"
HOSTS = {"a": "127.0.0.1", "b": "127.0.0.2", "c": "127.0.0.3"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADAPTERS = ("r8_attn_rs", "r2_mlp")
PROMPT = "the fox jumps over the lazy dog"


def stub_resolver(name, port, *args, **kwargs):
    if name != DNS_NAME:
        raise socket.gaierror(f"stub resolver: unknown name {name}")
    return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in HOSTS.values()]


def free_port() -> int:
    """A port free on all three loopback addresses."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for ip in HOSTS.values():
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port")


class Node(ServerThread):
    """A Server on its own uvloop thread at a fixed address, finding its peers through the stub DNS."""

    def __init__(self, config: Config):
        super().__init__(config, any_port=False, wait=False, resolver=stub_resolver)
        self.killed = False

    @property
    def cluster(self):
        return self.server.cluster

    def kill(self, reset: bool) -> None:
        """Stop dead. reset: as a SIGKILLed process, whose sockets the kernel closes (its peers'
        calls break at once); otherwise every socket stays open and callers hear silence, as from a
        host that lost power or a hung process (they find out when its digests stop)."""
        if reset:
            self.call(self._reset())
        self.killed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _reset(self) -> None:
        for site in self.server._runner.sites:
            site._server.close()
        for handler in self.server._runner.server.connections:
            handler.transport.abort()
        await self.server.cluster._session.close()

    def revive(self) -> None:
        """A silent node speaks again (its event loop resumes)."""
        self.killed = False
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.killed:       # bring the loop back only to release what the server holds
            self.revive()
        super().stop()

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
        """(status, parsed JSON or text)."""
        return super().request(method, path, body, headers)[:2]

    def signed(self, method: str, path: str, body: bytes = b"", key: str = KEY) -> tuple[int, object]:
        headers = PeerSigner(key).headers(method, path, body, self.cluster.destination)
        return self.request(method, path, body or None, headers)

    def stream(self, body: dict, path: str = "/v1/completions"):
        """Yield the JSON chunks of a streamed answer as they come, up to [DONE] (which must come)."""
        req = urllib.request.Request(self.base + path, data=json.dumps({**body, "stream": True}).encode(),
                                     method="POST", headers={"Content-Type": "application/json", **AUTH})
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    data = line[len(b"data: "):].strip()
                    if data == b"[DONE]":
                        return
                    yield json.loads(data)
        raise AssertionError("the stream ended without data: [DONE]")

    def peers_alive_soon(self, want: int, timeout: float = 10.0) -> bool:
        """Whether /metrics shows ``want`` live peers within ``timeout`` (a peer one busy moment
        late with its digest is suspect until its next one)."""
        deadline = time.monotonic() + timeout
        while self.metric("asyncserve_peers_alive") != want:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def metric(self, name: str, labels: str = "") -> float:
        """0 for a labelled counter nothing has counted yet."""
        try:
            return super().metric(name, labels)
        except KeyError:
            return 0.0


@pytest.fixture(scope="module")
def nodes(tiny_model):
    port = free_port()
    adapters = {name: str(tiny_model.adapters[name]) for name in ADAPTERS}
    dns = f"dns:{DNS_NAME}:{port}"
    peers = {"a": f"http://{HOSTS['b']}:{port},http://{HOSTS['c']}:{port}", "b": dns, "c": dns}
    dispatch = {"a": "round-robin", "b": "rank-aware", "c": "local"}
    configs = {name: Config(model=str(tiny_model.root), adapters=adapters, dtype="float32", device="cpu", threads=1,
                            served_model_name="tiny", host=host, port=port, api_key=API_KEY, peers=peers[name],
                            node_id=name, cluster_key=KEY, gossip_interval_s=0.1, dispatch=dispatch[name],
                            migration_threshold_s=0.0, max_model_len=512, shutdown_grace_s=2.0)
               for name, host in HOSTS.items()}
    yield from running(configs, lambda out: all(len(n.cluster.membership.alive_digests()) == 2 for n in out.values()),
                       "find each other")


def running(configs: dict[str, Config], settled, what: str):
    """A fixture's nodes: started from ``configs`` (name -> Config), yielded once each is ready and
    settled(nodes) holds (at most 20 s), stopped after; those started are stopped if one fails."""
    out = {}
    try:
        for name, config in configs.items():
            out[name] = Node(config)
        for node in out.values():
            node.wait_ready()
        deadline = time.monotonic() + 20
        while not settled(out):
            assert time.monotonic() < deadline, f"the peers did not {what}"
            time.sleep(0.05)
        yield out
    finally:
        for node in out.values():
            node.stop()


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(model=str(tiny_model.root), adapters={name: str(tiny_model.adapters[name]) for name in ADAPTERS},
               dtype="float32", device="cpu")


def expected(offline, body: dict) -> tuple[list[int], str]:
    adapter = None if body["model"] == "tiny" else body["model"]
    params = SamplingParams(max_tokens=body["max_tokens"], temperature=body.get("temperature", 1.0),
                            seed=body.get("seed"), ignore_eos=body.get("ignore_eos", False))
    out = offline.generate([body["prompt"]], params, adapters=adapter)[0]
    return out.token_ids, out.text


def streamed(chunks) -> tuple[list[int], str, str]:
    ids, text, finish = [], "", None
    for chunk in chunks:
        assert "error" not in chunk, chunk
        choice = chunk["choices"][0]
        ids += choice.get("token_ids") or []
        text += choice["text"]
        finish = choice["finish_reason"] or finish
    return ids, text, finish


def same_choices(got, want) -> None:
    """Equal text, tokens and finish; logprobs equal but for float rounding (a step's batch differs
    from node to node)."""
    assert _close(got, want), (got, want)


def _close(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) <= 1e-4
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_close(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_close(a, b) for a, b in zip(x, y))
    return x == y


def body(model: str, max_tokens: int, seed: int | None = None, prompt: str = PROMPT) -> dict:
    out = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True}
    out.update({"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed})
    return out


async def _holds(node: Node, request_id: str) -> bool:
    return any(s.request_id == request_id for s in node.server.engine.unfinished())


def running_on(nodes, request_id: str, timeout: float = 10.0) -> str:
    """The node whose engine holds the request (asked on each node's event loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, node in nodes.items():
            if not node.killed and node.call(_holds(node, request_id)):
                return name
        time.sleep(0.005)
    raise AssertionError(f"request {request_id} runs nowhere")


# ---- membership, security ---------------------------------------------------------------------------

def test_peers_found_by_url_and_dns_and_state_is_signed(nodes):
    status, state = nodes["b"].signed("GET", "/cluster/state")
    assert status == 200 and state["node_id"] == "b" and state["self"]["node_id"] == "b"
    alive = {p["node_id"] for p in state["peers"] if p["state"] == "alive"}
    assert alive == {"a", "c"}                           # found through the stub DNS; itself dropped
    assert {p["url"] for p in state["peers"]} == {f"http://{HOSTS[n]}:{nodes['a'].server.port}" for n in "ac"}
    assert nodes["a"].peers_alive_soon(2)
    assert nodes["b"].request("GET", "/cluster/state")[0] == 401


def _digest(node_id: str, url: str, **kw) -> Digest:
    fields = dict(node_id=node_id, url=url, seq=1, timestamp=time.time(), waiting=0, running=0,
                  pending_seconds=0.0, free_pages=10**6, page_tokens=16, max_running=64, running_rank_sum=0,
                  running_rank_max=0, adapters=AdapterTiers(host=list(ADAPTERS)),
                  coefficients=PerfCoefficients(beta=0.0, alpha_token=0.0, alpha_rank=0.0))
    fields.update(kw)
    return Digest(**fields)


def test_unsigned_forged_stale_and_replayed_peer_calls_are_refused(nodes):
    a = nodes["a"]
    body_ = msgspec.json.encode(_digest("intruder", "http://127.0.0.9:1"))
    path = "/cluster/gossip"
    to_a = a.cluster.destination
    headers = PeerSigner(KEY).headers("POST", path, body_, to_a)
    forged = {**headers, SIGNATURE_HEADER: "0" * 64}
    wrong_key = PeerSigner("another-key").headers("POST", path, body_, to_a)
    stale = PeerSigner(KEY, clock=lambda: time.time() - 3600).headers("POST", path, body_, to_a)
    tampered = PeerSigner(KEY).headers("POST", path, body_, to_a)
    for hdrs, data in ((None, body_), (forged, body_), (wrong_key, body_), (stale, body_),
                       (tampered, body_.replace(b"intruder", b"intrudes")),
                       ({**headers, NONCE_HEADER: "not-a-nonce"}, body_),
                       ({k: v for k, v in headers.items() if k != TIMESTAMP_HEADER}, body_)):
        status, err = a.request("POST", path, data, hdrs)
        assert status == 401 and err["error"]["code"] == "invalid_peer_signature", err
    forwarded = a.request("POST", "/cluster/forward", b"{}", None)
    assert forwarded[0] == 401
    assert a.request("POST", path, body_, headers)[0] == 204       # the genuine call, once
    assert a.request("POST", path, body_, headers)[0] == 401       # replayed
    assert a.cluster.membership.by_node_id("intruder") is not None
    # nothing the refused calls carried was taken: only the genuine call's digest, and its seq
    assert a.cluster.membership.by_node_id("intruder").digest.seq == 1
    a.call(_forget(a, "http://127.0.0.9:1"))
    # /v1/* still wants the client key; peer routes never accept it in place of a signature
    assert a.request("GET", "/v1/models")[0] == 401
    assert a.request("GET", "/v1/models", headers=AUTH)[0] == 200
    assert a.request("GET", "/cluster/state", headers=AUTH)[0] == 401
    status, err = a.signed("POST", path, b"not json")
    assert status == 400


def test_a_captured_call_replayed_to_another_node_is_refused(nodes):
    """A genuine signed call to b, captured: b takes it once; c refuses it (it names b's incarnation),
    telling only what a key holder can check, and takes nothing from it."""
    b, c = nodes["b"], nodes["c"]
    body_ = msgspec.json.encode(_digest("intruder", "http://127.0.0.9:2"))
    path = "/cluster/gossip"
    captured = PeerSigner(KEY).headers("POST", path, body_, b.cluster.destination)
    assert b.request("POST", path, body_, captured)[0] == 204
    status, err, hdrs = ServerThread.request(c, "POST", path, body_, captured)
    assert status == 401 and err["error"]["code"] == "invalid_peer_signature"
    assert "signed for b@" in err["error"]["message"]
    assert PeerSigner(KEY).learned(captured, hdrs) == c.cluster.destination      # what a's retry would use
    assert c.cluster.membership.by_node_id("intruder") is None
    assert b.request("POST", path, body_, captured)[0] == 401                       # and b took it only once
    b.call(_forget(b, "http://127.0.0.9:2"))


def test_a_captured_call_replayed_to_the_restarted_node_is_refused(tiny_model):
    """A node restarted (same node id, address and key) refuses a call captured on its way to its
    previous process, its timestamp still fresh and its nonce unknown to the new process; its peers
    learn the new incarnation from its refusal and go on."""
    port = free_port()
    config = dict(model=str(tiny_model.root), dtype="float32", device="cpu", threads=1, served_model_name="tiny",
                  host=HOSTS["a"], port=port, peers=f"http://{HOSTS['b']}:{port}", node_id="x", cluster_key=KEY,
                  gossip_interval_s=0.1, max_model_len=512, shutdown_grace_s=0.5)
    body_ = msgspec.json.encode(_digest("intruder", "http://127.0.0.9:3"))
    path = "/cluster/gossip"
    node = Node(Config(**config))
    try:
        node.wait_ready()
        captured = PeerSigner(KEY).headers("POST", path, body_, node.cluster.destination)
        assert node.request("POST", path, body_, captured)[0] == 204
    finally:
        node.stop()
    node = Node(Config(**config))
    try:
        node.wait_ready()
        status, err = node.request("POST", path, body_, captured)
        assert status == 401 and "signed for x@" in err["error"]["message"]
        assert node.cluster.membership.by_node_id("intruder") is None
        assert node.signed("POST", path, body_)[0] == 204          # a call to this incarnation is taken
    finally:
        node.stop()


async def _forget(node: Node, url: str) -> None:
    peer = node.cluster.membership.peers.pop(url)
    node.cluster.router.view.remove(peer.digest.node_id)


def test_cluster_mode_needs_a_key(monkeypatch, capsys):
    monkeypatch.delenv("ASYNCSERVE_CLUSTER_KEY", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--peers", "http://127.0.0.1:9"])
    assert exc.value.code == 2 and "cluster key" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dns:NAME:PORT"):
        Config(peers="dns:nameonly", cluster_key="k").validate()


# ---- forwarding ---------------------------------------------------------------------------------------

def test_forwarded_requests_stream_what_a_local_run_gives(nodes, offline):
    """a routes round-robin over a, b, c: of three requests two run on peers, relayed to the client."""
    a = nodes["a"]
    before = {n: a.metric("asyncserve_requests_forwarded_total", f'to="{n}"') for n in "bc"}
    bodies = [body("tiny", 24), body("r8_attn_rs", 24, seed=7), body("r2_mlp", 20, seed=3)]
    for b in bodies:
        ids, text, finish = streamed(a.stream(b))
        assert (ids, text) == expected(offline, b) and finish == "length"
    after = {n: a.metric("asyncserve_requests_forwarded_total", f'to="{n}"') for n in "bc"}
    assert after["b"] == before["b"] + 1 and after["c"] == before["c"] + 1
    # not streamed, n samples with logprobs, and a chat request: each of three lands on another node
    sampled = {**bodies[1], "n": 2, "logprobs": 2, "echo": True}
    local = nodes["c"].request("POST", "/v1/completions", sampled, AUTH)[1]
    chat = {"model": "tiny", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "hello"}],
            "logprobs": True, "top_logprobs": 2}
    local_chat = nodes["c"].request("POST", "/v1/chat/completions", chat, AUTH)[1]
    for _ in range(3):
        status, out = a.request("POST", "/v1/completions", sampled, AUTH)
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")     # the cached tokens depend on the node
        assert status == 200 and [out["usage"][k] for k in counts] == [local["usage"][k] for k in counts]
        same_choices(out["choices"], local["choices"])
        status, out = a.request("POST", "/v1/chat/completions", chat, AUTH)
        assert status == 200
        same_choices(out["choices"], local_chat["choices"])
    # in turn a, b, c, a, b, c: b and c each got one completion (n=2: two sequences) and one chat
    assert a.metric("asyncserve_requests_forwarded_total", 'to="b"') == after["b"] + 3
    assert a.metric("asyncserve_requests_forwarded_total", 'to="c"') == after["c"] + 3


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_peers_with_one_adapter_resolver_serve_adapters_none_of_them_had(tiny_model, offline, tmp_path):
    """--adapter-resolver on both nodes: a request for an adapter no node loaded, forwarded from a to b,
    is fetched on b as on a, with the tokens of a local run."""
    files = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietFiles, directory=str(tiny_model.adapters["r2_mlp"].parent)))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    port = free_port()
    template = f"http://127.0.0.1:{files.server_address[1]}/{{name}}"
    pair = {}
    try:
        for name, other, dispatch in (("a", "b", "round-robin"), ("b", "a", "local")):
            pair[name] = Node(Config(model=str(tiny_model.root), dtype="float32", device="cpu", threads=1,
                                     served_model_name="tiny", host=HOSTS[name], port=port, api_key=API_KEY,
                                     peers=f"http://{HOSTS[other]}:{port}", node_id=name, cluster_key=KEY,
                                     gossip_interval_s=0.1, dispatch=dispatch, migration_threshold_s=0.0,
                                     adapter_resolver=template, adapter_cache_dir=str(tmp_path / name)))
        for node in pair.values():
            node.wait_ready()
        assert all(node.peers_alive_soon(1) for node in pair.values())
        b = body("r2_mlp", 12)
        for _ in range(2):             # round-robin: one runs on a, one on b
            ids, text, _ = streamed(pair["a"].stream(b))
            assert (ids, text) == expected(offline, b)
        assert pair["a"].metric("asyncserve_requests_forwarded_total", 'to="b"') == 1
        for node in pair.values():
            assert "r2_mlp" in {m["id"] for m in node.request("GET", "/v1/models", headers=AUTH)[1]["data"]}
    finally:
        for node in pair.values():
            node.stop()
        files.shutdown()
        files.server_close()


# ---- migration -------------------------------------------------------------------------------------

def _stream_with(node: Node, b: dict, on_first, after: int = 3):
    """Stream b from node, calling on_first(request_id) once `after` chunks have come."""
    chunks = []
    for chunk in node.stream(b):
        chunks.append(chunk)
        if len(chunks) == after:
            on_first(chunk["id"].removeprefix("cmpl-"))
    return chunks


@pytest.mark.parametrize("seed", [None, 11])
def test_a_running_request_migrates_with_no_gap_and_equal_tokens(nodes, offline, seed):
    """c runs its own request; mid-stream it moves to b (c's client stream goes on from b)."""
    c, b = nodes["c"], nodes["b"]
    moved = []
    before = c.metric("asyncserve_migrations_total", 'kind="request"')

    def move(rid):
        assert running_on(nodes, rid) == "c"
        moved.append(c.call(c.cluster.move(rid, "b")))
        assert running_on(nodes, rid) == "b"

    req = body("r8_attn_rs", 200, seed=seed)
    ids, text, finish = streamed(_stream_with(c, req, move))
    assert moved == [True] and finish == "length"
    assert (ids, text) == expected(offline, req)
    assert c.metric("asyncserve_migrations_total", 'kind="request"') == before + 1
    assert not c.cluster.forwards and not b.cluster.served


@pytest.mark.parametrize("stop", ["qq", "ab"], ids=["guide-completes", "stop-string"])
def test_a_constrained_request_migrates_with_its_guide_and_stop_state(nodes, offline, stop):
    """The target rebuilds the structured-output guide's state and the stop strings' held text by
    replaying the tokens so far: the text equals an unmoved run's, which here either completes the
    expression (40 tokens) or ends at a stop string (14 tokens)."""
    c = nodes["c"]
    regex = "[a-z ]{40,90}x"
    req = {**body("r2_mlp", 120, seed=9), "structured_outputs": {"regex": regex}, "stop": [stop]}
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=9, ignore_eos=True, stop=[stop],
                            structured_outputs=StructuredOutputs(regex=regex))
    want = offline.generate([PROMPT], params, adapters="r2_mlp")[0]
    moved = []
    ids, text, finish = streamed(_stream_with(c, req, lambda rid: moved.append(c.call(c.cluster.move(rid, "a")))))
    assert moved == [True] and (ids, text) == (want.token_ids, want.text) and finish == "stop"
    assert re.fullmatch(regex, text) if stop == "qq" else len(text) < 40


def test_a_forwarded_request_that_moves_on_is_continued_by_its_origin(nodes, offline):
    """a's request runs on c for a; c moves it to b: c tells a, which continues it at b."""
    a, c = nodes["a"], nodes["c"]
    req = body("tiny", 200, seed=5)
    where = []

    def move(rid):
        where.append(running_on(nodes, rid))
        src = nodes[where[0]]
        target = "b" if where[0] == "c" else "c"
        assert src.call(src.cluster.move(rid, target))
        where.append(running_on(nodes, rid))

    # round-robin: one of the next two requests lands on a peer
    for _ in range(2):
        where.clear()
        ids, text, _ = streamed(_stream_with(a, req, move))
        assert (ids, text) == expected(offline, req)
        if where[0] != "a":
            break
    assert where[0] in "bc" and where[1] in "bc" and where[0] != where[1]
    assert not a.cluster.forwards


async def _set_migration(node: Node, threshold_s: float | None) -> None:
    node.cluster.migrator = CoMigrator(threshold_s=threshold_s) if threshold_s is not None else None
    node.cluster.rebalance_every_s = 0.2


def test_an_imbalance_moves_requests_by_the_milp_and_their_outputs_do_not_change(nodes, offline):
    """c keeps its requests (dispatch local) while a and b idle: past the threshold, dLoRA's
    integer program moves some of them away; every output still equals an unmoved run's."""
    c = nodes["c"]
    before = {n: nodes[n].metric("asyncserve_migrations_total", 'kind="request"') for n in "abc"}
    models = ("tiny",) + ADAPTERS
    reqs = [body(models[i % 3], 400, seed=None if i % 2 else 30 + i, prompt=f"{PROMPT} {i}") for i in range(6)]
    results, errors = {}, []

    def client(i):
        try:
            results[i] = streamed(c.stream(reqs[i]))
        except BaseException as e:      # noqa: BLE001 — reported by the main thread
            errors.append(e)

    c.call(_set_migration(c, 0.01))
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        c.call(_set_migration(c, None))
    assert not errors, errors
    for i, req in enumerate(reqs):
        assert results[i][:2] == expected(offline, req), i
    moved = c.metric("asyncserve_migrations_total", 'kind="request"') - before["c"]
    assert moved >= 1
    assert all(nodes[n].metric("asyncserve_migrations_total", 'kind="request"') == before[n] for n in "ab")
    assert not c.cluster.forwards


# ---- faults --------------------------------------------------------------------------------------------

def test_a_garbage_peer_is_suspect_and_its_request_goes_elsewhere(nodes, offline):
    """A peer (by its signed digest) that answers /cluster/forward with garbage: the request moved
    there is resubmitted with its tokens to a live node and the client sees one whole stream."""
    import http.server

    class Junk(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\x00garbage{]\n")

        def log_message(self, *args):
            pass

    junk = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Junk)
    threading.Thread(target=junk.serve_forever, daemon=True).start()
    c = nodes["c"]
    url = f"http://127.0.0.1:{junk.server_address[1]}"
    try:
        req = body("r2_mlp", 150, seed=2)
        resubmits = c.metric("asyncserve_migrations_total", 'kind="resubmit"')

        def move(rid):
            assert c.signed("POST", "/cluster/gossip", msgspec.json.encode(_digest("junk", url)))[0] == 204
            assert c.call(c.cluster.move(rid, "junk"))

        ids, text, _ = streamed(_stream_with(c, req, move))
        assert (ids, text) == expected(offline, req)
        assert c.metric("asyncserve_migrations_total", 'kind="resubmit"') == resubmits + 1
        assert c.cluster.membership.peers[url].state.value != "alive"
    finally:
        junk.shutdown()
        junk.server_close()
        c.call(_forget(c, url))


@pytest.mark.parametrize("reset", [False, True], ids=["silent", "sigkill"])
def test_a_peer_dead_mid_stream_loses_no_request(nodes, offline, reset):
    """Requests run on b for a and for c; b stops dead. Each origin resubmits what b ran, with its
    tokens so far, and every client gets its whole stream. A silent b comes back and rejoins; a
    killed one stays dead (the last test)."""
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    reqs = [body("tiny", 300, seed=21), body("r8_attn_rs", 300), body("r2_mlp", 300, seed=23)]
    results, errors = {}, []
    on_b = threading.Barrier(4, timeout=30)     # three clients and this thread
    resubmits = {n: nodes[n].metric("asyncserve_migrations_total", 'kind="resubmit"') for n in "ac"}

    def client(i, origin):
        def put_on_b(rid):
            where = running_on(nodes, rid)
            if where != "b":
                src = nodes[where]
                assert src.call(src.cluster.move(rid, "b"))
                assert running_on(nodes, rid) == "b"
            on_b.wait()

        try:
            results[i] = streamed(_stream_with(origin, reqs[i], put_on_b))
        except BaseException as e:      # noqa: BLE001 — reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i, origin)) for i, origin in enumerate((a, a, c))]
    for t in threads:
        t.start()
    on_b.wait()
    b.kill(reset)
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i, req in enumerate(reqs):
        ids, text, finish = results[i]
        assert finish == "length" and (ids, text) == expected(offline, req), i
    assert a.metric("asyncserve_migrations_total", 'kind="resubmit"') == resubmits["a"] + 2
    assert c.metric("asyncserve_migrations_total", 'kind="resubmit"') == resubmits["c"] + 1
    assert not a.cluster.forwards and not c.cluster.forwards
    if not reset:
        assert a.cluster.membership.by_node_id("b").state.value == "dead"
        b.revive()
        deadline = time.monotonic() + 10
        while not all(n.cluster.membership.by_node_id("b").state.value == "alive" for n in (a, c)):
            assert time.monotonic() < deadline, "b did not rejoin"
            time.sleep(0.05)
        assert a.peers_alive_soon(2)


# ---- the digest (no servers) --------------------------------------------------------------------------------
def digest_of(engine) -> Digest:
    """The digest a cluster actor makes of an engine (a namespace of the Engine API the digest reads)."""
    from types import SimpleNamespace

    from asyncserve.actors.cluster import ClusterActor

    config = SimpleNamespace(node_id="n0", host="127.0.0.1", advertise_url=None, gossip_interval_s=0.2, peers="",
                             cluster_key=KEY, dispatch="least-pending", migration_threshold_s=0.0)
    server = SimpleNamespace(config=config, metrics=None, engine=engine, scheduler=SimpleNamespace(mean_output=64.0))
    return ClusterActor(server, port=1).digest()


def test_a_digest_counts_parked_requests_and_their_adapter_fetches():
    """Requests parked while their adapter is read from disk are work like any other, and wait for the
    fetch first: a node full of them used to report nothing pending and drew every request (#16)."""
    from types import SimpleNamespace

    from asyncserve.actors.pager import FETCHERS
    from asyncserve.perf_model import STEP_TIME_PRIOR, QueuedWork, fetch_backlog_seconds, pending_seconds
    from asyncserve.sequence import Sequence

    def parked(rid: str, adapter: str, prompt: int) -> Sequence:
        return Sequence(rid, list(range(prompt)), SamplingParams(max_tokens=256), adapter, seed=0, arrival=0.0,
                        adapter_rank=8)

    fetch_s = 3.0
    engine = SimpleNamespace(     # the Engine API the digest reads
        load_snapshot=lambda: SimpleNamespace(waiting=3, running=0, pool=SimpleNamespace(free=1000)),
        unfinished=lambda: [],
        parked_requests=lambda: [[parked("p0", "x", 100), parked("p1", "x", 40)], [parked("p2", "y", 60)]],
        step_coefficients=STEP_TIME_PRIOR, step_model_measured=False, mean_disk_load_seconds=fetch_s,
        max_running=8, block_size=16, adapter_tiers=lambda: {}, model_name="tiny", layer_windows=[])
    digest = digest_of(engine)
    assert (digest.waiting, digest.measured) == (3, False)
    c = digest.coefficients
    assert c.load_disk_fixed_s == fetch_s                       # the fetch time it measured, not the prior's 0
    work = pending_seconds(c, [QueuedWork(n, 64, 8) for n in (100, 40, 60)], 8)
    assert work > 0
    assert digest.pending_seconds == pytest.approx(work + fetch_backlog_seconds(c, [8, 8], FETCHERS))
    assert digest.pending_seconds > fetch_s


def test_a_digest_of_a_windowed_model_prices_its_windows_and_computed_context():
    """A Gemma-like node's pending time counts its requests' remaining tokens over the keys they will
    read: min(position + 1, window) in its sliding-window layers, after the context they have computed;
    the digest carries the windows for its peers' routers."""
    from types import SimpleNamespace

    from asyncserve.perf_model import QueuedWork, drain_seconds
    from asyncserve.sequence import Sequence

    windows = [512] * 5 + [None]
    c = PerfCoefficients(beta=0.02, alpha_token=4e-4, alpha_rank=2e-6, alpha_seq=1e-4, alpha_attn=3e-9)

    def running(rid: str, prompt: int, computed: int, generated: int) -> Sequence:
        seq = Sequence(rid, list(range(prompt)), SamplingParams(max_tokens=4096), None, seed=0, arrival=0.0)
        seq.output_ids = [7] * generated
        seq.num_computed = computed
        return seq

    # decoding after 6,029 computed tokens; prefilling in chunks (1,024 of 3,000 done); decoding a short one
    seqs = [running("long", 6000, 6029, 30), running("chunked", 3000, 1024, 0), running("short", 100, 110, 11)]

    def engine(layer_windows: list) -> SimpleNamespace:
        return SimpleNamespace(
            load_snapshot=lambda: SimpleNamespace(waiting=0, running=len(seqs), pool=SimpleNamespace(free=1000)),
            unfinished=lambda: seqs, parked_requests=lambda: [], step_coefficients=c, step_model_measured=True,
            mean_disk_load_seconds=None, max_running=8, block_size=16, adapter_tiers=lambda: {}, model_name="tiny",
            layer_windows=layer_windows)

    digest, all_global = digest_of(engine(windows)), digest_of(engine([]))
    assert (digest.layer_windows, all_global.layer_windows) == (windows, [])
    # remaining output: the mean (64) less what each generated, floored at a quarter of it
    queue = [QueuedWork(0, 34, 0, context=6029), QueuedWork(1976, 64, 0, context=1024),
             QueuedWork(0, 53, 0, context=110)]
    assert digest.pending_seconds == pytest.approx(drain_seconds(digest.coefficients, queue, [], 0.0, 8, windows))
    assert all_global.pending_seconds == pytest.approx(drain_seconds(all_global.coefficients, queue, [], 0.0, 8))
    assert digest.pending_seconds < all_global.pending_seconds
