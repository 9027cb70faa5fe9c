"""The relay between a request's handler and the scheduler actor, and the answer's skeleton.

A request's choices (each prompt of a completion request, n samples of each) go to the scheduler as
one Submit each, all of them or none; their TokenEvents come back on one queue per choice. A client
that goes away (handler cancelled, or a write that fails) aborts all of them; the scheduler frees
their pages after the current step. ``Reply`` is what both endpoint families share: stream the events
(SSE, usage chunk, error event, [DONE]) or collect them into one JSON body.
"""
from __future__ import annotations

import abc
import asyncio
import functools
import json
import logging
import time

from aiohttp import web

from asyncserve.ingress.protocol import ApiError, now, usage
from asyncserve.messages import Abort, Failure, Submit, TokenEvent

log = logging.getLogger("asyncserve.ingress")


class Choice:
    """One sequence of a request (one sample of one of its prompts), answered as ``choices[index]``."""

    def __init__(self, index: int, seq):
        self.index, self.seq = index, seq
        self.stream: asyncio.Queue | None = None    # its TokenEvents, once submitted
        self.num_output_tokens = 0
        self.num_cached_tokens = 0                   # of its prompt, found in the prefix cache
        self.prompt_ids_sent = False                 # return_token_ids: the prompt's ids went out


def failure_error(failure: Failure) -> ApiError:
    """A request the server ended (TokenEvent.error) as the error its client gets."""
    return ApiError(failure.status, failure.message, code=failure.code)


# ---- to and from the scheduler actor ---------------------------------------------------------------

def submit(server, choices: list[Choice]) -> None:
    """Hand the choices' sequences to the scheduler: all of them, or none (429 / 400)."""
    limit = server.config.max_waiting
    if len(choices) > limit:
        raise ApiError(400, f"the request asks for {len(choices)} sequences (prompts x n); this server queues at "
                       f"most {limit}", param="n", code="invalid_value")
    if server.cluster is not None:       # cluster mode: the router may send them to a peer
        streams = [asyncio.Queue() for _ in choices]
        if server.cluster.dispatch([choice.seq for choice in choices], streams):
            for choice, stream in zip(choices, streams):
                choice.stream = stream
            return
    waiting = server.engine.load_snapshot().waiting + server.scheduler.mailbox.qsize()
    if waiting + len(choices) > limit:
        raise ApiError(429, f"the server is overloaded ({waiting} requests waiting); retry later",
                       code="overloaded", headers={"Retry-After": "1"})
    for choice in choices:
        choice.stream = asyncio.Queue()
        server.scheduler.mailbox.put_nowait(Submit(choice.seq, choice.stream))


def abort(server, seq) -> None:
    """Nobody reads the sequence's events any more: end it (its pages are freed after the step)."""
    server.scheduler.mailbox.put_nowait(Abort(seq.request_id))
    if server.cluster is not None:
        server.cluster.abort(seq.request_id)


async def relay(server, seq, stream: asyncio.Queue, model: str, on_event) -> None:
    """Feed the request's events to ``on_event`` until it finishes; abort it if the client leaves."""
    t0, first, n_out, status = seq.arrival, None, 0, "abort"
    try:
        while True:
            event: TokenEvent = await stream.get()
            if event.token_ids and first is None:
                first = time.monotonic()
            n_out = event.num_output_tokens or n_out
            await on_event(event)
            if event.finished:
                status = "error" if event.error else (event.finish_reason or "stop")
                return
    finally:
        if status == "abort":
            abort(server, seq)
        log.info("request %s model=%s prompt_tokens=%d output_tokens=%d ttft=%s latency=%.3fs status=%s",
                 seq.request_id, model, len(seq.prompt_ids), n_out,
                 f"{first - t0:.3f}s" if first is not None else "-", time.monotonic() - t0, status)


async def relay_all(server, choices: list[Choice], model: str, on_event) -> None:
    """relay every choice, ``on_event(choice, event)``; if one fails (its client write) or the handler
    is cancelled, the others are cancelled too, which aborts their sequences."""
    tasks = [asyncio.ensure_future(relay(server, c.seq, c.stream, model, functools.partial(on_event, c)))
             for c in choices]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


class Collected:
    """A non-streaming choice's events gathered into one."""

    def __init__(self):
        self.text, self.tokens, self.logprobs, self.top = "", [], [], []
        self.prompt_logprobs, self.prompt_top = None, None
        self.finish, self.n, self.cached, self.error = None, 0, 0, None

    async def add(self, event: TokenEvent) -> None:
        self.text += event.text
        self.tokens += event.token_ids
        if event.logprobs:
            self.logprobs += event.logprobs
            self.top += event.top_logprobs
        if event.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top = event.prompt_logprobs, event.prompt_top_logprobs
        if event.finished:
            self.finish, self.n, self.error = event.finish_reason, event.num_output_tokens, event.error
            self.cached = event.num_cached_tokens


# ---- the answer: streamed or collected -------------------------------------------------------------

