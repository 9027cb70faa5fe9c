"""Where a request runs: routing policies over the cluster's load digests, and adapter placement.

A router sees each node as its last digest plus what this router itself sent there since (digests
are up to a gossip interval old, and without that correction every request of an interval would go
to the same node). Policies, one class each behind RoutingPolicy.choose:

    local          always this node
    round-robin    the nodes in turn
    random         uniformly at random
    least-pending  the least predicted pending time (CaraServe's MostIdle)
    rank-aware     the least estimated pending time including loading the adapter where it is not
                   resident (dLoRA §5.1), plus the request's work priced by the rank-aware latency
                   model, what it adds to the others' steps and a penalty past the time-per-token
                   SLO (CaraServe §5, Algorithm 1); the adapter's placement set wins near-ties
    consolidate    the busiest node that still has a slot and the pages (Punica §5.1's first fit)

Adapter placement keeps each adapter on a bounded set of nodes sized by its demand, chosen by
rendezvous hashing (a node joining or leaving moves only the adapters it wins or held), with
hysteresis so the set's size does not flap when demand hovers near a boundary.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from dataclasses import dataclass, field

import msgspec

from asyncserve.cluster.messages import Digest
from asyncserve.perf_model import (PerfCoefficients, QueuedWork, adapter_load_seconds, decode_step_seconds,
                                   request_work_seconds)


@dataclass
class RouteRequest:
    adapter: str | None
    rank: int                          # 0: base model
    prompt_tokens: int
    expected_output: int               # the router's guess: mean output length, capped by max_tokens


@dataclass
class NodeLoad:
    """A node as a router sees it: its digest with this router's dispatches since added."""
    node_id: str
    waiting: int
    running: int
    pending_seconds: float
    free_pages: int
    page_tokens: int
    max_running: int
    rank_sum: int
    rank_max: int
    device: set[str]
    host: set[str]
    coefficients: PerfCoefficients
    windows: list[int | None] = field(default_factory=list)    # its model's per-layer attention windows

    @classmethod
    def from_digest(cls, d: Digest) -> NodeLoad:
        return cls(d.node_id, d.waiting, d.running, d.pending_seconds, d.free_pages, d.page_tokens,
                   d.max_running, d.running_rank_sum, d.running_rank_max, set(d.adapters.device),
                   set(d.adapters.host), d.coefficients, list(d.layer_windows))

    def tier(self, adapter: str | None) -> str | None:
        if adapter is None or adapter in self.device:
            return "device"
        return "host" if adapter in self.host else None

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting

    def fits(self, req: RouteRequest) -> bool:
        """A slot in the running batch and the pages for the request's tokens."""
        pages = math.ceil((req.prompt_tokens + req.expected_output) / self.page_tokens)
        return self.in_flight < self.max_running and pages <= self.free_pages

    def work_seconds(self, req: RouteRequest) -> float:
        batch = min(self.in_flight + 1, self.max_running)
        return request_work_seconds(self.coefficients, QueuedWork(req.prompt_tokens, req.expected_output, req.rank),
                                    batch, self.rank_max, self.windows)

    def add(self, req: RouteRequest) -> None:
        """Account for a request this router has just sent here."""
        self.pending_seconds += self.work_seconds(req)
        self.free_pages -= math.ceil((req.prompt_tokens + req.expected_output) / self.page_tokens)
        if self.in_flight < self.max_running:
            self.running += 1
            self.rank_sum += req.rank
            self.rank_max = max(self.rank_max, req.rank)
        else:
            self.waiting += 1
        if req.adapter is not None:
            self.device.add(req.adapter)


