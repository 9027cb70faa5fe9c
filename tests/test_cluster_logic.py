"""Cluster mode's plain classes: perf model fit, peer auth, membership, routing, placement, the
co-migration MILP (against brute force) and the cluster simulator."""
from __future__ import annotations

import collections

import itertools
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from asyncserve.cluster.auth import (DESTINATION_HEADER, NONCE_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, AuthError,
                                     PeerSigner, PeerVerifier, WrongDestination, new_incarnation)
from asyncserve.cluster.membership import Membership, PeerState
from asyncserve.cluster.messages import AdapterTiers, Digest
from asyncserve.cluster.migration import MAX_MIGRATIONS, MOVE_PRICE, Candidate, CoMigrator, build_problem, solve
from asyncserve.cluster.routing import (AdapterPlacement, ClusterView, Consolidate, LeastPending, Local, NodeLoad,
                                        Random, RankAware, RoundRobin, RouteRequest, Router, cluster_coefficients,
                                        rendezvous_weight)
from asyncserve.perf_model import (STEP_TIME_PRIOR, PerfCoefficients, QueuedWork, StepChunk, StepLatencyModel,
                                   StepSample, adapter_load_seconds, drain_seconds, fetch_backlog_seconds, fit,
                                   pending_seconds, predict_step_seconds, request_work_seconds)

COEFFS = PerfCoefficients(beta=0.02, alpha_token=4e-4, alpha_rank=2e-6, load_host_s_per_rank=1e-4,
                          load_disk_s_per_rank=2e-3, load_disk_fixed_s=0.05)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---- perf model ---------------------------------------------------------------------------------
def test_fit_recovers_coefficients_and_predicts_steps():
    rng = np.random.default_rng(0)
    truth = PerfCoefficients(beta=0.015, alpha_token=3e-4, alpha_rank=5e-6)
    samples = []
    for _ in range(40):
        chunks = [(int(rng.integers(1, 64)), int(rng.choice([8, 16, 64]))) for _ in range(int(rng.integers(1, 8)))]
        secs = predict_step_seconds(truth, chunks) * (1 + rng.normal(0, 0.01))
        samples.append(StepSample(sum(n for n, _ in chunks), sum(n * r for n, r in chunks), secs))
    got = fit(samples)
    assert got.r2 > 0.99
    assert got.beta == pytest.approx(truth.beta, rel=0.1)
    assert got.alpha_token == pytest.approx(truth.alpha_token, rel=0.1)
    assert got.alpha_rank == pytest.approx(truth.alpha_rank, rel=0.1)
    # padded kernels: a step costs its tokens times the largest rank
    padded = PerfCoefficients(beta=0.0, alpha_token=0.0, alpha_rank=1.0, rank_cost="max")
    assert predict_step_seconds(padded, [(1, 8), (1, 64)]) == 128


def test_fit_never_gives_negative_coefficients():
    # rank work that does not matter, with noise pulling its slope below zero
    samples = [StepSample(16, 0, 0.0221), StepSample(16, 200, 0.0219), StepSample(200, 0, 0.09), StepSample(200, 3000, 0.0899)]
    got = fit(samples)
    assert got.alpha_rank == 0.0 and got.beta > 0 and got.alpha_token > 0


def test_online_model_skips_warm_up_and_stalls_and_refits():
    """The engine's live model: the first steps (set-up, seconds long) and a stalled step never reach
    the fit; it starts from its prior and recovers the true coefficients from steps of several sizes."""
    rng = np.random.default_rng(3)
    true = PerfCoefficients(beta=0.03, alpha_token=0.002, alpha_rank=1e-5)
    model = StepLatencyModel(PerfCoefficients(beta=0.02, alpha_token=2e-4, alpha_rank=0.0), window=256,
                             refit_every=32, warmup=4)
    for _ in range(4):
        model.record([(64, 0)], 7.5)                           # warm-up steps: never fitted
    assert model.coefficients.beta == 0.02
    for i in range(200):
        chunks = [(int(rng.integers(1, 64)), int(rng.choice([0, 8, 16]))) for _ in range(int(rng.integers(1, 5)))]
        seconds = predict_step_seconds(true, chunks) * (1 + 0.02 * rng.standard_normal())
        model.record(chunks, 20.0 if i == 150 else seconds)    # one stall of the machine
    c = model.coefficients
    assert c.source == "fitted online"
    assert c.beta == pytest.approx(0.03, rel=0.1) and c.alpha_token == pytest.approx(0.002, rel=0.1)
    assert c.alpha_rank == pytest.approx(1e-5, rel=0.3)
    assert model.predict([(16, 16)]) > model.predict([(16, 0)])


def test_pending_seconds_is_the_sum_of_work_shares():
    queue = [QueuedWork(100, 50, 8), QueuedWork(0, 20, 16), QueuedWork(300, 100, 0)]
    expected = sum(request_work_seconds(COEFFS, w, 3) for w in queue)
    assert pending_seconds(COEFFS, queue, max_running=32) == pytest.approx(expected)
    one = QueuedWork(0, 10, 8)      # alone: ten decode steps of a batch of one
    assert pending_seconds(COEFFS, [one], 32) == pytest.approx(10 * predict_step_seconds(COEFFS, [(1, 8)]))


