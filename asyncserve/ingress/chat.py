"""/v1/chat/completions: messages through the chat template, chat logprobs, tool calls, and the
output read into reasoning, content and calls (chat_output.py)."""
from __future__ import annotations

from dataclasses import replace

from aiohttp import web

from asyncserve.ingress.chat_output import OutputReader, new_id, prompt_thinking, thinking_marks
from asyncserve.ingress.prepare import (max_tokens, new_sequence, num_samples, ready_server, sample_params,
                                        served_adapter, structured_outputs)
from asyncserve.ingress.protocol import (ApiError, ChatCompletionRequest, decode_body, refuse_unsupported,
                                         sampling_params, truncated_prompt)
from asyncserve.ingress.relay import Choice, Collected, Reply
from asyncserve.ingress.tokenizing import chat_prompt
from asyncserve.ingress.tools import ToolPlan, template_tools, tool_call, tool_plan
from asyncserve.messages import TokenEvent


class ChatChoice(Choice):
    def __init__(self, index: int, seq, reader: OutputReader | None):
        super().__init__(index, seq)
        self.tool_text = ""                          # tool_choice "required": the output, parsed at its end
        self.tool_call_id: str | None = None         # a named tool_choice: the streamed call's id
        self.reader = reader                         # an output read for reasoning or "auto" tool calls
        self.calls_sent = 0                          # "auto": the calls streamed so far


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = ready_server(request)
    req = decode_body(await request.read(), ChatCompletionRequest)
    choices, prompt_ids, tools = await prepared_chat(server, req)
    return await ChatReply(server, req, choices, prompt_ids, tools).answer(request)


async def prepared_chat(server, req: ChatCompletionRequest) -> tuple[list[ChatChoice], list[int], ToolPlan | None]:
    """A chat request checked and made into its choices' sequences (not yet submitted), with its prompt's
    token ids and what its tools ask of the output."""
    refuse_unsupported(req)
    tools = tool_plan(req, server.chat_formats)
    if tools is not None and tools.constraint is not None and req.logprobs:
        raise ApiError(400, "logprobs are not supported with tool calls", param="logprobs", code="invalid_value")
    adapter = await served_adapter(server, req.model)
    prompt_text, prompt_ids = await chat_prompt(server, req, req.add_special_tokens, template_tools(req))
    prompt_ids = truncated_prompt(prompt_ids, req, server.engine.max_model_len)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs", code="invalid_value")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    structured = await structured_outputs(server, req, tools)
    # "auto": calls are read from the output, constrained or not (as in vLLM). A response format holds
    # from the end of the thinking, where the model's markers are tokens (vLLM's structured outputs
    # with a reasoning parser); else, and for a tool choice's constraint, from the first token, and the
    # output is not read for thinking
    reasoning = server.chat_formats.reasoning
    thinks = prompt_thinking(prompt_text)
    if structured is not None and reasoning is not None:
        tool_constraint = tools is not None and tools.constraint is not None
        marks = None if tool_constraint else thinking_marks(server.engine.tokenizer, reasoning, thinks)
        if marks is not None:
            structured = replace(structured, thinking=marks)
        elif thinks is not False:
            reasoning = None
    tool_format = tools.format if tools is not None else None
    if tool_format is not None and tool_format.keeps_special_tokens:
        req.skip_special_tokens = False              # its markers are special tokens
    params = sampling_params(req, max_tokens(server, prompt_ids, requested, None, param), logprobs,
                             structured=structured)
    read = reasoning is not None or tool_format is not None
    schemas = {t.function.name: t.function.parameters or {} for t in req.tools or ()}
    choices = [ChatChoice(sample, new_sequence(server, prompt_ids, sample_params(params, sample), adapter),
                          OutputReader(tool_format, reasoning, thinks, None if req.parallel_tool_calls else 1,
                                       schemas) if read else None)
               for sample in range(num_samples(req))]
    return choices, prompt_ids, tools


