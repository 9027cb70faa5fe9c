"""IncrementalDetokenizer on SmolLM2's byte-level tokenizer: streamed text equals decode(), characters split
across tokens are held whole, stop strings are found across token boundaries and never leak."""
from __future__ import annotations

import random

import pytest
from model_io_helpers import TEXT_BATTERY, smollm2_tokenizer

from asyncserve.model.detokenizer import IncrementalDetokenizer
from asyncserve.model.tokenizer import gpt2_byte_chars

MULTILINGUAL = [
    "🙂🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷 — emoji made of several code points",
    "中文字符，日本語のテキスト、한국어 문장。Ελληνικά, русский, עברית, العربية, हिन्दी",
    "Ünïcödé àccénts: façade, naïve, Ångström; math ∑∫√∞ ≤ ≥; box ┌─┐ └─┘",
]
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    return smollm2_tokenizer(smollm2_gguf)


def byte_token(tok, byte: int) -> int:
    """The id of the token that is exactly this byte."""
    return tok.backend.token_to_id(gpt2_byte_chars()[byte])


@pytest.fixture(scope="module")
def byte_token_ids(tok):
    """Ids of the single-byte tokens: streams of these split characters anywhere."""
    return [i for i in (tok.backend.token_to_id(ch) for ch in gpt2_byte_chars().values()) if i is not None]


