"""SLO-aware scheduling: early abort on a TTFT SLO (S-LoRA §4.3) and rank-aware admission on a TPOT
SLO (CaraServe §5), first come first served otherwise.

Early abort: before each step, a waiting request that has not had its first token is answered with a
429 (code slo_unattainable) when even its fastest path misses --slo-ttft: the time it has waited plus
its prompt's prefill admitted now, in chunks of the whole step budget beside the running decodes,
each step priced by the engine's step-time model, less what the prefix cache holds of its prompt.
That is a lower bound on its TTFT whenever steps take what the model predicts, so a request is
refused only when it cannot meet the SLO; those it leaves queued may still miss it behind the queue
ahead of them. A request parked while its adapter is read from disk is checked too, as if it had
waited the rest of the read already (engine.disk_load_seconds_left: the mean read measured, less what
has run). Until the model's first refit from this server's steps (about 70 steps) nothing is
refused: a prior's guess could refuse every request, and with no step run the model would never
learn better.

TPOT: a request joins the running batch only while the model predicts a decode step of the batch
with it within --slo-tpot (one sequence always runs); admission stops at the first that does not,
so requests still start in arrival order. Prefill chunks sharing decode steps add to the
TPOT clients see; a smaller --max-step-tokens bounds that.
"""
from __future__ import annotations

from asyncserve.scheduler.policy import FirstComeFirstServed, PolicySettings
from asyncserve.sequence import Sequence
from asyncserve.step import Failure


def slo_unattainable(predicted_s: float, slo_s: float) -> Failure:
    return Failure(f"the request cannot get its first token within the {slo_s:g} s TTFT SLO (at best "
                   f"{predicted_s:.3f} s); retry later", 429, "slo_unattainable")


class SloAware(FirstComeFirstServed):
    name = "slo"

    def __init__(self, settings: PolicySettings):
        super().__init__(settings)
        self._full = False          # this step's admission reached the TPOT SLO

    def unattainable(self, running, waiting, now, cached_tokens):
        slo = self.settings.slo_ttft_s
        if slo is None or not self.settings.latency.measured:    # never refuse on the prior's guess
            return []
        decodes = [(1, s.adapter_rank) for s in running]
        fastest: dict[tuple[int, int], float] = {}        # (tokens to compute, rank) -> seconds, this step

        def best(seq: Sequence, tokens: int) -> float:
            key = (tokens, seq.adapter_rank)
            if key not in fastest:
                fastest[key] = self.fastest_prefill_seconds(tokens, seq.adapter_rank, decodes)
            return now - seq.arrival + fastest[key]
        out = []
        for seq in waiting:
            if seq.output_ids:           # its first token went out already (preempted, or moved here)
                continue
            # the prefix cache can only shorten the prefill: looked up for the requests it could save
            if best(seq, seq.num_tokens) > slo and (seconds := best(seq, seq.num_tokens - cached_tokens(seq))) > slo:
                out.append((seq, slo_unattainable(seconds, slo)))
        return out

    def fastest_prefill_seconds(self, prompt_tokens: int, rank: int, decodes: list[tuple[int, int]]) -> float:
        """The predicted seconds of a prompt's prefill admitted now: chunks of the step budget left
        beside the running decodes."""
        latency = self.settings.latency
        room = max(self.settings.max_step_tokens - len(decodes), 1)
        seconds, left = 0.0, prompt_tokens
        while left > 0:
            n = min(left, room)
            seconds += latency.predict(decodes + [(n, rank)])
            left -= n
        return seconds

    def step_rule(self, running, waiting):
        self._full = False
        return super().step_rule(running, waiting)

    def admits(self, seq: Sequence, batch: list[Sequence]) -> bool:
        """Within the TPOT SLO; the first request that is not closes admission for this step, so a
        request of a large rank is not passed by smaller ones for ever."""
        tpot = self.settings.slo_tpot_s
        if tpot is None or not batch:
            return True
        if not self._full:
            step = self.settings.latency.predict([(1, s.adapter_rank) for s in batch] + [(1, seq.adapter_rank)])
            self._full = step > tpot
        return not self._full