class ChatReply(Reply):
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, server, req: ChatCompletionRequest, choices: list[ChatChoice], prompt_ids: list[int],
                 tools: ToolPlan | None):
        super().__init__(server, req, choices, len(prompt_ids))
        self.tools = tools
        self.returned_prompt = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}

    def logprobs_content(self, token_ids: list[int], lps: list[float], tops: list) -> list[dict]:
        def entry(t: int, lp: float) -> dict:
            s = self.token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                for t, lp, top in zip(token_ids, lps, tops)]

    def chunk(self, choice: ChatChoice, delta: dict, finish: str | None, lp=None, token_ids=()) -> dict:
        return self.head(self.chunk_object, [{"index": choice.index, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish,
                                              **self.returned_ids(choice, list(token_ids), with_prompt=False)}])

    async def stream_start(self) -> None:
        for choice in self.choices:
            await self.send({**self.chunk(choice, {"role": "assistant", "content": ""}, None), **self.returned_prompt})

    def read_calls(self, choice: ChatChoice, calls: list[tuple[str, str]]) -> list[dict]:
        """"auto": calls read from the output, numbered on from those the choice sent before."""
        out = [{"index": choice.calls_sent + i, **tool_call(name, arguments, self.tools.format.call_id())}
               for i, (name, arguments) in enumerate(calls)]
        choice.calls_sent += len(calls)
        return out

    def reading_delta(self, choice: ChatChoice, event: TokenEvent) -> dict:
        new = choice.reader.feed(event.text, event.finished)
        delta = {}
        if new.reasoning and self.req.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = new.reasoning
        if new.content:
            delta["content"] = new.content
        if new.calls:
            delta["tool_calls"] = self.read_calls(choice, new.calls)
        return delta

    async def stream_event(self, choice: ChatChoice, event: TokenEvent) -> None:
        req, tools, finish = self.req, self.tools, event.finish_reason
        if tools is None or tools.constraint is None:
            lp = ({"content": self.logprobs_content(event.token_ids, event.logprobs, event.top_logprobs)}
                  if req.logprobs and event.token_ids else None)
            if choice.reader is None:
                delta = {"content": event.text} if event.text else {}
            else:
                delta = self.reading_delta(choice, event)
                if choice.calls_sent and finish == "stop":
                    finish = "tool_calls"
            if delta or lp or (req.return_token_ids and event.token_ids):
                await self.send(self.chunk(choice, delta or {"content": ""}, None, lp, event.token_ids))
        elif tools.function is not None and event.text:
            # a named function: its arguments stream as they come, the first delta naming the call
            call = {"index": 0, "function": {"arguments": event.text}}
            if choice.tool_call_id is None:
                choice.tool_call_id = new_id("call")
                call = {"index": 0, **tool_call(tools.function, event.text, choice.tool_call_id)}
            await self.send(self.chunk(choice, {"tool_calls": [call]}, None, token_ids=event.token_ids))
        elif tools.function is None:
            # "required": the array of calls is parsed once whole
            choice.tool_text += event.text
            if event.finished:
                calls = tools.calls(choice.tool_text)
                if calls is None:
                    delta = {"content": choice.tool_text}
                else:
                    delta, finish = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, "tool_calls"
                await self.send(self.chunk(choice, delta, None))
        if event.finished:
            await self.send(self.chunk(choice, {}, finish))

    def collected_choice(self, choice: ChatChoice, c: Collected) -> dict:
        lp = {"content": self.logprobs_content(c.tokens, c.logprobs, c.top)} if self.req.logprobs else None
        message, finish = {"role": "assistant", "content": c.text}, c.finish
        if choice.reader is not None:
            message, finish = self.read_message(choice, c.text, finish)
        elif self.tools is not None and self.tools.constraint is not None:
            calls = self.tools.calls(c.text)
            if calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                finish = finish if self.tools.function is not None else "tool_calls"
        return {"index": choice.index, "message": message, "logprobs": lp, "finish_reason": finish,
                **self.returned_ids(choice, c.tokens, with_prompt=False)}

    def read_message(self, choice: ChatChoice, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The message of an output read for reasoning and "auto" tool calls."""
        reading = choice.reader.read(text)
        more = bool(reading.calls or reading.reasoning)
        message = {"role": "assistant", "content": reading.content if reading.content or not more else None}
        if choice.reader.reasoning is not None and self.req.include_reasoning:
            message["reasoning"] = message["reasoning_content"] = reading.reasoning or None
        if reading.calls:
            message["tool_calls"] = self.read_calls(choice, reading.calls)
            finish = "tool_calls" if finish == "stop" else finish
        return message, finish

    def body_extra(self) -> dict:
        return self.returned_prompt
