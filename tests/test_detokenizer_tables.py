"""The streaming detokenizer's text lookups (Tokenizer.text_after, from model/tokenizer.py's TokenTexts,
read once per vocabulary) against the tokenizers library's decode: a lookup is always decode(ids) less
decode(ids[:-1]), and streams through IncrementalDetokenizer with the lookups release every chunk the
library-only path releases. For byte-level BPE (SmolLM2's GGUF, and the same vocabulary as an HF
tokenizer.json) and SentencePiece vocabularies (GGUF with and without the leading space, and an HF
tokenizer.json made by transformers)."""
from __future__ import annotations

import copy
import random

import gguf
import pytest
from family_models import sentencepiece_hf_tokenizer
from model_io_helpers import TEXT_BATTERY, save_hf_tokenizer, smollm2_tokenizer, write_sentencepiece_gguf

from asyncserve.model.detokenizer import IncrementalDetokenizer
from asyncserve.model.tokenizer import Tokenizer, gpt2_byte_chars

EMOJI_AND_ACCENTS = "🙂🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷 中文字符 Ünïcödé ÿ — naïve"
KINDS = ["gguf-byte-level", "hf-byte-level", "gguf-sentencepiece", "gguf-sentencepiece-gemma", "hf-sentencepiece"]


class LibraryOnly:
    """The per-sequence path before the lookups: every text from the tokenizers library's decode."""

    def __init__(self, tok: Tokenizer):
        self.backend = tok.backend

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def text_after(self, ids, skip_special_tokens=True):
        return None


class CountingBackend:
    """A backend that counts its decode calls."""

    def __init__(self, backend):
        self._backend = backend
        self.decodes = 0

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self._backend.decode(*args, **kwargs)


@pytest.fixture(scope="module", params=KINDS)
def case(request, smollm2_gguf, tmp_path_factory):
    """(our tokenizer, the ids of its byte tokens: those that split characters anywhere)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gguf-byte-level":
        tok = smollm2_tokenizer(smollm2_gguf)
    elif request.param == "hf-byte-level":
        save_hf_tokenizer(smollm2_tokenizer(smollm2_gguf), folder)
        tok = Tokenizer.from_hf_folder(folder)
    elif request.param == "hf-sentencepiece":
        sentencepiece_hf_tokenizer("phi3", folder).save_pretrained(folder)     # Llama-2 style: Strip of the leading space
        tok = Tokenizer.from_hf_folder(folder)
    else:
        path = write_sentencepiece_gguf(folder / "spm.gguf", gemma=request.param.endswith("gemma"))
        tok = Tokenizer.from_gguf(gguf.GGUFReader(path).fields)
    if "byte-level" in request.param:
        byte_ids = [tok.backend.token_to_id(c) for c in gpt2_byte_chars().values()]
    else:
        byte_ids = [tok.backend.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    return tok, [i for i in byte_ids if i is not None]


def random_ids(rng: random.Random, tok: Tokenizer, byte_ids: list[int], n: int) -> list[int]:
    """Ids that split characters anywhere (byte tokens), special ones, emoji and accents, and any others."""
    specials = sorted(tok.all_special_ids)
    pieces = tok.encode(EMOJI_AND_ACCENTS, add_special_tokens=False)
    out = []
    while len(out) < n:
        roll = rng.random()
        if roll < 0.3:
            out.append(rng.choice(byte_ids))
        elif roll < 0.4:
            out.append(rng.choice(specials))
        elif roll < 0.6:
            start = rng.randrange(len(pieces))
            out += pieces[start:start + rng.randint(1, 4)]
        else:
            out.append(rng.randrange(tok.vocab_size))
    return out[:n]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_lookup_is_what_decode_adds(case, skip_special_tokens):
    tok, byte_ids = case
    rng = random.Random(5)
    looked_up = 0
    for _ in range(3000):
        ids = random_ids(rng, tok, byte_ids, rng.randint(1, 10))
        text = tok.text_after(ids, skip_special_tokens)
        if text is not None:
            looked_up += 1
            before = tok.backend.decode(ids[:-1], skip_special_tokens=skip_special_tokens)
            assert before + text == tok.backend.decode(ids, skip_special_tokens=skip_special_tokens), ids
    assert looked_up > 600
    # the text battery: most tokens are lookups (not those that split an emoji, nor <0xNN> ones)
    found = []
    for text in TEXT_BATTERY:
        ids = tok.encode(text, add_special_tokens=False)
        for k in range(2, len(ids) + 1):
            found.append(tok.text_after(ids[:k], skip_special_tokens))
            if found[-1] is not None:
                assert tok.decode(ids[:k - 1], skip_special_tokens) + found[-1] == tok.decode(ids[:k], skip_special_tokens)
    assert sum(piece is not None for piece in found) > 0.7 * len(found)


def test_streams_equal_the_library_path_chunk_by_chunk(case):
    """Random streams (partial UTF-8, special tokens, emoji, stop strings cut from the stream's text so
    that they span tokens): every delta the detokenizer releases with the lookups equals the
    library-only path's, so the text at every chunk boundary is the same."""
    tok, byte_ids = case
    reference = LibraryOnly(tok)
    rng = random.Random(17)
    for trial in range(300):
        prompt = random_ids(rng, tok, byte_ids, rng.randint(0, 6))
        ids = random_ids(rng, tok, byte_ids, rng.randint(1, 40))
        skip = rng.random() < 0.6
        full = tok.backend.decode(ids, skip_special_tokens=skip)
        stops = []
        for _ in range(rng.randint(0, 2) if full else 0):
            start = rng.randrange(len(full))
            stops.append(full[start:start + rng.randint(1, 6)])
        kwargs = dict(skip_special_tokens=skip, stop=stops, include_stop_str_in_output=rng.random() < 0.5)
        ours = IncrementalDetokenizer(tok, prompt, **kwargs)
        theirs = IncrementalDetokenizer(reference, prompt, **kwargs)
        for token in ids:
            assert ours.add(token) == theirs.add(token), (trial, prompt, ids, kwargs)
            if theirs.stopped_by is not None:
                break
        assert ours.finish() == theirs.finish()
        assert (ours.text, ours.stopped_by) == (theirs.text, theirs.stopped_by)


def test_ordinary_text_streams_with_few_decode_calls(case):
    """The lookups are what a stream of ordinary text runs on: the library decodes a few windows
    (the first tokens, SentencePiece's byte tokens), not two per token."""
    tok, _ = case
    counted = copy.copy(tok)
    counted.backend = CountingBackend(tok.backend)
    prompt = tok.encode("Say something.")
    tokens = 0
    for text in TEXT_BATTERY:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(counted, prompt)
        streamed = "".join(detok.add(token) for token in ids) + detok.finish()
        assert streamed == LibraryOnly(tok).decode(prompt + ids)[len(LibraryOnly(tok).decode(prompt)):]
        tokens += len(ids)
    assert tokens > 300
    assert counted.backend.decodes < 0.5 * tokens
