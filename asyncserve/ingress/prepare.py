"""Request preparation: from a decoded request to the sequences the scheduler runs.

The served model or adapter, a chat rendered through the model's template (tokenizing.py makes token
ids of texts), max_tokens, the output constraint (compiled off the event loop) and one Sequence per
sample. Every check that fails is an ApiError in OpenAI's shape.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from aiohttp import web

from asyncserve.engine import RequestError
from asyncserve.ingress.protocol import ApiError, ChatCompletionRequest, TokenizeRequest, structured_outputs_of
from asyncserve.ingress.tools import ToolPlan
from asyncserve.sampling_params import StructuredOutputs
from asyncserve.structured import StructuredOutputError

SERVER_KEY = web.AppKey("server", object)
KEY_GIVEN = web.RequestKey("key_given", bool)      # the request carried the API key (or none is set)
MAX_N = 128                      # samples per prompt, as OpenAI allows


def ready_server(request: web.Request):
    server = request.app[SERVER_KEY]
    if not server.ready:
        raise ApiError(503, "the model is still loading", code="loading", headers={"Retry-After": "5"})
    return server


def adapter_for(server, model: str) -> str | None:
    """The adapter a request's ``model`` names; None for the base model."""
    if model == server.engine.model_name:
        return None
    if server.engine.has_adapter(model):
        return model
    raise ApiError(404, f"the model {model!r} does not exist; see GET /v1/models", param="model",
                   code="model_not_found")


async def served_adapter(server, model: str) -> str | None:
    """adapter_for a request to run; with --adapter-resolver, an adapter not loaded is fetched and loaded
    first."""
    resolver = server.adapter_resolver
    if resolver is None or model == server.engine.model_name or server.engine.has_adapter(model) \
            or not resolver.resolvable(model):
        return adapter_for(server, model)
    await resolver.resolve(server, model)
    return adapter_for(server, model)


def new_sequence(server, prompt_ids: list[int], params, adapter: str | None):
    try:
        return server.engine.make_sequence(prompt_ids, params, adapter, request_id=uuid.uuid4().hex,
                                           arrival=time.monotonic())
    except RequestError as e:
        raise ApiError(e.status, str(e), param=e.param,
                       code="model_not_found" if e.status == 404 else "context_length_exceeded"
                       if e.param in ("prompt", "max_tokens", "messages") else "invalid_value") from None


async def structured_outputs(server, req, tools: ToolPlan | None = None) -> StructuredOutputs | None:
    """The request's output constraint, with its automaton built in a worker thread (seconds for a
    large one), so that make_sequence finds it cached and the event loop never waits on it."""
    spec, param = structured_outputs_of(req)
    if tools is not None and tools.constraint is not None:
        if spec is not None:
            raise ApiError(400, f"tool calls already constrain the output; {param} cannot be added", param=param,
                           code="invalid_value")
        spec, param = tools.constraint, "tools"
    if spec is not None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, server.engine.compile_constraint, spec)
        except StructuredOutputError as e:
            raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None
    return spec


def max_tokens(server, prompt_ids: list[int], requested: int | None, default: int | None, param: str) -> int:
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


def num_samples(req) -> int:
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}, got {req.n}", param="n", code="invalid_value")
    return req.n


def sample_params(params, sample: int):
    """The ``sample``-th of n samples: a request's seed s gives its samples seeds s, s+1, ..., so each
    is reproducible on its own and they differ."""
    if sample == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + sample)


def chat_messages(req: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
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
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part.get("type"), str) else "untyped"
                    raise ApiError(400, f"messages[{i}].content[{j}] is a {kind[:40]!r} part; asyncserve "
                                   "serves text only (a multimodal model's language model, without its vision "
                                   "encoder): give text parts", param=f"messages[{i}].content[{j}]",
                                   code="invalid_value")
                texts.append(part["text"])
            content = "".join(texts)
        message = {"role": m.role, "content": content or ""}
        if m.tool_calls is not None:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        for name in ("reasoning", "reasoning_content"):      # an assistant's earlier thinking
            if getattr(m, name) is not None:
                message[name] = getattr(m, name)
        out.append(message)
    return out


# what the server itself gives the template; chat_template_kwargs may not replace them
TEMPLATE_ARGUMENTS = {"messages", "conversation", "tools", "documents", "add_generation_prompt",
                      "continue_final_message", "chat_template", "tokenize"}


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict:
    kwargs = req.chat_template_kwargs or {}
    taken = sorted(TEMPLATE_ARGUMENTS.intersection(kwargs))
    if taken:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(taken)}", param="chat_template_kwargs",
                       code="invalid_value")
    return kwargs


def chat_text(tok, req: ChatCompletionRequest | TokenizeRequest, tools: list[dict] | None = None) -> str:
    """The conversation (and the tools, for templates that show them) rendered through the model's chat
    template."""
    try:
        return tok.apply_chat_template(chat_messages(req), add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message, tools=tools,
                                       **template_kwargs(req))
    except ApiError:
        raise
    except Exception as e:      # template errors (raise_exception in the template, no template, ...)
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages", code="invalid_value") from None