class ClusterView:
    """The newest digest of each node, with what this router sent to each since it arrived."""

    def __init__(self, settle_s: float = 0.0):
        self.settle_s = settle_s           # a request sent this long before a digest arrived is in it
        self.digests: dict[str, Digest] = {}
        self._base: dict[str, NodeLoad] = {}
        self._sent: dict[str, list[tuple[float, RouteRequest]]] = {}

    def update(self, digest: Digest, received_at: float) -> None:
        old = self.digests.get(digest.node_id)
        if old is not None and digest.seq <= old.seq:
            return
        self.digests[digest.node_id] = digest
        self._base[digest.node_id] = NodeLoad.from_digest(digest)
        self._sent[digest.node_id] = [(t, r) for t, r in self._sent.get(digest.node_id, [])
                                      if t > received_at - self.settle_s]

    def remove(self, node_id: str) -> None:
        self.digests.pop(node_id, None)
        self._base.pop(node_id, None)
        self._sent.pop(node_id, None)

    def note_sent(self, node_id: str, req: RouteRequest, now: float) -> None:
        self._sent.setdefault(node_id, []).append((now, req))

    def loads(self) -> list[NodeLoad]:
        """Every node's load, by node id (read-only: unadjusted ones are shared with the view)."""
        out = []
        for node_id in sorted(self._base):
            load = self._base[node_id]
            sent = self._sent.get(node_id)
            if sent:
                load = dataclasses.replace(load, device=set(load.device))
                for _, req in sent:
                    load.add(req)
            out.append(load)
        return out


def cluster_coefficients(own: PerfCoefficients, measured: bool, fetch_s: float | None,
                         digests: list[Digest]) -> PerfCoefficients:
    """The model a node prices its queue with in its digest (and its peers price sending it work).

    Steps: its own once fitted to its steps, before that a peer's fitted one (peers serve the same
    model): a node still on the prior would look several times cheaper than its fitted peers.
    Adapter fetches from disk: `fetch_s`, the mean this node measured (the pager builds an adapter a
    few MiB per step, up to seconds on a busy CPU), else the slowest a fitted peer measured; the prior's 0
    would make a cold adapter look free to route to or migrate to (issue #16)."""
    fitted = sorted((d for d in digests if d.measured), key=lambda d: d.node_id)
    c = own if measured or not fitted else fitted[0].coefficients
    if fetch_s is None:
        if adapter_load_seconds(c, 1, None) > 0.0:          # a disk model of its own (a profile)
            return c
        fetch_s = max((d.coefficients.load_disk_fixed_s for d in fitted), default=0.0)
        if fetch_s <= 0.0:
            return c
    return msgspec.structs.replace(c, load_disk_fixed_s=fetch_s, load_disk_s_per_rank=0.0)


def rendezvous_weight(adapter: str, node_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{adapter}\0{node_id}".encode(), digest_size=8).digest(), "big")


class AdapterPlacement:
    """Each adapter's set of nodes: the `n` with the highest rendezvous weight, n sized by demand.

    Demand is an exponentially weighted rate of the adapter's work (seconds of work per second,
    i.e. how many fully busy nodes it would need). The set grows as soon as demand passes
    n * target_utilization and shrinks only once it falls below (n - 1) * target_utilization *
    (1 - hysteresis)."""

    def __init__(self, target_utilization: float = 0.5, hysteresis: float = 0.3, min_replicas: int = 1,
                 half_life_s: float = 10.0):
        self.target = target_utilization
        self.hysteresis = hysteresis
        self.min_replicas = min_replicas
        self.tau = half_life_s / math.log(2)
        self._rate: dict[str, tuple[float, float]] = {}      # adapter -> (rate, when)
        self._size: dict[str, int] = {}

    def observe(self, adapter: str, work_seconds: float, now: float) -> None:
        rate, then = self._rate.get(adapter, (0.0, now))
        self._rate[adapter] = (rate * math.exp(-(now - then) / self.tau) + work_seconds / self.tau, now)

    def demand(self, adapter: str, now: float) -> float:
        rate, then = self._rate.get(adapter, (0.0, now))
        return rate * math.exp(-(now - then) / self.tau)

    def size(self, adapter: str, now: float) -> int:
        demand = self.demand(adapter, now)
        n = self._size.get(adapter, self.min_replicas)
        if demand > n * self.target:
            n = math.ceil(demand / self.target)
        elif n > self.min_replicas and demand < (n - 1) * self.target * (1 - self.hysteresis):
            n = max(self.min_replicas, math.ceil(demand / (self.target * (1 - self.hysteresis))))
        self._size[adapter] = n
        return n

    def nodes_for(self, adapter: str, node_ids: list[str], now: float) -> list[str]:
        n = min(self.size(adapter, now), len(node_ids))
        return sorted(node_ids, key=lambda node: rendezvous_weight(adapter, node), reverse=True)[:n]


class RoutingPolicy:
    name = "base"

    def choose(self, req: RouteRequest, nodes: list[NodeLoad], self_id: str, now: float) -> str:
        """The node id to run `req` on; `nodes` (self included) is never empty."""
        raise NotImplementedError

    def prices(self, req: RouteRequest, nodes: list[NodeLoad], now: float) -> dict[str, float] | None:
        """For a policy that picks the cheapest node: each node's price in seconds (choose() is the
        cheapest), so that a Router can spread near-equal choices; None for the others. Call one of
        prices() and choose() per request (either may record the request)."""
        return None


class Local(RoutingPolicy):
    name = "local"

    def choose(self, req, nodes, self_id, now):
        return self_id


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self):
        self._next: int | None = None

    def choose(self, req, nodes, self_id, now):
        if self._next is None:             # start at itself, so that routers do not move in step
            self._next = next((i for i, n in enumerate(nodes) if n.node_id == self_id), 0)
        node = nodes[self._next % len(nodes)]
        self._next += 1
        return node.node_id


