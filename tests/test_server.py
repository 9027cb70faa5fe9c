"""The server over real HTTP with the official openai client, on the tiny random Llama."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import msgspec
import openai
import pytest
from aiohttp import web
from torch.utils._python_dispatch import TorchDispatchMode

import asyncserve
from asyncserve import LLM, SamplingParams
from asyncserve.config import Config
from asyncserve.messages import Abort, Submit
from asyncserve.sampling_params import StructuredOutputs
from server_harness import ServerThread

PROMPTS = ["the fox jumps over", "adapters serve many models", "batch token step rank lazy dog"]


@pytest.fixture(scope="module")
def adapter_root(tiny_model, tmp_path_factory):
    """Adapters for runtime loading live under this root; one symlink points outside it."""
    root = tmp_path_factory.mktemp("adapter_root")
    shutil.copytree(tiny_model.adapters["r8_attn_rs"], root / "late")
    (root / "escape").symlink_to(tiny_model.adapters["r1_qv"])
    return root


@pytest.fixture(scope="module")
def srv(tiny_model, adapter_root):
    adapters = {k: str(v) for k, v in tiny_model.adapters.items() if k != "r64_all"}
    st = ServerThread(Config(model=str(tiny_model.root), adapters=adapters, dtype="float32", device="cpu",
                             served_model_name="tiny", adapter_root=str(adapter_root), max_body_bytes=64 * 1024))
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model):
    adapters = {k: str(v) for k, v in tiny_model.adapters.items() if k != "r64_all"}
    return LLM(model=str(tiny_model.root), adapters=adapters, dtype="float32", device="cpu")


def test_models_lists_base_and_adapters_with_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert "tiny" in models and models["tiny"].parent is None
    for name in ("r1_qv", "r2_mlp", "r8_attn_rs", "r16_patterns"):
        assert models[name].parent == "tiny"


@pytest.mark.parametrize("model", ["tiny", "r1_qv", "r2_mlp", "r8_attn_rs", "r16_patterns"])
def test_completions_equal_offline_engine_streaming_and_not(client, offline, model):
    adapter = None if model == "tiny" else model
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = offline.generate(PROMPTS, params, adapters=adapter)
    for prompt, exp in zip(PROMPTS, expected):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == exp.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len(exp.prompt_token_ids)
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == exp.text
        assert chunks[-1].usage.completion_tokens == 10
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_equal_offline_engine_streaming_and_not(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox jumps"}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for model in ("tiny", "r8_attn_rs"):
        exp = offline.chat(messages, params, adapters=None if model == "tiny" else model)[0]
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == exp.text
        assert r.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == exp.text


def test_sampling_extensions_seed_stop_and_logprobs(client, offline):
    kw = dict(model="r1_qv", prompt=PROMPTS[0], max_tokens=12, temperature=0.9, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b, "a seeded request must be reproducible"
    greedy = offline.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop = greedy.text[3:6]
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert greedy.text.startswith(r.choices[0].text)
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert all(abs(max(t.values()) - x) < 1e-4 for t, x in zip(lp.top_logprobs, lp.token_logprobs))  # greedy
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=2.0, seed=5, logprobs=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs                      # sampled: OpenAI lists the token itself beside the top N
    assert all(t == {s: x} for t, s, x in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert len(c.choices[0].logprobs.content) == 3
    assert all(len(e.top_logprobs) == 2 for e in c.choices[0].logprobs.content)
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                  extra_body={"min_tokens": 6, "stop_token_ids": [5], "top_k": 1})
    assert r.usage.completion_tokens == 6
    favourite = offline.tokenizer.encode(" fox")[0]
    r = client.completions.create(model="r1_qv", prompt=PROMPTS[1], max_tokens=5, temperature=0.8, seed=3,
                                  logit_bias={str(favourite): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == offline.tokenizer.decode([favourite] * 5)


def test_several_prompts_and_n_samples_in_one_request(client, offline):
    """Choices are numbered prompt by prompt, n per prompt; each equals the same sample asked alone
    (sample j of a request with seed s is seeded s + j); usage counts each prompt once."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = offline.generate(PROMPTS[:2], params, adapters="r8_attn_rs")
    kw = dict(model="r8_attn_rs", prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert r.usage.completion_tokens == 4 * 6
    texts, finishes, chunks = {}, {}, list(client.completions.create(**kw, stream=True,
                                                                     stream_options={"include_usage": True}))
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert texts == {i: c.text for i, c in enumerate(r.choices)}
    assert finishes == {i: "length" for i in range(4)}
    assert chunks[-1].usage.completion_tokens == 4 * 6 and not chunks[-1].choices

    sampled = dict(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    both = client.completions.create(**sampled, n=3, seed=77).choices
    alone = [client.completions.create(**sampled, seed=77 + j).choices[0].text for j in range(3)]
    assert [c.text for c in both] == alone
    assert len(set(alone)) > 1, "the samples of one request must not all be the same"

    messages = [{"role": "user", "content": "the fox jumps"}]
    exp = offline.chat(messages, params, adapters="r1_qv")[0]
    kw = dict(model="r1_qv", messages=messages, n=2, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    c = client.chat.completions.create(**kw)
    assert [x.message.content for x in c.choices] == [exp.text] * 2 and c.usage.completion_tokens == 12
    assert c.usage.prompt_tokens == len(exp.prompt_token_ids)
    texts, roles = {}, {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            roles[choice.index] = roles.get(choice.index) or choice.delta.role
    assert texts == {0: exp.text, 1: exp.text} and roles == {0: "assistant", 1: "assistant"}


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(srv, offline):
    """lm-eval-harness's loglikelihood request: token-id prompts, echo, logprobs=1, max_tokens=1. Each
    choice lists the prompt's tokens then the generated one; the first has no logprob, the others
    equal the offline engine's prompt_logprobs."""
    tok = offline.tokenizer
    prompts = [tok.encode(PROMPTS[0]), tok.encode(PROMPTS[2])]
    expected = offline.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                                        prompt_logprobs=1, logprobs=1), adapters="r1_qv")
    body = {"model": "r1_qv", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
            "ignore_eos": True}
    status, out, _ = srv.request("POST", "/v1/completions", body)
    assert status == 200, out
    for choice, ids, exp in zip(out["choices"], prompts, expected):
        lp = choice["logprobs"]
        assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ids + exp.token_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        scored = lp["token_logprobs"][1:len(ids)]
        assert max(abs(a - b) for a, b in zip(scored, exp.prompt_logprobs)) < 1e-5
        assert abs(lp["token_logprobs"][-1] - exp.logprobs[0]) < 1e-5
        for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert 1 <= len(top) <= 2 and top[token] == value       # the best token, and the token itself
        assert lp["text_offset"][0] == 0 and choice["text"] == tok.decode(ids) + exp.text
    chunks = srv.stream("/v1/completions", {**body, "stream": True})
    firsts = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            firsts.setdefault(choice["index"], choice["logprobs"])
    assert firsts == {0: out["choices"][0]["logprobs"], 1: out["choices"][1]["logprobs"]}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "required": ["q"],
                                     "properties": {"q": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}}}
