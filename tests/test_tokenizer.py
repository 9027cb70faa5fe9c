"""Tokenizer from GGUF metadata and from HF folders: ids, decoding and chat templates equal transformers'."""
from __future__ import annotations

import json
import random
import re

import gguf
import jinja2
import pytest
from model_io_helpers import (
    SPM_CORPUS,
    TEXT_BATTERY,
    backend_vocab,
    save_hf_tokenizer,
    sentencepiece_model,
    smollm2_tokenizer,
    transformers_smollm2_tokenizer,
    write_gguf,
    write_sentencepiece_gguf,
)
from reference import make_tiny_tokenizer

from asyncserve.model.config import ModelLoadError
from asyncserve.model.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "Emoji 🙂 and\nnew lines\n\n"}],
    [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf) -> Tokenizer:
    return smollm2_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def theirs(smollm2_gguf):
    return transformers_smollm2_tokenizer(smollm2_gguf)


# ---- SmolLM2 GGUF vs transformers ------------------------------------------------------------

@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gguf_encode_matches_transformers(ours, theirs, add_special_tokens):
    for text in TEXT_BATTERY:
        expected = theirs.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)


def test_gguf_decode_matches_transformers(ours, theirs):
    rng = random.Random(0)
    sequences = [theirs.encode(text) for text in TEXT_BATTERY]
    sequences += [[rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    sequences += [[rng.randrange(20) for _ in range(10)] for _ in range(20)]     # dense in special tokens
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(ours, theirs, add_generation_prompt):
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_gguf_special_tokens(ours, theirs):
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == theirs.bos_token_id == 1
    # eos, then <|endoftext|>: llama.cpp ends generation at it too, known by its spelling
    assert ours.eos_token_ids == [theirs.eos_token_id, 0] == [2, 0]
    assert set(theirs.all_special_ids) <= ours.all_special_ids
    assert set(range(17)) == ours.all_special_ids          # the control tokens <|endoftext|> ... <empty_output>
    assert ours.id_to_token(1) == "<|im_start|>" and ours.id_to_token(19556) == theirs.convert_ids_to_tokens(19556)
    # SmolLM2's GGUF says add_bos_token = false, and transformers follows it: no BOS on encode
    assert ours.encode("Hello") == theirs.encode("Hello") == [19556]


def test_gguf_smollm_pre_tokenizer_isolates_digits(ours, theirs):
    """llama.cpp's "smollm" pre-tokenizer (like SmolLM2's own tokenizer.json) isolates every Unicode digit
    before the GPT-2 split; transformers' GGUF converter drops that step. ASCII digits come out the same
    (the vocabulary has no multi-digit tokens), other digits like ² can differ: we follow llama.cpp."""
    assert ours.encode("E = mc2, 12345") == theirs.encode("E = mc2, 12345")
    assert ours.encode(" ²") == [216, 19133]                # " " then "²", as llama.cpp splits it
    assert theirs.encode(" ²") == [3351, 127]               # " \xc2" then "\xb2": half of ² in each token
    assert ours.decode(ours.encode("x ² ½ ١٢٣")) == "x ² ½ ١٢٣"


def test_content_parts_are_joined(ours):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]}]
    plain = [{"role": "user", "content": "Hello world"}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template(plain)
    with pytest.raises(ValueError, match="text content parts"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# ---- other GGUF tokenizers: a tiny byte-level BPE written with each pre-tokenizer ---------------

@pytest.fixture(scope="module")
def tiny_vocab():
    return backend_vocab(make_tiny_tokenizer().backend_tokenizer)


# the pre-tokenizers of the files users bring: Llama 3.x (llama-bpe), Mistral Nemo (tekken), Qwen2.5/3
# and the R1 distills of Qwen (qwen2, deepseek-r1-qwen), Qwen3.5, Phi-4-mini (gpt-4o), Llama 4
PRE_TOKENIZERS = [("gpt-2", None), ("llama-bpe", True), ("tekken", True), ("smaug-bpe", False), ("qwen2", False),
                  ("deepseek-r1-qwen", True), ("qwen35", False), ("gpt-4o", False), ("llama4", True)]
SPLIT_BATTERY = TEXT_BATTERY + ["12345 678 9 + ٣٤٥٦", "I'M SURE You'RE fine, don'T", "cafe\u0301 nai\u0308ve a\u0308b",
                                "path/to/file.txt\n/usr/bin", "camelCaseWords and HTTPServer x2y3"]


@pytest.mark.parametrize("pre, add_bos", PRE_TOKENIZERS)
def test_tiny_gguf_tokenizer_matches_transformers(tmp_path, tiny_vocab, pre, add_bos):
    """Each pre-tokenizer splits text as transformers' GGUF loader does (its table of llama.cpp's
    tokenizer.ggml.pre names): the same pieces, ids, decoded text and BOS."""
    from transformers import AutoTokenizer

    tokens, merges, special = tiny_vocab
    path = write_gguf(tmp_path / "tiny.gguf", tokens=tokens, merges=merges, special=special, pre=pre, add_bos=add_bos,
                      llama={"block_count": 1, "embedding_length": 8, "attention.head_count": 2})
    ours = Tokenizer.from_gguf(gguf.GGUFReader(path).fields)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in SPLIT_BATTERY:
        pieces = ours.backend.pre_tokenizer.pre_tokenize_str(text)
        assert pieces == theirs.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text), (pre, text)
        for add_special_tokens in (True, False):
            expected = theirs.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, (pre, text)
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.encode("hi")[0] == 1) == bool(add_bos)


