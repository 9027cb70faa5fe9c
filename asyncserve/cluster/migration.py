"""dLoRA §5.2's reactive adapter-request co-migration, as an integer program.

When the predicted pending times of the nodes spread past a threshold, the top-K most loaded nodes
offer candidate requests (their newest: Punica evicts the newest) and the top-K least loaded are
targets. x[i, j] = 1 puts candidate i on node j (staying where it is included); y[k, j] = 1 loads
adapter k on node j where it is not resident. Minimise the largest predicted pending time T over
these nodes (dLoRA's objective), plus a tiny price on each move so that equal plans keep requests
where they are, subject to:

    sum_j x[i, j] = 1                                    each request somewhere
    x[i, j] <= y[k(i), j]                                a request only where its adapter is
    base_j + sum_i work[i, j] x[i, j] + sum_k load[k, j] y[k, j] <= T
    sum_{i moved to j} pages_i x[i, j] <= free_pages_j   KV fits
    sum_{i moved} recompute_tokens_i x[i, j] <= budget   bounded migration cost

A moved request is recomputed from its tokens (Punica §5.3), so its work on a target includes
prefilling its prompt and output so far. Solved exactly by scipy.optimize.milp (HiGHS); with top-K
candidates the program has a few hundred binaries and solves in milliseconds, so dLoRA's
relaxation of x to reals is not needed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from asyncserve.cluster.routing import NodeLoad
from asyncserve.perf_model import QueuedWork, adapter_load_seconds, request_work_seconds

MAX_MIGRATIONS = 2     # times one request may be moved for load: never ping-pong
MOVE_PRICE = 1e-4      # objective units (seconds) per recomputed token: breaks ties towards staying


@dataclass
class Candidate:
    request_id: str
    source: str
    adapter: str | None
    rank: int
    prefill_tokens: int                # still to prefill where it is
    context_tokens: int                # prompt + output so far: what a move recomputes
    decode_tokens: int                 # expected output still to come
    migrations: int = 0                # times it has been moved already
    barred: frozenset[str] = frozenset()   # nodes it may not go to (they refused its adapter lately)


@dataclass
class Move:
    request_id: str
    source: str
    target: str


@dataclass
class MigrationProblem:
    """The program's data, in arrays (what the solver and a brute-force check both read)."""
    nodes: list[str]                   # J
    candidates: list[Candidate]        # I
    adapters: list[str]                # K: adapters of candidates that some node would have to load
    base: np.ndarray                   # [J] pending seconds without the candidates
    work: np.ndarray                   # [I, J] seconds candidate i adds to node j
    source: np.ndarray                 # [I] index of each candidate's node
    adapter_of: np.ndarray             # [I] index into adapters, -1: resident everywhere it may go
    needs_load: np.ndarray             # [K, J] bool: adapter k is not resident on node j
    load: np.ndarray                   # [K, J] seconds to load adapter k on node j
    pages: np.ndarray                  # [I] KV pages a moved candidate takes
    free_pages: np.ndarray             # [J]
    recompute: np.ndarray              # [I] tokens a move recomputes
    budget_tokens: int
    barred: np.ndarray | None = None   # [I, J] bool: candidate i may not go to node j (None: none barred)


@dataclass
class MigrationPlan:
    moves: list[Move] = field(default_factory=list)
    loads: list[tuple[str, str]] = field(default_factory=list)   # (adapter, node) to load
    makespan_before: float = 0.0
    makespan_after: float = 0.0
    objective: float = 0.0
    solve_seconds: float = 0.0