STATUS_SCHEMA = {"type": "object", "required": ["ok", "level"],
                 "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}}}
STRUCTURED_FIELDS = [   # (request fields, the same constraint for the offline engine)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "status", "schema": STATUS_SCHEMA}}},
     StructuredOutputs(json=STATUS_SCHEMA)),
    ({"response_format": {"type": "json_object", "schema": STATUS_SCHEMA}}, StructuredOutputs(json=STATUS_SCHEMA)),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"guided_json": json.dumps(STATUS_SCHEMA)}, StructuredOutputs(json=STATUS_SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]{2,5}-[0-9]{2}"}}, StructuredOutputs(regex="[a-z]{2,5}-[0-9]{2}")),
    ({"guided_regex": "(yes|no)!"}, StructuredOutputs(regex="(yes|no)!")),
    ({"guided_choice": ["lazy dog", "quick fox"]}, StructuredOutputs(choice=["lazy dog", "quick fox"])),
]


def test_structured_outputs_equal_offline_engine_streaming_and_not(client, offline):
    """OpenAI's response_format (json_schema; json_object, plain or with LoRAX's schema), vLLM's
    structured_outputs and guided_* fields: the offline engine's constrained text, chat and completions."""
    messages = [{"role": "user", "content": "the fox jumps"}]
    for model in ("tiny", "r8_attn_rs"):
        adapter = None if model == "tiny" else model
        for fields, spec in STRUCTURED_FIELDS:
            params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec)
            exp = offline.chat(messages, params, adapters=adapter)[0]
            kw = dict(model=model, messages=messages, max_tokens=40, temperature=0)
            if "response_format" in fields:
                kw["response_format"] = fields["response_format"]
            else:
                kw["extra_body"] = fields
            r = client.chat.completions.create(**kw)
            assert r.choices[0].message.content == exp.text, fields
            assert r.choices[0].finish_reason == exp.finish_reason
            if spec.json is not None and exp.finish_reason == "stop":
                assert json.loads(exp.text)["level"] in ("low", "mid", "high")
            stream = client.chat.completions.create(**kw, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == exp.text
            exp = offline.generate([PROMPTS[1]], params, adapters=adapter)[0]
            r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=40, temperature=0, n=2,
                                          extra_body=fields)
            assert [c.text for c in r.choices] == [exp.text] * 2
    assert any(c.finish_reason == "stop" for c in r.choices)


def _tool_plan(body: dict):
    from asyncserve.ingress.protocol import ChatCompletionRequest
    from asyncserve.ingress.chat_output import ChatFormats
    from asyncserve.ingress.tools import tool_plan

    return tool_plan(msgspec.convert(body, ChatCompletionRequest), ChatFormats(None, None, False))


