"""The HTTP ingress actor: an aiohttp app speaking OpenAI's API with server-sent events.

Handlers validate and tokenize, hand one Sequence per choice (each prompt of a completion request,
n samples of each) to the scheduler actor, then relay the sequences' TokenEvents to the client. A
client that goes away (handler cancelled, or a write that fails) aborts all of them; the scheduler
frees their pages after the current step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from pathlib import Path

from aiohttp import web

from asyncserve import __version__
from asyncserve.engine import RequestError
from asyncserve.ingress.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                         LoadLoraRequest, TokenizeRequest, UnloadLoraRequest, decode_body, now,
                                         prompts_of, refuse_unsupported, sampling_params, structured_outputs_of,
                                         truncated_prompt, usage)
from asyncserve.ingress.tools import ToolPlan, new_call_id, template_tools, tool_call, tool_plan
from asyncserve.messages import Abort, LoadAdapter, Submit, TokenEvent, UnloadAdapter
from asyncserve.sampling_params import StructuredOutputs
from asyncserve.structured import StructuredOutputError

log = logging.getLogger("asyncserve.ingress")
SERVER_KEY = web.AppKey("server", object)
MAX_N = 128                      # samples per prompt, as OpenAI allows


# ---- errors, auth and limits -----------------------------------------------------------------------

def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(ApiError(413, f"the request body is too large ({e.text})", code="payload_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(ApiError(e.status, e.reason or "error", code=e.reason.lower().replace(" ", "_")))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error", code="internal_error"))


def auth_middleware(api_key: str | None):
    @web.middleware
    async def check(request: web.Request, handler):
        if api_key and request.path.startswith("/v1/"):
            if request.headers.get("Authorization", "") != f"Bearer {api_key}":
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
        return await handler(request)
    return check


# ---- helpers ---------------------------------------------------------------------------------------

def _server(request: web.Request):
    server = request.app[SERVER_KEY]
    if not server.ready:
        raise ApiError(503, "the model is still loading", code="loading", headers={"Retry-After": "5"})
    return server


def _adapter_for(server, model: str) -> str | None:
    if model == server.engine.model_name:
        return None
    if model in server.engine.pager.host:
        return model
    raise ApiError(404, f"the model {model!r} does not exist; see GET /v1/models", param="model",
                   code="model_not_found")


def _new_sequence(server, prompt_ids: list[int], params, adapter: str | None):
    try:
        return server.engine.make_sequence(prompt_ids, params, adapter, request_id=uuid.uuid4().hex,
                                           arrival=time.monotonic())
    except RequestError as e:
        raise ApiError(e.status, str(e), param=e.param,
                       code="model_not_found" if e.status == 404 else "context_length_exceeded"
                       if e.param in ("prompt", "max_tokens", "messages") else "invalid_value") from None


async def _structured_outputs(server, req, tools: ToolPlan | None = None) -> StructuredOutputs | None:
    """The request's output constraint, with its automaton built in a worker thread (seconds for a
    large one), so that make_sequence finds it cached and the event loop never waits on it."""
    spec, param = structured_outputs_of(req)
    if tools is not None:
        if spec is not None:
            raise ApiError(400, f"tool calls already constrain the output; {param} cannot be added", param=param,
                           code="invalid_value")
        spec, param = tools.constraint, "tools"
    if spec is not None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, server.engine.guides.index, spec)
        except StructuredOutputError as e:
            raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None
    return spec


def _max_tokens(server, prompt_ids: list[int], requested: int | None, default: int | None, param: str) -> int:
    """The request's max_tokens: an explicit one that overflows the context is a 400 (as in vLLM and
    OpenAI); the default is cut to the room the prompt leaves."""
    room = server.engine.max_model_len - len(prompt_ids)
    if requested is None:
        return max(1, room if default is None else min(default, room))
    if room > 0 and requested > room:
        raise ApiError(400, f"this model's context is {server.engine.max_model_len} tokens: the prompt's "
                       f"{len(prompt_ids)} plus {param}={requested} do not fit; ask for at most {room}",
                       param=param, code="context_length_exceeded")
    return requested


class _Choice:
    """One sequence of a request (one sample of one of its prompts), answered as ``choices[index]``."""

    def __init__(self, index: int, seq, prefix: str = ""):
        self.index, self.seq = index, seq
        self.stream: asyncio.Queue | None = None    # its TokenEvents, once submitted
        self.prefix = prefix                         # owed before its first text (the echoed prompt)
        self.offset = 0                              # characters of text sent (logprobs' text_offset)
        self.num_output_tokens = 0
        self.tool_text = ""                          # tool_choice "required": the output, parsed at its end
        self.tool_call_id: str | None = None         # a named tool_choice: the streamed call's id
        self.prompt_ids_sent = False                 # return_token_ids: the prompt's ids went out


def _returned_ids(req, choice: _Choice, token_ids: list[int], with_prompt: bool = True) -> dict:
    """vLLM's return_token_ids: a choice's new token ids, and its prompt's the first time."""
    if not req.return_token_ids:
        return {}
    out = {"token_ids": token_ids}
    if with_prompt and not choice.prompt_ids_sent:
        out["prompt_token_ids"] = choice.seq.prompt_ids
        choice.prompt_ids_sent = True
    return out


