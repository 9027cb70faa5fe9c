"""Issue 33, the ingress: a 4 MB /tokenize runs beside the event loop (a stream's inter-token gaps stay
near its own steps' while it runs), a prompt over the byte limit is a 400 before any tokenizing,
/tokenize and /detokenize need the API key unless --tokenize-public, and /metrics' per-adapter
series show only with the key unless --metrics-public (the aggregate series stay open)."""
from __future__ import annotations

import http.client
import json
import random
import statistics
import threading
import time

import pytest
from server_harness import ServerThread

from asyncserve.config import Config

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
WORDS = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def srv(tiny_model):
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapters={"r8_attn_rs": str(tiny_model.adapters["r8_attn_rs"])}, api_key=KEY,
                             max_body_bytes=8 * 2**20, max_prompt_bytes="8MiB",
                             speculative_tokens=0))    # one token per event: the stalls show between them
    yield st
    st.stop()


def text_of(nbytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < nbytes:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:nbytes]


def stream_arrivals(st: ServerThread, max_tokens: int) -> list[float]:
    """When each token's chunk of a greedy completion stream arrived (monotonic seconds)."""
    conn = http.client.HTTPConnection("127.0.0.1", st.server.port, timeout=120)
    body = {"model": "tiny", "prompt": "the fox", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **AUTH})
    resp = conn.getresponse()
    assert resp.status == 200
    times = []
    for line in resp:
        if line.startswith(b"data: {"):
            times.append(time.monotonic())
    conn.close()
    assert len(times) == max_tokens
    return times


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times[1:], times[2:])]        # after the first token: steps, not the prefill


def test_a_4mb_tokenize_does_not_pause_a_running_stream(srv):
    baseline = statistics.median(gaps(stream_arrivals(srv, 64)))
    prompt = text_of(4 * 2**20)
    payload = json.dumps({"prompt": prompt}).encode()
    arrivals: list[list[float]] = []
    done = threading.Event()

    def streams():                  # streams back to back for as long as the tokenize runs
        while not done.is_set():
            arrivals.append(stream_arrivals(srv, 64))
    streamer = threading.Thread(target=streams)
    streamer.start()
    try:
        time.sleep(0.3)
        conn = http.client.HTTPConnection("127.0.0.1", srv.server.port, timeout=120)
        t0 = time.monotonic()
        conn.request("POST", "/tokenize", payload, {"Content-Type": "application/json", **AUTH})
        resp = conn.getresponse()
        raw = resp.read()            # parsed after the streams: a 2M-id json.loads here would hold the GIL
        t1 = time.monotonic()
        conn.close()
    finally:
        done.set()
        streamer.join(120)
    assert resp.status == 200, raw[:300]
    out = json.loads(raw)
    assert out["count"] == len(out["tokens"]) > 10**6
    assert out["tokens"][:50] == srv.server.engine.tokenizer.encode(prompt[:200])[:50]
    tokenize_s = t1 - t0
    during = [b - a for times in arrivals for a, b in zip(times[1:], times[2:]) if t0 <= a and b <= t1]
    assert len(during) >= 20, "the streams did not run while the tokenize did"
    # on the event loop the tokenize would pause the stream for its whole time; in a thread the
    # stream goes on at about its own pace (the GIL is held only while the 2M ids become a list)
    bound = 10 * baseline + 0.25 * tokenize_s
    assert 10 * baseline < 0.5 * tokenize_s, "the tokenize was too short to tell"
    assert max(during) < bound, (max(during), baseline, tokenize_s)
    print(f"4 MB tokenize {tokenize_s:.2f} s; stream gaps: median {baseline * 1e3:.1f} ms alone, "
          f"max {max(during) * 1e3:.0f} ms (median {statistics.median(during) * 1e3:.1f} ms) beside it")


def test_a_prompt_over_the_byte_limit_is_refused_before_tokenizing(srv, monkeypatch):
    tok = srv.server.engine.tokenizer
    calls = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **kw: (calls.append(1), encode(*a, **kw))[1])
    monkeypatch.setattr(srv.server.config, "max_prompt_bytes", 1000)
    bodies = [("/v1/completions", {"model": "tiny", "prompt": "x" * 1001, "max_tokens": 1}),
              ("/v1/completions", {"model": "tiny", "prompt": ["ok", "é" * 501], "max_tokens": 1}),    # 1002 bytes
              ("/v1/completions", {"model": "r8_attn_rs", "prompt": "日本" * 200, "max_tokens": 1}),  # 1200 bytes
              ("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [
                  {"role": "user", "content": "a" * 600},
                  {"role": "user", "content": [{"type": "text", "text": "b" * 600}]}]}),
              ("/tokenize", {"prompt": "y" * 5000}),
              ("/tokenize", {"messages": [{"role": "user", "content": "z" * 1001}]})]
    for path, body in bodies:
        status, err, _ = srv.request("POST", path, body, AUTH)
        assert status == 400 and err["error"]["code"] == "context_length_exceeded", (path, err)
        assert "1000 bytes" in err["error"]["message"]
    assert calls == [1]              # only the batch's "ok", before its second prompt was refused
    status, out, _ = srv.request("POST", "/tokenize", {"prompt": "é" * 500}, AUTH)        # 1000 bytes: in
    assert status == 200 and out["count"] > 0
    assert srv.request("GET", "/health")[0] == 200


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "the fox"}),
                                        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
                                        ("/detokenize", {"tokens": [1, 2, 3]})])
def test_tokenize_needs_the_key_unless_public(srv, monkeypatch, path, body):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, err, _ = srv.request("POST", path, body, headers)
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
    status, with_key, _ = srv.request("POST", path, body, AUTH)
    assert status == 200
    monkeypatch.setattr(srv.server.config, "tokenize_public", True)
    status, without, _ = srv.request("POST", path, body)
    assert status == 200 and without == with_key


def test_per_adapter_metrics_need_the_key_unless_public(srv, monkeypatch):
    status, _, _ = srv.request("POST", "/v1/completions", {"model": "r8_attn_rs", "prompt": "the fox", "max_tokens": 2},
                               AUTH)
    assert status == 200
    per_adapter = 'asyncserve_adapter_requests_total{adapter="r8_attn_rs"}'
    status, open_text, _ = srv.request("GET", "/metrics")
    assert status == 200 and "asyncserve_requests_total" in open_text and "asyncserve_pool_pages" in open_text
    assert 'adapter="' not in open_text and "r8_attn_rs" not in open_text
    status, keyed, _ = srv.request("GET", "/metrics", headers=AUTH)
    assert status == 200 and per_adapter in keyed and "asyncserve_requests_total" in keyed
    status, err, _ = srv.request("GET", "/metrics", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    monkeypatch.setattr(srv.server.config, "metrics_public", True)
    status, public, _ = srv.request("GET", "/metrics")
    assert status == 200 and per_adapter in public
    assert srv.request("GET", "/health")[0] == 200                 # health never wanted the key
