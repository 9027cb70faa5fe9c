"""Discrete-event simulation of N asyncserve peers, driven by the rank-aware step-latency model.

Runs the server's own cluster classes (asyncserve.cluster.routing's policies, adapter placement and
ClusterView, migration's CoMigrator and its MILP, messages.Digest, perf_model) over a MAF-like trace:
Gamma inter-arrivals (cv 2) plus per-adapter bursts, power-law adapter popularity, log-normal prompt
and output lengths, adapter ranks mixed. Each node is a continuous-batching server: up to
`max_running` sequences, a per-step token budget shared by one decode token per running sequence
and prefill chunks, a unified pool of KV and adapter pages, adapters paged in from host memory or
disk (an LRU per tier) while other work runs. A step's time is the latency model's prediction; a
run of identical decode-only steps is one event, cut short when something could join the batch.

Requests enter at one node (`--entry one`, a front door: the papers' central scheduler) or at a
random node each (`--entry random`: every node routes its own arrivals from its own view). Digests
are gossiped every `--gossip-interval`; between them a router adds what it sent itself.

    .venv/bin/python scripts/simulate_cluster.py                       # 60 nodes, all policies
    .venv/bin/python scripts/simulate_cluster.py --nodes 8 --duration 20 --plot /tmp/sim.png

Default coefficients: fitted by perf_model.fit to decode and mixed steps measured on CPU box B
(BENCHMARKS.md, SmolLM2-135M, bf16, 2 threads); adapter paging at box B's measured copy bandwidth.
`--coefficients FILE` takes a JSON PerfCoefficients instead (e.g. fitted on a GPU).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import gamma_arrival_times, power_law_adapter_indices  # noqa: E402

from asyncserve.cluster.messages import AdapterTiers, Digest  # noqa: E402
from asyncserve.cluster.migration import MAX_MIGRATIONS, Candidate, CoMigrator  # noqa: E402
from asyncserve.cluster.routing import (POLICIES, AdapterPlacement, ClusterView, RankAware, RouteRequest,  # noqa: E402
                                        Router, cluster_coefficients)
from asyncserve.perf_model import (STEP_TIME_PRIOR, PerfCoefficients, QueuedWork, StepSample,  # noqa: E402
                                   adapter_load_seconds, drain_seconds, expected_remaining_tokens, fit,
                                   step_seconds)

# (tokens, rank work, seconds) of steps measured on CPU box B, BENCHMARKS.md "A cost-model bug in the
# torch LoRA backend" (decode step of 16 sequences: 22.13 ms base, 24.96 ms with 4 adapters of ranks
# 8/16, mean 12) and its W1 mixed step (12 decodes + four 64-token prompts = 268 tokens: 114 ms base,
# 121 ms with adapters).
BOX_B_STEPS = [StepSample(16, 0, 0.02213), StepSample(16, 16 * 12, 0.02496),
               StepSample(268, 0, 0.114), StepSample(268, 268 * 12, 0.121)]
# SmolLM2 adapter on q/k/v/o, per unit of rank: 30 layers x (4 x 576 A + (576 + 192 + 192 + 576) B)
# bf16 values = 230 KB; box B copies 74 GB/s read + write (BENCHMARKS.md, Machines), i.e. 37 GB/s.
ADAPTER_BYTES_PER_RANK = 30 * (4 * 576 + 576 + 192 + 192 + 576) * 2
BOX_B_COPY_BYTES_PER_S = 37e9
# Not measured: reading an adapter that is not in host memory, assumed 1 GB/s plus 5 ms.
DISK_BYTES_PER_S = 1e9
DISK_FIXED_S = 0.005
KV_BYTES_PER_TOKEN = 30 * 2 * 192 * 2          # SmolLM2: layers x (K, V) x kv dim x bf16


def default_coefficients() -> PerfCoefficients:
    return fit(BOX_B_STEPS, "sum",
               load_host_s_per_rank=ADAPTER_BYTES_PER_RANK / BOX_B_COPY_BYTES_PER_S,
               load_disk_s_per_rank=ADAPTER_BYTES_PER_RANK / DISK_BYTES_PER_S,
               load_disk_fixed_s=DISK_FIXED_S,
               source="fitted to BENCHMARKS.md box B steps (SmolLM2, CPU bf16); disk speed assumed")


# ---- trace ------------------------------------------------------------------------------------------
@dataclass
class SimRequest:
    rid: int
    arrival: float
    adapter: str
    rank: int
    prompt: int
    output: int                        # true output length (unknown to routers and nodes)
    generated: int = 0
    prefill_left: int = 0
    first_token: float | None = None
    finish: float | None = None
    node: str = ""
    migrations: int = 0
    reserved: int = 0                  # pool tokens reserved while running
    moving_to: str | None = None       # marked for migration at the next step boundary


def make_trace(args, rng: np.random.Generator) -> list[SimRequest]:
    ranks = [int(r) for r in args.ranks.split(",")]
    adapter_rank = rng.choice(ranks, size=args.adapters)
    n_base = int(args.rps * args.duration * 1.2) + 10
    times = gamma_arrival_times(rng, n_base, args.rps, args.cv)
    times = times[times < args.duration]
    which = power_law_adapter_indices(rng, len(times), args.adapters, args.popularity_alpha)
    parts_t, parts_a = [times], [which]
    # short bursts of one adapter each (dLoRA §5.1's short-term unpredictability)
    n_bursts = rng.poisson(args.bursts_per_min * args.duration / 60)
    for _ in range(n_bursts):
        start = rng.uniform(0, args.duration)
        length = rng.uniform(2.0, 6.0)
        count = rng.poisson(args.burst_rps * length)
        parts_t.append(np.sort(rng.uniform(start, min(start + length, args.duration), size=count)))
        parts_a.append(np.full(count, power_law_adapter_indices(rng, 1, args.adapters, args.popularity_alpha)[0]))
    t = np.concatenate(parts_t)
    a = np.concatenate(parts_a)
    order = np.argsort(t, kind="stable")
    t, a = t[order], a[order]
    prompts = np.clip(rng.lognormal(math.log(args.prompt_median), 1.0, size=len(t)), 4, 2048).astype(int)
    outputs = np.clip(rng.lognormal(math.log(args.output_median), 1.0, size=len(t)), 2, args.max_tokens).astype(int)
    return [SimRequest(i, float(t[i]), f"lora{a[i]}", int(adapter_rank[a[i]]), int(prompts[i]), int(outputs[i]))
            for i in range(len(t))]


def service_seconds(c: PerfCoefficients, req: SimRequest, max_step_tokens: int) -> float:
    """The request alone on an idle node with its adapter resident: its prefill chunks, then one
    decode step per further token."""
    chunks = math.ceil(req.prompt / max_step_tokens)
    prefill = chunks * c.beta + req.prompt * (c.alpha_token + c.alpha_rank * req.rank)
    return prefill + (req.output - 1) * step_seconds(c, 1, req.rank)


# ---- one server --------------------------------------------------------------------------------------
class SimNode:
    def __init__(self, sim: Simulation, node_id: str):
        self.sim = sim
        self.id = node_id
        self.c = sim.coeffs
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.device: OrderedDict[str, int] = OrderedDict()     # adapter -> pool tokens, LRU first
        self.host: OrderedDict[str, None] = OrderedDict()
        self.loading: dict[str, float] = {}                     # adapter -> when its copy is done
        self.fetchers_free = [0.0] * sim.args.fetchers          # when each disk reader is free
        self.in_use: dict[str, int] = {}
        self.used_tokens = 0
        self.busy = False
        self.step_start = self.step_dt = 0.0
        self.step_k = 0
        self.version = 0
        self.seq = 0
        self.adapter_loads = 0
        self.steps = 0                     # steps run: its step model is the prior until --prior-steps
        self.next_rebalance = 0.0

    # -- adapters
    def _adapter_ready(self, req: SimRequest, now: float) -> bool:
        a = req.adapter
        if a in self.device:
            self.device.move_to_end(a)
            return True
        if a not in self.loading:
            tier = "host" if a in self.host else None
            seconds = adapter_load_seconds(self.c, req.rank, tier)
            if tier is None:                # disk reads queue for the pager's fetchers
                f = min(range(len(self.fetchers_free)), key=self.fetchers_free.__getitem__)
                self.loading[a] = self.fetchers_free[f] = max(now, self.fetchers_free[f]) + seconds
            else:
                self.loading[a] = now + seconds
            self.sim.push(self.loading[a], "ready", self.id)
            return False
        if self.loading[a] > now:
            return False
        size = req.rank * self.sim.tokens_per_rank
        if not self._make_room(size):
            return False
        del self.loading[a]
        self.device[a] = size
        self.used_tokens += size
        self.host.pop(a, None)
        self.adapter_loads += 1
        return True

    def _make_room(self, tokens: int) -> bool:
        """Evict idle adapters (least recently used first) to host memory until `tokens` fit."""
        pool = self.sim.args.pool_tokens
        for a in [a for a in self.device if not self.in_use.get(a)]:
            if self.used_tokens + tokens <= pool:
                break
            self.used_tokens -= self.device.pop(a)
            self.host[a] = None
            if len(self.host) > self.sim.args.host_adapters:
                self.host.popitem(last=False)
        return self.used_tokens + tokens <= pool

    # -- requests
    def enqueue(self, req: SimRequest, now: float, front: bool = False) -> None:
        req.node = self.id
        (self.waiting.appendleft if front else self.waiting.append)(req)
        self.kick(now)

    def kick(self, now: float) -> None:
        """Something may join the batch: start a step if idle, or end a run of identical steps at
        the step now in progress."""
        if not self.busy:
            self._start_step(now)
        elif self.step_k > 1:
            done = min(self.step_k, int((now - self.step_start) / self.step_dt) + 1)
            if done < self.step_k:
                self.step_k = done
                self.version += 1
                self.sim.push(self.step_start + done * self.step_dt, "step", self.id, self.version)

    def _admit(self, now: float) -> None:
        args = self.sim.args
        for req in list(self.waiting):
            if len(self.running) >= args.max_running:
                break
            if not self._adapter_ready(req, now):
                continue                     # its adapter is being paged in; admit the others
            # reserve KV for all its tokens (the simulator knows the length; the server preempts instead)
            need = req.prompt + req.output
            if self.used_tokens + need > args.pool_tokens and not self._make_room(need):
                break
            self.waiting.remove(req)
            self.running.append(req)
            self.used_tokens += need
            req.reserved = need
            req.prefill_left = req.prompt + req.generated    # recompute after a migration
            self.in_use[req.adapter] = self.in_use.get(req.adapter, 0) + 1

    def _start_step(self, now: float) -> None:
        self._admit(now)
        if not self.running:
            self.busy = False
            return
        budget = self.sim.args.max_step_tokens
        tokens = 0
        work = 0.0
        max_rank = 0
        prefilling = False
        self.plan: list[tuple[SimRequest, int]] = []
        for req in self.running:                      # decodes first, one token each
            if req.prefill_left == 0:
                self.plan.append((req, 1))
                tokens += 1
                work += req.rank
                max_rank = max(max_rank, req.rank)
        for req in self.running:                      # then prefill chunks under the budget
            if req.prefill_left > 0 and tokens < budget:
                n = min(req.prefill_left, budget - tokens)
                self.plan.append((req, n))
                tokens += n
                work += n * req.rank
                max_rank = max(max_rank, req.rank)
                prefilling = True
        if self.c.rank_cost == "max":
            work = tokens * max_rank
        self.step_dt = step_seconds(self.c, tokens, work)
        self.step_k = 1 if prefilling else min(r.output - r.generated for r in self.running)
        self.step_start = now
        self.busy = True
        self.version += 1
        self.sim.push(now + self.step_k * self.step_dt, "step", self.id, self.version)

    def end_step(self, now: float) -> None:
        k = self.step_k
        self.steps += k
        finished = []
        for req, n in self.plan:
            if req.prefill_left == 0:
                req.generated += k
            else:
                req.prefill_left -= n
                if req.prefill_left == 0:             # the chunk reaching the end samples a token
                    req.generated += 1
                    if req.first_token is None:
                        req.first_token = now
            if req.generated >= req.output:
                finished.append(req)
        for req in finished:
            req.finish = now
            self._release(req)
            self.sim.finished(req)
        for req in [r for r in self.running if r.moving_to is not None]:
            self._release(req)
            self.sim.deliver(req, now)
        self._start_step(now)

    def _release(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.used_tokens -= req.reserved
        req.reserved = 0
        self.in_use[req.adapter] -= 1

    def migrate_out(self, req: SimRequest, target: str, now: float) -> None:
        req.moving_to = target
        if req in self.waiting:
            self.waiting.remove(req)
            self.sim.deliver(req, now)
        else:                                         # leaves at the end of the step in progress
            self.kick(now)

    # -- what it tells its peers
    def _queue(self) -> tuple[list[QueuedWork], list[QueuedWork]]:
        """(runnable, parked): the queue's work, those waiting for an adapter read apart."""
        mean = self.sim.mean_output
        cap = self.sim.args.max_tokens
        runnable = [QueuedWork(r.prefill_left, expected_remaining_tokens(r.generated, mean, cap), r.rank,
                               r.prompt + r.generated - r.prefill_left)
                    for r in self.running]
        parked = []
        for r in self.waiting:
            work = QueuedWork(r.prompt + r.generated, expected_remaining_tokens(r.generated, mean, cap), r.rank)
            (parked if r.adapter in self.loading else runnable).append(work)
        return runnable, parked

    def digest(self, now: float) -> Digest:
        self.seq += 1
        args = self.sim.args
        # the engine's step model: the prior until it has fitted enough of its own steps (then, as the
        # actor does, a fitted peer's from the last gossip)
        measured = self.steps >= args.prior_steps
        c = cluster_coefficients(self.c if measured else STEP_TIME_PRIOR, measured, None,
                                 [d for d in self.sim.last_digests if d.node_id != self.id])
        return Digest(node_id=self.id, url=f"sim://{self.id}", seq=self.seq, timestamp=now,
                      waiting=len(self.waiting), running=len(self.running),
                      # its adapter reads (in parallel here) overlap the work of the requests not waiting for one
                      pending_seconds=drain_seconds(c, *self._queue(),
                                                    max((done - now for done in self.loading.values()), default=0.0),
                                                    args.max_running, args.windows),
                      free_pages=(args.pool_tokens - self.used_tokens) // args.page_tokens,
                      page_tokens=args.page_tokens, max_running=args.max_running,
                      running_rank_sum=sum(r.rank for r in self.running),
                      running_rank_max=max((r.rank for r in self.running), default=0),
                      adapters=AdapterTiers(device=list(self.device), host=list(self.host)),
                      coefficients=c, measured=measured,
                      routed_per_s=router.arrivals.rate(now) if (router := self.sim.routers.get(self.id)) else 0.0,
                      layer_windows=args.windows)

    def candidates(self, k: int) -> list[Candidate]:
        """Its newest requests, waiting ones first (Punica evicts the newest)."""
        mean, cap = self.sim.mean_output, self.sim.args.max_tokens
        out = []
        for req in list(reversed(self.waiting)) + list(reversed(self.running)):
            if len(out) >= k:
                break
            if req.moving_to is not None or req.migrations >= MAX_MIGRATIONS:
                continue
            stays_prefill = req.prefill_left if req in self.running else req.prompt + req.generated
            out.append(Candidate(str(req.rid), self.id, req.adapter, req.rank, stays_prefill,
                                 req.prompt + req.generated,
                                 expected_remaining_tokens(req.generated, mean, cap), req.migrations))
        return out


