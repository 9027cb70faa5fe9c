"""Tool calls in chat completions (OpenAI's ``tools`` and ``tool_choice``), by structured outputs.

- A named function: the output is held to that function's parameter schema and is its call's
  ``arguments``.
- ``"required"``: the output is held to a JSON array of ``{"name", "parameters"}`` objects, each
  matching one tool's schema (a single item when ``parallel_tool_calls`` is false), parsed into calls.
- ``"none"``: the tools are only shown to the chat template.
- ``"auto"`` (OpenAI's default when tools are given): the output is free, and the calls the model
  writes in its own format are read back from it (chat_output.py). The server must be started with
  --enable-auto-tool-choice and know the format (--tool-call-parser, or the chat template shows it),
  else it is a 400, as in vLLM.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from asyncserve.ingress.chat_output import ChatFormats, ToolFormat, new_id
from asyncserve.ingress.protocol import ApiError, ChatCompletionRequest
from asyncserve.sampling_params import StructuredOutputs


@dataclass
class ToolPlan:
    constraint: StructuredOutputs | None    # None for "auto"
    function: str | None = None             # the named function; None for "required" and "auto"
    format: ToolFormat | None = None        # "auto": how the model writes its calls

    def calls(self, text: str) -> list[dict] | None:
        """OpenAI tool_calls for a finished output; None if it is not whole (cut by max_tokens or a stop)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.function is not None:
            found = [(self.function, text)]
        else:
            found = [(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]
        return [tool_call(name, arguments) for name, arguments in found]


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_id("call"), "type": "function", "function": {"name": name, "arguments": arguments}}


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates take them (transformers' ``tools=``)."""
    if not req.tools:
        return None
    return [{"type": t.type, "function": {k: v for k, v in (("name", t.function.name),
                                                            ("description", t.function.description),
                                                            ("parameters", t.function.parameters)) if v is not None}}
            for t in req.tools]


def tool_plan(req: ChatCompletionRequest, formats: ChatFormats) -> ToolPlan | None:
    """What the request's tools and tool_choice ask of the output; None when nothing."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None
    schemas = {}
    for i, tool in enumerate(req.tools):
        if tool.type != "function":
            raise ApiError(400, f"tools[{i}].type must be 'function', got {tool.type!r}", param=f"tools[{i}].type",
                           code="invalid_value")
        name = tool.function.name
        if not name or name in schemas:
            raise ApiError(400, f"tools[{i}].function.name must be non-empty and unique, got {name!r}",
                           param=f"tools[{i}].function.name", code="invalid_value")
        schemas[name] = tool.function.parameters or {"type": "object", "properties": {}}
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if not formats.auto_tool_choice or formats.tools is None:
            why = "the server started with --enable-auto-tool-choice" if not formats.auto_tool_choice else \
                "a --tool-call-parser: this model's chat template shows no tool-call format the server knows"
            raise ApiError(400, f"tool_choice 'auto' (the default with tools) needs {why}; send tool_choice "
                           "'required', a named function ({'type': 'function', 'function': {'name': ...}}) or 'none'",
                           param="tool_choice", code="invalid_value")
        return ToolPlan(None, format=formats.tools)
    if choice == "required":
        items = [{"type": "object", "required": ["name", "parameters"],
                  "properties": {"name": {"const": name}, "parameters": schema}} for name, schema in schemas.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(StructuredOutputs(json=schema), None)
    if isinstance(choice, str) or choice.type != "function":
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       "{'name': ...}}", param="tool_choice", code="invalid_value")
    if choice.function.name not in schemas:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                       param="tool_choice", code="invalid_value")
    return ToolPlan(StructuredOutputs(json=schemas[choice.function.name]), choice.function.name)