def stream(tok, ids, prompt_ids=(), **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids one by one (stopping at a stop string, as the scheduler does); deltas include finish()'s."""
    detok = IncrementalDetokenizer(tok, list(prompt_ids), **kwargs)
    deltas = []
    for token in ids:
        deltas.append(detok.add(token))
        if detok.stopped_by is not None:
            break
    deltas.append(detok.finish())
    return deltas, detok


def expected_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: the stop string that ends first (earliest start among those ending together)."""
    best = None
    for stop in stops:
        position = text.find(stop)
        if position != -1 and (best is None or (position + len(stop), position) < (best[0] + len(best[1]), best[0])):
            best = (position, stop)
    if best is None:
        return text, None
    position, stop = best
    return text[:position + len(stop)] if include else text[:position], stop


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_restreamed_text_equals_decode(tok, skip_special_tokens):
    prompt_ids = tok.encode(PROMPT)
    for text in TEXT_BATTERY + MULTILINGUAL:
        ids = tok.encode(text)
        deltas, detok = stream(tok, ids, prompt_ids, skip_special_tokens=skip_special_tokens)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.text == expected, repr(text)
        assert not any("\ufffd" in delta for delta in deltas), (text, deltas)
        assert detok.stopped_by is None


def test_characters_split_across_tokens_are_held_whole(tok):
    text = "a🙂b中c"
    byte_ids = [byte_token(tok, b) for b in text.encode("utf-8")]    # the emoji's 4 bytes arrive in 4 tokens
    deltas, detok = stream(tok, byte_ids)
    assert deltas == ["a", "", "", "", "🙂", "b", "", "", "中", "c", ""]
    assert detok.text == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_streams_equal_decode(tok, byte_token_ids, skip_special_tokens):
    """Any ids, a third of them single bytes: invalid UTF-8 too, which decodes to U+FFFD in both."""
    rng = random.Random(1234)

    def random_ids(n: int) -> list[int]:
        return [rng.choice(byte_token_ids) if rng.random() < 0.3 else rng.randrange(tok.vocab_size) for _ in range(n)]

    for _ in range(300):
        prompt_ids, ids = random_ids(rng.randint(0, 6)), random_ids(rng.randint(1, 60))
        deltas, detok = stream(tok, ids, prompt_ids, skip_special_tokens=skip_special_tokens)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.text == expected, (prompt_ids, ids)


def test_prompt_ending_mid_character(tok):
    emoji_ids = [byte_token(tok, b) for b in "🙂".encode("utf-8")]
    prompt_ids, output_ids = tok.encode("Hi ") + emoji_ids[:2], emoji_ids[2:] + tok.encode(" ok")
    deltas, detok = stream(tok, output_ids, prompt_ids)
    assert detok.text == tok.decode(output_ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_fuzz(tok, include):
    """Random stop strings cut from the text: the output equals the reference truncation, every prefix of
    the stream is a prefix of it (so no part of a stop string is ever released), whatever the tokens."""
    rng = random.Random(99)
    texts = [t for t in TEXT_BATTERY + MULTILINGUAL if len(t) > 4]
    for _ in range(400):
        text = rng.choice(texts)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text) - 1)
            stops.append(text[start:start + rng.randint(1, 8)])
        if rng.random() < 0.3:
            stops.append("never appears \x00")
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        expected, expected_by = expected_stop(full, stops, include)
        detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
        released = ""
        for token in ids:
            released += detok.add(token)
            assert expected.startswith(released), (stops, released)
            if detok.stopped_by is not None:
                break
        released += detok.finish()
        assert released == detok.text == expected, (text, stops)
        assert detok.stopped_by == expected_by


def test_stop_string_spanning_tokens(tok):
    text = "The answer is 42. END of story"
    ids = tok.encode(text)
    stop = "swer is 4"           # ends of " answer", " is", " ", "4"
    assert not any(stop in tok.decode([token]) for token in ids)
    deltas, detok = stream(tok, ids, stop=[stop])
    assert detok.text == "The an" and detok.stopped_by == stop
    deltas, detok = stream(tok, ids, stop=[stop], include_stop_str_in_output=True)
    assert detok.text == "The answer is 4"
    # the earlier-ending of two overlapping stop strings wins
    deltas, detok = stream(tok, ids, stop=["42. END", "is 42"])
    assert detok.stopped_by == "is 42" and detok.text == "The answer "


def test_stop_prefix_is_held_until_it_cannot_be_a_stop(tok):
    ids = tok.encode("Hello ST")
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    streamed = "".join(detok.add(token) for token in ids)
    assert streamed == "Hello "                # " ST" might still become " STOP"
    assert detok.finish() == "ST" and detok.text == "Hello ST" and detok.stopped_by is None

    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    streamed = "".join(detok.add(token) for token in tok.encode("Hello STONE"))
    assert streamed == "Hello STONE"          # released as soon as "STON" rules the stop string out


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi<|im_end|>there<|endoftext|>", add_special_tokens=False)
    assert stream(tok, ids)[1].text == "Hithere"
    assert stream(tok, ids, skip_special_tokens=False)[1].text == "Hi<|im_end|>there<|endoftext|>"
    _, detok = stream(tok, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert detok.stopped_by == "<|im_end|>" and detok.text == "Hi"
    _, detok = stream(tok, ids, skip_special_tokens=True, stop=["<|im_end|>"])
    assert detok.stopped_by is None and detok.text == "Hithere"


def test_nothing_after_stop_or_finish(tok):
    ids = tok.encode("one two three four")
    detok = IncrementalDetokenizer(tok, [], stop=[" two"])
    for token in ids:
        detok.add(token)
    assert detok.stopped_by == " two" and detok.text == "one"
    assert detok.add(tok.encode(" five")[0]) == "" and detok.finish() == "" and detok.text == "one"

    detok = IncrementalDetokenizer(tok, [])
    for token in ids:
        detok.add(token)
    detok.finish()
    assert detok.add(ids[0]) == "" and detok.text == "one two three four"


def test_cost_per_token_is_a_small_window(tok):
    """Decoding touches a bounded window, not the whole output: long outputs cost O(1) per token."""
    class CountingTokenizer:
        def __init__(self):
            self.longest = 0
            self.calls = 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            self.calls += 1
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

        def text_after(self, ids, skip_special_tokens=True):
            return None         # every token through decode (test_detokenizer_tables.py: the lookups)

    ids = tok.encode(" ".join(TEXT_BATTERY + MULTILINGUAL) * 5, add_special_tokens=False)
    assert len(ids) > 3000
    counting = CountingTokenizer()
    deltas, detok = stream(counting, ids, tok.encode(PROMPT), stop=["no such stop string"])
    assert "".join(deltas) == tok.decode(ids)
    assert counting.longest <= 9                 # context + one character's tokens
    assert counting.calls <= 2 * len(ids) + 3