# ---- the cluster -------------------------------------------------------------------------------------
@dataclass
class Result:
    policy: str
    latencies: np.ndarray
    slo_ok: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    service: np.ndarray
    migrations: int
    adapter_loads: int
    finished_once: bool
    output_tokens: int
    wall_s: float
    milp_s: float = 0.0

    def row(self) -> dict:
        return {"policy": self.policy, "slo_attainment": float(self.slo_ok.mean()),
                "mean_latency_s": float(self.latencies.mean()),
                "latency_per_token_ms": float(self.latencies.sum() / self.output_tokens * 1e3), "p99_latency_s": float(np.percentile(self.latencies, 99)),
                "mean_ttft_s": float(self.ttft.mean()), "mean_tpot_ms": float(np.nanmean(self.tpot) * 1e3),
                "migrations": self.migrations, "adapter_loads": self.adapter_loads,
                "milp_seconds": round(self.milp_s, 3), "wall_s": round(self.wall_s, 1)}


class Simulation:
    def __init__(self, args, trace: list[SimRequest], policy: str, coeffs: PerfCoefficients):
        self.args = args
        self.coeffs = coeffs
        self.tokens_per_rank = max(1, round(ADAPTER_BYTES_PER_RANK / KV_BYTES_PER_TOKEN))
        self.trace = [SimRequest(r.rid, r.arrival, r.adapter, r.rank, r.prompt, r.output) for r in trace]
        self.ids = [f"n{i:02d}" for i in range(args.nodes)]
        self.nodes = {i: SimNode(self, i) for i in self.ids}
        name, _, extra = policy.partition("+")
        self.migrate = extra == "migrate"
        routers = self.ids if args.entry == "random" else self.ids[:1]
        self.routers = {i: Router(i, self._policy(name, i), horizon_s=args.gossip_interval) for i in routers}
        # each node's view (a router's own); migration is planned by each node on its view, as the actor does
        self.views = {i: self.routers[i].view if i in self.routers else ClusterView() for i in self.ids}
        self.migrator = CoMigrator(threshold_s=args.migrate_threshold, top_k_nodes=args.migrate_top_k,
                                   top_k_requests=args.migrate_candidates, budget_tokens=args.migrate_budget)
        self.rng = np.random.default_rng(args.seed + 1)
        self.heap: list = []
        self.counter = 0
        self.mean_output = float(args.output_median)    # the routers' and nodes' running guess
        self.n_finished = 0
        self.finish_count: dict[int, int] = {}
        self.migrations = 0
        self.milp_s = 0.0
        self.last_digests: list[Digest] = []

    def _policy(self, name: str, node_id: str):
        if name == "rank-aware":
            return RankAware(AdapterPlacement(target_utilization=self.args.placement_utilization))
        if name == "random":
            return POLICIES[name](seed=self.args.seed + int(node_id[1:]))
        return POLICIES[name]()

    def push(self, t: float, kind: str, *payload) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (t, self.counter, kind, payload))

    def finished(self, req: SimRequest) -> None:
        self.n_finished += 1
        self.finish_count[req.rid] = self.finish_count.get(req.rid, 0) + 1
        self.mean_output += (req.output - self.mean_output) / min(self.n_finished, 200)

    def deliver(self, req: SimRequest, now: float) -> None:
        target = req.moving_to
        req.moving_to = None
        req.migrations += 1
        self.migrations += 1
        self.nodes[target].enqueue(req, now, front=True)

    def gossip(self, now: float) -> None:
        digests = self.last_digests = [n.digest(now) for n in self.nodes.values()]
        for view in self.views.values():
            for d in digests:
                view.update(d, now)

    def route(self, req: SimRequest, now: float) -> None:
        entry = self.ids[int(self.rng.integers(len(self.ids)))] if self.args.entry == "random" else self.ids[0]
        router = self.routers[entry]
        r = RouteRequest(req.adapter, req.rank, req.prompt, int(min(self.mean_output, self.args.max_tokens)))
        self.nodes[router.route(r, now)].enqueue(req, now)

    def rebalance(self, now: float) -> None:
        """Each node's round (actors/cluster.py _rebalance): on its own view, for its own requests,
        when it is among the overloaded; after moves it waits two more rounds for the digests."""
        for node_id, node in self.nodes.items():
            if now < node.next_rebalance:
                continue
            loads = self.views[node_id].loads()
            if self.migrator.mover(loads) != node_id:
                continue
            candidates = node.candidates(self.args.migrate_candidates)
            if not candidates:
                continue
            plan = self.migrator.plan(loads, candidates)
            self.milp_s += plan.solve_seconds
            if plan.moves:
                node.next_rebalance = now + 2 * self.args.migrate_interval
            by_id = {str(r.rid): r for r in node.running + list(node.waiting)}
            for move in plan.moves:
                req = by_id.get(move.request_id)
                if req is not None and req.moving_to is None:
                    node.migrate_out(req, move.target, now)

    def run(self) -> Result:
        wall = time.perf_counter()
        for req in self.trace:
            self.push(req.arrival, "arrival", req)
        self.push(0.0, "gossip")
        if self.migrate:
            self.push(self.args.migrate_interval, "rebalance")
        total = len(self.trace)
        while self.heap and self.n_finished < total:
            now, _, kind, payload = heapq.heappop(self.heap)
            if kind == "arrival":
                self.route(payload[0], now)
            elif kind == "step":
                node = self.nodes[payload[0]]
                if payload[1] == node.version:
                    node.end_step(now)
            elif kind == "ready":
                self.nodes[payload[0]].kick(now)
            elif kind == "gossip":
                self.gossip(now)
                self.push(now + self.args.gossip_interval, "gossip")
            elif kind == "rebalance":
                self.rebalance(now)
                self.push(now + self.args.migrate_interval, "rebalance")
        done = [r for r in self.trace if r.finish is not None]
        lat = np.array([r.finish - r.arrival for r in done])
        svc = np.array([service_seconds(self.coeffs, r, self.args.max_step_tokens) for r in done])
        ttft = np.array([r.first_token - r.arrival for r in done])
        tpot = np.array([(r.finish - r.first_token) / (r.output - 1) for r in done])
        return Result(policy="", latencies=lat, slo_ok=lat <= self.args.slo_scale * svc, ttft=ttft, tpot=tpot,
                      service=svc, migrations=self.migrations,
                      adapter_loads=sum(n.adapter_loads for n in self.nodes.values()),
                      finished_once=len(done) == total and all(v == 1 for v in self.finish_count.values()),
                      output_tokens=sum(r.output for r in done),
                      wall_s=time.perf_counter() - wall, milp_s=self.milp_s)


