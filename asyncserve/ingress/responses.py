"""/v1/responses: OpenAI's Responses API, stateless, over the chat path.

A request's ``instructions`` and ``input`` (a string, or message, function_call,
function_call_output and reasoning items) become chat messages; its function ``tools``,
``tool_choice``, ``text.format`` and sampling fields become the chat request's, which chat.py
checks and runs. The output is read as the chat route reads it (reasoning, content, tool calls:
chat_output.py) and answered as Responses items (``reasoning``, ``message`` with ``output_text``,
``function_call``); streamed, as Responses' typed events, from ``response.created`` to
``response.completed`` (``response.incomplete`` when max_output_tokens cut it, ``response.failed``
when the server ended it). Nothing is stored: ``previous_response_id`` and ``background`` are 400s,
and a conversation goes on by sending its items back, as stateless clients do.
"""
from __future__ import annotations

import json
from typing import Union

import msgspec
from aiohttp import web

from asyncserve.ingress.chat import ChatChoice, prepared_chat
from asyncserve.ingress.chat_output import Reading, new_id
from asyncserve.ingress.prepare import ready_server
from asyncserve.ingress.protocol import ApiError, ChatCompletionRequest, decode_body
from asyncserve.ingress.relay import Collected, Reply
from asyncserve.ingress.tools import ToolPlan
from asyncserve.messages import TokenEvent


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    input: Union[str, list[dict]]
    instructions: Union[str, None] = None
    tools: Union[list[dict], None] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool = True
    text: Union[dict, None] = None             # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: Union[dict, None] = None        # echoed; a model thinks as its chat template says
    max_output_tokens: Union[int, None] = None
    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    stream: bool = False
    user: Union[str, None] = None
    metadata: Union[dict, None] = None
    store: Union[bool, None] = None            # nothing is stored, whatever it says
    include: Union[list[str], None] = None     # nothing it names (encrypted reasoning, ...) is kept to include
    previous_response_id: Union[str, None] = None
    background: bool = False
    truncation: Union[str, None] = None
    # vLLM's sampling extensions and chat template fields, as on the chat route
    seed: Union[int, None] = None
    top_k: Union[int, None] = None
    min_p: Union[float, None] = None
    repetition_penalty: Union[float, None] = None
    presence_penalty: Union[float, None] = None
    frequency_penalty: Union[float, None] = None
    stop: Union[str, list[str], None] = None
    ignore_eos: bool = False
    chat_template_kwargs: Union[dict, None] = None
    structured_outputs: Union[dict, None] = None


TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


def refused(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise ApiError(400, "this server stores no responses: send the conversation's items in input instead of "
                       "previous_response_id", param="previous_response_id", code="invalid_value")
    if req.background:
        raise ApiError(400, "background responses are not supported (nothing is stored)", param="background",
                       code="invalid_value")
    if req.truncation not in (None, "disabled"):
        raise ApiError(400, "truncation must be 'disabled': an input longer than the context is a 400",
                       param="truncation", code="invalid_value")


def item_text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{param}: only text content (input_text, output_text) is supported", param=param,
                   code="invalid_value")