def test_tool_calls_for_a_named_function_and_required_equal_offline_engine(client, offline):
    """A named tool_choice gives one call whose arguments are the offline engine's text under the
    function's schema (streamed as argument deltas after a first one naming the call); "required"
    gives calls parsed from an array of {name, parameters}; "none" leaves a plain answer."""
    messages = [{"role": "user", "content": "the fox jumps"}]
    kw = dict(messages=messages, max_tokens=60, temperature=0, tools=[WEATHER, SEARCH])
    named = {"type": "function", "function": {"name": "get_weather"}}
    for model in ("tiny", "r8_attn_rs"):
        adapter = None if model == "tiny" else model
        params = SamplingParams(max_tokens=60, temperature=0.0,
                                structured_outputs=StructuredOutputs(json=WEATHER["function"]["parameters"]))
        exp = offline.chat(messages, params, adapters=adapter)[0]
        assert exp.finish_reason == "stop" and json.loads(exp.text)["city"] in ("Paris", "Oslo")
        r = client.chat.completions.create(model=model, tool_choice=named, **kw)
        message, = [c.message for c in r.choices]
        assert message.content is None and r.choices[0].finish_reason == "stop"
        call, = message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather" and call.function.arguments == exp.text
        deltas = [d for c in client.chat.completions.create(model=model, tool_choice=named, stream=True, **kw)
                  if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
        assert all(d.id is None and d.index == 0 for d in deltas[1:])
        assert "".join(d.function.arguments for d in deltas) == exp.text

        body = {"model": model, "tool_choice": "required", "parallel_tool_calls": False, **kw}
        params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=_tool_plan(body).constraint)
        exp = offline.chat(messages, params, adapters=adapter)[0]
        expected = [(item["name"], item["parameters"]) for item in json.loads(exp.text)]
        r = client.chat.completions.create(model=model, tool_choice="required", parallel_tool_calls=False, **kw)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == expected
        chunks = [c for c in client.chat.completions.create(model=model, tool_choice="required", stream=True,
                                                            parallel_tool_calls=False, **kw) if c.choices]
        streamed = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert [(d.function.name, json.loads(d.function.arguments)) for d in streamed] == expected
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert {name for name, _ in expected} <= {"get_weather", "search"}

    plain = offline.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))[0]
    r = client.chat.completions.create(model="tiny", tool_choice="none", **{**kw, "max_tokens": 8})
    assert r.choices[0].message.content == plain.text and not r.choices[0].message.tool_calls
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    r = client.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0)
    assert r.choices[0].message.content == offline.chat(history, SamplingParams(max_tokens=4, temperature=0.0))[0].text


def test_templates_see_the_tools_and_tool_calls(offline):
    from asyncserve.ingress.prepare import chat_text
    from asyncserve.ingress.protocol import ChatCompletionRequest
    from asyncserve.ingress.tools import template_tools
    from asyncserve.model.tokenizer import Tokenizer

    base = offline.tokenizer
    template = ("{% for t in tools %}[{{ t.function.name }}: {{ t.function.parameters | tojson }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<call {{ c.function.name }}>{% endfor %}"
                "{% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}|{% endfor %}")
    tok = Tokenizer(base.backend, special_tokens=base.special_tokens, chat_template=template)
    req = msgspec.convert({"model": "tiny", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}, ChatCompletionRequest)
    text = chat_text(tok, req, tools=template_tools(req))
    assert text == ('[get_weather: ' + json.dumps(WEATHER["function"]["parameters"]) + ']user:hi|'
                    'assistant:<call get_weather>|tool:sunny<for c1>|')


def test_add_special_tokens_reaches_the_tokenizer(srv, client, monkeypatch):
    """vLLM's add_special_tokens: True by default for a completion's text, False for chat."""
    tok = srv.server.engine.tokenizer
    flags, encode = [], tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, add_special_tokens=True: (
        flags.append(add_special_tokens), encode(text, add_special_tokens=add_special_tokens))[1])
    messages = [{"role": "user", "content": "x"}]
    client.completions.create(model="tiny", prompt="the fox", max_tokens=1)
    client.completions.create(model="tiny", prompt="the fox", max_tokens=1, extra_body={"add_special_tokens": False})
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body={"add_special_tokens": True})
    assert flags == [True, False, False, True]


