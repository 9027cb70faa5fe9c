"""Adapter affinity (S-LoRA §4.2, "adapter clustering"), with a cap that holds and aging that bounds it.

The running batch, so every step, holds requests of at most d = --max-step-adapters distinct
adapters (the base model's requests aside: they need no adapter). Waiting requests of the batch's
adapters join freely; another adapter joins when the batch has fewer than d. Admission tries the
adapters with the most waiting requests first, in arrival order within each.

Aging: an adapter whose requests have waited outside the batch for ``aging_steps`` steps is aged.
Aged adapters come first, longest-waiting first, and while one waits for a slot the batch's adapters
take no new requests, so the batch drains until one of them leaves. Bound: an adapter with a waiting
request enters the batch within aging_steps + ceil(m / d) * L steps, where m is the number of aged
adapters ahead of it and L the most steps a running request still takes (its prompt's chunks plus
max_tokens; more if it is preempted and recomputed), pages permitting.
"""
from __future__ import annotations

from asyncserve.scheduler.policy import PolicySettings, SchedulingPolicy
from asyncserve.sequence import Sequence


class AdapterAffinity(SchedulingPolicy):
    name = "affinity"

    def __init__(self, settings: PolicySettings, aging_steps: int = 64):
        super().__init__(settings)
        self.max_adapters = settings.max_step_adapters
        self.aging_steps = aging_steps
        self.steps = 0
        self.blocked_since: dict[str | None, int] = {}   # adapter (None: base) -> step it began waiting outside
        self._batch_size = -1                             # the batch whose adapters _batch_adapters holds
        self._batch_adapters: set[str] = set()

    def aged(self) -> list[str | None]:
        """Adapters waiting outside the batch for aging_steps or more, longest first."""
        old = [t for t, since in self.blocked_since.items() if self.steps - since >= self.aging_steps]
        return sorted(old, key=self.blocked_since.__getitem__)

    def step_rule(self, running, waiting):
        self._batch_size = -1
        return super().step_rule(running, waiting)

    def admission_order(self, waiting, resident_adapters):
        groups: dict[str | None, list[Sequence]] = {}
        for seq in waiting:
            groups.setdefault(seq.adapter, []).append(seq)
        aged = {t: i for i, t in enumerate(self.aged())}
        first_index = {t: i for i, t in enumerate(groups)}

        def priority(t):
            return (0, aged[t]) if t in aged else (1, -len(groups[t]), first_index[t])
        return [seq for t in sorted(groups, key=priority) for seq in groups[t]]

    def admits(self, seq, batch):
        if seq.adapter is None:
            return True
        if len(batch) != self._batch_size:        # the batch grows during one admission pass only
            self._batch_size = len(batch)
            self._batch_adapters = {s.adapter for s in batch if s.adapter is not None}
        adapters = self._batch_adapters
        if seq.adapter in adapters:
            return not self._draining(adapters)
        return len(adapters) < self.max_adapters

    def _draining(self, adapters: set[str]) -> bool:
        """The batch is full and an aged adapter waits for a slot."""
        return len(adapters) >= self.max_adapters and any(t is not None and t not in adapters for t in self.aged())

    def observe(self, plan, running, waiting):
        self.steps += 1
        in_batch = {s.adapter for s in running}
        outside = {s.adapter for s in waiting} - in_batch
        self.blocked_since = {t: self.blocked_since.get(t, self.steps) for t in outside}
