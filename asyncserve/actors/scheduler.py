"""The scheduler actor: admission, batch formation and postprocessing, one step in flight at a time.

It drives the engine's schedule() and postprocess() (waiting queue, running set, KV pages); the
stepper actor runs the step in between. While the stepper runs a step in its thread, this actor
keeps taking submissions and aborts; aborts of sequences in the running step are applied after the
step returns, so their pages are never reused mid-step.
"""
from __future__ import annotations

import asyncio
import logging
import time

from asyncserve.engine import Engine
from asyncserve.messages import (Abort, AdapterReady, Export, FetchAdapters, Prefetch, RunStep, Shutdown, StepDone,
                                 Submit, TokenEvent, adapter_unloaded)
from asyncserve.metrics import Metrics
from asyncserve.sequence import Sequence
from asyncserve.step import EngineFailed, Failure, SeqUpdate

log = logging.getLogger("asyncserve.scheduler")

# 503: another replica, or this one restarted, can serve the request
SHUTTING_DOWN = Failure("the server is shutting down", 503, "server_shutting_down")


class SchedulerActor:
    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self.mailbox: asyncio.Queue = asyncio.Queue()
        self.stepper_mailbox: asyncio.Queue | None = None
        self.pager_mailbox: asyncio.Queue | None = None
        self.streams: dict[str, asyncio.Queue] = {}
        self._in_flight: set[str] = set()       # request ids in the running step
        self._deferred: list[Abort | Export] = []    # for requests in the running step: after it
        self.mean_output = 128.0                # output tokens of recent finished requests (load estimates)
        self._finished_updates: list[SeqUpdate] = []   # of the last step, published once the next one is sent
        self._step_id = 0
        self._stepping = False
        self._stopping = False

    @property
    def idle(self) -> bool:
        return not self._stepping and not self.engine.has_unfinished()

    async def run(self) -> None:
        while True:
            msg = await self.mailbox.get()
            self._handle(msg)
            while not self.mailbox.empty():
                self._handle(self.mailbox.get_nowait())
            if self.pager_mailbox is not None and (cold := self.engine.take_fetches()):
                self.pager_mailbox.put_nowait(FetchAdapters(cold))     # their requests wait, parked
            self._maybe_step()
            self.metrics.observe_loads(self.engine)
            # tokens go out after the next step is on its way: the stream handlers they wake then
            # run while the model computes instead of before it starts
            updates, self._finished_updates = self._finished_updates, []
            self._publish(updates)
            if self._stopping and self.idle:
                return

    def _handle(self, msg) -> None:
        if isinstance(msg, Submit):
            if self._stopping:
                self._emit_error(msg.seq, msg.stream, SHUTTING_DOWN)
                return
            if msg.seq.adapter is not None and not self.engine.has_adapter(msg.seq.adapter):
                self._emit_error(msg.seq, msg.stream, adapter_unloaded(msg.seq.adapter))
                return
            self.streams[msg.seq.request_id] = msg.stream
            self.engine.add(msg.seq)
        elif isinstance(msg, (Abort, Export)):
            if msg.request_id in self._in_flight:
                self._deferred.append(msg)
            elif isinstance(msg, Abort):
                self._abort(msg)
            else:
                self._export(msg)
        elif isinstance(msg, StepDone):
            self._finish_step(msg)
        elif isinstance(msg, AdapterReady):
            self.engine.unpark(msg.name)
        elif isinstance(msg, Shutdown):
            self._stopping = True

    def _maybe_step(self) -> None:
        if self._stepping or self.stepper_mailbox is None:
            return
        refused = self.engine.abort_unattainable()
        for u in refused:
            self.metrics.requests_aborted.labels(u.error.code).inc()
        self._publish(refused)
        plan = self.engine.schedule()
        if not plan:
            self._publish(self.engine.fail_unschedulable())
            return
        self._step_id += 1
        self._stepping = True
        self._in_flight = {c.seq.request_id for c in plan.chunks}
        self.stepper_mailbox.put_nowait(RunStep(self._step_id, plan))
        if self.pager_mailbox is not None and (heads := self.engine.prefetch_candidates()):
            self.pager_mailbox.put_nowait(Prefetch(heads))

    def _finish_step(self, done: StepDone) -> None:
        self._stepping = False
        self._in_flight = set()
        error = done.error
        if error is None:
            self.metrics.step.observe(done.result.duration_s)
            try:
                self._finished_updates += self.engine.postprocess(done.plan, done.result)
            except Exception as e:      # a bug in one step's bookkeeping fails its requests, not the server
                log.exception("postprocessing step %d failed", done.step_id)
                error = e
        if error is not None:
            log.error("step %d failed: %r; failing its requests", done.step_id, error)
            # an engine that cannot step (a tensor-parallel rank died) is unavailable, not a bug
            failure = Failure(f"the server cannot compute any more: {error}", 503, "engine_failed") \
                if isinstance(error, EngineFailed) else f"internal error: {error!r}"
            for chunk in done.plan.chunks:
                seq = chunk.seq
                self._abort(Abort(seq.request_id, reason="error"), error=failure)
                if (stream := self.streams.pop(seq.request_id, None)) is not None:   # finished, unpublished
                    self._emit_error(seq, stream, failure)
        for msg in self._deferred:
            self._abort(msg) if isinstance(msg, Abort) else self._export(msg)
        self._deferred = []

    def _publish(self, updates: list[SeqUpdate]) -> None:
        now = time.monotonic()
        for u in updates:
            seq = u.seq
            stream = self.streams.get(seq.request_id)
            if u.new_token_ids:
                self.metrics.generated_tokens.inc(len(u.new_token_ids))
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    self.metrics.ttft.observe(now - seq.arrival)
            if u.finished:
                self._record_finish(seq, u.finish_reason, now)
            if stream is None:
                continue
            lp = seq.params.logprobs is not None
            first = bool(u.new_token_ids) and len(seq.output_ids) == len(u.new_token_ids)
            prompt_lp = first and seq.params.prompt_logprobs is not None
            stream.put_nowait(TokenEvent(
                request_id=seq.request_id, token_ids=u.new_token_ids, text=u.new_text, finished=u.finished,
                finish_reason=u.finish_reason,
                logprobs=seq.logprobs[-len(u.new_token_ids):] if lp and u.new_token_ids else None,
                top_logprobs=seq.top_logprobs[-len(u.new_token_ids):] if lp and u.new_token_ids else None,
                prompt_logprobs=seq.prompt_logprobs if prompt_lp else None,
                prompt_top_logprobs=seq.prompt_top_logprobs if prompt_lp else None,
                num_prompt_tokens=len(seq.prompt_ids), num_output_tokens=len(seq.output_ids),
                num_cached_tokens=seq.num_cached_tokens or 0, error=u.error))
            if u.finished:
                del self.streams[seq.request_id]

    def _record_finish(self, seq: Sequence, reason: str | None, now: float) -> None:
        self.metrics.record_finish(seq.adapter or self.engine.model_name, seq.adapter,
                                   seq.adapter is None or self.engine.has_adapter(seq.adapter), reason or "unknown",
                                   len(seq.prompt_ids), len(seq.output_ids))
        self.metrics.latency.observe(now - seq.arrival)
        n = len(seq.output_ids)
        if reason in ("stop", "length"):
            self.mean_output += (n - self.mean_output) / 64
        if n > 1 and seq.first_token_time is not None:
            self.metrics.tpot.observe((now - seq.first_token_time) / (n - 1))

    def _export(self, export: Export) -> None:
        """The request leaves with its stream, after the tokens of its last step are on it (so the
        stream goes on elsewhere with no gap or repeat)."""
        mine = [u for u in self._finished_updates if u.seq.request_id == export.request_id]
        if mine:
            self._finished_updates = [u for u in self._finished_updates if u.seq.request_id != export.request_id]
            self._publish(mine)
        seq = self.engine.export_sequence(export.request_id)
        stream = self.streams.pop(export.request_id, None) if seq is not None else None
        if not export.reply.done():
            export.reply.set_result((seq, stream) if stream is not None else None)

    def _abort(self, abort: Abort, error: Failure | str | None = None) -> None:
        """End the request; ``error``: its failure, or an internal error's message (500); else the Abort's."""
        seq = self.engine.abort(abort.request_id)
        if seq is None:          # unknown, or finished by the last step: its stream gets that update
            return
        stream = self.streams.pop(abort.request_id, None)
        self._record_finish(seq, abort.reason, time.monotonic())
        if stream is not None:
            # a stream still read means the client is there: it gets an error, never a finish_reason
            # "abort" (a client that went away reads nothing)
            failure = (Failure(error) if isinstance(error, str) else error) if error is not None \
                else abort.failure or Failure("the request was aborted")
            stream.put_nowait(TokenEvent(request_id=seq.request_id, token_ids=[], text="", finished=True,
                                         finish_reason=abort.reason, num_prompt_tokens=len(seq.prompt_ids),
                                         num_output_tokens=len(seq.output_ids), error=failure))

    def _emit_error(self, seq: Sequence, stream: asyncio.Queue, failure: Failure | str) -> None:
        """End a request that has no (more) place in the scheduler; a str is an internal error's message."""
        stream.put_nowait(TokenEvent(request_id=seq.request_id, token_ids=[], text="", finished=True,
                                     finish_reason="error", num_prompt_tokens=len(seq.prompt_ids),
                                     num_output_tokens=len(seq.output_ids),
                                     error=Failure(failure) if isinstance(failure, str) else failure))
