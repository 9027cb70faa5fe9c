"""Structured outputs on the tiny random Llama: constrained greedy decoding against a brute-force
reference (transformers, fp32, each token checked against the constraint by partial matching with
Python's `regex` module), sampled outputs that always satisfy their constraint, and the token
spellings outlines-core's vocabulary is built from."""
import dataclasses
import json
import random

import outlines_core
import pytest
import regex
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from asyncserve import LLM, SamplingParams
from asyncserve.model.tokenizer import Tokenizer
from asyncserve.sampling_params import StructuredOutputs
from asyncserve.structured import StructuredOutputError, constraint_regex, token_bytes
from reference import CORPUS, TEST_DEVICE, ReferenceRun, assert_greedy_matches

SCHEMA = {"type": "object", "required": ["ok", "level", "tag"],
          "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]},
                         "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}}}
CHOICES = ["lazy dog", "quick fox", "a.b+c"]       # the last is literal: '.' and '+' are escaped
PATTERN = r"[a-z]{2,5}-[0-9]{2}"
CONSTRAINTS = {                                   # name: (constraint, the same language as a Python regex)
    "schema": (StructuredOutputs(json=SCHEMA), None),
    "choice": (StructuredOutputs(choice=CHOICES), "|".join(regex.escape(c) for c in CHOICES)),
    "regex": (StructuredOutputs(regex=PATTERN), PATTERN),
}
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model.root), adapters={k: str(v) for k, v in tiny_model.adapters.items()},
               dtype="float32", device=TEST_DEVICE, max_step_tokens=24)


def python_pattern(name: str) -> str:
    """The constraint's language for Python's regex module (the schema's as outlines-core writes it;
    its syntax is the common subset of both engines)."""
    spec, pattern = CONSTRAINTS[name]
    return pattern if pattern is not None else constraint_regex(spec)


def reference_constrained(model, hf_tok, prompt_ids: list[int], pattern: str, eos: int) -> ReferenceRun:
    """Greedy decoding held to ``pattern`` by brute force: a token may follow when the text with it
    can still be completed to a match, the end-of-sequence token only when the text is one. (The
    constraints here are ASCII, so tokens that decode to anything else never fit.)"""
    special = set(hf_tok.all_special_ids)
    spelled = {t: hf_tok.decode([t]) for t in range(len(hf_tok)) if t not in special}
    ids, out, logits, text = list(prompt_ids), [], [], ""
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            step = model(torch.tensor([ids])).logits[0, -1].float()
            allowed = torch.zeros(step.shape, dtype=torch.bool)
            for t, s in spelled.items():
                allowed[t] = s.isascii() and regex.fullmatch(pattern, text + s, partial=True) is not None
            allowed[eos] = regex.fullmatch(pattern, text) is not None
            masked = step.masked_fill(~allowed, float("-inf"))
            token = int(masked.argmax())
            out.append(token)
            logits.append(masked)
            if token == eos:
                break
            ids.append(token)
            text += spelled[token]
    return ReferenceRun(out, logits)


def run_engine(engine, cases: list[tuple[list[int], str | None, SamplingParams]]):
    """All cases in one batch (and with max_step_tokens=24, in shared prefill/decode steps)."""
    seqs = [engine.make_sequence(ids, params, adapter) for ids, adapter, params in cases]
    for seq in seqs:
        engine.add(seq)
    while engine.has_unfinished():
        engine.step()
    return seqs


def check_output(name: str, text: str) -> None:
    assert regex.fullmatch(python_pattern(name), text), (name, text)
    if name == "schema":
        value = json.loads(text)
        assert set(value) == {"ok", "level", "tag"} and isinstance(value["ok"], bool)
        assert value["level"] in ("low", "mid", "high") and regex.fullmatch("[a-z]{1,4}", value["tag"])