def string_field(item: dict, name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{param}.{name} must be a string", param=f"{param}.{name}", code="invalid_value")
    return value


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """The instructions and input items as chat messages: function calls join the assistant turn they
    follow, a reasoning item goes with the assistant turn after it."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    thought = None
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise ApiError(400, f"{param}.role must be one of {', '.join(ROLES)}", param=f"{param}.role",
                               code="invalid_value")
            message = {"role": item["role"], "content": item_text(item.get("content"), f"{param}.content")}
            if message["role"] == "assistant" and thought is not None:
                message["reasoning"], thought = thought, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": string_field(item, "call_id", param), "type": "function",
                    "function": {"name": string_field(item, "name", param),
                                 "arguments": string_field(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if thought is not None:
                last["reasoning"], thought = thought, None
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": string_field(item, "call_id", param),
                             "content": output if isinstance(output, str) else item_text(output, f"{param}.output")})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            thought = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ApiError(400, f"{param}: items of type {kind!r} are not supported", param=f"{param}.type",
                           code="invalid_value")
    return messages


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, str | dict | None]:
    """Function tools and tool_choice in the chat route's shapes."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise ApiError(400, f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}",
                               param=f"tools[{i}].type", code="invalid_value")
            tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                           if tool.get(k) is not None}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                           param="tool_choice", code="invalid_value")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def response_format(req: ResponsesRequest) -> dict | None:
    fmt = (req.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ApiError(400, "text.format must be an object with a type", param="text.format", code="invalid_value")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    tools, tool_choice = chat_tools(req)
    body = {"model": req.model, "messages": chat_messages(req), "stream": req.stream, "tools": tools,
            "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": response_format(req), "max_tokens": req.max_output_tokens,
            **{name: getattr(req, name) for name in ("temperature", "top_p", "user", "seed", "top_k", "min_p",
                                                     "repetition_penalty", "presence_penalty", "frequency_penalty",
                                                     "stop", "ignore_eos", "chat_template_kwargs",
                                                     "structured_outputs")}}
    try:
        return msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}", code="invalid_value") from None


async def responses(request: web.Request) -> web.StreamResponse:
    server = ready_server(request)
    req = decode_body(await request.read(), ResponsesRequest)
    refused(req)
    chat = chat_request(req)
    choices, prompt_ids, tools = await prepared_chat(server, chat)
    return await ResponsesReply(server, req, chat, choices, prompt_ids, tools).answer(request)