def simulate(args, policy: str, trace: list[SimRequest], coeffs: PerfCoefficients) -> Result:
    result = Simulation(args, trace, policy, coeffs).run()
    result.policy = policy
    return result


# ---- command line ------------------------------------------------------------------------------------
DEFAULT_POLICIES = "random,consolidate,least-pending,round-robin,rank-aware,rank-aware+migrate"


def layer_windows(text: str) -> list[int | None]:
    return [None if w.strip() == "global" else int(w) for w in text.split(",") if w.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=60)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--rps", type=float, default=320.0, help="mean arrival rate of the Gamma process")
    p.add_argument("--cv", type=float, default=2.0, help="coefficient of variation of inter-arrivals")
    p.add_argument("--bursts-per-min", type=float, default=6.0)
    p.add_argument("--burst-rps", type=float, default=40.0, help="extra rate of one adapter during a burst")
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--popularity-alpha", type=float, default=0.4, help="power law (workloads.py): smaller is more skewed")
    p.add_argument("--ranks", default="8,16,32,64")
    p.add_argument("--prompt-median", type=int, default=128)
    p.add_argument("--output-median", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--max-step-tokens", type=int, default=512)
    p.add_argument("--pool-tokens", type=int, default=65536, help="unified pool per node, in KV tokens")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--host-adapters", type=int, default=256, help="adapters a node keeps in host memory")
    p.add_argument("--fetchers", type=int, default=2, help="adapter reads from disk at once per node (the pager's)")
    p.add_argument("--entry", choices=("one", "random"), default="one")
    p.add_argument("--gossip-interval", type=float, default=0.2)
    p.add_argument("--placement-utilization", type=float, default=0.5)
    p.add_argument("--migrate-interval", type=float, default=1.0, help="seconds between a node's migration rounds")
    p.add_argument("--migrate-threshold", type=float, default=2.0, help="pending-seconds spread that triggers it")
    p.add_argument("--migrate-top-k", type=int, default=3)
    p.add_argument("--migrate-candidates", type=int, default=16)
    p.add_argument("--migrate-budget", type=int, default=8192, help="tokens recomputed per round, at most")
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO: latency <= this x the unloaded service time")
    p.add_argument("--prior-steps", type=int, default=0,
                   help="steps a node runs before its digests carry its fitted step model, not the engine's prior "
                        "(the engine: 8 skipped + 64 to the first fit)")
    p.add_argument("--coefficients", help="JSON PerfCoefficients (default: fitted to box B's measured steps)")
    p.add_argument("--windows", type=layer_windows, default=[],
                   help="the model's per-layer attention windows the queue estimates price, comma-separated: a "
                        "number of tokens or 'global' per layer (Gemma 3's: five of 512, then one global, ...); "
                        "default: every layer global")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="comma-separated routing policies; POLICY+migrate adds co-migration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the table as JSON here")
    p.add_argument("--plot", help="write a PNG of SLO attainment, latencies and latency CDFs here")
    return p