GEMMA_WINDOWS = [512] * 5 + [None]     # Gemma 3's layout: five sliding-window layers of 512 keys, then a global one
ATTN = PerfCoefficients(beta=0.02, alpha_token=4e-4, alpha_rank=2e-6, alpha_seq=1e-4, alpha_attn=3e-9)


def pairs_by_position(context: int, tokens: int, windows: list) -> float:
    """Reference: each position's keys, min(position + 1, window) in a window layer, averaged over the layers."""
    return sum(sum(q + 1 if w is None else min(q + 1, w) for w in windows) / len(windows)
               for q in range(context, context + tokens))


@pytest.mark.parametrize("work", [QueuedWork(3000, 200, 8), QueuedWork(0, 300, 16, context=4000),
                                  QueuedWork(700, 100, 0, context=900), QueuedWork(400, 200, 8, context=100)])
def test_queue_estimate_prices_sliding_windows_over_the_computed_context(work):
    """A long request on a Gemma-like model costs less than on an all-global one, by alpha_attn times the
    pairs its window layers do not read: counted from the context it has computed already."""
    everything = work.prefill_tokens + work.decode_tokens
    global_only = request_work_seconds(ATTN, work, 8)
    windowed = request_work_seconds(ATTN, work, 8, windows=GEMMA_WINDOWS)
    unread = pairs_by_position(work.context, everything, [None]) - pairs_by_position(work.context, everything,
                                                                                        GEMMA_WINDOWS)
    assert unread > 0
    assert global_only - windowed == pytest.approx(ATTN.alpha_attn * unread, rel=1e-9)
    # the context already computed is read by every remaining token
    fresh = request_work_seconds(ATTN, work._replace(context=0), 8)
    assert global_only - fresh == pytest.approx(ATTN.alpha_attn * everything * work.context, rel=1e-9)


@pytest.mark.parametrize("work", [QueuedWork(300, 200, 8), QueuedWork(0, 100, 16, context=400),
                                  QueuedWork(12, 0, 0, context=500), QueuedWork(0, 1, 8, context=511)])
def test_queue_estimate_under_the_window_is_the_global_price(work):
    assert work.context + work.prefill_tokens + work.decode_tokens <= 512
    assert request_work_seconds(ATTN, work, 4, windows=GEMMA_WINDOWS) == \
        pytest.approx(request_work_seconds(ATTN, work, 4), rel=1e-12)


@pytest.mark.parametrize("windows", [[], GEMMA_WINDOWS, [64, None]])
def test_queue_estimate_is_the_step_model_summed_over_the_requests_steps(windows):
    """One formula: a request alone (batch of one) costs what the step model predicts for its decode
    steps, each one token after the context grown so far."""
    c = ATTN
    for context, decodes in [(0, 50), (700, 40), (3000, 30)]:
        steps = sum(predict_step_seconds(c, [StepChunk(1, 8, context + k)], windows) for k in range(decodes))
        assert pending_seconds(c, [QueuedWork(0, decodes, 8, context)], 32, windows) == pytest.approx(steps, rel=1e-9)


def test_routing_and_migration_price_a_nodes_windows():
    """A digest carries its model's windows: a router's and the migration program's price of a request on
    that node use them (a long prompt costs less there than on an all-global node of the same coefficients)."""
    def digest(node_id: str, windows: list) -> Digest:
        return Digest(node_id=node_id, url=f"http://{node_id}", seq=1, timestamp=0.0, waiting=0, running=2,
                      pending_seconds=1.0, free_pages=10_000, page_tokens=16, max_running=32, running_rank_sum=16,
                      running_rank_max=8, adapters=AdapterTiers(device=["a"]), coefficients=ATTN,
                      layer_windows=windows)

    windowed, plain = NodeLoad.from_digest(digest("w", GEMMA_WINDOWS)), NodeLoad.from_digest(digest("g", []))
    assert windowed.windows == GEMMA_WINDOWS
    req = RouteRequest("a", 8, 6000, 200)
    unread = pairs_by_position(0, 6200, [None]) - pairs_by_position(0, 6200, GEMMA_WINDOWS)
    assert plain.work_seconds(req) - windowed.work_seconds(req) == pytest.approx(ATTN.alpha_attn * unread, rel=1e-9)
    # a running candidate on the windowed node: staying costs its remaining work after its computed context,
    # moving recomputes it all (priced with the target's windows)
    candidate = Candidate("r", "w", "a", 8, prefill_tokens=0, context_tokens=5000, decode_tokens=100)
    problem = build_problem([windowed, plain], [candidate], budget_tokens=10_000)
    stay = request_work_seconds(ATTN, QueuedWork(0, 100, 8, 5000), 3, 8, GEMMA_WINDOWS)
    move = request_work_seconds(ATTN, QueuedWork(5000, 100, 8), 3, 8)
    assert problem.work[0].tolist() == pytest.approx([stay, move], rel=1e-12)