def test_pre_tokenizers_split_differently(tmp_path, tiny_vocab):
    """The battery tells the regexes apart (so the test above checks each one): every pre-tokenizer but
    the aliases of another (smaug-bpe of llama-bpe, deepseek-r1-qwen of qwen2, llama4 of gpt-4o)
    splits it its own way."""
    tokens, merges, special = tiny_vocab
    splits = {}
    for pre, _ in PRE_TOKENIZERS:
        path = write_gguf(tmp_path / f"{pre}.gguf", tokens=tokens, merges=merges, special=special, pre=pre)
        tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(path).fields)
        splits[pre] = [tokenizer.backend.pre_tokenizer.pre_tokenize_str(text) for text in SPLIT_BATTERY]
    assert splits["smaug-bpe"] == splits["llama-bpe"] and splits["deepseek-r1-qwen"] == splits["qwen2"]
    assert splits["llama4"] == splits["gpt-4o"]
    distinct = ["gpt-2", "llama-bpe", "tekken", "qwen2", "qwen35", "gpt-4o"]
    assert len({repr(splits[pre]) for pre in distinct}) == len(distinct)


def test_unsupported_gguf_tokenizers(tmp_path, tiny_vocab):
    tokens, merges, special = tiny_vocab
    for model in ("t5", "rwkv", "bert", "gemma4"):
        path = write_gguf(tmp_path / f"{model}.gguf", tokens=tokens, merges=merges, special=special, tokenizer_model=model)
        with pytest.raises(ModelLoadError, match=f"tokenizer model is '{model}'.*'gpt2'.*'llama'"):
            Tokenizer.from_gguf(gguf.GGUFReader(path).fields)
    odd = write_gguf(tmp_path / "odd.gguf", tokens=tokens, merges=merges, special=special, pre="default")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'default'.*supported: .*llama-bpe"):
        Tokenizer.from_gguf(gguf.GGUFReader(odd).fields)


# ---- SentencePiece GGUF tokenizers ("llama"): Llama-2, Mistral, Phi-3, Gemma ------------------

SPM_TEXTS = TEXT_BATTERY + SPM_CORPUS + [
    " x", "  x", "   x", "x ", "x  ", " ", "  ", "\n", " \n ", "a\n\n b", "\t\ttab", "a<think>b<think> </think>",
    "ß ŉ ǅ — ‘quotes’ … €", "\x00\x01\x7f control bytes", "🧑🏿‍🚀 astronaut", "zero\u200bwidth",
    "<start_of_turn>  spaced <end_of_turn>\n\n<start_of_turn>", "<|user|>\n\n  hi<|end|> <|assistant|>\t<s>x</s>",
    "<|endoftext|>   kept<unk> kept", "<start_of_turn", "end_of_turn>", "<|end|",
]
# the architectures whose GGUFs llama.cpp tokenizes differently: Gemma without the leading space, Phi-3
# dropping the whitespace after its control tokens
SPM_FILES = {"llama": False, "phi3": False, "gemma2": True}      # architecture: Gemma's vocabulary


@pytest.fixture(scope="module", params=list(SPM_FILES))
def spm_pair(request, tmp_path_factory):
    architecture, gemma = request.param, SPM_FILES[request.param]
    path = write_sentencepiece_gguf(tmp_path_factory.mktemp(architecture) / "spm.gguf", gemma,
                                    architecture=architecture, chat_template=CHAT_TEMPLATE_GEMMA)
    sp, tokens, _, types = sentencepiece_model(gemma)
    return architecture, Tokenizer.from_gguf(gguf.GGUFReader(path).fields), sp, tokens, types


