"""Continuous batching over the unified pool: each step mixes decodes and prefill chunks.

schedule() picks, under a per-step token budget, one decode token for every running sequence past
its prefill and prefill chunks for the rest, admitting waiting sequences in the policy's order
while their adapter can be paged in and their first chunk's KV pages fit. A decode that finds no
free page evicts idle adapters, then preempts the most recently admitted sequence, whose pages
return to the pool; it is recomputed from its tokens when readmitted (Punica's cancel+recompute).
postprocess() appends sampled tokens, applies stop conditions and frees finished sequences.

Prefix caching (vLLM's automatic prefix caching, per adapter): once a full block of a sequence's
tokens has its KV computed, its page is registered under a key naming the block's tokens, the
blocks before it and the adapter (which load of it). A sequence admitted later whose tokens start
with registered blocks takes those pages as they are (shared, read-only: a sequence writes only
past its cached prefix) and computes from there, always at least its last token, which gives the
logits to sample from. Requests that want prompt logprobs compute every prompt token.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from asyncserve.model.detokenizer import IncrementalDetokenizer
from asyncserve.model.tokenizer import Tokenizer
from asyncserve.pager.pager import AdapterPager
from asyncserve.pager.pool import PagedPool
from asyncserve.scheduler.policy import SchedulingPolicy
from asyncserve.scheduler.sequence import Sequence, SeqStatus
from asyncserve.stepper.sampler import SampleOutput

log = logging.getLogger("asyncserve.scheduler")


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence's known tokens (so a token is sampled)."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    decodes: list[ScheduledChunk] = field(default_factory=list)    # one token each, grouped by adapter
    prefills: list[ScheduledChunk] = field(default_factory=list)   # grouped by adapter

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


@dataclass
class SeqUpdate:
    """What one step changed for one request: new tokens and text, and whether it ended."""
    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None


class Scheduler:
    def __init__(self, pool: PagedPool, pager: AdapterPager, tokenizer: Tokenizer, policy: SchedulingPolicy,
                 max_running: int, max_step_tokens: int, max_model_len: int, prefix_caching: bool = True):
        self.pool = pool
        self.pager = pager
        self.tokenizer = tokenizer
        self.policy = policy
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []            # admission order
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.requests: dict[str, Sequence] = {}
        # keep a few pages free so running decodes rarely have to preempt right after an admission
        self.watermark = max(1, pool.num_pages // 100)
        self.prefix_caching = prefix_caching
        self.prefix_queried_tokens = 0          # prompt tokens of admissions that looked up the cache
        self.prefix_hit_tokens = 0              # of those, tokens found cached

    # ---- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.requests[seq.request_id] = seq
        p = seq.params
        self.detoks[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_ids, skip_special_tokens=p.skip_special_tokens,
            stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)
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
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_step_tokens
        # 1. decodes of running sequences, preempting the newest when pages run out
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.in_prefill:
                continue
            if not self._grow(seq, seq.num_computed + 1):
                continue                               # seq itself was preempted
            plan.decodes.append(ScheduledChunk(seq, 1))
            budget -= 1
        # 2. running sequences mid-prefill continue their chunks
        for seq in self.running:
            if budget <= 0:
                break
            if seq.status is SeqStatus.RUNNING and seq.in_prefill:
                n = min(seq.num_tokens - seq.num_computed, budget)
                if self._reserve(seq, seq.num_computed + n):
                    plan.prefills.append(ScheduledChunk(seq, n))
                    budget -= n
        # 3. admissions, in the policy's order, while everything fits
        resident = set(self.pager.resident)
        for seq in self.policy.admission_order(list(self.waiting), resident):
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            n = self._admit(seq, budget)
            if not n:
                break
            chunk = ScheduledChunk(seq, n)
            (plan.decodes if not seq.in_prefill and n == 1 else plan.prefills).append(chunk)
            budget -= n
        key = lambda c: (c.seq.adapter or "")  # noqa: E731 — group each adapter's tokens into segments
        plan.decodes.sort(key=key)
        plan.prefills.sort(key=key)
        return plan

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admit seq with a first chunk of at most ``budget`` tokens past its cached prefix; returns the
        chunk's size, 0 if it does not fit now."""
        if seq.adapter is not None:
            if self.pager.ensure_resident(seq.adapter) is None:
                return 0
            self.pager.acquire(seq.adapter)      # held from here so making room for KV cannot evict it
        seq.block_table = self._cached_prefix(seq)
        seq.num_registered_blocks = len(seq.block_table)
        seq.num_computed = len(seq.block_table) * self.pool.block_size
        first_chunk = min(seq.num_tokens - seq.num_computed, budget)
        kv_pages = self.pool.pages_for_tokens(seq.num_computed + first_chunk) - len(seq.block_table)
        if self.pool.num_free - kv_pages < self.watermark and not self.pager.make_room(kv_pages + self.watermark):
            self.pool.release(seq.block_table)
            seq.block_table, seq.num_computed = [], 0
            if seq.adapter is not None:
                self.pager.release(seq.adapter)
            return 0
        seq.block_table += self.pool.allocate(kv_pages, "kv")
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return first_chunk

    # ---- prefix cache ----------------------------------------------------------------------
    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages of the longest run of seq's first blocks that is cached, now held by seq too."""
        if not self.prefix_caching:
            return []
        if seq.cache_root is None:
            registration = 0 if seq.adapter is None else self.pager.registration(seq.adapter)
            if registration is None:          # unloaded while running: not worth caching for
                return []
            seq.cache_root = (seq.adapter, registration)
        if seq.params.prompt_logprobs is not None:     # every prompt token's logits are wanted
            return []
        pages = []
        for i in range((seq.num_tokens - 1) // self.pool.block_size):    # the last token is always computed
            page = self.pool.cached_block(self._block_key(seq, i))
            if page is None:
                break
            self.pool.share(page)
            pages.append(page)
        self.prefix_queried_tokens += seq.num_tokens
        self.prefix_hit_tokens += len(pages) * self.pool.block_size
        return pages

    def _block_key(self, seq: Sequence, i: int) -> tuple:
        """Block i's key: (block i-1's key hashed, or the cache root for block 0; block i's tokens)."""
        keys, bs = seq.block_keys, self.pool.block_size
        while len(keys) <= i:
            j = len(keys)
            keys.append((hash(keys[-1]) if keys else seq.cache_root, tuple(seq.tokens(j * bs, (j + 1) * bs))))
        return keys[i]

    def _register_blocks(self, seq: Sequence) -> None:
        """Offer seq's newly completed blocks to the cache."""
        full = seq.num_computed // self.pool.block_size
        for i in range(seq.num_registered_blocks, full):
            self.pool.register_block(seq.block_table[i], self._block_key(seq, i))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for ``num_tokens`` KV entries, evicting idle adapters if needed; no preemption."""
        need = self.pool.pages_for_tokens(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if self.pool.num_free < need and not self.pager.make_room(need):
            return False
        seq.block_table += self.pool.allocate(need, "kv")
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Like _reserve, but preempts the newest running sequences until it fits."""
        while not self._reserve(seq, num_tokens):
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
                self.pager.release(seq.adapter)
        self.pool.release(seq.block_table)
        seq.block_table = []

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
        self.detoks.pop(seq.request_id, None)

    # ---- postprocess ------------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, sampled: SampleOutput, prompt_logprobs: dict | None = None
                    ) -> list[SeqUpdate]:
        """prompt_logprobs: StepResult.prompt_logprobs."""
        updates = []
        i = 0
        for chunk in plan.chunks:
            seq = chunk.seq
            samples = chunk.samples
            seq.num_computed += chunk.num_tokens
            if seq.cache_root is not None and not seq.finished:
                self._register_blocks(seq)
            if prompt_logprobs and seq.request_id in prompt_logprobs:
                lps, tops = prompt_logprobs[seq.request_id]
                seq.prompt_logprobs += lps
                seq.prompt_top_logprobs += tops
            if not samples:
                continue
            token = sampled.token_ids[i]
            if sampled.logprobs is not None:
                seq.logprobs.append(sampled.logprobs[i])
                seq.top_logprobs.append(sampled.top_logprobs[i] if sampled.top_logprobs else [])
            i += 1
            if seq.finished:                   # aborted while the step ran
                continue
            updates.append(self._append(seq, token))
        return updates

    def _append(self, seq: Sequence, token: int) -> SeqUpdate:
        p = seq.params
        seq.output_ids.append(token)
        detok = self.detoks[seq.request_id]
        text = detok.add(token)
        n_out = len(seq.output_ids)
        reason = None
        # a guide allows the end-of-sequence token only where its text is complete: that ends the
        # sequence whatever ignore_eos and min_tokens say
        guide_done = seq.guide is not None and token in self.tokenizer.eos_token_ids
        if seq.guide is not None and not guide_done:
            try:
                seq.guide.advance(token)
            except ValueError as e:     # the sampler gives only allowed tokens; never let one request stop the rest
                log.error("request %s: token %d is outside its constraint (%s); ending it", seq.request_id, token, e)
                guide_done = True
        if detok.stopped_by is not None or guide_done:
            reason = "stop"
        elif n_out >= p.min_tokens and (token in p.stop_token_ids or
                                        (not p.ignore_eos and token in self.tokenizer.eos_token_ids)):
            reason = "stop"
        elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            text += detok.finish()
            self._finish(seq, reason)
        return SeqUpdate(seq, [token], text, reason is not None, reason)

    def output_text(self, request_id: str) -> str:
        return self.detoks[request_id].text
