"""Structured outputs on a model that thinks first (vLLM's structured outputs with a reasoning parser):
the constraint holds from the end of the thinking. A tiny random Qwen3 whose vocabulary has <think> and
</think> as tokens, under a Qwen3.5-style template (thinking opened in the prompt, closed by
enable_thinking: false): the gate's walk token by token, the engine's tokens against unconstrained and
constrained runs, and the chat route's reasoning and content over HTTP."""
import json

import pytest
import torch

from asyncserve import LLM, SamplingParams
from asyncserve.sampling_params import StructuredOutputs, ThinkingMarks
from asyncserve.structured import ThinkingGate
from reference import TEST_DEVICE, make_tiny_tokenizer, save_tiny_model

SCHEMA = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """(model folder, its LLM, <think> id, </think> id)."""
    import chat_templates

    tok = make_tiny_tokenizer()
    tok.add_tokens(["<think>", "</think>"])           # as Qwen3's: added, not special (they show in text)
    folder = tmp_path_factory.mktemp("thinker") / "model"
    save_tiny_model(folder, tok, "qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    (folder / "chat_template.jinja").write_text(chat_templates.HERMES)
    llm = LLM(model=str(folder), dtype="float32", device=TEST_DEVICE)
    begin, end = (llm.tokenizer.backend.token_to_id(t) for t in ("<think>", "</think>"))
    assert begin is not None and end is not None
    return folder, llm, begin, end


def test_the_gate_frees_the_thinking_and_holds_what_follows(thinker):
    """While thinking every token is allowed (a zero bias); </think> starts the constraint's walk at its
    first state; a prompt that has not opened the thinking allows <think> or the constraint's first
    tokens, and any of the latter starts the walk at once. Drafts (accepted, after) read the same states."""
    _, llm, begin, end = thinker
    compiler, vocab = llm.engine.guides, llm.engine.vocab_size
    spec = StructuredOutputs(choice=CHOICES)
    plain = compiler.guide(spec)
    first_bias = plain.bias(vocab).clone()
    yes = llm.tokenizer.encode("yes", add_special_tokens=False)
    free = [t for t in range(vocab) if first_bias[t] == float("-inf") and t not in (begin, end)][:3]

    gate = compiler.guide(StructuredOutputs(choice=CHOICES, thinking=ThinkingMarks(end=end, begin=begin, open=True)))
    assert isinstance(gate, ThinkingGate) and not gate.constraining
    for token in free + [begin]:                       # thinking: anything goes, <think> included
        assert torch.equal(gate.bias(vocab), torch.zeros(vocab))
        gate.advance(token)
    assert gate.accepted(free + [end] + yes) == len(free) + 1 + len(yes)
    assert gate.accepted([end] + free) == 1             # after </think>, the constraint's tokens only
    assert torch.equal(gate.after([end]).bias(vocab), first_bias)
    gate.advance(end)
    assert gate.constraining and torch.equal(gate.bias(vocab), first_bias)
    for token in yes:
        gate.advance(token)
    assert torch.equal(gate.bias(vocab), plain.after(yes).bias(vocab))

    closed = compiler.guide(StructuredOutputs(choice=CHOICES, thinking=ThinkingMarks(end=end, begin=begin)))
    allowed = closed.bias(vocab)
    assert allowed[begin] == 0 and torch.equal(torch.cat([allowed[:begin], allowed[begin + 1:]]),
                                               torch.cat([first_bias[:begin], first_bias[begin + 1:]]))
    assert torch.equal(closed.after([begin]).bias(vocab), torch.zeros(vocab))
    assert closed.accepted([begin] + free + [end] + yes) == 2 + len(free) + len(yes)
    assert closed.accepted(yes + [begin]) == len(yes)   # answering at once: <think> is no longer allowed
    closed.advance(yes[0])
    assert closed.constraining and closed.bias(vocab)[begin] == float("-inf")


def test_the_engine_thinks_freely_then_answers_within_the_constraint(thinker):
    """Greedy, thinking opened: with no </think> the output is the unconstrained run's tokens (the
    constraint never started); with </think> pushed by a logit bias it closes at once and the answer
    is one of the choices, where the constraint alone (no gate) could never have written </think>."""
    _, llm, begin, end = thinker
    prompt = llm.tokenizer.encode("the quick brown fox <think>\n")
    marks = ThinkingMarks(end=end, begin=begin, open=True)
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert end not in free.token_ids
    gated = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                         structured_outputs=StructuredOutputs(choice=CHOICES, thinking=marks)))[0]
    assert gated.token_ids == free.token_ids
    push = {end: 30.0}
    closed = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, logit_bias=push,
                          structured_outputs=StructuredOutputs(choice=CHOICES, thinking=marks)))[0]
    assert closed.token_ids[0] == end and closed.finish_reason == "stop"
    assert llm.tokenizer.decode(closed.token_ids[1:]) in CHOICES
    held = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, logit_bias=push,
                        structured_outputs=StructuredOutputs(choice=CHOICES)))[0]
    assert end not in held.token_ids and llm.tokenizer.decode(held.token_ids) in CHOICES


def test_chat_response_format_after_the_thinking(thinker):
    """Over HTTP with the openai client: a json_schema response format on a template that opens the
    thinking: the thinking comes back as reasoning_content, unconstrained (the offline engine's
    tokens), and once </think> is written the content is JSON of the schema; with enable_thinking:
    false the constraint holds from the first token and there is no reasoning."""
    import openai

    from asyncserve.config import Config
    from server_harness import ServerThread

    folder, llm, _, end = thinker
    messages = [{"role": "user", "content": "Is the fox quick?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    srv = ServerThread(Config(model=str(folder), dtype="float32", device="cpu", served_model_name="thinker"))
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        thinking = client.chat.completions.create(model="thinker", messages=messages, max_tokens=8, temperature=0,
                                                  response_format=fmt)
        expected = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert thinking.choices[0].finish_reason == "length" and thinking.choices[0].message.content is None
        assert thinking.choices[0].message.reasoning_content == expected.text.strip()
        answered = client.chat.completions.create(model="thinker", messages=messages, max_tokens=40, temperature=0,
                                                  response_format=fmt, logit_bias={str(end): 30})
        message = answered.choices[0].message
        assert answered.choices[0].finish_reason == "stop" and not message.reasoning_content
        assert isinstance(json.loads(message.content)["ok"], bool)
        plain = client.chat.completions.create(model="thinker", messages=messages, max_tokens=40, temperature=0,
                                               response_format=fmt, logit_bias={str(end): 30},
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert isinstance(json.loads(plain.choices[0].message.content)["ok"], bool)
        assert not getattr(plain.choices[0].message, "reasoning_content", None)
    finally:
        srv.stop()