def _sample_params(params, sample: int):
    """The ``sample``-th of n samples: a request's seed s gives its samples seeds s, s+1, ..., so each
    is reproducible on its own and they differ."""
    if sample == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + sample)


def _num_samples(req) -> int:
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}, got {req.n}", param="n", code="invalid_value")
    return req.n


def _submit(server, choices: list[_Choice]) -> None:
    """Hand the choices' sequences to the scheduler: all of them, or none (429 / 400)."""
    limit = server.config.max_waiting
    if len(choices) > limit:
        raise ApiError(400, f"the request asks for {len(choices)} sequences (prompts x n); this server queues at "
                       f"most {limit}", param="n", code="invalid_value")
    waiting = len(server.engine.scheduler.waiting) + server.scheduler.mailbox.qsize()
    if waiting + len(choices) > limit:
        raise ApiError(429, f"the server is overloaded ({waiting} requests waiting); retry later",
                       code="overloaded", headers={"Retry-After": "1"})
    for choice in choices:
        choice.stream = asyncio.Queue()
        server.scheduler.mailbox.put_nowait(Submit(choice.seq, choice.stream))


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _log_finish(server, seq, model: str, status: str, t0: float, first: float | None, n_out: int) -> None:
    end = time.monotonic()
    log.info("request %s model=%s prompt_tokens=%d output_tokens=%d ttft=%s latency=%.3fs status=%s",
             seq.request_id, model, len(seq.prompt_ids), n_out,
             f"{first - t0:.3f}s" if first is not None else "-", end - t0, status)


async def _relay(server, seq, stream: asyncio.Queue, model: str, on_event) -> None:
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
            server.scheduler.mailbox.put_nowait(Abort(seq.request_id))
        _log_finish(server, seq, model, status, t0, first, n_out)


async def _relay_all(server, choices: list[_Choice], model: str, on_event) -> None:
    """_relay every choice, ``on_event(choice, event)``; if one fails (its client write) or the handler
    is cancelled, the others are cancelled too, which aborts their sequences."""
    tasks = [asyncio.ensure_future(_relay(server, c.seq, c.stream, model, functools.partial(on_event, c)))
             for c in choices]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


class _Collected:
    """A non-streaming request's events gathered into one response."""

    def __init__(self, prefix: str = ""):
        self.text, self.tokens, self.logprobs, self.top = prefix, [], [], []
        self.prompt_logprobs, self.prompt_top = None, None
        self.finish, self.n, self.error = None, 0, None

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

    def raise_error(self) -> None:
        if self.error:
            raise ApiError(500, self.error, code="internal_error")


async def _start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "Connection": "keep-alive"})
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, payload: dict | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    await resp.write(f"data: {data}\n\n".encode())


# ---- /v1/completions -------------------------------------------------------------------------------