# ---- auth -----------------------------------------------------------------------------------------
def test_auth_accepts_good_calls_and_refuses_bad_ones():
    clock = FakeClock()
    signer, verifier = PeerSigner("k1", clock), PeerVerifier("k1", "b@1", window_s=30, clock=clock)
    body = b'{"node_id":"a"}'
    good = signer.headers("POST", "/cluster/digest", body, "b@1")
    verifier.verify("POST", "/cluster/digest", good, body)

    with pytest.raises(AuthError, match="replayed"):
        verifier.verify("POST", "/cluster/digest", good, body)
    with pytest.raises(AuthError, match="missing"):
        verifier.verify("POST", "/cluster/digest", {}, body)
    forged = PeerSigner("other key", clock).headers("POST", "/cluster/digest", body, "b@1")
    with pytest.raises(AuthError, match="bad signature"):
        verifier.verify("POST", "/cluster/digest", forged, body)
    fresh = signer.headers("POST", "/cluster/digest", body, "b@1")
    for method, path, b in (("POST", "/cluster/digest", b'{"node_id":"b"}'), ("POST", "/cluster/forward", body),
                            ("PUT", "/cluster/digest", body)):
        with pytest.raises(AuthError, match="bad signature"):
            verifier.verify(method, path, fresh, b)
    tampered = dict(fresh, **{SIGNATURE_HEADER: fresh[SIGNATURE_HEADER][:-1] + "0"})
    if tampered[SIGNATURE_HEADER] != fresh[SIGNATURE_HEADER]:
        with pytest.raises(AuthError):
            verifier.verify("POST", "/cluster/digest", tampered, body)
    # the refused calls did not use up its nonce
    verifier.verify("POST", "/cluster/digest", fresh, body)

    old = signer.headers("POST", "/cluster/digest", body, "b@1")
    clock.t += 31
    with pytest.raises(AuthError, match="stale"):
        verifier.verify("POST", "/cluster/digest", old, body)
    future = PeerSigner("k1", FakeClock(clock.t + 31)).headers("POST", "/cluster/digest", body, "b@1")
    with pytest.raises(AuthError, match="stale"):
        verifier.verify("POST", "/cluster/digest", future, body)
    bad_nonce = dict(signer.headers("POST", "/p", body, "b@1"), **{NONCE_HEADER: "x\ny"})
    with pytest.raises(AuthError, match="malformed"):
        verifier.verify("POST", "/p", bad_nonce, body)
    assert TIMESTAMP_HEADER in good and NONCE_HEADER in good


def test_auth_nonce_cache_is_bounded_and_forgets_expired_nonces():
    clock = FakeClock()
    signer, verifier = PeerSigner(b"k", clock), PeerVerifier(b"k", "b@1", window_s=10, max_nonces=2, clock=clock)
    for _ in range(2):
        verifier.verify("GET", "/cluster/state", signer.headers("GET", "/cluster/state", b"", "b@1"), b"")
    with pytest.raises(AuthError, match="too many"):
        verifier.verify("GET", "/cluster/state", signer.headers("GET", "/cluster/state", b"", "b@1"), b"")
    clock.t += 11
    verifier.verify("GET", "/cluster/state", signer.headers("GET", "/cluster/state", b"", "b@1"), b"")
    assert len(verifier._seen) == 1
    with pytest.raises(ValueError):
        PeerVerifier("", "b@1")


def test_auth_binds_the_destination_incarnation():
    """A call signed for node b's incarnation is refused by node c and by b restarted (same node id, new
    incarnation, empty nonce cache) while its timestamp is fresh; the refusal teaches the genuine caller
    the incarnation, and a forged refusal teaches nothing."""
    clock = FakeClock()
    b1, c, b2 = new_incarnation("b"), new_incarnation("c"), new_incarnation("b")
    assert len({b1, c, b2}) == 3 and b1.startswith("b@") and b2.startswith("b@")
    signer = PeerSigner("k", clock)
    body = b'{"node_id":"a"}'
    call = signer.headers("POST", "/cluster/forward", body, b1)
    PeerVerifier("k", b1, clock=clock).verify("POST", "/cluster/forward", call, body)
    for incarnation in (c, b2):
        verifier = PeerVerifier("k", incarnation, clock=clock)
        with pytest.raises(WrongDestination, match="signed for b@") as refused:
            verifier.verify("POST", "/cluster/forward", call, body)
        assert verifier._seen == {}
        assert signer.learned(call, refused.value.headers) == incarnation
        forged = dict(refused.value.headers, **{DESTINATION_HEADER: b1 + "x"})
        assert signer.learned(call, forged) is None
        assert PeerSigner("other", clock).learned(call, refused.value.headers) is None
        assert signer.learned(signer.headers("POST", "/p", body, b1), refused.value.headers) is None  # another call's
        retry = signer.headers("POST", "/cluster/forward", body, incarnation)
        verifier.verify("POST", "/cluster/forward", retry, body)
    tampered = dict(call, **{DESTINATION_HEADER: c})     # re-addressed without the key: the signature breaks
    with pytest.raises(AuthError, match="bad signature"):
        PeerVerifier("k", c, clock=clock).verify("POST", "/cluster/forward", tampered, body)
    with pytest.raises(ValueError):
        new_incarnation("two\nlines")


