"""/v1/responses (OpenAI's Responses API) through the openai client, against the offline engine.

The server runs the tiny model under a Qwen3.5-style template (conftest's reading_server): its
answers must be the offline engine's text for the same conversation, read into reasoning, message
and function_call items; streamed, the typed events must build the same items and end with the
same response. Each class of input the route cannot serve is a 400 in OpenAI's shape."""
from __future__ import annotations

import json

from chat_templates import CALL_REGEX, TOOLS
from asyncserve import SamplingParams, StructuredOutputs
from asyncserve.ingress.chat_output import Hermes, OutputReader

FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]     # the Responses API's shape


def items_of(response) -> list[tuple]:
    """(type, text or (name, arguments), status) of each output item, ids left out."""
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content), item.status))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content), item.status))
        else:
            out.append(("function_call", (item.name, item.arguments), item.status))
    return out


def expected_items(reading, status: str) -> list[tuple]:
    out = [("reasoning", reading.reasoning, "completed" if reading.content or reading.calls else status)] \
        if reading.reasoning else []
    if reading.content:
        out.append(("message", reading.content, "completed" if reading.calls else status))
    out += [("function_call", call, "completed") for call in reading.calls]
    if out:
        out[-1] = out[-1][:2] + (status,)
    return out


def streamed(client, **kw):
    """The events' types, the items the deltas build, and the final response."""
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    built: dict[int, list] = {}
    for e in events:
        if e.type == "response.output_item.added":
            built[e.output_index] = [e.item.type, ""]
        elif e.type.endswith(".delta"):
            built[e.output_index][1] += e.delta
        elif e.type == "response.output_item.done":
            item = e.item
            text = item.arguments if item.type == "function_call" else "".join(c.text for c in item.content)
            assert built[e.output_index] == [item.type, text]
    return [e.type for e in events], events[-1].response


def test_text_and_reasoning_equal_the_offline_text_read(reading_client, reference):
    messages = [{"role": "user", "content": "think about foxes"}]
    for max_tokens, kwargs in ((16, None), (16, {"enable_thinking": False})):
        out = reference.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             chat_template_kwargs=kwargs)[0]
        reading = OutputReader(None, "qwen3", kwargs is None or None).read(out.text)
        status = "incomplete" if out.finish_reason == "length" else "completed"
        kw = dict(model="qwen-like", input="think about foxes", max_output_tokens=max_tokens, temperature=0,
                  extra_body={"chat_template_kwargs": kwargs} if kwargs else None)
        r = reading_client.responses.create(**kw)
        assert r.object == "response" and r.id.startswith("resp_") and r.status == status
        assert items_of(r) == expected_items(reading, status)
        assert (r.usage.input_tokens, r.usage.output_tokens) == (len(out.prompt_token_ids), len(out.token_ids))
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        thinking_tokens = len(out.token_ids) if kwargs is None and not reading.content else 0
        assert r.usage.output_tokens_details.reasoning_tokens == thinking_tokens
        if status == "incomplete":
            assert r.incomplete_details.reason == "max_output_tokens"
        types, final = streamed(reading_client, **kw)
        assert types[-1] == f"response.{status}" and items_of(final) == items_of(r)
        assert final.usage.output_tokens == r.usage.output_tokens


def test_function_calls_and_their_round_trip(reading_client, reference):
    messages = [{"role": "user", "content": "weather in the north?"}]
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=StructuredOutputs(regex=CALL_REGEX))
    text = reference.chat(messages, params, tools=TOOLS)[0].text
    reading = OutputReader(Hermes()).read(text)
    assert reading.calls and reading.content == "Checking."
    kw = dict(model="qwen-like", input=messages[0]["content"], tools=FUNCTIONS, max_output_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"regex": CALL_REGEX}})
    r = reading_client.responses.create(**kw)
    assert r.status == "completed" and items_of(r) == expected_items(reading, "completed")
    calls = [item for item in r.output if item.type == "function_call"]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    types, final = streamed(reading_client, **kw)
    assert items_of(final) == items_of(r) and "response.function_call_arguments.done" in types
    # the calls and their outputs sent back as items are the conversation the chat route renders
    history = [{"role": "user", "content": messages[0]["content"]},
               {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                             "text": "North means Oslo."}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}]
    history += [{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                for c in calls]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": "-3 C"} for c in calls]
    chat_history = [messages[0], {"role": "assistant", "content": "Checking.", "reasoning": "North means Oslo.",
                                  "tool_calls": [{"id": c.call_id, "type": "function", "function": {
                                      "name": c.name, "arguments": c.arguments}} for c in calls]}]
    chat_history += [{"role": "tool", "tool_call_id": c.call_id, "content": "-3 C"} for c in calls]
    out = reference.chat(chat_history, SamplingParams(max_tokens=8, temperature=0.0), tools=TOOLS)[0]
    r = reading_client.responses.create(model="qwen-like", input=history, tools=FUNCTIONS, max_output_tokens=8,
                                        temperature=0, instructions=None)
    assert r.usage.input_tokens == len(out.prompt_token_ids)
    assert items_of(r) == expected_items(OutputReader(Hermes(), "qwen3", True).read(out.text),
                                         "incomplete" if out.finish_reason == "length" else "completed")


def test_named_function_and_text_format_hold_the_output(reading_client, reference):
    messages = [{"role": "user", "content": "the fox"}]
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                                               "days": {"enum": [1, 2, 3]}},
              "required": ["city", "days"], "additionalProperties": False}
    pick = {"type": "function", "name": "pick", "parameters": schema}
    held = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputs(json=schema))
    out = reference.chat(messages, held, tools=[{"type": "function", "function": {"name": "pick", "parameters": schema}}])[0]
    assert out.finish_reason == "stop" and json.loads(out.text)["city"]
    kw = dict(model="qwen-like", input="the fox", tools=[pick], max_output_tokens=60, temperature=0,
              tool_choice={"type": "function", "name": "pick"})
    r = reading_client.responses.create(**kw)
    assert items_of(r) == [("function_call", ("pick", out.text), "completed")]
    types, final = streamed(reading_client, **kw)
    assert items_of(final) == items_of(r) and types.count("response.function_call_arguments.delta") > 1
    # text.format: the message is held to the schema (no thinking: the constraint starts at once)
    out = reference.chat(messages, held)[0]
    r = reading_client.responses.create(model="qwen-like", input="the fox", max_output_tokens=60, temperature=0,
                                        text={"format": {"type": "json_schema", "name": "w", "schema": schema}})
    assert items_of(r) == [("message", out.text, "completed")] and r.output_text == out.text


def test_what_the_route_cannot_serve_is_a_400(reading_server):
    base = {"model": "qwen-like", "input": "hi", "max_output_tokens": 2}
    bad = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": 3, "output": "x"}]}, "input[0].call_id"),
        ({"input": 3}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": FUNCTIONS, "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema"}}}, "response_format"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"text": {"format": {"type": "xml"}}}, "response_format"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"instructions": "be brief", "input": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]},
         "input[1].role"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}, "input[0].output"),
        ({"model": "nope"}, "model"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ]
    for fields, param in bad:
        status, body, _ = reading_server.request("POST", "/v1/responses", {**base, **fields})
        assert status in (400, 404) and body["error"]["param"] == param, (fields, body)
    status, body, _ = reading_server.request("POST", "/v1/responses", base)
    assert status == 200 and body["status"] in ("completed", "incomplete")