CHAT_TEMPLATE_GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                       "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                       "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def llama_cpp_spm_encode(architecture, sp, tokens, types, text, add_special_tokens):
    """llama.cpp's SentencePiece tokenization, with SentencePiece itself cutting the text between
    whole-matched tokens: control, unknown and user-defined tokens are found in the text first (longest
    first); each piece of text between them gets the leading space (when the vocabulary adds one) and
    SentencePiece's BPE; Phi-3's control tokens but <unk>, <s>, <|endoftext|> eat the whitespace after them."""
    whole = {tokens[i]: i for i, t in enumerate(types) if t in (2, 3, 4)}
    eats_whitespace = {i for i, t in enumerate(types) if t == 3 and architecture == "phi3"
                       and tokens[i] not in ("<unk>", "<s>", "<|endoftext|>")}
    ids = [sp.bos_id()] if add_special_tokens else []
    pattern = re.compile("|".join(re.escape(t) for t in sorted(whole, key=len, reverse=True)))
    position = 0
    while position <= len(text):
        match = pattern.search(text, position)
        end = match.start() if match else len(text)
        if end > position:
            ids += sp.encode(text[position:end])
        if not match:
            break
        ids.append(whole[match.group()])
        position = match.end()
        if whole[match.group()] in eats_whitespace:
            while position < len(text) and text[position] in " \t\n\r\v\f":
                position += 1
    return ids


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_sentencepiece_gguf_encodes_as_llama_cpp(spm_pair, add_special_tokens):
    """A SentencePiece BPE vocabulary (trained by the sentencepiece package: scores, byte fallback,
    control and user-defined tokens) written as llama.cpp writes Llama-2's, Phi-3's and Gemma's:
    ids equal SentencePiece's own, cut around special tokens as llama.cpp cuts them."""
    architecture, ours, sp, tokens, types = spm_pair
    for text in SPM_TEXTS:
        expected = llama_cpp_spm_encode(architecture, sp, tokens, types, text, add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, (architecture, text)


def test_sentencepiece_gguf_decodes_as_sentencepiece(spm_pair):
    """Decoding: SentencePiece's text for the battery's ids and for random runs of non-byte tokens (a run
    of byte tokens that is not valid UTF-8 gives one U+FFFD per byte, as transformers' tokenizer.json
    decoder does; SentencePiece keeps the run's valid bytes)."""
    architecture, ours, sp, tokens, types = spm_pair
    rng = random.Random(1)
    pieces = [i for i, t in enumerate(types) if t in (1, 3)]
    sequences = [sp.encode(text) for text in SPM_TEXTS]
    sequences += [[rng.choice(pieces) for _ in range(rng.randint(1, 20))] for _ in range(300)]
    for ids in sequences:
        assert ours.decode(ids) == sp.decode(ids), (architecture, [tokens[i] for i in ids])
    for text in SPM_TEXTS:       # text with no token matched whole comes back as it was
        if not re.search(r"<(s|/s|unk|think|/think|start_of_turn|end_of_turn)>|<\|", text):
            assert ours.decode(ours.encode(text)) == text, (architecture, text)


def test_sentencepiece_gguf_special_tokens_and_chat(spm_pair):
    architecture, ours, sp, tokens, _ = spm_pair
    assert ours.vocab_size == len(tokens) == sp.get_piece_size()
    assert (ours.bos_token_id, ours.special_tokens["unk_token"]) == (sp.bos_id(), "<unk>")
    assert ours.special_tokens["pad_token"] == ("<pad>" if architecture == "gemma2" else None)
    # llama.cpp ends generation at eos and at the end-of-turn tokens it knows by their spelling
    assert ours.eos_token_ids == [sp.eos_id(), *(tokens.index(t) for t in ("<end_of_turn>", "<|end|>", "<|endoftext|>"))]
    assert {sp.bos_id(), sp.eos_id(), sp.unk_id(), tokens.index("<start_of_turn>")} <= ours.all_special_ids
    assert tokens.index("<think>") not in ours.all_special_ids           # user-defined: kept in decoded text
    assert ours.encode("hi")[0] == sp.bos_id()                         # add_bos: llama.cpp's default for SentencePiece
    messages = CONVERSATIONS[2]
    prompt = ours.apply_chat_template(messages)
    assert prompt.startswith(f"{tokens[sp.bos_id()]}<start_of_turn>system\nAnswer in French.<end_of_turn>\n<start_of_turn>user\nHello")
    assert prompt.endswith("<end_of_turn>\n<start_of_turn>model\n")
    ids = ours.encode(prompt, add_special_tokens=False)
    assert ids == llama_cpp_spm_encode(architecture, sp, tokens, _, prompt, False)
    assert ids.count(tokens.index("<start_of_turn>")) == 5 and ids[0] == sp.bos_id()


def test_sentencepiece_gguf_equals_transformers_for_gemma(tmp_path):
    """transformers' GGUF tokenizer builds Gemma's the same way: equal ids (special tokens in text too) and text."""
    from transformers import AutoTokenizer

    path = write_sentencepiece_gguf(tmp_path / "gemma.gguf", True, architecture="gemma2")
    ours = Tokenizer.from_gguf(gguf.GGUFReader(path).fields)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_gguf_without_scores_types_or_flags(tmp_path):
    """Older files: no token types, add_bos or add_space_prefix: llama.cpp's defaults (BOS added, a
    leading space); byte tokens still fall back by their <0xNN> spelling."""
    sp, tokens, scores, _ = sentencepiece_model(False)
    path = write_gguf(tmp_path / "old.gguf", tokens=tokens, merges=[], special=set(), tokenizer_model="llama",
                      scores=scores, token_types=[], pre="default")
    ours = Tokenizer.from_gguf(gguf.GGUFReader(path).fields)
    for text in ("Hello, world!", "  two leading", "emoji 🙂🚀 中文字符 ñ"):
        assert ours.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        assert ours.decode(ours.encode(text)) == text


# ---- HF folders ------------------------------------------------------------------------------

@pytest.mark.parametrize("add_bos_token", [None, True])
def test_hf_folder_tokenizer_matches_transformers(tmp_path, ours, add_bos_token):
    from transformers import AutoTokenizer

    kwargs = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    save_hf_tokenizer(ours, tmp_path, **kwargs)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    folder_tokenizer = Tokenizer.from_hf_folder(tmp_path, generation_eos_ids=[2, 0])
    for text in TEXT_BATTERY:
        for add_special_tokens in (True, False):
            expected = theirs.encode(text, add_special_tokens=add_special_tokens)
            assert folder_tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)
    assert (folder_tokenizer.encode("hi")[0] == 1) == bool(add_bos_token)
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert folder_tokenizer.apply_chat_template(messages) == expected
    assert folder_tokenizer.eos_token_ids == [2, 0]
    assert folder_tokenizer.bos_token_id == 1