class Random(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def choose(self, req, nodes, self_id, now):
        return self.rng.choice(nodes).node_id


class LeastPending(RoutingPolicy):
    name = "least-pending"

    def choose(self, req, nodes, self_id, now):
        return min(nodes, key=lambda n: (n.pending_seconds, n.in_flight, n.node_id)).node_id

    def prices(self, req, nodes, now):
        return {n.node_id: n.pending_seconds for n in nodes}


class Consolidate(RoutingPolicy):
    """Punica: the node with the largest working set that still fits the request (ties: the highest
    id); when none fits, the least pending (Punica would hold it centrally; a peer cannot)."""
    name = "consolidate"

    def choose(self, req, nodes, self_id, now):
        fitting = [n for n in nodes if n.fits(req)]
        if not fitting:
            return LeastPending().choose(req, nodes, self_id, now)
        return max(fitting, key=lambda n: (n.in_flight, n.node_id)).node_id


class RankAware(RoutingPolicy):
    """dLoRA's proactive dispatch priced with CaraServe's rank-aware model: the node's estimated
    queueing (its pending time) plus loading the adapter where it is not resident, plus the
    request's own work at that node's batch, plus what its rank adds to the steps of the requests
    already running there (CaraServe's cost of a request on a server), plus a penalty where the
    predicted time per token would break the SLO. Among nodes within `spill_s` plus the cheapest
    node's load of the adapter, those of the adapter's placement set win: the margin is what
    keeping the adapter where it is placed saves (that load, and an eviction there). Where the
    cheapest node already holds the adapter on its device, the margin is `spill_s` alone: a
    preference then saves nothing and only piles a popular adapter's bursts onto its set (three
    equal peers, a cold load's margin always: mean latency 7.3-8.9 s against round-robin's 6.6-7.4;
    BENCHMARKS.md, thirteenth session)."""
    name = "rank-aware"

    def __init__(self, placement: AdapterPlacement | None = None, slo_tpot_s: float | None = None,
                 slo_penalty_s: float = 1000.0, spill_s: float = 0.0):
        self.placement = placement if placement is not None else AdapterPlacement()
        self.slo_tpot_s = slo_tpot_s
        self.slo_penalty_s = slo_penalty_s
        self.spill_s = spill_s

    def score(self, req: RouteRequest, n: NodeLoad) -> float:
        c = n.coefficients
        load = adapter_load_seconds(c, req.rank, n.tier(req.adapter))
        batch = min(n.in_flight, n.max_running)
        slot = n.in_flight < n.max_running
        before = decode_step_seconds(c, batch, n.rank_sum, n.rank_max) if batch else 0.0
        after = decode_step_seconds(c, batch + 1 if slot else batch, n.rank_sum + req.rank, max(n.rank_max, req.rank))
        # over about half of their output still to come
        impact = (after - before) * batch * req.expected_output / 2 if slot else 0.0
        penalty = self.slo_penalty_s if self.slo_tpot_s is not None and after > self.slo_tpot_s else 0.0
        return load + n.pending_seconds + n.work_seconds(req) + impact + penalty

    def prices(self, req, nodes, now):
        """Scores, those of the adapter's placement set lowered by the margin."""
        scores = {n.node_id: self.score(req, n) for n in nodes}
        if req.adapter is None:
            return scores
        best = min(scores, key=lambda k: (scores[k], k))
        by_id = {n.node_id: n for n in nodes}
        self.placement.observe(req.adapter, by_id[best].work_seconds(req), now)
        placed = set(self.placement.nodes_for(req.adapter, list(by_id), now))
        margin = self.spill_s + adapter_load_seconds(by_id[best].coefficients, req.rank, by_id[best].tier(req.adapter))
        return {k: v - margin if k in placed else v for k, v in scores.items()}

    def choose(self, req, nodes, self_id, now):
        prices = self.prices(req, nodes, now)
        return min(prices, key=lambda k: (prices[k], k))


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (Local, RoundRobin, Random, LeastPending, RankAware, Consolidate)}


