"""dLoRA's dynamic batching (§4.2, Algorithms 1-3): merged steps for a dominant adapter, unmerged
steps otherwise, switched by credits and adaptive thresholds; and the merged-only baseline.

Requests are typed by adapter (None: the base model). Each step, B_fcfs is what first come first
served would run: the first --max-running requests, running or waiting, by arrival. Unmerged, the adapter with the most requests, A, is merged when min(|R_A|, max_running)
/ |B_fcfs| > alpha; merged, the state returns to unmerged when that ratio falls below beta or A loses
its credit. A merged step carries only A's requests (no LoRA compute for them, once the weights are
merged); the other types' running sequences sit it out.

Credits (Algorithm 3): a merged step moves credit from A to every other type with requests in
B_fcfs, one per such request skipped (a skipped type's own debt, from when it ran merged, is
forgiven first); credits fade by ``fade`` each unmerged step. A type above
``starve_credit`` is starving until it falls below ``normal_credit``: while one starves, steps run
unmerged and its waiting requests are admitted first. A may merge only while its debt stays within
``debt_limit``. Bound: a request that FCFS would run (it is in B_fcfs) gives its type at least one
credit per merged step that skips it, so after at most starve_credit + 1 merged steps (and one
unmerge, t_M) it is first in line; if A's requests admitted out of turn hold every batch slot by
then, it waits for the first of them to finish (at most L steps: a request's prompt chunks plus
max_tokens). A request outside B_fcfs waits for FCFS to reach it first.

Thresholds (Algorithm 2): at each break point (a switch, or every ``period`` steps) the period's
predicted throughput of merged batches (min(|R_A|, max_running) decodes, no LoRA, plus one switch
t_M) and of the FCFS batches (their decodes with their ranks) are compared: merged faster lowers the
threshold of the state the period was in (alpha unmerged, beta merged) by gamma_dec, else raises it
by the factor gamma_mul. Iteration times come from the engine's step-time model.
"""
from __future__ import annotations

import heapq
from collections import Counter

from asyncserve.scheduler.policy import ANY, PolicySettings, SchedulingPolicy, StepRule
from asyncserve.sequence import Sequence


def fcfs_batch(running: list[Sequence], waiting: list[Sequence], max_running: int) -> list[Sequence]:
    """What first come first served would run: the first max_running requests by arrival (so a request
    admitted out of turn does not push an older one out of it)."""
    return heapq.nsmallest(max_running, running + waiting, key=lambda s: s.arrival)