def build_problem(nodes: list[NodeLoad], candidates: list[Candidate], budget_tokens: int) -> MigrationProblem:
    ids = [n.node_id for n in nodes]
    col = {node: j for j, node in enumerate(ids)}
    base = np.array([n.pending_seconds for n in nodes], dtype=np.float64)
    work = np.zeros((len(candidates), len(nodes)))
    # a node that holds a candidate has its adapter, or is fetching it for it already (a cost in its
    # pending time): staying, or another candidate joining it there, loads nothing (issue #16)
    held = {(c.adapter, c.source) for c in candidates}
    adapters = sorted({c.adapter for c in candidates if c.adapter is not None
                       and any(c.adapter not in n.device and (c.adapter, n.node_id) not in held for n in nodes)})
    row = {a: k for k, a in enumerate(adapters)}
    needs_load = np.zeros((len(adapters), len(nodes)), dtype=bool)
    load = np.zeros((len(adapters), len(nodes)))
    rank_of = {c.adapter: c.rank for c in candidates}
    for k, a in enumerate(adapters):
        for j, n in enumerate(nodes):
            needs_load[k, j] = a not in n.device and (a, n.node_id) not in held
            load[k, j] = adapter_load_seconds(n.coefficients, rank_of[a], n.tier(a))
    for i, c in enumerate(candidates):
        for j, n in enumerate(nodes):
            # where it is, it goes on after what it has computed; elsewhere it recomputes all of it first
            stays = n.node_id == c.source
            prefill = c.prefill_tokens if stays else c.context_tokens
            computed = c.context_tokens - c.prefill_tokens if stays else 0
            batch = min(n.in_flight + 1, n.max_running)
            work[i, j] = request_work_seconds(n.coefficients, QueuedWork(prefill, c.decode_tokens, c.rank, computed),
                                              batch, n.rank_max, n.windows)
        base[col[c.source]] -= work[i, col[c.source]]
    base = np.maximum(base, 0.0)
    page_tokens = {n.node_id: n.page_tokens for n in nodes}
    return MigrationProblem(
        nodes=ids, candidates=candidates, adapters=adapters, base=base, work=work,
        source=np.array([col[c.source] for c in candidates], dtype=np.int64),
        adapter_of=np.array([row.get(c.adapter, -1) for c in candidates], dtype=np.int64),
        needs_load=needs_load, load=load,
        pages=np.array([math.ceil((c.context_tokens + c.decode_tokens) / page_tokens[c.source])
                        for c in candidates], dtype=np.float64),
        free_pages=np.array([max(n.free_pages, 0) for n in nodes], dtype=np.float64),
        recompute=np.array([c.context_tokens for c in candidates], dtype=np.float64),
        budget_tokens=budget_tokens,
        barred=np.array([[node in c.barred for node in ids] for c in candidates], dtype=bool).reshape(-1, len(ids)))