class RateMeter:
    """Events per second, exponentially weighted over `tau_s`."""

    def __init__(self, tau_s: float = 5.0):
        self.tau_s = tau_s
        self._rate = 0.0
        self._then: float | None = None

    def rate(self, now: float) -> float:
        if self._then is None:
            return 0.0
        return self._rate * math.exp(-max(now - self._then, 0.0) / self.tau_s)

    def observe(self, now: float) -> None:
        self._rate = self.rate(now) + 1.0 / self.tau_s
        self._then = now


class Router:
    """One node's router: its view of the cluster and a policy.

    Where several nodes route (each the entry point of its own clients) they all see the same
    digests, and each would send to the same cheapest node until the next digest shows what the
    others sent: a herd (the simulator's --entry random). So a router whose peers route too
    (Digest.routed_per_s) expects n more arrivals from them within `horizon_s` (the gossip
    interval) and water-fills: it raises a level over the nodes' prices, each node taking
    (level - price) / the request's work there, until the n + 1 requests are placed, and draws its
    node in proportion. Routers that draw alike fill the cheapest nodes evenly instead of piling
    onto one; a lone entry point (n = 0) keeps the policy's own choice."""

    def __init__(self, self_id: str, policy: RoutingPolicy, settle_s: float = 0.0, horizon_s: float = 0.2,
                 rate_tau_s: float = 5.0):
        self.self_id = self_id
        self.policy = policy
        self.view = ClusterView(settle_s)
        self.horizon_s = horizon_s
        self.arrivals = RateMeter(rate_tau_s)
        self.rng = random.Random(self_id)

    def route(self, req: RouteRequest, now: float, allowed: set[str] | None = None) -> str:
        """The node to run `req` on, among `allowed` (default: every node in the view)."""
        self.arrivals.observe(now)
        nodes = [n for n in self.view.loads() if allowed is None or n.node_id in allowed]
        if not nodes:
            return self.self_id
        others = self.horizon_s * sum(d.routed_per_s for node_id, d in self.view.digests.items()
                                      if node_id != self.self_id)
        prices = self.policy.prices(req, nodes, now) if others > 0 else None
        if prices is None:
            choice = self.policy.choose(req, nodes, self.self_id, now)
        else:
            choice = self._water_fill(req, nodes, prices, others + 1.0)
        self.view.note_sent(choice, req, now)
        return choice

    def _water_fill(self, req: RouteRequest, nodes: list[NodeLoad], prices: dict[str, float], count: float) -> str:
        work = {n.node_id: max(n.work_seconds(req), 1e-9) for n in nodes}
        order = sorted(prices, key=lambda k: (prices[k], k))
        inverse = weighted = 0.0
        for k, node_id in enumerate(order):       # the level where the first k + 1 nodes take `count`
            inverse += 1.0 / work[node_id]
            weighted += prices[node_id] / work[node_id]
            level = (count + weighted) / inverse
            if k + 1 == len(order) or level <= prices[order[k + 1]]:
                break
        filled = order[:k + 1]
        return self.rng.choices(filled, weights=[(level - prices[n]) / work[n] for n in filled])[0]
