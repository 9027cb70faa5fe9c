"""Adapter affinity (S-LoRA §4.2 and Appendix A.2, "adapter clustering"), with a cap per step and
aging that bounds it.

Every step carries requests of at most d = --max-step-adapters distinct adapters (the base model's
requests aside: they need no adapter). The running batch itself is not capped: S-LoRA's clustering
is work-conserving (requests of other adapters join when the batch's adapters cannot fill it), and
capping the batch instead idles it. On S-LoRA's trace (8 adapters, power law 0.3, d = 2) a capped
batch held two adapters' requests while the others queued beside free slots, and an adapter's turn
ended only when its last request did, so the others waited for whole requests to finish (L steps
each) and, once aged, drained the batch, the most popular adapter's requests with it.

So the running batch takes any request, and each step picks which d of its adapters run (the
others' running sequences sit that step out, keeping their pages): a turn lasts one step. The
adapters with the most waiting work run first: an adapter's priority is its requests (running and
waiting) plus the request-steps they sat out since it last ran, so a popular adapter runs nearly
every step and the others take the remaining places in proportion to what waits. A request whose
adapter does not run that step is not admitted; admission is in arrival order, aged adapters' first.

Aging: an adapter with requests that has not run for ``aging_steps`` steps is aged. Aged adapters
take the first places, longest-idle first; one whose requests all wait takes a place only while the
batch has a free slot (else it could not run). Bound: an adapter with a running request runs within
aging_steps + ceil((m + 1) / d) steps of its last step, m the aged adapters ahead of it; one with
only waiting requests, within that many steps once the batch has a free slot for it (pages
permitting). A popular adapter's requests never wait for the batch to drain.
"""
from __future__ import annotations

from collections import Counter

from asyncserve.scheduler.policy import ANY, PolicySettings, SchedulingPolicy, StepRule
from asyncserve.sequence import Sequence


class AdapterAffinity(SchedulingPolicy):
    name = "affinity"

    def __init__(self, settings: PolicySettings, aging_steps: int = 64):
        super().__init__(settings)
        self.max_adapters = settings.max_step_adapters
        self.aging_steps = aging_steps
        self.steps = 0
        self.credit: dict[str, int] = {}        # adapter -> request-steps its requests sat out since it last ran
        self.idle_since: dict[str, int] = {}    # adapter with requests -> the step since which it has not run

    def aged(self) -> list[str]:
        """Adapters with requests that have not run for aging_steps steps or more, longest first."""
        old = [t for t, since in self.idle_since.items() if self.steps - since >= self.aging_steps]
        return sorted(old, key=self.idle_since.__getitem__)

    def step_rule(self, running, waiting):
        work = _requests_by_adapter(running + waiting)
        if len(work) <= self.max_adapters:
            return ANY
        room = len(running) < self.settings.max_running
        in_batch = {s.adapter for s in running}
        aged = {t: i for i, t in enumerate(self.aged())}

        def priority(t):
            return (0, aged[t]) if t in aged else (1, -(work[t] + self.credit.get(t, 0)))
        runnable = [t for t in work if room or t in in_batch]
        return StepRule(frozenset(sorted(runnable, key=priority)[:self.max_adapters]) | {None})

    def progress_rule(self, running, waiting):
        """The adapters of the oldest sequences: running ones are preempted newest first, so these run."""
        first = list(_requests_by_adapter(running + waiting))[:self.max_adapters]
        return StepRule(frozenset(first) | {None})

    def admission_order(self, waiting, is_resident):
        aged = {t: i for i, t in enumerate(self.aged())}
        return sorted(waiting, key=lambda s: aged.get(s.adapter, len(aged)))     # stable: arrival order

    def observe(self, plan, running, waiting):
        self.steps += 1
        ran = {c.seq.adapter for c in plan.chunks}
        work = _requests_by_adapter(running + waiting)
        self.credit = {t: 0 if t in ran else self.credit.get(t, 0) + n for t, n in work.items()}
        self.idle_since = {t: self.idle_since.get(t, self.steps) for t in work if t not in ran}


def _requests_by_adapter(seqs: list[Sequence]) -> Counter:
    """Requests per adapter (the base model's aside), in the order of each adapter's first."""
    return Counter(s.adapter for s in seqs if s.adapter is not None)