def solve(p: MigrationProblem, time_limit_s: float = 1.0) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Optimal (assignment [I] of node indices, loads [K, J] bool, objective), or None if the
    solver found nothing within the time limit."""
    n_i, n_j, n_k = len(p.candidates), len(p.nodes), len(p.adapters)
    nx, ny = n_i * n_j, n_k * n_j
    n = nx + ny + 1                                  # x (row-major [I, J]), y ([K, J]), T
    t = n - 1
    moved = np.ones((n_i, n_j))
    moved[np.arange(n_i), p.source] = 0.0            # [I, J] 1 where x[i, j] is a move
    cost = np.zeros(n)
    cost[:nx] = (MOVE_PRICE * p.recompute[:, None] * moved).ravel()
    cost[t] = 1.0
    rows, lo, hi = [], [], []

    def add(coeffs: dict[int, float], low: float, high: float) -> None:
        r = np.zeros(n)
        for idx, v in coeffs.items():
            r[idx] += v
        rows.append(r)
        lo.append(low)
        hi.append(high)

    for i in range(n_i):
        add({i * n_j + j: 1.0 for j in range(n_j)}, 1.0, 1.0)
        k = p.adapter_of[i]
        if k >= 0:
            for j in range(n_j):
                if p.needs_load[k, j]:
                    add({i * n_j + j: 1.0, nx + k * n_j + j: -1.0}, -np.inf, 0.0)
    for j in range(n_j):
        coeffs = {i * n_j + j: p.work[i, j] for i in range(n_i)}
        coeffs.update({nx + k * n_j + j: p.load[k, j] for k in range(n_k) if p.needs_load[k, j]})
        coeffs[t] = -1.0
        add(coeffs, -np.inf, -p.base[j])
        add({i * n_j + j: p.pages[i] * moved[i, j] for i in range(n_i)}, -np.inf, p.free_pages[j])
    add({i * n_j + j: p.recompute[i] * moved[i, j] for i in range(n_i) for j in range(n_j)}, -np.inf,
        float(p.budget_tokens))
    integrality = np.ones(n)
    integrality[t] = 0
    upper = np.ones(n)
    if p.barred is not None:
        upper[:nx] = ~p.barred.ravel()               # never where the node refused the request's adapter
    upper[nx:nx + ny] = p.needs_load.ravel()         # no load variable where the adapter is resident
    upper[t] = np.inf
    res = milp(cost, integrality=integrality, bounds=Bounds(np.zeros(n), upper),
               constraints=LinearConstraint(np.array(rows), lo, hi), options={"time_limit": time_limit_s})
    if res.x is None:
        return None
    x = res.x[:nx].reshape(n_i, n_j)
    y = res.x[nx:nx + ny].reshape(n_k, n_j) > 0.5
    return x.argmax(axis=1), y, float(res.fun)


class CoMigrator:
    """Decides when to migrate and what: imbalance trigger, top-K nodes each way, top-K candidates."""

    def __init__(self, threshold_s: float = 2.0, top_k_nodes: int = 3, top_k_requests: int = 16,
                 budget_tokens: int = 8192, time_limit_s: float = 1.0, min_gain_s: float | None = None):
        self.threshold_s = threshold_s
        self.top_k_nodes = top_k_nodes
        self.top_k_requests = top_k_requests
        self.budget_tokens = budget_tokens
        self.time_limit_s = time_limit_s
        # a plan must shorten the predicted makespan this much (default: the trigger's threshold)
        self.min_gain_s = threshold_s if min_gain_s is None else min_gain_s

    def mover(self, nodes: list[NodeLoad]) -> str | None:
        """The one node that moves its requests this round: the busiest, if the spread passes the
        threshold. Each node plans alone on the same digests: were every overloaded node to move in
        the same round, each would fill the same least-loaded targets as if it were the only one,
        overshooting them, and they would move the requests on (issue #16)."""
        sources = self.overloaded(nodes)
        return sources[0].node_id if sources else None

    def overloaded(self, nodes: list[NodeLoad]) -> list[NodeLoad]:
        """The sources of a migration round: the top-K by pending time, if the spread between the
        most and least loaded passes the threshold (dLoRA triggers only on a real imbalance)."""
        if len(nodes) < 2:
            return []
        ordered = sorted(nodes, key=lambda n: (-n.pending_seconds, n.node_id))
        if ordered[0].pending_seconds - ordered[-1].pending_seconds < self.threshold_s:
            return []
        floor = ordered[-1].pending_seconds + self.threshold_s
        return [n for n in ordered[:self.top_k_nodes] if n.pending_seconds >= floor]

    def plan(self, nodes: list[NodeLoad], candidates: list[Candidate]) -> MigrationPlan:
        """`candidates` come from the overloaded nodes (each its newest requests); targets are the
        top-K least loaded of `nodes`."""
        sources = {c.source for c in candidates}
        ordered = sorted(nodes, key=lambda n: (n.pending_seconds, n.node_id))
        targets = [n for n in ordered if n.node_id not in sources][:self.top_k_nodes]
        involved = [n for n in nodes if n.node_id in sources] + targets
        if not candidates or not targets:
            return MigrationPlan()
        # never past the cap; a request moved already (recomputed once, and its target's newest) last
        candidates = sorted((c for c in candidates if c.migrations < MAX_MIGRATIONS),
                            key=lambda c: (c.migrations, -(c.prefill_tokens + c.decode_tokens)))[:self.top_k_requests]
        if not candidates:
            return MigrationPlan()
        p = build_problem(involved, candidates, self.budget_tokens)
        stay = p.base.copy()
        np.add.at(stay, p.source, p.work[np.arange(len(candidates)), p.source])
        start = time.perf_counter()
        solved = solve(p, self.time_limit_s)
        spent = time.perf_counter() - start
        if solved is None:
            return MigrationPlan(makespan_before=float(stay.max()), solve_seconds=spent)
        assign, _, objective = solved
        moves = [Move(c.request_id, c.source, p.nodes[j]) for c, j in zip(candidates, assign)
                 if p.nodes[j] != c.source]
        # the loads the moves need (a load variable nothing uses may sit at 1 when it costs nothing)
        needed = sorted({(p.adapter_of[i], j) for i, j in enumerate(assign)
                         if p.adapter_of[i] >= 0 and p.needs_load[p.adapter_of[i], j]})
        after = p.base.copy()
        np.add.at(after, assign, p.work[np.arange(len(candidates)), assign])
        for k, j in needed:
            after[j] += p.load[k, j]
        if stay.max() - after.max() < self.min_gain_s:
            # predicted pending times are off by more than this (output lengths are guesses): a smaller
            # gain is noise, and every move costs a recompute
            moves, needed = [], []
        return MigrationPlan(moves=moves, loads=[(p.adapters[k], p.nodes[j]) for k, j in needed],
                             makespan_before=float(stay.max()), makespan_after=float(after.max()),
                             objective=objective, solve_seconds=spent)
