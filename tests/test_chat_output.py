"""Chat outputs read into reasoning, content and tool calls (ingress/chat_output.py), and the chat
template's request fields (chat_template_kwargs, continue_final_message).

The reference for each tool-call format is the family's chat template: the calls an assistant turn
holds are rendered as the model was trained to write them (tests/chat_templates.py, checked against
the published templates), and reading that text must give them back. Streamed at any cut, the
pieces must join to the one-shot reading. Over HTTP, a server on a tiny model writes a call because
a regex holds it to one, and thinks because its template opens <think>: the answers are the offline
engine's text read the same way."""
from __future__ import annotations

import json
import random

import pytest

import chat_templates as templates
from chat_templates import CALL_REGEX, TOOLS
from asyncserve import SamplingParams, StructuredOutputs
from asyncserve.config import Config
from asyncserve.ingress.chat_output import (ChatFormats, Hermes, Llama3Json, Mistral, OutputReader, Pythonic,
                                            Qwen3Coder, Reading, check_format_names, detected_reasoning_format,
                                            detected_tool_format, prompt_thinking)
from asyncserve.model.tokenizer import Tokenizer
from server_harness import ServerThread

CALL_SETS = [
    [("get_weather", {"city": "Paris"})],
    [("get_weather", {"city": "Oslo", "unit": "c"}), ("search", {"q": "h\u00e9llo \"x\" </tool_call> ]", "n": 3})],
    [("search", {"deep": {"a": [1, None, True, -2.5], "b": {}}, "empty": ""}), ("search", {}),
     ("get_weather", {"city": "S\u00e3o Paulo"})],
]
FORMATS = [  # (format, template, extra template variables, content before calls is written)
    (Hermes(), templates.HERMES, {}, True),
    (Qwen3Coder(), templates.QWEN3_CODER, {}, True),
    (Llama3Json(), templates.LLAMA3_JSON, {}, False),
    (Mistral(), templates.MISTRAL_LIST, {}, False),
    (Mistral(), templates.MISTRAL_ARGS, {"with_ids": True}, True),
    (Mistral(), templates.MISTRAL_ARGS, {}, True),
    (Pythonic(), templates.PYTHONIC, {}, False),
]


def template_only(template: str) -> Tokenizer:
    """A Tokenizer that only renders chat templates (no vocabulary needed)."""
    tok = Tokenizer.__new__(Tokenizer)
    tok.chat_template, tok._template, tok.special_tokens = template, None, {"eos_token": "</s>"}
    return tok