async def completions(request: web.Request) -> web.StreamResponse:
    server = _server(request)
    req = decode_body(await request.read(), CompletionRequest)
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of > 1 is not supported", param="best_of", code="invalid_value")
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix", code="invalid_value")
    refuse_unsupported(req)
    adapter = _adapter_for(server, req.model)
    n = _num_samples(req)
    structured = await _structured_outputs(server, req)
    tok = server.engine.tokenizer
    choices, prompt_tokens = [], 0
    for prompt in prompts_of(req):
        given = tok.encode(prompt, add_special_tokens=req.add_special_tokens) if isinstance(prompt, str) else list(prompt)
        prompt_ids = truncated_prompt(given, req, server.engine.max_model_len)
        # echo with logprobs scores the echoed prompt too (as vLLM does; lm-eval's loglikelihood relies on it)
        params = sampling_params(req, _max_tokens(server, prompt_ids, req.max_tokens, 16, "max_tokens"), req.logprobs,
                                 req.logprobs if req.echo else None, structured)
        whole = isinstance(prompt, str) and len(prompt_ids) == len(given)
        echo = (prompt if whole else tok.decode(prompt_ids)) if req.echo else ""
        for sample in range(n):
            seq = _new_sequence(server, prompt_ids, _sample_params(params, sample), adapter)
            choices.append(_Choice(len(choices), seq, prefix=echo))
        prompt_tokens += len(prompt_ids)
    _submit(server, choices)
    rid, created = f"cmpl-{choices[0].seq.request_id}", now()

    def logprobs_block(event: TokenEvent, offset: int, prompt_ids: list[int]) -> dict | None:
        """The event's tokens from text offset ``offset``, after the prompt's when the event carries
        its logprobs (echo: the first prompt token has none). As in OpenAI's completions, each
        top_logprobs entry also holds the token itself: up to logprobs + 1 items."""
        if req.logprobs is None or not event.token_ids:
            return None
        ids, lps, tops = event.token_ids, event.logprobs, event.top_logprobs
        if event.prompt_logprobs is not None:
            ids, lps = prompt_ids + ids, [None] + event.prompt_logprobs + lps
            tops = [None] + event.prompt_top_logprobs + tops
        tokens = [_token_text(tok, t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top_dicts = [None if top is None else {**{_token_text(tok, i): v for i, v in top}, text: lp}
                     for top, text, lp in zip(tops, tokens, lps)]
        return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets, "top_logprobs": top_dicts}

    if req.stream:
        resp = await _start_sse(request)

        async def on_event(choice: _Choice, event: TokenEvent):
            if event.error:
                await _send(resp, ApiError(500, event.error, code="internal_error").body())
            text, choice.prefix = choice.prefix + event.text, ""      # the echoed prompt goes out first
            if text or event.token_ids or event.finished:
                scored_echo = event.prompt_logprobs is not None         # its tokens start at the echo
                lp = logprobs_block(event, choice.offset + (0 if scored_echo else len(text) - len(event.text)),
                                    choice.seq.prompt_ids)
                choice.offset += len(text)
                await _send(resp, {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                                   "choices": [{"index": choice.index, "text": text, "logprobs": lp,
                                                "finish_reason": event.finish_reason if event.finished else None,
                                                **_returned_ids(req, choice, event.token_ids)}]})
            if event.finished:
                choice.num_output_tokens = event.num_output_tokens

        await _relay_all(server, choices, req.model, on_event)
        if req.stream_options and req.stream_options.include_usage:
            await _send(resp, {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                               "choices": [], "usage": _usage(prompt_tokens, choices)})
        await _send(resp, "[DONE]")
        return resp

    collected = [_Collected(choice.prefix) for choice in choices]
    await _relay_all(server, choices, req.model, lambda choice, event: collected[choice.index].add(event))
    out = []
    for choice, c in zip(choices, collected):
        c.raise_error()
        choice.num_output_tokens = c.n
        lp = None
        if req.logprobs is not None:
            event = TokenEvent(choice.seq.request_id, c.tokens, "", logprobs=c.logprobs, top_logprobs=c.top,
                               prompt_logprobs=c.prompt_logprobs, prompt_top_logprobs=c.prompt_top)
            lp = logprobs_block(event, 0 if c.prompt_logprobs is not None else len(choice.prefix),
                                choice.seq.prompt_ids)
        out.append({"index": choice.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish,
                    **_returned_ids(req, choice, c.tokens)})
    return web.json_response({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                              "choices": out, "usage": _usage(prompt_tokens, choices)})


def _usage(prompt_tokens: int, choices: list[_Choice]) -> dict:
    """Each prompt's tokens counted once however many samples it has, as OpenAI does."""
    return usage(prompt_tokens, sum(choice.num_output_tokens for choice in choices))


# ---- /v1/chat/completions --------------------------------------------------------------------------

def _chat_messages(req: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "tool", "developer"):
            raise ApiError(400, f"messages[{i}].role {m.role!r} is not one of system, user, assistant, tool",
                           param=f"messages[{i}].role", code="invalid_value")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content", code="invalid_value")
                texts.append(part["text"])
            content = "".join(texts)
        message = {"role": m.role, "content": content or ""}
        if m.tool_calls is not None:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _chat_prompt_ids(tok, req: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool = False,
                     tools: list[dict] | None = None) -> list[int]:
    """The conversation (and the tools, for templates that show them) rendered through the model's chat
    template, as token ids."""
    try:
        text = tok.apply_chat_template(_chat_messages(req), add_generation_prompt=req.add_generation_prompt,
                                       tools=tools)
    except ApiError:
        raise
    except Exception as e:      # template errors (raise_exception in the template, no template, ...)
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages", code="invalid_value") from None
    return tok.encode(text, add_special_tokens=add_special_tokens)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = _server(request)
    req = decode_body(await request.read(), ChatCompletionRequest)
    refuse_unsupported(req)
    tools = tool_plan(req)
    if tools is not None and req.logprobs:
        raise ApiError(400, "logprobs are not supported with tool calls", param="logprobs", code="invalid_value")
    adapter = _adapter_for(server, req.model)
    tok = server.engine.tokenizer
    prompt_ids = truncated_prompt(_chat_prompt_ids(tok, req, req.add_special_tokens, template_tools(req)), req,
                                  server.engine.max_model_len)
    returned_prompt = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs", code="invalid_value")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(server, prompt_ids, requested, None, param)
    params = sampling_params(req, max_tokens, logprobs, structured=await _structured_outputs(server, req, tools))
    choices = [_Choice(sample, _new_sequence(server, prompt_ids, _sample_params(params, sample), adapter))
               for sample in range(_num_samples(req))]
    _submit(server, choices)
    rid, created = f"chatcmpl-{choices[0].seq.request_id}", now()

    def logprobs_content(token_ids: list[int], lps: list[float], tops: list) -> list[dict]:
        def entry(t: int, lp: float) -> dict:
            s = _token_text(tok, t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                for t, lp, top in zip(token_ids, lps, tops)]

    if req.stream:
        resp = await _start_sse(request)

        def chunk(choice: _Choice, delta: dict, finish: str | None, lp=None, token_ids=()) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": [{"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                                 **_returned_ids(req, choice, list(token_ids), with_prompt=False)}]}

        for choice in choices:
            await _send(resp, {**chunk(choice, {"role": "assistant", "content": ""}, None), **returned_prompt})

        async def on_event(choice: _Choice, event: TokenEvent):
            if event.error:
                await _send(resp, ApiError(500, event.error, code="internal_error").body())
            finish = event.finish_reason
            if tools is None:
                lp = ({"content": logprobs_content(event.token_ids, event.logprobs, event.top_logprobs)}
                      if req.logprobs and event.token_ids else None)
                if event.text or lp or (req.return_token_ids and event.token_ids):
                    await _send(resp, chunk(choice, {"content": event.text}, None, lp, event.token_ids))
            elif tools.function is not None and event.text:
                # a named function: its arguments stream as they come, the first delta naming the call
                call = {"index": 0, "function": {"arguments": event.text}}
                if choice.tool_call_id is None:
                    choice.tool_call_id = new_call_id()
                    call = {"index": 0, **tool_call(tools.function, event.text, choice.tool_call_id)}
                await _send(resp, chunk(choice, {"tool_calls": [call]}, None, token_ids=event.token_ids))
            elif tools.function is None:
                # "required": the array of calls is parsed once whole
                choice.tool_text += event.text
                if event.finished:
                    calls = tools.calls(choice.tool_text)
                    if calls is None:
                        delta = {"content": choice.tool_text}
                    else:
                        delta, finish = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, "tool_calls"
                    await _send(resp, chunk(choice, delta, None))
            if event.finished:
                choice.num_output_tokens = event.num_output_tokens
                await _send(resp, chunk(choice, {}, finish))

        await _relay_all(server, choices, req.model, on_event)
        if req.stream_options and req.stream_options.include_usage:
            await _send(resp, {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                               "choices": [], "usage": _usage(len(prompt_ids), choices)})
        await _send(resp, "[DONE]")
        return resp

    collected = [_Collected() for _ in choices]
    await _relay_all(server, choices, req.model, lambda choice, event: collected[choice.index].add(event))
    out = []
    for choice, c in zip(choices, collected):
        c.raise_error()
        choice.num_output_tokens = c.n
        lp = {"content": logprobs_content(c.tokens, c.logprobs, c.top)} if req.logprobs else None
        message, finish = {"role": "assistant", "content": c.text}, c.finish
        calls = tools.calls(c.text) if tools is not None else None
        if calls is not None:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = finish if tools.function is not None else "tool_calls"
        out.append({"index": choice.index, "message": message, "logprobs": lp, "finish_reason": finish,
                    **_returned_ids(req, choice, c.tokens, with_prompt=False)})
    return web.json_response({"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                              "choices": out, "usage": _usage(len(prompt_ids), choices), **returned_prompt})


# ---- models, adapters, health, metrics -------------------------------------------------------------

async def models(request: web.Request) -> web.Response:
    server = _server(request)
    engine = server.engine
    base = engine.model_name
    data = [{"id": base, "object": "model", "created": server.started, "owned_by": "asyncserve", "root": base,
             "parent": None, "max_model_len": engine.max_model_len}]
    for name, adapter in engine.pager.host.items():
        data.append({"id": name, "object": "model", "created": server.started, "owned_by": "asyncserve",
                     "root": adapter.path, "parent": base, "max_model_len": engine.max_model_len})
    return web.json_response({"object": "list", "data": data})


def _inside_root(server, path: str) -> str:
    root = server.config.adapter_root
    if root is None:
        raise ApiError(403, "runtime adapter loading is disabled; start the server with --adapter-root DIR",
                       param="lora_path", code="forbidden")
    root_real = Path(root).resolve()
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root_real / candidate
    real = candidate.resolve()          # follows symlinks and '..': what would actually be read
    if not real.is_relative_to(root_real):
        raise ApiError(400, f"lora_path must be inside the adapter root {root_real}", param="lora_path",
                       code="invalid_value")
    if not real.is_dir():
        raise ApiError(404, f"no adapter folder at {path!r}", param="lora_path", code="not_found")
    return str(real)


async def load_lora_adapter(request: web.Request) -> web.Response:
    server = _server(request)
    req = decode_body(await request.read(), LoadLoraRequest)
    if not req.lora_name or req.lora_name == server.engine.model_name:
        raise ApiError(400, "lora_name must be a new, non-empty name", param="lora_name", code="invalid_value")
    if req.lora_name in server.engine.pager.host:
        raise ApiError(400, f"adapter {req.lora_name!r} is already loaded", param="lora_name", code="invalid_value")
    path = _inside_root(server, req.lora_path)
    reply = asyncio.get_running_loop().create_future()
    server.pager.mailbox.put_nowait(LoadAdapter(req.lora_name, path, reply))
    try:
        await reply
    except ValueError as e:       # AdapterError and friends: the adapter does not fit this model
        raise ApiError(400, str(e), param="lora_path", code="invalid_value") from None
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    server = _server(request)
    req = decode_body(await request.read(), UnloadLoraRequest)
    reply = asyncio.get_running_loop().create_future()
    server.pager.mailbox.put_nowait(UnloadAdapter(req.lora_name, reply))
    try:
        await reply
    except KeyError:
        raise ApiError(404, f"adapter {req.lora_name!r} is not loaded", param="lora_name",
                       code="model_not_found") from None
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens"}."""
    server = _server(request)
    req = decode_body(await request.read(), TokenizeRequest)
    if req.model is not None:
        _adapter_for(server, req.model)
    tok = server.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "send either prompt or messages", param="prompt", code="invalid_value")
    if req.prompt is not None:
        tokens = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        tokens = _chat_prompt_ids(tok, req, add_special_tokens=bool(req.add_special_tokens))
    return web.json_response({"count": len(tokens), "max_model_len": server.engine.max_model_len, "tokens": tokens})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {"tokens"} -> {"prompt"}."""
    server = _server(request)
    req = decode_body(await request.read(), DetokenizeRequest)
    if req.model is not None:
        _adapter_for(server, req.model)
    vocab = server.engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is out of range [0, {vocab})", param="tokens", code="invalid_value")
    return web.json_response({"prompt": server.engine.tokenizer.decode(req.tokens)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def health(request: web.Request) -> web.Response:
    server = request.app[SERVER_KEY]
    if server.failed:
        return web.json_response({"status": "failed", "error": server.failed}, status=503)
    if not server.ready:
        return web.json_response({"status": "loading"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    server = request.app[SERVER_KEY]
    if server.ready:
        server.metrics.observe_engine(server.engine)
    return web.Response(body=server.metrics.render(), content_type="text/plain", charset="utf-8")


def build_app(server, api_key: str | None, max_body_bytes: int) -> web.Application:
    app = web.Application(middlewares=[errors_middleware, auth_middleware(api_key)], client_max_size=max_body_bytes)
    app[SERVER_KEY] = server
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