def plot(results: list[Result], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    names = [r.policy for r in results]
    axes[0].bar(names, [100 * r.slo_ok.mean() for r in results])
    axes[0].set_ylabel("SLO attainment (%)")
    x = np.arange(len(results))
    axes[1].bar(x - 0.2, [r.latencies.mean() for r in results], 0.4, label="mean")
    axes[1].bar(x + 0.2, [np.percentile(r.latencies, 99) for r in results], 0.4, label="p99")
    axes[1].set_xticks(x, names)
    axes[1].set_ylabel("request latency (s)")
    axes[1].set_yscale("log")
    axes[1].legend()
    for r in results:
        lat = np.sort(r.latencies)
        axes[2].plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=r.policy)
    axes[2].set_xscale("log")
    axes[2].set_xlabel("request latency (s)")
    axes[2].set_ylabel("CDF")
    axes[2].legend(fontsize=8)
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> list[Result]:
    args = parser().parse_args(argv)
    coeffs = (msgspec.json.decode(Path(args.coefficients).read_bytes(), type=PerfCoefficients)
              if args.coefficients else default_coefficients())
    trace = make_trace(args, np.random.default_rng(args.seed))
    svc = np.array([service_seconds(coeffs, r, args.max_step_tokens) for r in trace])
    print(f"coefficients: beta {coeffs.beta * 1e3:.2f} ms, alpha_token {coeffs.alpha_token * 1e6:.1f} us, "
          f"alpha_rank {coeffs.alpha_rank * 1e9:.1f} ns ({coeffs.rank_cost}), R2 {coeffs.r2}; {coeffs.source}")
    print(f"trace: {len(trace)} requests over {args.duration:.0f} s ({len(trace) / args.duration:.0f}/s), "
          f"{args.adapters} adapters, mean prompt {np.mean([r.prompt for r in trace]):.0f}, "
          f"mean output {np.mean([r.output for r in trace]):.0f}, mean service {svc.mean():.2f} s; "
          f"{args.nodes} nodes, entry {args.entry}")
    results = []
    header = f"{'policy':<22}{'SLO %':>7}{'mean s':>9}{'ms/tok':>8}{'p99 s':>9}{'TTFT s':>9}{'TPOT ms':>9}{'migr':>7}{'loads':>7}{'wall s':>8}"
    print(header)
    for policy in args.policies.split(","):
        r = simulate(args, policy, trace, coeffs)
        results.append(r)
        row = r.row()
        print(f"{policy:<22}{100 * row['slo_attainment']:>7.1f}{row['mean_latency_s']:>9.2f}"
              f"{row['latency_per_token_ms']:>8.1f}{row['p99_latency_s']:>9.2f}"
              f"{row['mean_ttft_s']:>9.2f}{row['mean_tpot_ms']:>9.1f}{row['migrations']:>7}{row['adapter_loads']:>7}"
              f"{row['wall_s']:>8.1f}", flush=True)
        if not r.finished_once:
            raise SystemExit(f"{policy}: not every request finished exactly once")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "coefficients": msgspec.to_builtins(coeffs),
                                               "results": [r.row() for r in results]}, indent=2))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return results


if __name__ == "__main__":
    main()