def test_constrained_greedy_equals_brute_force_reference_in_mixed_batches(llm, tiny_model):
    """Every constraint, on the base model and on an adapter, batched with unconstrained requests.
    ignore_eos does not keep a constrained sequence going once its text is complete."""
    from peft import PeftModel

    tok, hf_tok, base = llm.tokenizer, tiny_model.tokenizer, tiny_model.base
    eos = tok.eos_token_ids[0]
    prompts = [tok.encode(p) for p in ("the fox jumps over", "adapters serve many models batch")]
    constrained = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    cases, labels = [], []
    for ids in prompts:
        for adapter in (None, "r8_attn_rs"):
            for name, (spec, _) in CONSTRAINTS.items():
                cases.append((ids, adapter, dataclasses.replace(constrained, structured_outputs=spec)))
                labels.append(name)
            cases.append((ids, adapter, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
            labels.append(None)
    seqs = run_engine(llm.engine, cases)

    refs = {}
    for adapter in (None, "r8_attn_rs"):
        model = base if adapter is None else PeftModel.from_pretrained(base, tiny_model.adapters[adapter]).eval()
        for i, ((ids, a, _), name) in enumerate(zip(cases, labels)):
            if a == adapter and name is not None:
                refs[i] = reference_constrained(model, hf_tok, ids, python_pattern(name), eos)
        if adapter is not None:
            model.unload()
    finished = 0
    for i, ref in refs.items():
        seq, name = seqs[i], labels[i]
        label = f"{name} on {cases[i][1] or 'base'}"
        if assert_greedy_matches(seq.output_ids, ref, 1e-4, label) and seq.finish_reason == "stop":
            assert seq.output_ids[-1] == eos
            check_output(name, tok.decode(seq.output_ids[:-1]))
            finished += 1
    assert finished >= len(refs) // 2, f"only {finished} of {len(refs)} constrained outputs completed"
    assert all(seqs[i].finish_reason == "length" for i, name in enumerate(labels) if name is None)


def test_sampled_outputs_always_satisfy_their_constraint(llm):
    """Random sampling with seeds, penalties and min_tokens: every completed text is in the
    constraint's language. min_tokens beyond what the constraint can hold yields to the constraint."""
    tok = llm.tokenizer
    rng = random.Random(5)
    cases, labels = [], []
    for k in range(24):
        name = list(CONSTRAINTS)[k % 3]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=rng.choice([0.7, 1.0, 1.5]), seed=k,
                                top_k=rng.choice([0, 20]), repetition_penalty=rng.choice([1.0, 1.3]),
                                min_tokens=rng.choice([0, 40]), structured_outputs=CONSTRAINTS[name][0])
        cases.append((tok.encode(rng.choice(CORPUS)[:40]), rng.choice([None, "r1_qv", "r64_all"]), params))
        labels.append(name)
    seqs = run_engine(llm.engine, cases)
    completed = [(name, seq) for name, seq in zip(labels, seqs) if seq.finish_reason == "stop"]
    assert {name for name, _ in completed} == set(CONSTRAINTS)
    for name, seq in completed:
        check_output(name, tok.decode(seq.output_ids[:-1]))
    # the choices take at most 9 tokens, far below min_tokens=40
    assert any(name == "choice" and len(seq.output_ids) < 40 and seq.params.min_tokens == 40 for name, seq in completed)


def test_constraint_errors_are_request_errors(llm):
    from asyncserve.engine import RequestError

    ids = llm.tokenizer.encode("the fox")
    for spec in (StructuredOutputs(regex="(unclosed"), StructuredOutputs(json={"type": "no-such-type"}),
                 StructuredOutputs(json="{not json")):
        with pytest.raises(RequestError) as err:
            llm.engine.make_sequence(ids, SamplingParams(structured_outputs=spec), None)
        assert err.value.param == "structured_outputs"
    for fields in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"choice": ["a", ""]}, {"regex": ""}):
        with pytest.raises(ValueError):
            StructuredOutputs(**fields)


def _spellings(tokenizer) -> dict[int, bytes]:
    return {i: spelled for spelled, ids in token_bytes(tokenizer).items() for i in ids}


def test_token_bytes_spell_byte_level_vocabularies(llm):
    """Concatenating the spellings of a text's tokens gives the text's UTF-8 bytes, emoji and CJK too."""
    tok = llm.tokenizer
    spelled = _spellings(tok)
    assert not set(spelled) & tok.all_special_ids
    for text in CORPUS:
        assert b"".join(spelled[i] for i in tok.encode(text, add_special_tokens=False)) == text.encode()