def test_vllm_fields_allowed_tokens_bad_words_truncation_and_token_ids(client, offline):
    """allowed_token_ids, bad_words, truncate_prompt_tokens and return_token_ids give the offline
    engine's tokens for the same parameters and prompt."""
    tok = offline.tokenizer
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = offline.generate([PROMPTS[0]], SamplingParams(**greedy), adapters="r2_mlp")[0]
    allowed = sorted(set(free.token_ids[1:6]))          # the unconstrained run picked tokens 1..5 but not 0
    # a word the unconstrained run generates
    word = next(w for w in (tok.decode([t]).strip() for t in free.token_ids) if w.isascii() and w.isalpha())
    for fields in ({"allowed_token_ids": allowed}, {"bad_words": [word]}):
        exp = offline.generate([PROMPTS[0]], SamplingParams(**greedy, **fields), adapters="r2_mlp")[0]
        r = client.completions.create(model="r2_mlp", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, **fields})
        assert r.choices[0].text == exp.text != free.text
    assert set(exp.token_ids).isdisjoint(ids[0] for ids in (tok.encode(word, add_special_tokens=False),
                                                            tok.encode(" " + word, add_special_tokens=False))
                                         if len(ids) == 1)

    ids = tok.encode(PROMPTS[2])
    exp = offline.generate([ids[-5:]], SamplingParams(**greedy))[0]
    body = {"model": "tiny", "prompt": PROMPTS[2], "truncate_prompt_tokens": 5, "return_token_ids": True,
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = client.completions.create(**{k: v for k, v in body.items() if k in ("model", "prompt", "max_tokens",
                                                                           "temperature")},
                                  extra_body={k: body[k] for k in ("truncate_prompt_tokens", "return_token_ids",
                                                                   "ignore_eos")})
    assert r.usage.prompt_tokens == 5 and r.choices[0].text == exp.text
    assert r.choices[0].model_extra["prompt_token_ids"] == ids[-5:]
    assert r.choices[0].model_extra["token_ids"] == exp.token_ids
    chunks = [c for c in client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                                   stream=True, extra_body={k: body[k] for k in (
                                                       "truncate_prompt_tokens", "return_token_ids", "ignore_eos")})]
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == exp.token_ids
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ids[-5:]

    messages = [{"role": "user", "content": "the fox jumps"}]
    exp = offline.chat(messages, SamplingParams(max_tokens=6, temperature=0.0))[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == exp.prompt_token_ids
    assert r.choices[0].model_extra["token_ids"] == exp.token_ids
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == exp.prompt_token_ids
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == exp.token_ids


def test_tokenize_detokenize_and_version(srv, offline):
    """vLLM's utility endpoints: token ids as the engine sees them, for a prompt and for messages."""
    tok = offline.tokenizer
    status, out, _ = srv.request("POST", "/tokenize", {"model": "r1_qv", "prompt": PROMPTS[0]})
    assert status == 200 and out["tokens"] == tok.encode(PROMPTS[0]) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == offline.engine.max_model_len
    messages = [{"role": "user", "content": "the fox jumps"}]
    status, out, _ = srv.request("POST", "/tokenize", {"messages": messages})
    assert status == 200 and out["tokens"] == offline.chat(messages, SamplingParams(max_tokens=1))[0].prompt_token_ids
    status, back, _ = srv.request("POST", "/detokenize", {"model": "tiny", "tokens": tok.encode(PROMPTS[1])})
    assert status == 200 and back["prompt"] == tok.decode(tok.encode(PROMPTS[1]))
    status, out, _ = srv.request("GET", "/version")
    assert status == 200 and out["version"] == asyncserve.__version__


def test_version_without_package_metadata():
    """Run from a source checkout (PYTHONPATH, nothing installed, as on a GPU box): the package
    imports and names its version instead of failing on the missing metadata."""
    code = ("import importlib.metadata as m\n"
            "def missing(name): raise m.PackageNotFoundError(name)\n"
            "m.version = missing\n"
            "import asyncserve; print(asyncserve.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0+source"


BAD_REQUESTS = [
    # (path, raw body or dict, expected status, param that must be named, if any)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, None),                                   # no prompt
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": ["x", "y"], "n": 129}, 400, "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": -1}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": ["x", 5]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["x", ""]}, 400, "prompt"),                # one bad of two
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"7": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 600}, 400, "prompt"),        # longer than context
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),  # past context
    ("/v1/completions", {"model": "no-such-adapter", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 70_000}, 413, None),            # body over the limit
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "r1_qv", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "response_format": "json"}, 400, "response_format"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_json": {"type": "no-such-type"}}, 400, "guided_json"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_regex": "(a|b)*a(a|b){22}"}, 400,   # automaton
     "guided_regex"),                                                                            # past 1 GiB
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "guided_choice"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    *[("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **fields}, 400, param)
      for fields, param in [
          ({"tools": [WEATHER]}, "tool_choice"),                                     # "auto" needs a parser
          ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
          ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
          ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
          ({"tool_choice": "required"}, "tool_choice"),
          ({"tools": [{**WEATHER, "type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
          ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
          ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
           "response_format"),
          ({"tools": [WEATHER], "tool_choice": "required", "logprobs": True}, "logprobs"),
          ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
            "tool_choice": "required"}, "tools"),
      ]],
    ("/v1/completions", {"model": "tiny", "prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "priority": 3}, 400, "priority"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "allowed_token_ids": [10**7]}, 400, "allowed_token_ids"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "bad_words": [" "]},
     400, "bad_words"),
    ("/tokenize", {"model": "tiny"}, 400, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"model": "tiny", "tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": "1 2"}, 400, "tokens"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../../etc"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "escape"}, 400, "lora_path"),   # symlink out
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "missing"}, 404, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "r1_qv", "lora_path": "late"}, 400, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_requests_get_openai_error_shape_and_server_stays_healthy(srv, path, body, status, param):
    got, payload, _ = srv.request("POST", path, body)
    assert got == status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] and param in err["param"], err
    assert srv.request("GET", "/health")[0] == 200
    ok, out, _ = srv.request("POST", "/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 2})
    assert ok == 200 and out["usage"]["completion_tokens"] >= 1


FUZZ_VALUES = {
    "max_tokens": [1, 3, 0, -2, 10**6, "3", None], "temperature": [0, 0.7, 2.5, -1, "hot"], "top_p": [0.5, 0.0, 2],
    "top_k": [0, 1, 4, -1, -3], "n": [1, 2, 0, 500], "stream": [True, False, "yes"],
    "stream_options": [{"include_usage": True}, {}, [], None], "stop": ["e", ["o", "x"], [], [""], 5],
    "seed": [0, 7, -3, 2**70, 1.5], "logprobs": [0, 2, 21, True, None], "top_logprobs": [0, 2, 50],
    "echo": [True, False], "logit_bias": [{"5": 10}, {"3": -100}, {"x": 1}, {"5": 1000}, []],
    "min_tokens": [0, 2, 99], "ignore_eos": [True, 1], "stop_token_ids": [[1, 2], [], [-1], "1"],
    "presence_penalty": [0.5, 3], "repetition_penalty": [1.2, 0], "min_p": [0.1, 2],
    "prompt": ["", "x", ["a", "b"], [[1, 2], [3]], [1, 2, 3], ["a", [1]], [True], {}, [[]], None],
    "messages": [[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [{"role": "assistant", "content": None}],
                 [{"role": "user"}], [{"content": "x"}], [], "hi", [{"role": "user", "content": [{"type": "image"}]}]],
    "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "bogus"}, "x"],
    "guided_choice": [["yes", "no"], [], [""]], "guided_regex": ["[a-z]{1,3}", "("],
    "tools": [[WEATHER], [SEARCH, WEATHER], [{"type": "function"}], "x"],
    "allowed_token_ids": [[5, 6], [], [-1]], "bad_words": [["fox"], [""], "fox"], "truncate_prompt_tokens": [2, 0, -1],
    "return_token_ids": [True, 1], "use_beam_search": [False, True],
    "tool_choice": ["required", "none", "auto", {"type": "function", "function": {"name": "search"}}, 3],
    "model": ["tiny", "r1_qv", "nope", "", 3], "tokens": [[1, 2], [], [-5], "ab"], "add_generation_prompt": [False, "no"],
}


def test_fuzzed_requests_get_4xx_or_a_whole_answer(srv):
    """Random mixes of valid and invalid values for every field, on every generation endpoint: each
    answer is a 4xx in OpenAI's error shape or a complete 200 (a stream ends with [DONE] and holds
    no error event), and afterwards the server is healthy and holds no KV pages."""
    rng = random.Random(1234)
    paths = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
    statuses = collections.Counter()
    for _ in range(300):
        body = {"model": "tiny", "prompt": "the fox", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for field in rng.sample(sorted(FUZZ_VALUES), rng.randint(1, 4)):
            body[field] = rng.choice(FUZZ_VALUES[field])
        if rng.random() < 0.2:
            del body[rng.choice(sorted(body))]
        status, out, _ = srv.request("POST", rng.choice(paths), body)
        statuses[status] += 1
        if status == 200:
            assert not isinstance(out, str) or ("[DONE]" in out and '"error"' not in out), out[:500]
        else:
            assert 400 <= status < 500 and set(out["error"]) == {"message", "type", "param", "code"}, (status, out)
    assert statuses[200] >= 30 and sum(statuses.values()) > statuses[200] >= 30, statuses
    assert srv.request("GET", "/health")[0] == 200
    deadline = time.monotonic() + 30
    while srv.metric("asyncserve_running_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.metric("asyncserve_pool_pages", 'kind="kv"') == 0


def test_unknown_route_and_method(srv):
    status, payload, _ = srv.request("GET", "/v1/completions")
    assert status == 405 and "error" in payload
    status, payload, _ = srv.request("GET", "/nope")
    assert status == 404 and "error" in payload


def _aborted(srv) -> float:
    """Sequences the server has ended as aborted, over the models the tests stream from."""
    total = 0.0
    for model in ("tiny", "r1_qv", "r2_mlp"):
        try:
            total += srv.metric("asyncserve_requests_total", f'model="{model}",status="abort"')
        except KeyError:              # no request of that model aborted yet
            pass
    return total


def _wait_pool_empty(srv) -> None:
    """Aborted sequences free their pages after the step they were in: wait (bounded) for that."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if srv.metric("asyncserve_pool_pages", 'kind="kv"') == 0 and srv.metric("asyncserve_running_requests") == 0:
            break
        time.sleep(0.1)
    assert srv.metric("asyncserve_pool_pages", 'kind="kv"') == 0
    assert srv.metric("asyncserve_running_requests") == 0
    assert srv.metric("asyncserve_waiting_requests") == 0


async def _leave_after_three_chunks(srv, session, body: dict) -> None:
    async with session.post(srv.base + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        got = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                got += 1
                if got >= 3:
                    return            # leaving the context manager drops the connection


def test_disconnecting_stream_clients_leave_no_kv_pages(srv):
    async def one(session, i):
        body = {"model": ["tiny", "r1_qv", "r2_mlp"][i % 3], "prompt": PROMPTS[i % 3], "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        if i % 4 == 0:              # four sequences in one stream: two prompts, two samples each
            body.update(prompt=PROMPTS[:2], n=2)
        await _leave_after_three_chunks(srv, session, body)

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(one(session, i) for i in range(20)))

    aborted_before = _aborted(srv)
    asyncio.run(main())
    _wait_pool_empty(srv)
    assert _aborted(srv) - aborted_before == 15 + 5 * 4      # every sequence of every stream


def _send_and_close(srv, body: dict) -> None:
    """A streaming request on a bare socket, closed as soon as it is sent: before any token."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", srv.server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)


@pytest.mark.parametrize("when", ["before_first_token", "mid_stream", "mid_stream_write", "at_done"])
def test_a_client_leaving_its_stream_is_no_server_error(srv, monkeypatch, caplog, when):
    """A client that goes away while its stream is written (before its first token, after a few chunks,
    its connection closing as a chunk or [DONE] is written) is normal: no ERROR record, its sequences
    aborted (or finished) and their pages freed; the next request is served."""
    bodies = [{"model": ["tiny", "r1_qv", "r2_mlp"][i % 3], "prompt": PROMPTS[i % 3], "temperature": 0,
               "ignore_eos": True, "stream": True, "max_tokens": 400 if when != "at_done" else 5 + i}
              for i in range(6)]
    bodies[0].update(prompt=PROMPTS[:2], n=2)                      # four sequences in one stream
    bodies[1]["stream_options"] = {"include_usage": True}
    sequences = 3 + len(bodies)
    # the connection closes just as the server writes: the third chunk, or [DONE]
    close_on = {"mid_stream_write": lambda n, data: n == 3,
                "at_done": lambda n, data: data == b"data: [DONE]\n\n"}.get(when)
    if close_on is not None:
        real_write, written = web.StreamResponse.write, collections.Counter()

        async def write(self, data):
            written[id(self)] += 1
            if close_on(written[id(self)], data):
                self._req.transport.close()
            return await real_write(self, data)

        monkeypatch.setattr(web.StreamResponse, "write", write)

    async def read_until_closed(session, body):
        async with session.post(srv.base + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            lines = []
            with pytest.raises(aiohttp.ClientPayloadError):     # the chunked body never ends
                async for line in resp.content:
                    lines.append(line)
            assert b"data: [DONE]\n" not in lines
            assert any(b'"finish_reason": "length"' in line for line in lines) == (when == "at_done")

    async def main():
        async with aiohttp.ClientSession() as session:
            if when == "mid_stream":
                await asyncio.gather(*(_leave_after_three_chunks(srv, session, body) for body in bodies))
            else:
                await asyncio.gather(*(read_until_closed(session, body) for body in bodies))

    aborted_before = _aborted(srv)
    with caplog.at_level(logging.DEBUG):
        if when == "before_first_token":
            for body in bodies:
                _send_and_close(srv, body)
        else:
            asyncio.run(main())
        _wait_pool_empty(srv)
        monkeypatch.undo()
        chunks = srv.stream("/v1/completions", {"model": "r1_qv", "prompt": PROMPTS[0], "max_tokens": 3,
                                                "ignore_eos": True, "stream": True,
                                                "stream_options": {"include_usage": True}})
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 3
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == []
    assert _aborted(srv) - aborted_before == (0 if when == "at_done" else sequences)
    # a client that leaves mid-stream usually has its handler cancelled first (handler_cancellation);
    # a write that comes first fails on the closing transport, as in the other cases
    left = [r for r in caplog.records if "closed the connection" in r.getMessage()]
    assert left or when == "mid_stream"
    assert all(r.levelno <= logging.INFO and r.exc_info is None and "\n" not in r.getMessage() for r in left)


@pytest.mark.parametrize("max_tokens, reason", [(1, "length"), (400, "abort")])
def test_abort_while_in_the_running_step(srv, max_tokens, reason):
    """An abort that arrives while the request's step runs is applied after the step: a request that
    step finished still gets its last tokens and finish reason, any other ends with "abort"."""
    scheduler = srv.server.scheduler

    async def scenario():
        seq = srv.server.engine.make_sequence([5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                              None)
        stream: asyncio.Queue = asyncio.Queue()
        scheduler.mailbox.put_nowait(Submit(seq, stream))
        while seq.request_id not in scheduler._in_flight:
            await asyncio.sleep(0)
        scheduler.mailbox.put_nowait(Abort(seq.request_id))
        events = [await asyncio.wait_for(stream.get(), 30)]
        while not events[-1].finished:
            events.append(await asyncio.wait_for(stream.get(), 30))
        return events

    events = srv.call(scenario())
    assert events[-1].finish_reason == reason
    if reason == "length":
        assert sum(len(e.token_ids) for e in events) == 1
    assert srv.metric("asyncserve_running_requests") == 0


@pytest.mark.parametrize("where", ["run", "postprocess"])
def test_a_failing_step_fails_its_requests_and_the_server_goes_on(srv, monkeypatch, where):
    """A step that raises in the model's thread, or in its bookkeeping after finishing sequences:
    its requests answer 500 in OpenAI's shape, and the next request is served."""
    engine = srv.server.engine
    owner, name = (engine.runner, "run") if where == "run" else (engine.scheduler, "postprocess")
    real = getattr(owner, name)
    failures = []

    def failing(*args):
        if not failures:
            failures.append(real(*args))            # postprocess: sequences finish, then the step fails
            raise RuntimeError("injected")
        return real(*args)

    monkeypatch.setattr(owner, name, failing)
    status, out, _ = srv.request("POST", "/v1/completions", {"model": "tiny", "prompt": "the fox", "max_tokens": 1})
    assert status == 500 and "injected" in out["error"]["message"] and out["error"]["type"] == "server_error"
    status, out, _ = srv.request("POST", "/v1/completions", {"model": "tiny", "prompt": "the fox", "max_tokens": 2,
                                                             "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    assert srv.metric("asyncserve_pool_pages", 'kind="kv"') == 0


def test_runtime_load_and_unload_while_others_stream(srv, client, offline, tiny_model):
    results = {}

    def stream_long(i):
        chunks = client.completions.create(model="r2_mlp", prompt=PROMPTS[i % 3], max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        results[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=stream_long, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    status, text, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": "late"})
    assert status == 200, text
    assert "late" in {m.id for m in client.models.list().data}
    exp = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           adapters="r8_attn_rs")[0]
    r = client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == exp.text          # "late" is a copy of r8_attn_rs
    status, text, _ = srv.request("POST", "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 200, text
    for t in threads:
        t.join(60)
    exp_long = offline.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                adapters="r2_mlp")
    assert [results[i] for i in range(4)] == [exp_long[i % 3].text for i in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=2)


def test_unloaded_adapters_leave_no_metric_series(srv):
    """Names loaded, used and unloaded at runtime (a soak's churn, a tenant's) fold into "other": the
    scrape keeps no series of theirs and every total still counts their requests."""
    names = [f"churn{i}" for i in range(3)]
    before = _scrape(srv)
    for i, name in enumerate(names):
        status, text, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": "late"})
        assert status == 200, text
        for _ in range(i + 1):
            body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            assert srv.request("POST", "/v1/completions", body)[0] == 200
        assert any(name in key for key in _scrape(srv))
        status, text, _ = srv.request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        assert status == 200, text
    after = _scrape(srv)
    assert not [key for key in after if "churn" in key]

    def delta(prefix: str, key: str | None = None) -> float:
        keys = [key] if key else [k for k in after if k.startswith(prefix)]
        return sum(after.get(k, 0.0) - before.get(k, 0.0) for k in keys)

    assert delta("asyncserve_requests_total{") == 1 + 2 + 3
    assert delta("", 'asyncserve_requests_total{model="other",status="length"}') == 6
    assert delta("", 'asyncserve_adapter_requests_total{adapter="other"}') == 6
    assert delta("", 'asyncserve_adapter_tokens_total{adapter="other",kind="generated"}') == 12


def _scrape(srv) -> dict[str, float]:
    """Every sample of /metrics, keyed by its name and labels as written."""
    _, text, _ = srv.request("GET", "/metrics")
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def test_metrics_count_what_the_requests_did(srv, offline):
    """The documented metrics are there and count these requests: tokens generated, finished requests
    by model and finish reason, one TTFT and latency sample each; the gauges add up once idle."""
    # a stop token: the first greedy token that did not come before, so the request stops right there
    first = offline.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    k = next(i for i in range(1, len(first)) if first[i] not in first[:i])
    requests = [("tiny", {"max_tokens": 5}), ("tiny", {"max_tokens": 3}), ("r8_attn_rs", {"max_tokens": 4}),
                ("tiny", {"max_tokens": 8, "stop_token_ids": [first[k]]}),
                ("r2_mlp", {"max_tokens": 1})]
    before = _scrape(srv)
    finished, generated = collections.Counter(), 0
    for model, extra in requests:
        body = {"model": model, "prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True, **extra}
        status, payload, _ = srv.request("POST", "/v1/completions", body)
        assert status == 200, payload
        finished[(model, payload["choices"][0]["finish_reason"])] += 1
        generated += payload["usage"]["completion_tokens"]
    assert srv.request("POST", "/v1/completions", {"model": "nope", "prompt": "x"})[0] == 404
    after = _scrape(srv)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert finished[("tiny", "stop")] == 1 and generated == 5 + 3 + 4 + (k + 1) + 1
    assert delta("asyncserve_generated_tokens_total") == generated
    for (model, reason), n in finished.items():
        assert delta(f'asyncserve_requests_total{{model="{model}",status="{reason}"}}') == n, (model, reason)
    assert sum(delta(key) for key in after if key.startswith("asyncserve_requests_total{")) == len(requests)
    assert delta("asyncserve_time_to_first_token_seconds_count") == len(requests)
    assert delta("asyncserve_request_latency_seconds_count") == len(requests)
    assert delta("asyncserve_time_per_output_token_seconds_count") == len(requests) - 1     # all but the 1-token one
    assert 1 <= delta("asyncserve_step_duration_seconds_count") <= generated + len(requests)
    engine = srv.server.engine
    assert after["asyncserve_running_requests"] == 0 and after["asyncserve_waiting_requests"] == 0
    pages = {kind: after[f'asyncserve_pool_pages{{kind="{kind}"}}'] for kind in ("free", "kv", "adapter")}
    assert pages["kv"] == 0 and sum(pages.values()) == engine.pool.num_pages
    assert after['asyncserve_adapters_loaded{tier="host"}'] == len(engine.adapter_names)
    assert 1 <= after['asyncserve_adapters_loaded{tier="device"}'] <= len(engine.adapter_names)
    assert after["asyncserve_adapter_loads_total"] >= after['asyncserve_adapters_loaded{tier="device"}']
    assert "asyncserve_prefix_cache_hit_tokens_total" in after and "asyncserve_prefix_cache_pages" in after


def test_prefix_cache_hits_over_http(srv, offline):
    """A second request whose prompt starts with the first one's full blocks reuses their KV (the
    hit counter grows by whole blocks, and its usage counts them) and answers as the offline engine does."""
    long_prompt = " ".join(PROMPTS) * 3
    hits = srv.metric("asyncserve_prefix_cache_hit_tokens_total")
    body = {"model": "r16_patterns", "prompt": long_prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = srv.request("POST", "/v1/completions", body)[1]
    second = srv.request("POST", "/v1/completions", {**body, "prompt": long_prompt + " fox"})[1]
    gained = srv.metric("asyncserve_prefix_cache_hit_tokens_total") - hits
    assert gained >= 16 and gained % 16 == 0
    # each request's usage says how many of its prompt's tokens were found cached: the second, the first's
    # blocks (the first, any an earlier test left)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second)]
    assert sum(cached) == gained and cached[1] >= 16 and cached[1] % 16 == 0
    assert srv.metric("asyncserve_prefix_cache_queried_tokens_total") >= gained
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = offline.generate([long_prompt, long_prompt + " fox"], params, adapters="r16_patterns")
    assert [first["choices"][0]["text"], second["choices"][0]["text"]] == [e.text for e in expected]


def test_api_key_required_when_set(tiny_model):
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", api_key="s3cret"))
    try:
        status, payload, _ = st.request("GET", "/v1/models")
        assert status == 401 and payload["error"]["code"] == "invalid_api_key"
        status, payload, _ = st.request("GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        assert st.request("GET", "/health")[0] == 200
    finally:
        st.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_stream_and_exits_zero(tiny_model, tmp_path):
    """(`serve` measures its step profile at start, into --step-profile-dir.)"""
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncserve.cli", "serve", "--model", str(tiny_model.root),
                             "--dtype", "float32", "--device", "cpu", "--port", str(port), "--threads", "1",
                             "--step-profile-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                import urllib.request
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model=client.models.list().data[0].id, prompt="the fox", max_tokens=60,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = [c for c in stream]
        finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"], "the in-flight request should finish during the grace period"
        assert first is not None
        assert proc.wait(60) == 0
        log = proc.stdout.read().decode()
        assert "shutting down" in log and "stopped" in log
        assert "step profile measured" in log and len(list(tmp_path.glob("*.json"))) == 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_all_torch_work_runs_in_the_stepper_thread(tiny_model, adapter_root, monkeypatch):
    """Engine build, steps, adapter tensors and page copies share one thread, and the event loop runs
    no torch kernel: every thread that runs torch ops gets its own OpenMP team, and more OpenMP
    threads than cores made each server step ~1.7x slower than offline (BENCHMARKS.md); one op of
    the pager's on the loop (an index of 6,720 pointers) still cost W1 ~20% of every step."""
    import asyncserve.actors.pager as pager_actor
    import asyncserve.server as server_module
    from asyncserve.pager.pager import AdapterPager
    from asyncserve.stepper.runner import ModelRunner

    threads_seen: dict[str, set[int]] = {}

    def record(label, fn):
        def wrapped(*args, **kwargs):
            threads_seen.setdefault(label, set()).add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(server_module, "Engine", record("engine", server_module.Engine))
    monkeypatch.setattr(ModelRunner, "run", record("step", ModelRunner.run))
    monkeypatch.setattr(AdapterPager, "write_pending", record("page copy", AdapterPager.write_pending))
    def record_pieces(fn):          # a generator: each piece runs where next() is called
        def wrapped(*args):
            for piece in fn(*args):
                threads_seen.setdefault("adapter tensors", set()).add(threading.get_ident())
                yield piece
        return wrapped

    monkeypatch.setattr(pager_actor, "build_in_pieces", record_pieces(pager_actor.build_in_pieces))

    class LoopOps(TorchDispatchMode):       # dispatch modes are per thread: entered on the loop's
        def __init__(self):
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    async def enter(mode):
        mode.__enter__()

    async def leave(mode):
        mode.__exit__(None, None, None)

    loop_ops = LoopOps()
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_root=str(adapter_root)))
    try:
        st.call(enter(loop_ops))
        status, text, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": "late"})
        assert status == 200, text
        for model in ("tiny", "late"):
            for extra in ({}, {"logprobs": 2}, {"response_format": {"type": "json_object"}}):
                status, body, _ = st.request("POST", "/v1/completions", {"model": model, "prompt": PROMPTS[0],
                                                                         "max_tokens": 3, **extra})
                assert status == 200, body
        st.call(leave(loop_ops))
    finally:
        st.stop()
    # torch.from_numpy's wrap of the pager's row pointers: no kernel runs
    assert loop_ops.ops <= {"aten.lift_fresh.default"}, loop_ops.ops
    assert set(threads_seen) == {"engine", "step", "page copy", "adapter tensors"}
    torch_threads = set().union(*threads_seen.values())
    assert len(torch_threads) == 1 and st.thread.ident not in torch_threads and threading.get_ident() not in torch_threads
