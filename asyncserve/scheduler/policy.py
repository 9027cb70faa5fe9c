"""Scheduling policies: what a step may carry, in what order waiting requests are admitted, and which
of them are answered at once instead of queued.

One class per policy behind one interface (S-LoRA's idea). The Scheduler keeps the token budget,
the page fitting and preemption; a policy only decides:
  step_rule      which adapters the next step may carry, and whether it runs merged with one
                 (dLoRA): running sequences of other adapters sit that step out, keeping their pages
  progress_rule  what the step carries instead when step_rule's requests cannot run now (pages)
  admission_order the order admission tries the waiting sequences (it stops at the first that does
                 not fit, so the order is also the priority)
  admits         whether a sequence may join the batch beside what it holds (an adapter cap, a TPOT SLO)
  unattainable   waiting sequences to answer now with an error instead of queueing them (a TTFT SLO)
  observe        the step as scheduled, to keep the policy's own state (credits, ages)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from asyncserve.perf_model import StepLatencyModel
from asyncserve.sequence import Sequence
from asyncserve.step import Failure, StepPlan


@dataclass
class PolicySettings:
    """What policies consult: the server's settings and the engine's live step-time model."""
    max_running: int
    max_step_tokens: int
    latency: StepLatencyModel
    max_step_adapters: int = 4               # affinity: distinct adapters per step, the base model aside
    slo_ttft_s: float | None = None          # slo: time to first token to attain
    slo_tpot_s: float | None = None          # slo: time per output token to keep the running batch within
    # dlora: seconds one merge (or unmerge) of the named adapter costs, dLoRA's t_M; None: estimated
    # from the step-time model (see dlora.py)
    switch_seconds: Callable[[str], float] | None = None
    # why the named adapter cannot be merged (then its steps run unmerged), None if it can
    merge_refusal: Callable[[str], str | None] = lambda name: None


@dataclass(frozen=True)
class StepRule:
    """Which requests a step may carry. types: only sequences of these adapters (None in the set: the
    base model's); None: any. merged: the adapter merged into the base weights for the step (then
    types is {merged}); None: unmerged."""
    types: frozenset | None = None
    merged: str | None = None

    def allows(self, adapter: str | None) -> bool:
        return self.types is None or adapter in self.types


ANY = StepRule()


class SchedulingPolicy:
    name = "base"

    def __init__(self, settings: PolicySettings):
        self.settings = settings

    def step_rule(self, running: list[Sequence], waiting: list[Sequence]) -> StepRule:
        return ANY

    def progress_rule(self, running: list[Sequence], waiting: list[Sequence]) -> StepRule:
        """The rule of a step whose step_rule's requests cannot run now (their pages do not fit): one
        that makes progress; by default anything may run."""
        return ANY

    def admission_order(self, waiting: list[Sequence], is_resident: Callable[[str], bool]) -> Iterable[Sequence]:
        """is_resident(adapter): whether its current load is on the device. A predicate, not a set: the
        set would be built over every registered adapter (thousands) on every step."""
        raise NotImplementedError

    def admits(self, seq: Sequence, batch: list[Sequence]) -> bool:
        """Whether seq may join the batch (running sequences and those admitted this step so far)."""
        return True

    def unattainable(self, running: list[Sequence], waiting: list[Sequence], now: float,
                     cached_tokens: Callable[[Sequence], int]) -> list[tuple[Sequence, Failure]]:
        """Waiting sequences to end now, each with the error its client gets; cached_tokens(seq): how
        many of its first tokens the prefix cache would spare it."""
        return []

    def observe(self, plan: StepPlan, running: list[Sequence], waiting: list[Sequence]) -> None:
        """The step the scheduler planned (it runs next); plan.merged may differ from the rule's when
        the rule's requests could not run (the scheduler then planned an unrestricted step)."""


class FirstComeFirstServed(SchedulingPolicy):
    """Arrival order; preempted sequences were put back at the front, so they resume first. A waiting
    request waits only for those that arrived before it (nobody jumps the queue)."""
    name = "fcfs"

    def admission_order(self, waiting, is_resident):
        return list(waiting)