def test_token_bytes_spell_sentencepiece_vocabularies():
    """SentencePiece style: '▁' for a space, <0xNN> byte tokens for what the vocabulary lacks."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the"]:
        vocab[piece] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab, [("▁", "t"), ("h", "e"), ("▁t", "he")], unk_token="<unk>",
                                          byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok = Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    spelled = _spellings(tok)
    text = "the cat sat on 🙂 ÿ"
    ids = tok.encode(text, add_special_tokens=False)
    assert vocab["▁the"] in ids and vocab["<0xF0>"] in ids
    assert b"".join(spelled[i] for i in ids) == b" " + text.encode()


def test_unsupported_tokenizer_is_a_clear_error():
    backend = BackendTokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = Tokenizer(backend, special_tokens={"eos_token": "</s>"})
    with pytest.raises(StructuredOutputError, match="byte-level BPE or SentencePiece"):
        token_bytes(tok)


def test_preempted_constrained_sequences_end_as_if_never_preempted(llm, tiny_model):
    """A pool for about three sequences at a time: preempted constrained sequences are recomputed
    from their tokens and keep their guides' state, so they end with the roomy pool's tokens."""
    tok = llm.tokenizer
    rng = random.Random(3)
    prompts = [tok.encode(" ".join(rng.choice(CORPUS).split()[:rng.randint(4, 12)])) for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=11,
                            structured_outputs=StructuredOutputs(regex="[a-z]+( [a-z]+)*"))
    adapters = [None, "r8_attn_rs"] * 3
    expected = llm.generate(prompts, params, adapters=adapters)
    engine = llm.engine
    page = engine.pool.page_numel * engine.pool.data.element_size()
    need = sorted(engine.pool.pages_for_tokens(len(p) + 40) for p in prompts)
    small = LLM(model=str(tiny_model.root), adapters={"r8_attn_rs": str(tiny_model.adapters["r8_attn_rs"])},
                dtype="float32", device=TEST_DEVICE,
                pool_mem=(engine.pager.footprint("r8_attn_rs") + sum(need[-3:])) * page)
    seqs = []
    add = small.engine.add
    small.engine.add = lambda seq: (seqs.append(seq), add(seq))[1]
    got = small.generate(prompts, params, adapters=adapters)
    assert sum(seq.num_preemptions for seq in seqs) > 0, "the pool should have forced preemptions"
    assert [out.token_ids for out in got] == [out.token_ids for out in expected]
    for out in got:     # a whole match, or one cut by max_tokens
        assert regex.fullmatch("[a-z]+( [a-z]+)*", out.text, partial=out.finish_reason == "length"), out.text


def test_state_biases_are_cached_within_their_byte_bound(llm, monkeypatch):
    """Each automaton state's bias is the outlines-core mask (0 where allowed, -inf elsewhere), the
    same whether computed or taken from the cache, and the cache stays within its byte bound."""
    import asyncserve.structured as structured

    tok = llm.tokenizer
    vocab = llm.engine.model_config.vocab_size
    monkeypatch.setattr(structured, "CACHED_BIAS_BYTES", 3 * vocab * 4)
    compiler = structured.GuideCompiler(tok)
    spec = StructuredOutputs(choice=CHOICES)
    text = tok.encode("quick fox", add_special_tokens=False)
    for _ in range(2):                     # the second walk revisits the first's states
        guide, reference = compiler.guide(spec), outlines_core.Guide(compiler.index(spec))
        for token in text + [None]:
            allowed = torch.zeros(vocab, dtype=torch.bool)
            allowed[reference.get_tokens()] = True
            assert torch.equal(guide.bias(vocab) == 0, allowed)
            assert torch.isneginf(guide.bias(vocab)[~allowed]).all()
            if token is not None:
                guide.advance(token)
                reference.advance(token)
        assert len(compiler.biases) == 3
    assert compiler.biases.nbytes == 3 * vocab * 4


def test_automata_too_large_or_slow_to_build_are_refused(llm, monkeypatch):
    """The automaton of (a|b)*a(a|b){22} has millions of states: its build, in a child process,
    runs out of its address space and is refused, as is one past the build deadline; the engine
    keeps serving."""
    import asyncserve.structured as structured
    from asyncserve.engine import RequestError

    ids = llm.tokenizer.encode("the fox")
    monkeypatch.setattr(structured, "BUILD_MEMORY_BYTES", 256 * 2**20)
    with pytest.raises(RequestError, match="needs more than 256 MiB"):
        llm.engine.make_sequence(ids, SamplingParams(structured_outputs=StructuredOutputs(regex="(a|b)*a(a|b){22}")),
                                 None)
    monkeypatch.setattr(structured, "BUILD_SECONDS", 0.001)
    with pytest.raises(RequestError, match="takes more than 0.001 s"):
        llm.engine.make_sequence(ids, SamplingParams(structured_outputs=StructuredOutputs(regex="[a-z]{1,50}")), None)
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_a_cached_constraint_never_waits_for_another_ones_build(llm, monkeypatch):
    """The server looks constraints up on its event loop: while one thread builds an automaton, a
    cached one is returned at once, and a second build waits for the first."""
    import threading

    import asyncserve.structured as structured

    compiler = structured.GuideCompiler(llm.tokenizer)
    cached = StructuredOutputs(choice=["yes", "no"])
    compiler.index(cached)
    release, started, built = threading.Event(), threading.Event(), []
    real_build = structured.build_index

    def slow_build(regex, eos, vocabulary):
        started.set()
        assert release.wait(30)
        built.append(regex)
        return real_build(regex, eos, vocabulary)

    monkeypatch.setattr(structured, "build_index", slow_build)
    builders = [threading.Thread(target=compiler.index, args=(StructuredOutputs(regex=rx),)) for rx in ("[a-c]+", "[d-f]+")]
    builders[0].start()
    assert started.wait(30)
    builders[1].start()
    looked_up = []
    lookup = threading.Thread(target=lambda: looked_up.append(compiler.guide(cached)))
    lookup.start()
    lookup.join(10)
    assert looked_up and built == [], "the cached lookup waited for the blocked build"
    release.set()
    for thread in builders:
        thread.join(30)
    assert sorted(built) == ["[a-c]+", "[d-f]+"]


def test_the_constraint_wins_over_allowed_tokens_and_bad_words(llm):
    """allowed_token_ids and bad_words that leave nothing the constraint allows yield to it, and a
    token outside the constraint (which the sampler never gives) ends that sequence alone."""
    tok = llm.tokenizer
    ids = tok.encode("the fox")
    forbidding = SamplingParams(max_tokens=20, temperature=0.0, allowed_token_ids=[5, 6], bad_words=["quick"],
                                structured_outputs=StructuredOutputs(choice=["quick fox", "lazy dog"]))
    outs = llm.generate([ids, ids], forbidding, adapters=[None, "r1_qv"])
    assert all(out.text in ("quick fox", "lazy dog") and out.finish_reason == "stop" for out in outs)

    engine = llm.engine
    seqs = [engine.make_sequence(ids, SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="[a-z]+")),
                                 None), engine.make_sequence(ids, SamplingParams(max_tokens=8, ignore_eos=True), None)]
    for seq in seqs:
        engine.add(seq)
    engine.step()
    update = engine.scheduler._append(seqs[0], tok.encode("7", add_special_tokens=False)[0])
    assert update.finished and update.finish_reason == "stop"
    while engine.has_unfinished():
        engine.step()
    assert len(seqs[1].output_ids) == 8


def test_generate_cli_with_and_without_a_constraint(llm, tiny_model, tmp_path):
    """`asyncserve generate` prints the offline engine's text, held to --choice, --regex or
    --json-schema (a file) when given."""
    import subprocess
    import sys

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    prompt = "the fox jumps over"
    cases = [([], None), (["--choice", CHOICES[0], "--choice", CHOICES[1]], StructuredOutputs(choice=CHOICES[:2])),
             (["--regex", PATTERN], StructuredOutputs(regex=PATTERN)), (["--json-schema", str(schema)],
                                                                        StructuredOutputs(json=SCHEMA))]
    for flags, spec in cases:
        run = subprocess.run([sys.executable, "-m", "asyncserve.cli", "generate", "--model", str(tiny_model.root),
                              "--dtype", "float32", "--device", "cpu", "--prompt", prompt, "--max-tokens", "40",
                              "--use-adapter", "r1_qv", "--adapter", f"r1_qv={tiny_model.adapters['r1_qv']}", *flags],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        expected = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec),
                                adapters="r1_qv")[0].text
        assert run.stdout == expected + "\n"
