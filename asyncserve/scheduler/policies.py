"""The policies by name (--policy), each built from the same PolicySettings."""
from __future__ import annotations

from asyncserve.scheduler.affinity import AdapterAffinity
from asyncserve.scheduler.dlora import DLoRA, MergedOnly
from asyncserve.scheduler.policy import FirstComeFirstServed, PolicySettings, SchedulingPolicy
from asyncserve.scheduler.slo import SloAware

POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (FirstComeFirstServed, AdapterAffinity, SloAware, DLoRA, MergedOnly)}


def make_policy(name: str, settings: PolicySettings) -> SchedulingPolicy:
    return POLICIES[name](settings)