def written_turn(template: str, calls, content: str = "", reasoning: str | None = None, **variables) -> str:
    """What the template writes for an assistant turn holding these calls (its end-of-turn cut: the
    model's end-of-sequence token ends the output before it)."""
    tok = template_only(template)
    user = {"role": "user", "content": "the weather?"}
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": [
        {"id": f"call{i:05d}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for i, (name, args) in enumerate(calls)] or None}
    before = tok.apply_chat_template([user], add_generation_prompt=True, tools=TOOLS, **variables)
    whole = tok.apply_chat_template([user, turn], add_generation_prompt=False, tools=TOOLS, **variables)
    if "<think>" in before:            # the generation prompt began thinking, the history writes it whole
        before = before[:before.rindex("<think>")]
    assert whole.startswith(before)
    text = whole[len(before):]
    for end in templates.END_OF_TURN:
        text = text.removesuffix(end)
    return text


def streamed(reader_args, text: str, rng: random.Random, max_piece: int) -> Reading:
    reader, out = OutputReader(*reader_args), Reading()
    pos = 0
    while True:
        end = min(len(text), pos + rng.randint(1, max_piece))
        new = reader.feed(text[pos:end], end == len(text))
        out.reasoning += new.reasoning
        out.content += new.content
        out.calls += new.calls
        pos = end
        if pos == len(text):
            return out


def assert_streams_as_read(reader_args, text: str) -> Reading:
    whole = OutputReader(*reader_args).read(text)
    rng = random.Random(len(text))
    for max_piece in (1, 2, 3, 7, 40):
        for _ in range(4):
            assert streamed(reader_args, text, rng, max_piece) == whole, (text, max_piece)
    return whole


def as_calls(calls):
    return [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]


@pytest.mark.parametrize("fmt,template,variables,with_content", FORMATS,
                         ids=["hermes", "qwen3_coder", "llama3_json", "mistral_list", "mistral_call_ids", "mistral_args",
                              "pythonic"])
def test_each_format_reads_back_the_calls_its_template_writes(fmt, template, variables, with_content):
    for calls in CALL_SETS:
        if isinstance(fmt, Llama3Json):
            calls = calls[:1]                  # Llama's templates write one call a turn
        text = written_turn(template, calls, **variables)
        read = assert_streams_as_read((fmt, None), text)
        assert read == Reading("", "", as_calls(calls)), text
        if with_content:
            text = written_turn(template, calls, content="Let me look that up.", **variables)
            assert assert_streams_as_read((fmt, None), text) == Reading("", "Let me look that up.", as_calls(calls))


def test_thinking_is_read_from_the_output_or_from_the_prompt():
    calls = CALL_SETS[1]
    text = written_turn(templates.HERMES, calls, content="Checking.", reasoning="The user wants\ntwo things.")
    assert text.startswith("<think>\nThe user wants")
    read = assert_streams_as_read((Hermes(), "qwen3", None), text)
    assert read == Reading("The user wants\ntwo things.", "Checking.", as_calls(calls))
    # the prompt began the thinking: the output goes on with it, up to </think>
    assert assert_streams_as_read((Hermes(), "qwen3", True), "step 1\nstep 2\n</think>\n\nIt is 4.") == \
        Reading("step 1\nstep 2", "It is 4.")
    for reasoning in ("qwen3", "deepseek_r1"):     # cut by max_tokens while thinking: all of it is reasoning
        assert assert_streams_as_read((None, reasoning, True), "  still thinking <") == Reading("still thinking <")
        # the prompt closed the thinking (enable_thinking=false): all content, a <think> in it too
        assert assert_streams_as_read((None, reasoning, False), "no <think> here") == Reading("", "no <think> here")
    assert assert_streams_as_read((None, "qwen3", None), "plain answer") == Reading("", "plain answer")
    assert assert_streams_as_read((None, "deepseek_r1", None), "R1 thinks\n</think>\nso 4") == Reading("R1 thinks", "so 4")
    assert assert_streams_as_read((None, "qwen3", None), "<think>a</think>b") == Reading("a", "b")


def test_what_does_not_read_as_calls_stays_content():
    unreadable = [
        (Hermes(), 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),    # cut by max_tokens
        (Hermes(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),  # bad JSON
        (Hermes(), '<tool_call>\n{"arguments": {}}\n</tool_call>'),                          # no name
        (Hermes(), '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),            # not an object
        (Hermes(), '<tool_call>' + "[" * 20_000 + '</tool_call>'),                          # nested past the stack
        (Llama3Json(), '{"answer": 4}'),
        (Llama3Json(), '{"name": "f", "parameters": {}} and then some words'),
        (Llama3Json(), '{"name": "f", "parameters": {"x": 1}'),
        (Mistral(), '[TOOL_CALLS]not json'),
        (Mistral(), '[TOOL_CALLS][{"name": "f"}, 3]'),
        (Mistral(), '[TOOL_CALLS]f[ARGS]{"x": 1} trailing'),
        (Qwen3Coder(), 'Sure <tool_call>\n<function=f>\n<parameter=x>\n1'),                # cut by max_tokens
        (Qwen3Coder(), '<tool_call>\n<function=f>\n<parameter=x>\n1\n</function>\n</tool_call>'),  # not closed
        (Qwen3Coder(), '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),       # hermes' JSON
        (Qwen3Coder(), '<tool_call>\n<function=>\n</function>\n</tool_call>'),              # no name
        (Pythonic(), '[f(1, 2)]'),                            # positional arguments
        (Pythonic(), '[f(x=open("/etc/passwd"))]'),           # not a literal
        (Pythonic(), '[f(**kw)]'),
        (Pythonic(), '[1, 2, 3]'),
        (Pythonic(), '[' * 20_000),
    ]
    for fmt, text in unreadable:
        assert assert_streams_as_read((fmt, None), text) == Reading("", text), text
    # calls read before an unreadable one stay calls; the rest is content
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu'
    assert assert_streams_as_read((Hermes(), None), text) == \
        Reading("", '\n<tool_call>\n{"name": "g", "argu', [("f", "{}")])
    # parallel_tool_calls: false keeps the first call only
    text = written_turn(templates.HERMES, CALL_SETS[2], content="Three.")
    assert assert_streams_as_read((Hermes(), None, None, 1), text) == Reading("", "Three.", as_calls(CALL_SETS[2][:1]))
    # plain answers, and text that only looks like the start of a marker, pass through whole
    for fmt, text in ((Hermes(), "a <tool and a <tool_cal"), (Llama3Json(), "The answer: {x}"),
                      (Mistral(), "[TOOL_CALL"), (Pythonic(), "no calls [here]"), (Pythonic(), "  ")):
        assert assert_streams_as_read((fmt, None), text) == Reading("", text)


def test_qwen3_coder_values_are_typed_by_the_tools_schemas():
    """Its values are raw text: a string parameter stays text (a zip code of digits too), others read as
    JSON or as the Python literal the template wrote (True, None)."""
    schema = {"properties": {"zip": {"type": "string"}, "days": {"type": "integer"}, "ok": {"type": "boolean"},
                             "tags": {"type": "array"}, "note": {"type": ["string", "null"]}}}
    text = written_turn(templates.QWEN3_CODER, [("f", {"zip": "75001", "days": 3, "ok": True, "tags": ["a", 1],
                                                       "note": None, "free": "x y", "n": 2.5})])
    assert "<parameter=ok>\nTrue\n</parameter>" in text and "<parameter=note>\nNone\n" in text
    read = assert_streams_as_read((Qwen3Coder(), None, None, None, {"f": schema}), text)
    assert json.loads(read.calls[0][1]) == {"zip": "75001", "days": 3, "ok": True, "tags": ["a", 1], "note": None,
                                            "free": "x y", "n": 2.5}
    unknown = json.loads(OutputReader(Qwen3Coder()).read(text).calls[0][1])
    assert unknown["zip"] == 75001 and unknown["free"] == "x y"     # with no schema, what reads as JSON is JSON


def test_formats_are_found_in_chat_templates(tiny_model):
    assert [detected_tool_format(t) for t in (templates.HERMES, templates.QWEN3_CODER, templates.LLAMA3_JSON,
                                              templates.MISTRAL_LIST, templates.MISTRAL_ARGS,
                                              templates.PYTHONIC.replace("[", "<|python_start|>["),
                                              "{{ messages }}", None)] == \
        ["hermes", "qwen3_coder", "llama3_json", "mistral", "mistral", "pythonic", None, None]
    assert detected_reasoning_format(templates.HERMES) == "qwen3"
    assert detected_reasoning_format("<｜Assistant｜><think>\n{% if x %}</think>{% endif %}") == "deepseek_r1"
    assert detected_reasoning_format(templates.LLAMA3_JSON) is None
    assert prompt_thinking("a<|im_start|>assistant\n<think>\n") is True
    assert prompt_thinking("<think>\n\n</think>\n\n") is False
    assert prompt_thinking("<think>x</think> user text") is None
    tok = template_only(templates.HERMES)
    formats = ChatFormats.of("auto", "auto", True, tok)
    assert formats.tools.name == "hermes" and formats.reasoning == "qwen3"
    formats = ChatFormats.of("pythonic", "none", False, tok)
    assert formats.tools.name == "pythonic" and formats.reasoning is None and not formats.auto_tool_choice
    for tool_parser, reasoning_parser in (("hermes2", "auto"), ("", "auto"), ("auto", "r1"), ("auto", "QWEN3")):
        with pytest.raises(ValueError):
            check_format_names(tool_parser, reasoning_parser)
    with pytest.raises(ValueError, match="tool_call_parser"):
        Config(model=str(tiny_model.root), tool_call_parser="json").validate()
    with pytest.raises(ValueError, match="reasoning_parser"):
        Config(model=str(tiny_model.root), reasoning_parser="think").validate()
    assert len(Mistral().call_id()) == 9 and Mistral().call_id().isalnum()


def test_continue_final_message_and_tool_call_arguments_in_templates():
    tok = template_only(templates.HERMES)
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, 3,"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n1, 2, 3,")
    for bad in ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}],    # nothing to continue
                []):
        with pytest.raises(ValueError):
            tok.apply_chat_template(bad, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot both"):
        tok.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    # arguments sent as JSON text reach the template as an object; text that is not an object stays text
    for arguments, written in (('{"city": "Oslo"}', '{"city": "Oslo"}'), ("not json", '"not json"'),
                               ("[1, 2]", '"[1, 2]"'), ("[" * 100_000, json.dumps("[" * 100_000))):
        turn = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
        text = tok.apply_chat_template([messages[0], turn], add_generation_prompt=False)
        assert f'"arguments": {written}}}' in text


# ---- over HTTP -------------------------------------------------------------------------------------

def joined_stream(chunks) -> tuple[str, str, list, str | None]:
    reasoning = content = ""
    calls, finish = [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
        calls += [(c.id, c.index, c.function.name, c.function.arguments) for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_auto_tool_calls_over_http_equal_the_offline_text_read(reading_server, reading_client, reference):
    messages = [{"role": "user", "content": "weather in the north?"}]
    for max_tokens in (120, 30):          # 30: cut inside the call, which stays content
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputs(regex=CALL_REGEX))
        text = reference.chat(messages, params, tools=TOOLS)[0].text
        expected = OutputReader(Hermes()).read(text)
        kw = dict(model="qwen-like", messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0,
                  extra_body={"structured_outputs": {"regex": CALL_REGEX}})
        r = reading_client.chat.completions.create(**kw)
        choice = r.choices[0]
        got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert (choice.message.content or "", got) == (expected.content, expected.calls)
        if max_tokens == 120:
            assert got and choice.finish_reason == "tool_calls" and expected.content == "Checking."
            assert len({c.id for c in choice.message.tool_calls}) == len(got)
        else:
            assert not got and choice.finish_reason == "length" and choice.message.content == text
        reasoning, content, calls, finish = joined_stream(reading_client.chat.completions.create(**kw, stream=True))
        assert (reasoning, content, [(name, args) for _, _, name, args in calls]) == ("", expected.content, expected.calls)
        assert [index for _, index, _, _ in calls] == list(range(len(calls))) and finish == choice.finish_reason
    # two calls written, parallel_tool_calls: false answers with the first
    two_calls = CALL_REGEX.replace(")?", ")")
    params = SamplingParams(max_tokens=160, temperature=0.0, structured_outputs=StructuredOutputs(regex=two_calls))
    expected = OutputReader(Hermes()).read(reference.chat(messages, params, tools=TOOLS)[0].text)
    assert len(expected.calls) == 2
    for parallel in (True, False):
        r = reading_client.chat.completions.create(
            model="qwen-like", messages=messages, tools=TOOLS, max_tokens=160, temperature=0,
            parallel_tool_calls=parallel, extra_body={"structured_outputs": {"regex": two_calls}})
        got = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert got == expected.calls[:2 if parallel else 1]


def test_reasoning_over_http_is_the_offline_text_read(reading_server, reading_client, reference):
    messages = [{"role": "user", "content": "think about foxes"}]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    text = reference.chat(messages, params)[0].text
    expected = OutputReader(None, "qwen3", True).read(text)
    assert expected.reasoning
    kw = dict(model="qwen-like", messages=messages, max_tokens=24, temperature=0)
    message = reading_client.chat.completions.create(**kw).choices[0].message
    extra = message.model_extra
    assert (extra["reasoning"], extra["reasoning_content"], message.content or "") == \
        (expected.reasoning, expected.reasoning, expected.content)
    assert joined_stream(reading_client.chat.completions.create(**kw, stream=True))[:2] == \
        (expected.reasoning, expected.content)
    # include_reasoning: false leaves it out
    message = reading_client.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0].message
    assert message.model_extra.get("reasoning") is None and (message.content or "") == expected.content
    # enable_thinking: false closes the thinking in the prompt: all of it is content, the template's kwargs' text
    closed = reference.chat(messages, params, chat_template_kwargs={"enable_thinking": False})[0].text
    assert closed != text
    body = dict(kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reading_client.chat.completions.create(**body).choices[0].message
    assert message.content == closed and message.model_extra["reasoning"] is None
    # a constrained output is all content (the constraint starts at the first token, before any thinking)
    message = reading_client.chat.completions.create(**kw, extra_body={"guided_choice": ["yes", "no"]}).choices[0].message
    assert message.content in ("yes", "no") and message.model_extra.get("reasoning") is None


def test_chat_template_fields_over_http(reading_server, reading_client, reference):
    # an earlier call's arguments, sent as JSON text, are written by the template as an object
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "reasoning": "Oslo it is.", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    status, body, _ = reading_server.request("POST", "/tokenize", {"model": "qwen-like", "messages": history})
    assert status == 200
    text = reference.tokenizer.decode(body["tokens"], skip_special_tokens=False)
    assert '<think>\nOslo it is.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    r = reading_client.chat.completions.create(model="qwen-like", messages=history, tools=TOOLS, tool_choice="none",
                                               max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    # continue_final_message: the answer goes on from the assistant's text
    messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one, two,"}]
    expected = reference.chat(messages, SamplingParams(max_tokens=6, temperature=0.0),
                            add_generation_prompt=False, continue_final_message=True)[0].text
    r = reading_client.chat.completions.create(model="qwen-like", messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                           "include_reasoning": False})
    assert r.choices[0].message.content == OutputReader(None, "qwen3", None).read(expected).content
    # bad template fields: a 400 each, and the server goes on
    bad = [{"chat_template_kwargs": {"messages": []}}, {"chat_template_kwargs": {"tools": None}},
           {"chat_template_kwargs": {"add_generation_prompt": False}}, {"chat_template_kwargs": ["enable_thinking"]},
           {"chat_template_kwargs": "x"}, {"continue_final_message": True},
           {"continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}]
    for fields in bad:
        status, body, _ = reading_server.request("POST", "/v1/chat/completions", {
            "model": "qwen-like", "messages": messages, "max_tokens": 2, **fields})
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (fields, body)
    status, _, _ = reading_server.request("POST", "/v1/chat/completions",
                                          {"model": "qwen-like", "messages": messages[:1], "max_tokens": 2})
    assert status == 200


def test_auto_tool_choice_needs_the_flag(tiny_model, qwen_like):
    """Without --enable-auto-tool-choice (vLLM's flag), or with no format known, "auto" is a 400."""
    for model, fields in ((qwen_like, {}), (tiny_model.root, {"enable_auto_tool_choice": True}),
                          (qwen_like, {"enable_auto_tool_choice": True, "tool_call_parser": "none"})):
        st = ServerThread(Config(model=str(model), dtype="float32", device="cpu", served_model_name="m", **fields))
        try:
            for choice in (None, "auto"):
                status, body, _ = st.request("POST", "/v1/chat/completions", {
                    "model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "max_tokens": 2,
                    **({"tool_choice": choice} if choice else {})})
                assert status == 400 and body["error"]["param"] == "tool_choice"
                flag = "--tool-call-parser" if fields.get("enable_auto_tool_choice") else "--enable-auto-tool-choice"
                assert flag in body["error"]["message"]
        finally:
            st.stop()