# ---- membership -------------------------------------------------------------------------------------
def _digest(node_id: str, url: str, seq: int = 1, **kw) -> Digest:
    fields = dict(waiting=0, running=0, pending_seconds=0.0, free_pages=1000, page_tokens=16, max_running=8,
                  running_rank_sum=0, running_rank_max=0, adapters=AdapterTiers(), coefficients=COEFFS)
    fields.update(kw)
    return Digest(node_id=node_id, url=url, seq=seq, timestamp=0.0, **fields)


def test_membership_states_dns_and_rejoin():
    clock = FakeClock(0.0)
    answers = {"svc": ["10.0.0.1", "10.0.0.2", "10.0.0.9"]}

    def resolver(name, port, type=None):
        if name not in answers:
            raise socket.gaierror("no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[name]]

    m = Membership("http://10.0.0.9:8000", "http://h1:8000,dns:svc:8000", gossip_interval_s=0.2,
                   resolve_every_s=5.0, clock=clock, resolver=resolver)
    assert m.urls() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://h1:8000"]   # not itself
    assert all(p.state is PeerState.ALIVE for p in m.peers.values())

    clock.t = 0.59
    m.refresh()
    assert len(m.alive()) == 3
    clock.t = 0.61                                           # three intervals of silence
    changes = m.refresh()
    assert {(u, old, new) for u, old, new in changes} == {(u, PeerState.ALIVE, PeerState.SUSPECT) for u in m.urls()}
    assert m.heard(_digest("b", "http://10.0.0.2:8000", seq=5))
    assert m.peers["http://10.0.0.2:8000"].state is PeerState.ALIVE
    assert not m.heard(_digest("b", "http://10.0.0.2:8000", seq=4))           # older than what we have
    clock.t = 2.01                                           # ten intervals
    m.refresh()
    assert m.peers["http://h1:8000"].state is PeerState.DEAD
    assert m.peers["http://10.0.0.2:8000"].state is PeerState.SUSPECT      # heard at 0.6: 7 intervals
    assert m.heard(_digest("h", "http://h1:8000", seq=1))                   # a dead peer rejoins by speaking
    assert m.peers["http://h1:8000"].state is PeerState.ALIVE
    assert [d.node_id for d in m.alive_digests()] == ["h"]

    m.call_failed("http://h1:8000")                         # slow or garbage: suspect until it speaks
    assert m.peers["http://h1:8000"].state is PeerState.SUSPECT
    m.refresh()
    assert m.peers["http://h1:8000"].state is PeerState.SUSPECT
    assert m.heard(_digest("h", "http://h1:8000", seq=2))
    m.refresh()
    assert m.peers["http://h1:8000"].state is PeerState.ALIVE

    answers["svc"] = ["10.0.0.2", "10.0.0.3", "10.0.0.9"]   # a pod replaced
    clock.t = 4.9
    m.refresh()
    assert "http://10.0.0.3:8000" not in m.peers            # not re-resolved before resolve_every_s
    clock.t = 5.1
    changes = m.refresh()
    assert ("http://10.0.0.3:8000", None, PeerState.ALIVE) in changes
    assert any(u == "http://10.0.0.1:8000" and new is None for u, _, new in changes)
    assert set(m.urls()) == {"http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://h1:8000"}
    del answers["svc"]                                       # DNS failing keeps the table
    clock.t = 11.0
    m.refresh()
    assert set(m.urls()) == {"http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://h1:8000"}

    m.self_id = "me"                                         # our own digest seen through another name
    assert not m.heard(_digest("me", "http://10.0.0.3:8000"))
    assert "http://10.0.0.3:8000" not in m.peers
    with pytest.raises(ValueError):
        Membership("http://a:1", "dns:noport", clock=clock, resolver=resolver)


# ---- routing -------------------------------------------------------------------------------------------
def _view(*digests: Digest) -> ClusterView:
    view = ClusterView()
    for d in digests:
        view.update(d, received_at=0.0)
    return view


REQ = RouteRequest(adapter="sql", rank=16, prompt_tokens=64, expected_output=64)


def test_simple_policies_on_hand_made_digests():
    nodes = _view(_digest("n0", "u0", running=3, waiting=1, pending_seconds=4.0),
                  _digest("n1", "u1", running=6, pending_seconds=1.5),
                  _digest("n2", "u2", running=8, waiting=2, pending_seconds=9.0)).loads()
    assert Local().choose(REQ, nodes, "n1", 0) == "n1"
    rr = RoundRobin()
    assert [rr.choose(REQ, nodes, "n0", 0) for _ in range(4)] == ["n0", "n1", "n2", "n0"]
    assert LeastPending().choose(REQ, nodes, "n0", 0) == "n1"
    picks = [Random(seed=3).choose(REQ, nodes, "n0", 0) for _ in range(2)]
    assert picks[0] == picks[1]
    r = Random(seed=3)
    assert {r.choose(REQ, nodes, "n0", 0) for _ in range(60)} == {"n0", "n1", "n2"}
    # consolidate: the busiest that fits (n2 is full: 10 in flight >= max_running 8)
    assert Consolidate().choose(REQ, nodes, "n0", 0) == "n1"
    tied = _view(_digest("n0", "u0", running=5), _digest("n1", "u1", running=5), _digest("n2", "u2", running=2)).loads()
    assert Consolidate().choose(REQ, tied, "n0", 0) == "n1"                 # ties: the highest id
    no_room = _view(_digest("n0", "u0", running=2, free_pages=3, pending_seconds=2.0),
                    _digest("n1", "u1", running=8, pending_seconds=1.0)).loads()
    assert Consolidate().choose(REQ, no_room, "n0", 0) == "n1"              # none fits: least pending


def test_rank_aware_prices_adapter_loads_and_rank_mixes():
    # n0 is a little less loaded but would read the adapter from disk; n1 has it in the pool
    nodes = _view(_digest("n0", "u0", running=2, pending_seconds=1.0),
                  _digest("n1", "u1", running=2, pending_seconds=1.05, adapters=AdapterTiers(device=["sql"]))).loads()
    assert RankAware().choose(REQ, nodes, "n0", 0) == "n1"
    assert LeastPending().choose(REQ, nodes, "n0", 0) == "n0"
    # far less loaded beats a load
    nodes = _view(_digest("n0", "u0", running=2, pending_seconds=1.0),
                  _digest("n1", "u1", running=2, pending_seconds=9.0, adapters=AdapterTiers(device=["sql"]))).loads()
    assert RankAware().choose(REQ, nodes, "n0", 0) == "n0"
    # padded kernels: a rank-64 request goes where the batch already pays for rank 64
    padded = PerfCoefficients(beta=0.02, alpha_token=1e-4, alpha_rank=5e-5, rank_cost="max")
    big = RouteRequest(adapter=None, rank=64, prompt_tokens=16, expected_output=64)
    nodes = _view(_digest("n0", "u0", running=6, running_rank_sum=48, running_rank_max=8, pending_seconds=1.0,
                          coefficients=padded),
                  _digest("n1", "u1", running=6, running_rank_sum=384, running_rank_max=64, pending_seconds=1.3,
                          coefficients=padded)).loads()
    assert RankAware().choose(big, nodes, "n0", 0) == "n1"
    assert LeastPending().choose(big, nodes, "n0", 0) == "n0"
    # SLO: a node whose time per token would break it loses (n1's batch of 13 at rank 64: 62.9 ms)
    nodes = _view(_digest("n0", "u0", running=6, running_rank_sum=48, running_rank_max=8, pending_seconds=1.0,
                          coefficients=padded),
                  _digest("n1", "u1", running=12, running_rank_sum=768, running_rank_max=64, pending_seconds=1.3,
                          max_running=32, coefficients=padded)).loads()
    assert RankAware().choose(big, nodes, "n0", 0) == "n1"
    assert RankAware(slo_tpot_s=0.05).choose(big, nodes, "n0", 0) == "n0"


def test_rank_aware_placement_wins_only_what_a_load_would_cost():
    # the adapter's placement set (one node: demand is low) against a slightly cheaper other node
    placed, other = sorted(["n0", "n1"], key=lambda n: rendezvous_weight("sql", n), reverse=True)
    load = adapter_load_seconds(COEFFS, REQ.rank, None)
    cheaper = {"running": 2, "pending_seconds": 1.0}
    dearer = {"running": 2, "pending_seconds": 1.0 + load / 2}
    # neither holds the adapter: the placed node wins within a load (the load it saves elsewhere)
    nodes = _view(_digest(other, "u0", **cheaper), _digest(placed, "u1", **dearer)).loads()
    assert RankAware().choose(REQ, nodes, "n0", 0) == placed
    # both hold it on their devices: going to the placed node saves nothing, the cheaper wins
    both = AdapterTiers(device=["sql"])
    nodes = _view(_digest(other, "u0", adapters=both, **cheaper), _digest(placed, "u1", adapters=both, **dearer)).loads()
    assert RankAware().choose(REQ, nodes, "n0", 0) == other


def test_router_counts_what_it_sent_until_the_next_digest():
    router = Router("n0", LeastPending())
    router.view.update(_digest("n0", "u0", seq=1, pending_seconds=1.0), 0.0)
    router.view.update(_digest("n1", "u1", seq=1, pending_seconds=1.2), 0.0)
    first, second = router.route(REQ, 0.1), router.route(REQ, 0.1)
    assert (first, second) == ("n0", "n1")                  # without the correction both would go to n0
    loads = {n.node_id: n for n in router.view.loads()}
    assert loads["n0"].running == 1 and "sql" in loads["n0"].device
    router.view.update(_digest("n0", "u0", seq=2, pending_seconds=1.0), 0.2)   # it now includes the request
    assert {n.node_id: n.running for n in router.view.loads()}["n0"] == 0
    router.view.update(_digest("n0", "u0", seq=1, pending_seconds=50.0), 0.3)  # a stale digest is ignored
    assert {n.node_id: n.pending_seconds for n in router.view.loads()}["n0"] == 1.0


def test_routers_that_all_route_water_fill_instead_of_herding():
    """Ten entry points, one view: alone each would send its request to the idlest node; told (by the
    digests' routed_per_s) that the others route too, they spread over the nodes near the bottom in
    proportion to the room below the water level, so the herd's ten land where ten fit."""
    pending = {"n0": 0.0, "n1": 0.05, "n2": 0.1, "n3": 5.0}

    def routers(routed_per_s: float) -> list[Router]:
        out = []
        for i in range(10):
            r = Router(f"r{i}", LeastPending(), horizon_s=0.2)
            for node, p in pending.items():
                r.view.update(_digest(node, node, pending_seconds=p, routed_per_s=routed_per_s), 0.0)
            out.append(r)
        return out

    alone = [r.route(REQ, 1.0) for r in routers(0.0)]
    assert set(alone) == {"n0"}                             # a front door: the policy's own choice
    spread = collections.Counter(r.route(REQ, 1.0) for r in routers(5.0))   # 10 routers x 5/s x 0.2 s
    assert "n3" not in spread and len(spread) >= 2 and spread["n0"] < 10


def test_rendezvous_placement_is_stable_when_a_node_joins():
    placement = AdapterPlacement(target_utilization=0.5)
    adapters = [f"a{i}" for i in range(2000)]
    for a in adapters:                                       # demand for two nodes each
        placement.observe(a, 0.7 * placement.tau, now=0.0)
    nodes = [f"n{i:02d}" for i in range(20)]
    before = {a: placement.nodes_for(a, nodes, 0.0) for a in adapters}
    assert {len(s) for s in before.values()} == {2}
    after = {a: placement.nodes_for(a, nodes + ["n20"], 0.0) for a in adapters}
    changed = [a for a in adapters if set(after[a]) != set(before[a])]
    assert 0.05 < len(changed) / len(adapters) < 0.15       # ~2/21 of them, not a reshuffle
    assert all("n20" in after[a] and len(set(after[a]) - set(before[a])) == 1 for a in changed)
    gone = {a: placement.nodes_for(a, nodes[1:], 0.0) for a in adapters}
    assert all(set(gone[a]) == set(before[a]) for a in adapters if "n00" not in before[a])


def test_placement_size_follows_demand_with_hysteresis():
    p = AdapterPlacement(target_utilization=0.5, hysteresis=0.3, half_life_s=1e9)   # no decay within the test
    nodes = [f"n{i}" for i in range(10)]

    def set_demand(d: float) -> None:
        p._rate["x"] = (d, 0.0)

    set_demand(0.4)
    assert p.size("x", 0.0) == 1
    set_demand(1.2)                                          # grows at once
    assert p.size("x", 0.0) == 3
    for d in (0.95, 1.05, 0.9, 1.1, 0.75):                   # hovering near 2 nodes' worth: stays
        set_demand(d)
        assert p.size("x", 0.0) == 3
    set_demand(0.65)                                         # below 2 * 0.5 * 0.7 = 0.7: shrinks
    assert p.size("x", 0.0) == 2
    set_demand(0.8)                                          # and does not grow back until past 1.0
    assert p.size("x", 0.0) == 2
    assert len(p.nodes_for("x", nodes, 0.0)) == 2
    assert p.nodes_for("x", nodes, 0.0) == p.nodes_for("x", list(reversed(nodes)), 0.0)


# ---- migration -------------------------------------------------------------------------------------------
def _load(node_id: str, pending: float, device=(), host=(), free_pages=1000, running=8) -> NodeLoad:
    return NodeLoad(node_id, 0, running, pending, free_pages, 16, 32, running * 16, 16, set(device), set(host), COEFFS)


def _brute_force(p) -> float:
    """The program's optimum by enumerating every assignment."""
    n_i, n_j = len(p.candidates), len(p.nodes)
    best = np.inf
    for assign in itertools.product(range(n_j), repeat=n_i):
        assign = np.array(assign)
        moved = assign != p.source
        if (p.recompute * moved).sum() > p.budget_tokens:
            continue
        per_node = p.base.copy()
        pages = np.zeros(n_j)
        for i, j in enumerate(assign):
            per_node[j] += p.work[i, j]
            if moved[i]:
                pages[j] += p.pages[i]
        if (pages > p.free_pages).any():
            continue
        for k, j in {(p.adapter_of[i], j) for i, j in enumerate(assign) if p.adapter_of[i] >= 0}:
            if p.needs_load[k, j]:
                per_node[j] += p.load[k, j]
        best = min(best, per_node.max() + MOVE_PRICE * (p.recompute * moved).sum())
    return best


@pytest.mark.parametrize("budget", [100_000, 700, 0])
def test_milp_matches_brute_force(budget):
    nodes = [_load("hot", 9.0, device={"a", "b"}), _load("mid", 2.5, device={"a"}, host={"b"}),
             _load("cold", 0.5, free_pages=30)]
    candidates = [Candidate("r0", "hot", "a", 8, 0, 300, 200), Candidate("r1", "hot", "b", 64, 0, 500, 400),
                  Candidate("r2", "hot", "c", 16, 120, 120, 150), Candidate("r3", "hot", None, 0, 0, 200, 300),
                  Candidate("r4", "mid", "a", 8, 0, 250, 120)]
    p = build_problem(nodes, candidates, budget_tokens=budget)
    assign, _, objective = solve(p)
    expected = _brute_force(p)
    assert objective == pytest.approx(expected, rel=1e-6, abs=1e-9)
    if budget == 0:
        assert (assign == p.source).all()
    else:
        assert (assign != p.source).any()                   # the instance is not trivial


def test_comigrator_triggers_on_imbalance_and_plans_moves():
    m = CoMigrator(threshold_s=2.0, top_k_nodes=2, top_k_requests=4, budget_tokens=10_000)
    balanced = [_load("n0", 3.0), _load("n1", 2.0)]
    assert m.overloaded(balanced) == []
    nodes = [_load("n0", 12.0, device={"a"}), _load("n1", 1.0), _load("n2", 0.5, device={"a"}), _load("n3", 9.0)]
    sources = m.overloaded(nodes)
    assert [s.node_id for s in sources] == ["n0", "n3"]
    candidates = [Candidate(f"r{i}", "n0", "a", 16, 0, 200, 300) for i in range(6)]
    plan = m.plan(nodes, candidates)
    assert plan.moves and all(mv.source == "n0" and mv.target in ("n1", "n2") for mv in plan.moves)
    assert plan.makespan_after < plan.makespan_before
    assert all(adapter == "a" and node == "n1" for adapter, node in plan.loads)
    assert bool(plan.loads) == any(mv.target == "n1" for mv in plan.moves)
    assert len({mv.request_id for mv in plan.moves}) == len(plan.moves) <= 4


def test_only_the_busiest_node_migrates_in_a_round():
    """Every node plans alone on the same digests: two overloaded nodes moving in one round would
    both fill the same idle node as if alone (issue #16)."""
    m = CoMigrator(threshold_s=2.0)
    assert m.mover([_load("n0", 3.0), _load("n1", 2.0)]) is None
    nodes = [_load("n0", 12.0), _load("n1", 0.5), _load("n3", 11.0)]
    assert len(m.overloaded(nodes)) == 2 and m.mover(nodes) == "n0"


def test_staying_where_the_adapter_is_being_fetched_loads_nothing():
    """A request's node has its adapter or is fetching it for it (that wait is in its pending time):
    the program used to charge staying a second load, so moving to a cold node looked as cheap."""
    slow_fetch = PerfCoefficients(beta=0.02, alpha_token=4e-4, alpha_rank=2e-6, load_disk_fixed_s=4.0)
    nodes = [NodeLoad("hot", 2, 0, 6.0, 1000, 16, 32, 0, 0, set(), set(), slow_fetch),
             NodeLoad("cold", 0, 2, 3.0, 1000, 16, 32, 32, 16, set(), set(), slow_fetch)]
    candidates = [Candidate("r0", "hot", "a", 16, 100, 100, 64), Candidate("r1", "hot", "a", 16, 100, 100, 64)]
    p = build_problem(nodes, candidates, budget_tokens=10_000)
    assert not p.needs_load[:, 0].any() and p.needs_load[:, 1].all()
    plan = CoMigrator(threshold_s=2.0).plan(nodes, candidates)
    assert plan.moves == [] and plan.loads == []            # a 4 s fetch on "cold" outweighs the 3 s spread
    assert plan.makespan_before == pytest.approx(6.0)


def test_a_plan_prefers_requests_never_moved_and_never_passes_the_cap():
    nodes = [_load("n0", 12.0, device={"a"}), _load("n1", 0.5, device={"a"})]
    fresh = Candidate("fresh", "n0", "a", 16, 0, 200, 100)
    moved = Candidate("moved", "n0", "a", 16, 0, 200, 300, migrations=1)   # more work: it would go first
    capped = Candidate("capped", "n0", "a", 16, 0, 200, 300, migrations=MAX_MIGRATIONS)
    plan = CoMigrator(threshold_s=2.0, top_k_requests=1, min_gain_s=0.0).plan(nodes, [moved, capped, fresh])
    assert [mv.request_id for mv in plan.moves] == ["fresh"]
    assert CoMigrator(threshold_s=2.0, min_gain_s=0.0).plan(nodes, [capped]).moves == []


def test_a_plan_that_gains_less_than_the_threshold_moves_nothing():
    """Pending times are predictions (output lengths are guesses): a round whose moves shorten the
    makespan by less than the threshold would trade a sure recompute for noise."""
    nodes = [_load("n0", 12.0, device={"a"}), _load("n1", 0.5, device={"a"})]
    few = [Candidate(f"r{i}", "n0", "a", 16, 0, 200, 100) for i in range(2)]
    small = CoMigrator(threshold_s=2.0, min_gain_s=0.0).plan(nodes, few)
    assert small.moves and 0 < small.makespan_before - small.makespan_after < 2.0
    assert CoMigrator(threshold_s=2.0).plan(nodes, few).moves == []
    many = [Candidate(f"r{i}", "n0", "a", 16, 0, 200, 1000) for i in range(8)]
    big = CoMigrator(threshold_s=2.0).plan(nodes, many)
    assert big.moves and big.makespan_before - big.makespan_after >= 2.0


# ---- what a node tells its peers -------------------------------------------------------------------------
def test_a_node_on_the_prior_prices_with_a_fitted_peers_model_and_fetch_time():
    """The engine's prior says 20 ms steps and free adapter loads; a fitted peer on a busy CPU says
    5x that and 4 s fetches. A node still on the prior must not look 5x cheaper (issue #16)."""
    fitted = PerfCoefficients(beta=0.1, alpha_token=1e-3, alpha_rank=1e-5, load_disk_fixed_s=4.0, source="fitted")
    peers = [_digest("n2", "u2", coefficients=STEP_TIME_PRIOR),
             _digest("n1", "u1", coefficients=fitted, measured=True)]
    assert cluster_coefficients(STEP_TIME_PRIOR, False, None, peers) == fitted
    assert cluster_coefficients(STEP_TIME_PRIOR, False, None, peers[:1]) == STEP_TIME_PRIOR    # nothing fitted yet
    own = PerfCoefficients(beta=0.09, alpha_token=9e-4, alpha_rank=0.0)
    mine = cluster_coefficients(own, True, None, peers)         # its own steps, a peer's fetch time
    assert (mine.beta, mine.load_disk_fixed_s) == (0.09, 4.0)
    mine = cluster_coefficients(own, True, 2.5, peers)          # its own fetches measured
    assert adapter_load_seconds(mine, 16, None) == pytest.approx(2.5)
    assert cluster_coefficients(COEFFS, True, None, peers) == COEFFS     # a disk model of its own: kept
    queue = [QueuedWork(100, 50, 8)]
    assert pending_seconds(cluster_coefficients(STEP_TIME_PRIOR, False, None, peers), queue, 8) > \
        4 * pending_seconds(STEP_TIME_PRIOR, queue, 8)


def test_adapter_reads_overlap_the_runnable_work_and_the_parked_work_follows():
    runnable, parked = [QueuedWork(0, 4000, 8)], [QueuedWork(100, 64, 8)]
    both = pending_seconds(COEFFS, runnable + parked, 8)
    only_parked = pending_seconds(COEFFS, parked, 8)
    assert both > 4.0 + only_parked
    assert drain_seconds(COEFFS, runnable, parked, 4.0, 8) == pytest.approx(both)          # hidden by the work
    assert drain_seconds(COEFFS, runnable, parked, both, 8) == pytest.approx(both + only_parked)
    assert drain_seconds(COEFFS, [], parked, 4.0, 8) == pytest.approx(4.0 + only_parked)
    assert drain_seconds(COEFFS, runnable, [], 4.0, 8) == pytest.approx(pending_seconds(COEFFS, runnable, 8))


def test_the_fetch_backlog_is_the_cold_adapters_loads_shared_by_the_fetchers():
    c = PerfCoefficients(beta=0.02, alpha_token=4e-4, alpha_rank=0.0, load_disk_fixed_s=4.0)
    assert fetch_backlog_seconds(c, [8, 16, 64], fetchers=2) == pytest.approx(6.0)
    assert fetch_backlog_seconds(c, [], fetchers=2) == 0.0


# ---- simulator ------------------------------------------------------------------------------------------
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_simulator_is_deterministic_and_consistent():
    import simulate_cluster as sim
    argv = ["--nodes", "4", "--duration", "4", "--rps", "12", "--burst-rps", "8", "--adapters", "30",
            "--migrate-threshold", "0.2", "--migrate-interval", "0.2", "--max-running", "8",
            "--policies", "rank-aware+migrate,round-robin,consolidate", "--seed", "7"]
    first, second = sim.main(argv), sim.main(argv)
    for a, b in zip(first, second):
        ra, rb = a.row(), b.row()
        for volatile in ("wall_s", "milp_seconds"):
            ra.pop(volatile), rb.pop(volatile)
        assert ra == rb
        assert a.finished_once
        assert len(a.latencies) > 30
        assert (a.latencies >= a.service - 1e-9).all()        # nothing beats running alone
        assert (a.ttft > 0).all() and (a.ttft <= a.latencies + 1e-12).all()
    assert first[0].migrations > 0                            # the migration path ran
    assert first[1].migrations == 0


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"request_id": "' + b"[" * 50 + b'\xff"}', b"\xff\xfe{}",
                                  b'{"request_id": ' + b'{"a": ' * 20_000 + b"1" + b"}" * 20_000 + b"}", b""])
def test_malformed_peer_bodies_are_400_not_500(body):
    """A signed peer call's body that is not UTF-8, nested past the decoder's depth or of the wrong
    shape is a 400 like any client's (ingress/peers.py), whatever the decoder raises."""
    from asyncserve.cluster.messages import Digest, ForwardedRequest
    from asyncserve.ingress.peers import decode
    from asyncserve.ingress.protocol import ApiError
    for kind in (Digest, ForwardedRequest):
        with pytest.raises(ApiError) as refused:
            decode(body, kind)
        assert refused.value.status == 400