class ResponsesReply(Reply):
    """One response (one choice). Its output items are built as the choice's output is read, streamed
    or not: ``self.output``, the last of them ``self.open`` while it may still grow."""

    def __init__(self, server, req: ResponsesRequest, chat: ChatCompletionRequest, choices: list[ChatChoice],
                 prompt_ids: list[int], tools: ToolPlan | None):
        super().__init__(server, chat, choices, len(prompt_ids))
        self.request, self.tools = req, tools
        self.output: list[dict] = []
        self.open: dict | None = None
        self.pieces: list[str] = []       # the open item's text (or arguments) so far, joined when it closes
        self.events = 0                   # sequence_number of the next streamed event
        self.required_text = ""           # tool_choice "required": the output, read at its end
        self.reasoning_tokens = 0
        self.finish: str | None = None
        self.failed: ApiError | None = None

    def response_id(self, request_id: str) -> str:
        return f"resp_{request_id}"

    # ---- the response object ---------------------------------------------------------------------
    def response(self, status: str) -> dict:
        req, choice = self.request, self.choices[0]
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        done = status in ("completed", "incomplete")
        usage = {"input_tokens": self.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
                 "output_tokens": choice.num_output_tokens,
                 "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                 "total_tokens": self.prompt_tokens + choice.num_output_tokens} if done else None
        error = {"code": self.failed.code or "server_error", "message": self.failed.message} if self.failed else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": req.model, "output": self.output, "error": error, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
                "reasoning": req.reasoning, "store": False, "temperature": req.temperature,
                "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "top_p": req.top_p, "truncation": "disabled", "usage": usage,
                "user": req.user, "metadata": req.metadata or {}}

    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    # ---- reading the output into items ----------------------------------------------------------
    async def read_event(self, choice: ChatChoice, event: TokenEvent) -> None:
        """Turn the event's text into output items (and, streamed, events)."""
        if choice.reader is not None and choice.reader.thinking:
            self.reasoning_tokens += len(event.token_ids)
        if event.finished:
            self.finish = event.finish_reason
        tools = self.tools
        if choice.reader is not None:
            new = choice.reader.feed(event.text, event.finished)
        elif tools is not None and tools.constraint is not None and tools.function is not None:
            if event.text:                # a named function: the text is its arguments
                if self.open is None:
                    await self.open_item(self.call_item(tools.function))
                await self.grow(event.text)
            return
        elif tools is not None and tools.constraint is not None:
            self.required_text += event.text            # "required": an array of calls, read once whole
            if not event.finished:
                return
            calls = tools.calls(self.required_text)
            new = Reading(content=self.required_text) if calls is None else \
                Reading(calls=[(c["function"]["name"], c["function"]["arguments"]) for c in calls])
        else:
            new = Reading(content=event.text)
        if new.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                await self.open_item({"type": "reasoning", "id": new_id("rs"), "summary": [],
                                      "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
            await self.grow(new.reasoning)
        if new.content:
            if self.open is None or self.open["type"] != "message":
                await self.open_item({"type": "message", "id": new_id("msg"), "role": "assistant",
                                      "status": "in_progress", "content": [{"type": "output_text", "text": "",
                                                                           "annotations": [], "logprobs": []}]})
            await self.grow(new.content)
        for name, arguments in new.calls:
            await self.open_item(self.call_item(name))
            await self.grow(arguments)

    def call_item(self, name: str) -> dict:
        fmt = self.tools.format if self.tools is not None else None
        return {"type": "function_call", "id": new_id("fc"), "call_id": fmt.call_id() if fmt else new_id("call"),
                "name": name, "arguments": "", "status": "in_progress"}

    async def open_item(self, item: dict) -> None:
        await self.close_item("completed")
        self.output.append(item)
        self.open, self.pieces = item, []
        if self.req.stream:
            index = len(self.output) - 1
            await self.event("response.output_item.added", output_index=index,
                             item={**item, "content": []} if "content" in item else dict(item))
            if "content" in item:
                await self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=dict(item["content"][0]))

    async def grow(self, delta: str) -> None:
        item, index = self.open, len(self.output) - 1
        self.pieces.append(delta)
        if not self.req.stream:
            return
        if item["type"] == "function_call":
            await self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=delta)
        elif item["type"] == "message":
            await self.event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                             delta=delta, logprobs=[])
        else:
            await self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                             content_index=0, delta=delta)

    def finish_item(self, status: str) -> dict | None:
        """The open item made whole, with its status; None if none is open."""
        item = self.open
        if item is not None:
            text = "".join(self.pieces)
            if item["type"] == "function_call":
                item["arguments"] = text
            else:
                item["content"][0]["text"] = text
            item["status"] = status
            self.open, self.pieces = None, []
        return item

    async def close_item(self, status: str) -> None:
        item, index = self.finish_item(status), len(self.output) - 1
        if item is None or not self.req.stream:
            return
        if item["type"] == "function_call":
            await self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"])
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            await self.event(kind, item_id=item["id"], output_index=index, content_index=0, text=part["text"])
            await self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=part)
        await self.event("response.output_item.done", output_index=index, item=item)

    # ---- streamed -------------------------------------------------------------------------------
    async def event(self, kind: str, **fields) -> None:
        data = json.dumps({"type": kind, "sequence_number": self.events, **fields}, ensure_ascii=False)
        self.events += 1
        await self.resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

    async def stream_start(self) -> None:
        await self.event("response.created", response=self.response("in_progress"))
        await self.event("response.in_progress", response=self.response("in_progress"))

    async def stream_event(self, choice: ChatChoice, event: TokenEvent) -> None:
        await self.read_event(choice, event)

    async def stream_failure(self, choice: ChatChoice, error: ApiError) -> None:
        self.failed = error

    async def stream_end(self) -> None:
        if self.failed is not None:
            self.finish_item("incomplete")
            await self.event("response.failed", response=self.response("failed"))
            return
        status = self.status()
        await self.close_item(status)
        await self.event(f"response.{status}", response=self.response(status))

    # ---- collected ------------------------------------------------------------------------------
    async def collect_event(self, choice: ChatChoice, event: TokenEvent, collected: Collected) -> None:
        await collected.add(event)
        if not event.error:
            await self.read_event(choice, event)

    def collected_choice(self, choice: ChatChoice, collected: Collected) -> dict:
        return {}

    def collected_body(self, choices: list[dict]) -> dict:
        status = self.status()
        self.finish_item(status)
        return self.response(status)
