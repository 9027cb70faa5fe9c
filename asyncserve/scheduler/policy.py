"""Batch-formation policies: which waiting sequences the scheduler tries to admit, in what order.

One class per policy behind one interface (S-LoRA's idea); later policies (adapter clustering,
early abort on a TTFT SLO, credit-based merge/unmerge) plug in here.
"""
from __future__ import annotations

from typing import Iterable

from asyncserve.sequence import Sequence


class SchedulingPolicy:
    name = "base"

    def admission_order(self, waiting: list[Sequence], resident_adapters: set[str]) -> Iterable[Sequence]:
        """Waiting sequences in the order admission should try them; admission stops at the first
        that does not fit, so the order is also the priority."""
        raise NotImplementedError


class FirstComeFirstServed(SchedulingPolicy):
    """Arrival order; preempted sequences were put back at the front, so they resume first."""
    name = "fcfs"

    def admission_order(self, waiting, resident_adapters):
        return list(waiting)


POLICIES: dict[str, type[SchedulingPolicy]] = {FirstComeFirstServed.name: FirstComeFirstServed}