class DLoRA(SchedulingPolicy):
    name = "dlora"

    def __init__(self, settings: PolicySettings, alpha: float = 0.9, beta: float = 0.6, gamma_dec: float = 0.05,
                 gamma_mul: float = 1.1, period: int = 32, starve_credit: float = 64.0, normal_credit: float = 8.0,
                 debt_limit: float = 256.0, fade: float = 0.95):
        super().__init__(settings)
        self.alpha, self.beta = alpha, beta
        self.gamma_dec, self.gamma_mul, self.period = gamma_dec, gamma_mul, period
        self.starve_credit, self.normal_credit = starve_credit, normal_credit
        self.debt_limit, self.fade = debt_limit, fade
        self.merged: str | None = None            # S.type while S.state == merge
        self.credit: Counter = Counter()          # type (adapter, None: base) -> credit
        self.starving: set[str | None] = set()
        self._fair: Counter = Counter()           # this step's B_fcfs by type
        self._history: list[tuple[int, float, int, float]] = []   # per step since the break point
        self._switched_to: str | None = None      # the adapter whose merge the period's t_M prices
        self._top_rank = 0                        # and its rank

    def switch_seconds(self, adapter: str, rank: int) -> float:
        """t_M: the engine's measured cost when it has one; else a merge (W += B·A: out·in·r multiply-adds
        per adapted projection) priced like r tokens through the model."""
        if self.settings.switch_seconds is not None:
            return self.settings.switch_seconds(adapter)
        c = self.settings.latency.coefficients
        return c.alpha_token * rank

    def step_rule(self, running, waiting):
        max_running = self.settings.max_running
        batch = fcfs_batch(running, waiting, max_running)
        self._fair = Counter(s.adapter for s in batch)
        requests = Counter(s.adapter for s in running + waiting)
        for t in list(self.starving):
            if self.credit[t] < self.normal_credit or not requests[t]:
                self.starving.discard(t)
        self.starving |= {t for t in requests if self.credit[t] > self.starve_credit}
        if not batch:
            return ANY
        # merging a costs one credit per other request in B_fcfs, each step (Algorithm 3, line 18)
        eligible = {a for a in requests
                    if a is not None and self.credit[a] - (len(batch) - self._fair[a]) >= -self.debt_limit
                    and self.settings.merge_refusal(a) is None}
        top = self.merged if self.merged is not None else max(eligible, key=requests.__getitem__, default=None)
        if top is not None:
            self._record(top, requests[top], batch)
        if self.starving:                               # Algorithm 3, lines 6-15
            return self._switch(None)
        ratio = min(requests[top], max_running) / len(batch) if top is not None else 0.0
        if self.merged is None:                         # Algorithm 1, lines 6-12
            return self._switch(top) if top in eligible and ratio > self.alpha else ANY
        if self.merged not in eligible or ratio < self.beta:     # lines 13-19
            return self._switch(None)
        return StepRule(frozenset({self.merged}), self.merged)

    def _record(self, top: str, count: int, batch: list[Sequence]) -> None:
        """This step's candidate merged batch and FCFS batch, priced by the step-time model."""
        latency = self.settings.latency
        n_merge = min(count, self.settings.max_running)
        self._history.append((n_merge, latency.predict([(1, 0)] * n_merge),
                              len(batch), latency.predict([(1, s.adapter_rank) for s in batch])))
        self._top_rank = max((s.adapter_rank for s in batch if s.adapter == top), default=0)
        self._switched_to = self._switched_to or top
        if len(self._history) >= self.period:
            self._tune()

    def _switch(self, adapter: str | None) -> StepRule:
        if adapter != self.merged:
            self._tune()                                # a break point
            self.merged = adapter
        return ANY if adapter is None else StepRule(frozenset({adapter}), adapter)

    def _tune(self) -> None:
        """Algorithm 2 over the steps since the last break point."""
        if self._history and self._switched_to is not None:
            t_m = self.switch_seconds(self._switched_to, self._top_rank)
            merged = sum(h[0] for h in self._history) / (sum(h[1] for h in self._history) + t_m)
            unmerged = sum(h[2] for h in self._history) / max(sum(h[3] for h in self._history), 1e-9)
            better = merged > unmerged
            if self.merged is None:
                self.alpha = self.alpha - self.gamma_dec if better else self.alpha * self.gamma_mul
            else:
                self.beta = self.beta - self.gamma_dec if better else self.beta * self.gamma_mul
            # beta <= alpha <= 1 (a ratio is at most 1), so merging and unmerging never chase each other
            self.beta = min(max(self.beta, self.gamma_dec), 1.0)
            self.alpha = min(max(self.alpha, self.beta), 1.0)
        self._history, self._switched_to = [], None

    def admission_order(self, waiting, is_resident):
        if not self.starving:
            return list(waiting)
        starving = [s for s in waiting if s.adapter in self.starving]
        return starving + [s for s in waiting if s.adapter not in self.starving]

    def observe(self, plan, running, waiting):
        if plan.merged != self.merged:            # the merged requests could not run: the scheduler ran unmerged
            self._switch(plan.merged)
        if plan.merged is None:                   # faded to nothing, a type's entry goes (thousands of adapters)
            self.credit = Counter({t: c * self.fade for t, c in self.credit.items() if abs(c) > 0.01})
            return
        skipped = {t: n for t, n in self._fair.items() if t != plan.merged}
        for t, n in skipped.items():              # transfer_credit(RET, B_fcfs); a debt is no reason to wait
            self.credit[t] = max(self.credit[t], 0.0) + n
        self.credit[plan.merged] -= sum(skipped.values())


class MergedOnly(SchedulingPolicy):
    """dLoRA's merged-only baseline: one type at a time (an adapter merged, or the base model alone),
    switching to the type of the oldest request when the current one has no requests left or has
    had ``phase_steps`` steps while others wait. A request waits at most (types - 1) * phase_steps
    steps plus switches once it is the oldest of its type."""
    name = "merged-only"

    def __init__(self, settings: PolicySettings, phase_steps: int = 64):
        super().__init__(settings)
        self.phase_steps = phase_steps
        self.current: str | None = None
        self.phase = 0

    def step_rule(self, running, waiting):
        queue = running + waiting
        if not queue:
            return ANY
        types = {s.adapter for s in queue}
        if self.current not in types or (self.phase >= self.phase_steps and len(types) > 1):
            others = [s for s in sorted(queue, key=lambda s: s.arrival) if s.adapter != self.current]
            self.current, self.phase = others[0].adapter, 0
        self.phase += 1
        merged = self.current if self.current is not None and self.settings.merge_refusal(self.current) is None else None
        return StepRule(frozenset({self.current}), merged)

    def admission_order(self, waiting, is_resident):
        return list(waiting)