class Reply(abc.ABC):
    """One request's answer. Streamed: server-sent events, a usage chunk when asked, an error event in
    OpenAI's shape for a choice the server ended (as vLLM sends one, instead of its finish_reason), then
    [DONE]. Collected: one JSON body, or the first failed choice's error. An endpoint family says its
    chunks' and choices' shapes."""
    id_prefix = ""              # the response's id: "<id_prefix>-<its first sequence's request id>"
    object = ""                 # the collected body's "object"
    chunk_object = ""           # each streamed chunk's

    def __init__(self, server, req, choices: list[Choice], prompt_tokens: int):
        self.server, self.req, self.choices, self.prompt_tokens = server, req, choices, prompt_tokens
        self.tokenizer = server.engine.tokenizer
        self.id, self.created = "", 0
        self.resp: web.StreamResponse | None = None

    async def answer(self, request: web.Request) -> web.StreamResponse:
        submit(self.server, self.choices)
        self.id, self.created = self.response_id(self.choices[0].seq.request_id), now()
        return await (self._stream(request) if self.req.stream else self._collect())

    # ---- what an endpoint family says ------------------------------------------------------------
    def response_id(self, request_id: str) -> str:
        return f"{self.id_prefix}-{request_id}"

    async def stream_start(self) -> None:
        """Chunks before any choice's events."""

    async def stream_end(self) -> None:
        """After every choice's last event: the usage chunk when asked, and [DONE]."""
        if self.req.stream_options and self.req.stream_options.include_usage:
            await self.send({**self.head(self.chunk_object, []), "usage": self.usage()})
        await self.send("[DONE]")

    async def stream_failure(self, choice: Choice, error: ApiError) -> None:
        """A choice the server ended: an error event in OpenAI's shape (as vLLM sends one)."""
        await self.send(error.body())

    @abc.abstractmethod
    async def stream_event(self, choice: Choice, event: TokenEvent) -> None:
        """Send a choice's event (never an error) as the family's chunks."""

    @abc.abstractmethod
    def collected_choice(self, choice: Choice, collected: Collected) -> dict:
        """A finished choice's entry in the collected body's ``choices``."""

    async def collect_event(self, choice: Choice, event: TokenEvent, collected: Collected) -> None:
        """A choice's event, not streamed: gathered."""
        await collected.add(event)

    def body_extra(self) -> dict:
        """Fields after the collected body's usage."""
        return {}

    def collected_body(self, choices: list[dict]) -> dict:
        """The collected answer, from each choice's collected_choice."""
        return {**self.head(self.object, choices), "usage": self.usage(), **self.body_extra()}

    # ---- shared by the families ------------------------------------------------------------------
    def head(self, object_: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.req.model,
                "choices": choices}

    def usage(self) -> dict:
        """Each prompt's tokens counted once however many samples it has, as OpenAI does; of them, those
        its first sample found in the prefix cache (the choices come prompt by prompt, n each)."""
        cached = sum(choice.num_cached_tokens for choice in self.choices[::self.req.n])
        return {**usage(self.prompt_tokens, sum(choice.num_output_tokens for choice in self.choices)),
                "prompt_tokens_details": {"cached_tokens": cached}}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def returned_ids(self, choice: Choice, token_ids: list[int], with_prompt: bool = True) -> dict:
        """vLLM's return_token_ids: a choice's new token ids, and its prompt's the first time."""
        if not self.req.return_token_ids:
            return {}
        out = {"token_ids": token_ids}
        if with_prompt and not choice.prompt_ids_sent:
            out["prompt_token_ids"] = choice.seq.prompt_ids
            choice.prompt_ids_sent = True
        return out

    async def send(self, payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        await self.resp.write(f"data: {data}\n\n".encode())

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                "Connection": "keep-alive"})
        try:
            await self.resp.prepare(request)
            await self.stream_start()
        except BaseException:           # the client left before the first chunk: no relay will abort them
            for choice in self.choices:
                abort(self.server, choice.seq)
            raise
        await relay_all(self.server, self.choices, self.req.model, self._send_event)
        await self.stream_end()
        return self.resp

    async def _send_event(self, choice: Choice, event: TokenEvent) -> None:
        if event.finished or event.error:
            choice.num_output_tokens, choice.num_cached_tokens = event.num_output_tokens, event.num_cached_tokens
        if event.error:       # the stream's end still follows
            await self.stream_failure(choice, failure_error(event.error))
        else:
            await self.stream_event(choice, event)

    async def _collect(self) -> web.Response:
        collected = [Collected() for _ in self.choices]
        await relay_all(self.server, self.choices, self.req.model,
                        lambda choice, event: self.collect_event(choice, event, collected[choice.index]))
        out = []
        for choice, c in zip(self.choices, collected):
            if c.error:
                raise failure_error(c.error)
            choice.num_output_tokens, choice.num_cached_tokens = c.n, c.cached
            out.append(self.collected_choice(choice, c))
        return web.json_response(self.collected_body(out))