def test_hf_folder_chat_template_locations(tmp_path, ours):
    save_hf_tokenizer(ours, tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    assert Tokenizer.from_hf_folder(tmp_path).chat_template is None

    config["chat_template"] = "in config"
    config_file.write_text(json.dumps(config))
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "in config"

    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "named"}]
    config_file.write_text(json.dumps(config))
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "named"

    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "from json"

    (tmp_path / "chat_template.jinja").write_text("from jinja")
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "from jinja"


def test_hf_folder_without_tokenizer_json(tmp_path, ours):
    save_hf_tokenizer(ours, tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


# ---- chat template environment ----------------------------------------------------------------

def templated(ours: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(ours.backend, special_tokens=ours.special_tokens, chat_template=template)


def test_chat_template_environment(ours):
    hello = [{"role": "user", "content": "<b>héllo</b>"}]
    as_json = templated(ours, "{{ messages | tojson }}").apply_chat_template(hello)
    assert as_json == json.dumps(hello, ensure_ascii=False)          # no HTML escaping, no \u escapes
    assert templated(ours, "{{ bos_token }}|{{ eos_token }}").apply_chat_template(hello) == "<|im_start|>|<|im_end|>"
    # trim_blocks + lstrip_blocks, as transformers renders
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert templated(ours, template).apply_chat_template(hello) == "<b>héllo</b>\n"
    loop = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert templated(ours, loop).apply_chat_template(hello * 3) == "<b>héllo</b>"
    generation = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert templated(ours, generation).apply_chat_template(hello) == "[<b>héllo</b>]"
    # None values are dropped (OpenAI clients send content: null with tool calls), extra kwargs reach the template
    missing = "{% for m in messages %}{{ 'content' in m }}{% endfor %}{{ enable_thinking }}"
    assert templated(ours, missing).apply_chat_template([{"role": "assistant", "content": None}],
                                                         enable_thinking=False) == "FalseFalse"
    prompt = "{{ add_generation_prompt }}"
    assert templated(ours, prompt).apply_chat_template(hello, add_generation_prompt=False) == "False"


def test_chat_template_errors(ours):
    strict = templated(ours, "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
                             "{% endif %}")
    with pytest.raises(jinja2.TemplateError, match="first must be user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        templated(ours, None).apply_chat_template([{"role": "user", "content": "x"}])
    sandboxed = templated(ours, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        sandboxed.apply_chat_template([{"role": "user", "content": "x"}])
