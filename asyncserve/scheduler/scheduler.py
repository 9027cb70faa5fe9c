"""Continuous batching over the unified pool: each step mixes decodes and prefill chunks.

schedule() picks, under a per-step token budget, one decode token for every running sequence past
its prefill and prefill chunks for the rest, admitting waiting sequences in the policy's order
while their adapter can be paged in and their first chunk's KV pages fit. The policy (policy.py)
decides which adapters a step may carry (the others' running sequences sit it out) and which
waiting sequences are refused at once; the budget and the pages stay here. A decode that finds no
free page evicts idle adapters, then preempts the most recently admitted sequence, whose pages
return to the pool; it is recomputed from its tokens when readmitted (Punica's cancel+recompute).
postprocess() appends sampled tokens, applies stop conditions and frees finished sequences.

With CPU assist (``cold_admission``, CaraServe §4), a sequence whose adapter is not on the device is
admitted at once when the engine says assisting pays: its adapter is paged in if it fits (the copy
waits until after this step) and the CPU workers compute its LoRA meanwhile (StepPlan.assisted);
if it does not fit the sequence runs cold, prefill and decodes alike, until a later step finds room.
Decodes are assisted too, because a cold sequence that stopped after its prefill would hold its KV
pages while waiting for pages for its adapter, which a full pool may never free.

The KV pages and the prefix cache are the BlockManager's (block_manager.py); the text and the stop
rules are the OutputProcessor's (output.py).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from asyncserve.model.tokenizer import Tokenizer
from asyncserve.pager.pager import AdapterPager
from asyncserve.pager.pool import PagedPool
from asyncserve.scheduler.block_manager import BlockManager
from asyncserve.scheduler.drafts import NgramDrafter
from asyncserve.scheduler.output import OutputProcessor
from asyncserve.scheduler.policy import ANY, SchedulingPolicy, StepRule
from asyncserve.sequence import SeqStatus, Sequence
from asyncserve.step import SampleOutput, ScheduledChunk, SeqUpdate, StepPlan

log = logging.getLogger("asyncserve.scheduler")


class Scheduler:
    def __init__(self, pool: PagedPool, pager: AdapterPager, tokenizer: Tokenizer, policy: SchedulingPolicy,
                 max_running: int, max_step_tokens: int, max_model_len: int, prefix_caching: bool = True,
                 drafter: NgramDrafter | None = None, state_slots: int = 0):
        self.pager = pager
        self.drafter = drafter                       # speculative decoding's drafts (drafts.py), None: off
        # set by the engine when it has CPU workers: cold_admission(seq, tokens), whether to admit seq,
        # whose adapter is not on the device, with CPU assist for a first chunk of about ``tokens``
        self.cold_admission: Callable[[Sequence, int], bool] | None = None
        self._assisted: set[int] = set()             # this schedule's StepPlan.assisted
        self.policy = policy
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.blocks = BlockManager(pool, pager, prefix_caching, state_slots)
        self.output = OutputProcessor(tokenizer, max_model_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []            # admission order
        self.requests: dict[str, Sequence] = {}

    # ---- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.requests[seq.request_id] = seq
        self.output.start(seq)
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return None
        self._finish(seq, "abort")
        return seq

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- schedule ----------------------------------------------------------------------------
    def abort_unattainable(self, now: float) -> list[SeqUpdate]:
        """End the waiting sequences the policy finds cannot meet their SLO any more (S-LoRA §4.3)."""
        updates = []
        waiting = list(self.waiting)
        for seq, failure in self.policy.unattainable(self.running, waiting, now, self.blocks.cached_prefix_tokens):
            self._finish(seq, "error")
            updates.append(SeqUpdate(seq, [], "", True, "error", failure))
        return updates

    def schedule(self) -> StepPlan:
        rule = self.policy.step_rule(self.running, list(self.waiting))
        plan = self._plan(rule)
        if not plan and rule is not ANY:   # the rule's requests cannot run now (their pages do not fit): progress first
            plan = self._plan(self.policy.progress_rule(self.running, list(self.waiting)))
        self.policy.observe(plan, self.running, list(self.waiting))
        return plan

    def _plan(self, rule: StepRule) -> StepPlan:
        plan = StepPlan(merged=rule.merged)
        budget = self.max_step_tokens
        self._assisted = set()
        # 0. cold sequences go to the device path once their adapter fits (the copy is on this step's path)
        for seq in self.running:
            if seq.cold and not self._warm_up(seq):
                self._assisted.add(seq.adapter_load)
        # 1. decodes of running sequences the rule allows, preempting the newest when pages run out
        prefilling = []
        drafting = self.drafter is not None and sum(not s.in_prefill for s in self.running) <= self.drafter.max_batch
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or not rule.allows(seq.adapter):
                continue
            if seq.in_prefill:
                prefilling.append(seq)
            elif self._grow(seq, seq.num_computed + 1):   # else seq itself was preempted
                budget -= 1
                draft = self._draft(seq, budget) if drafting else []
                plan.decodes.append(ScheduledChunk(seq, 1 + len(draft), draft))
                budget -= len(draft)
        # 2. running sequences mid-prefill continue their chunks (unless preempted by a decode above)
        for seq in prefilling:
            if budget <= 0:
                break
            if seq.status is SeqStatus.RUNNING:
                n = min(seq.num_tokens - seq.num_computed, budget)
                if self.blocks.reserve(seq, seq.num_computed + n):
                    plan.prefills.append(ScheduledChunk(seq, n))
                    budget -= n
        # 3. admissions, in the policy's order, while everything fits
        for seq in self.policy.admission_order(list(self.waiting), self.pager.is_resident):
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if not rule.allows(seq.adapter) or not self.policy.admits(seq, self.running):
                continue
            n = self._admit(seq, budget)
            if not n:
                break
            chunk = ScheduledChunk(seq, n)
            (plan.decodes if not seq.in_prefill and n == 1 else plan.prefills).append(chunk)
            budget -= n
        key = lambda c: (c.seq.adapter or "", c.seq.adapter_load or 0)  # noqa: E731 — one segment per adapter
        plan.decodes.sort(key=key)
        plan.prefills.sort(key=key)
        plan.assisted = frozenset(self._assisted)
        return plan

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Tokens drafted to follow a decoding seq, within the step's budget, its max_tokens and the context
        length, whose KV fits in free pages (a draft never evicts or preempts); [] for none."""
        room = min(budget, seq.params.max_tokens - len(seq.output_ids), self.output.max_model_len - seq.num_tokens) - 1
        if room <= 0:
            return []
        draft = self.drafter.propose(seq, room)
        if seq.guide is not None:        # up to what its constraint allows, short of an end
            eos = self.output.tokenizer.eos_token_ids
            draft = draft[:next((i for i, t in enumerate(draft) if t in eos), len(draft))]
            draft = draft[:seq.guide.accepted(draft)]
        if not draft or not self.blocks.reserve_free(seq, seq.num_computed + 1 + len(draft)):
            return []
        self.drafter.drafted += len(draft)
        return draft

    def _warm_up(self, seq: Sequence) -> bool:
        """Page a cold sequence's adapter in if it fits now (not if its name was reloaded since: it keeps
        the load it began with, on the workers); True once resident."""
        if self.pager.registration(seq.adapter) != seq.adapter_load:
            return False
        seq.cold = self.pager.ensure_resident(seq.adapter, admission=False) is None
        return not seq.cold

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admit seq with a first chunk of at most ``budget`` tokens past its cached prefix; returns the
        chunk's size, 0 if it does not fit now."""
        if seq.adapter is not None:
            load = self.pager.registration(seq.adapter)
            if self._admit_cold(seq, load, budget):
                seq.cold = self.pager.ensure_resident(seq.adapter) is None   # its copy waits: plan.assisted
                self._assisted.add(load)
                self.pager.hold(load)
            elif self.pager.ensure_resident(seq.adapter) is None:
                return 0
            else:
                self.pager.acquire(load)     # held from here so making room for KV cannot evict it
            seq.adapter_load = load
        first_chunk = self.blocks.allocate_first_chunk(seq, budget)
        if not first_chunk:
            if seq.adapter is not None:
                self.pager.release(seq.adapter_load)
            seq.cold = False
            return 0
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return first_chunk

    def _admit_cold(self, seq: Sequence, load: int, budget: int) -> bool:
        """Whether seq starts with CPU assist: its adapter is not on the device (or its copy there waits
        for this step's end) and the engine's rule says so."""
        if self.cold_admission is None or (self.pager.is_resident(seq.adapter) and load not in self._assisted):
            return False
        return self.cold_admission(seq, min(budget, seq.num_tokens - seq.num_computed))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Like BlockManager.reserve, but preempts the newest running sequences until it fits."""
        while not self.blocks.reserve(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            if seq.adapter is not None:
                self.pager.release(seq.adapter_load)
        seq.cold = False
        self.blocks.free(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
        self.output.drop(seq.request_id)

    # ---- postprocess ------------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, sampled: SampleOutput, prompt_logprobs: dict | None = None
                    ) -> list[SeqUpdate]:
        """prompt_logprobs: StepResult.prompt_logprobs."""
        updates = []
        i = 0
        for chunk in plan.chunks:
            seq = chunk.seq
            if chunk.draft:
                if not seq.finished:           # else aborted while the step ran
                    updates.append(self._verify(chunk, sampled, i))
                i += chunk.num_sampled
                continue
            samples = chunk.samples
            seq.num_computed += chunk.num_tokens
            if not seq.finished:
                self.blocks.register_blocks(seq)
            if prompt_logprobs and seq.request_id in prompt_logprobs:
                lps, tops = prompt_logprobs[seq.request_id]
                seq.prompt_logprobs += lps
                seq.prompt_top_logprobs += tops
            if not samples:
                continue
            token, error = sampled.token_ids[i], sampled.errors.get(i)
            if sampled.logprobs is not None and error is None:
                seq.logprobs.append(sampled.logprobs[i])
                seq.top_logprobs.append(sampled.top_logprobs[i] if sampled.top_logprobs else [])
            i += 1
            if seq.finished:                   # aborted while the step ran
                continue
            if error is not None:              # nothing to sample from: this request fails, the others go on
                log.warning("request %s: %s", seq.request_id, error.message)
                self._finish(seq, "error")
                updates.append(SeqUpdate(seq, [], "", True, "error", error))
                continue
            updates.append(self._append(seq, token))
        return updates

    def _verify(self, chunk: ScheduledChunk, sampled: SampleOutput, row: int) -> SeqUpdate:
        """A drafted decode's tokens: the sampled ones from ``row`` on while each drafted token equals the
        one sampled before it, then the first that differs (or follows the whole draft). A row with no
        token ends the run before it; the first row's fails the request, as a decode's does."""
        seq, draft = chunk.seq, chunk.draft
        tokens, text, reason = [], "", None
        for j in range(len(draft) + 1):
            token, error = sampled.token_ids[row + j], sampled.errors.get(row + j)
            if error is not None:
                if j > 0:                      # the next step samples that position again, as a decode
                    break
                log.warning("request %s: %s", seq.request_id, error.message)
                self._finish(seq, "error")
                return SeqUpdate(seq, [], "", True, "error", error)
            if sampled.logprobs is not None:
                seq.logprobs.append(sampled.logprobs[row + j])
                seq.top_logprobs.append(sampled.top_logprobs[row + j] if sampled.top_logprobs else [])
            seq.num_computed += 1              # the KV of the token before it is kept
            tokens.append(token)
            delta, reason = self.output.append(seq, token)
            text += delta
            if reason is not None or j == len(draft) or token != draft[j]:
                break
        self.drafter.accepted += len(tokens) - 1
        if reason is not None:
            self._finish(seq, reason)
        else:
            self.blocks.trim(seq)              # the pages past its tokens held only rejected drafts' KV
            self.blocks.register_blocks(seq)
        return SeqUpdate(seq, tokens, text, reason is not None, reason)

    def _append(self, seq: Sequence, token: int) -> SeqUpdate:
        text, reason = self.output.append(seq, token)
        if reason is not None:
            self._finish(seq, reason)
        return SeqUpdate(seq, [token], text, reason is not None, reason)
