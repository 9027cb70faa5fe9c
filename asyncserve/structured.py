"""Structured outputs: sampling held to a JSON schema, any JSON object, a regular expression or a
list of choices (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``).

A constraint compiles to a regular expression, then to a token-level automaton over the model's
vocabulary (outlines-core's Index: which tokens may follow in each state, and where the text may
end). Each sequence walks its own guide over the shared Index: the sampler adds the bias of the
guide's state (-inf for every token it does not allow, the end-of-sequence token allowed only where
the text may end), and the scheduler advances the guide with the token sampled. Indexes are cached
by expression, since building one walks the whole vocabulary: ~25 ms for a small schema, ~5 s for
any JSON object on SmolLM2's 49k tokens. The build runs in a child process with memory and time
limits (a few expressions have automata that grow exponentially), which the server waits for in a
worker thread.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from collections import OrderedDict

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from asyncserve.model.tokenizer import gpt2_byte_chars
from asyncserve.sampling_params import StructuredOutputs, ThinkingMarks

# Indexes kept (the one for any JSON object is ~26 MB on a 49k vocabulary; a schema's far smaller).
CACHED_INDEXES = 32
# Memory for the logit biases of automaton states (196 KB each on a 49k vocabulary).
CACHED_BIAS_BYTES = 64 * 2**20
# Limits of the child process that builds an automaton (guide_build.py): any JSON object takes
# ~4.8 s and ~240 MB on SmolLM2's vocabulary.
BUILD_SECONDS = 60
BUILD_MEMORY_BYTES = 2**30
# Characters Rust's regex syntax treats as operators (regex_syntax::is_meta_character).
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


class StructuredOutputError(ValueError):
    """The constraint cannot be compiled (bad schema or expression, unsupported tokenizer)."""


def constraint_regex(spec: StructuredOutputs) -> str:
    """The regular expression (Rust regex syntax, as outlines-core reads it) of a constraint."""
    if spec.regex is not None:
        return spec.regex
    if spec.choice is not None:
        return "(" + "|".join("".join("\\" + c if c in _REGEX_META else c for c in choice)
                              for choice in spec.choice) + ")"
    schema = spec.json if spec.json is not None else {"type": "object"}
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return build_regex_from_schema(text)
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(f"unsupported or invalid JSON schema: {e}") from None


def token_bytes(tokenizer) -> dict[bytes, list[int]]:
    """The bytes each ordinary token stands for (special tokens left out), as outlines-core's
    Vocabulary takes them. Byte-level BPE vocabularies spell bytes with GPT-2's printable
    characters; SentencePiece ones spell spaces as '▁' and raw bytes as '<0xNN>'."""
    backend = tokenizer.backend
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    added = backend.get_added_tokens_decoder()
    if '"ByteLevel"' in decoder:
        unicode_to_byte = {c: b for b, c in gpt2_byte_chars().items()}

        def spell(token: str) -> bytes:
            return bytes(unicode_to_byte[c] for c in token)
    elif '"ByteFallback"' in decoder:
        def spell(token: str) -> bytes:
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                return bytes([int(token[3:5], 16)])
            return token.replace("\u2581", " ").encode()
    else:
        raise StructuredOutputError("structured outputs need a byte-level BPE or SentencePiece tokenizer; "
                                    "this model's decoder is neither")
    out: dict[bytes, list[int]] = {}
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i in tokenizer.all_special_ids:
            continue
        try:
            spelled = token.encode() if i in added else spell(token)
        except KeyError:            # a character outside the byte alphabet: not a plain token
            continue
        out.setdefault(spelled, []).append(i)
    return out


class GuideCompiler:
    """Builds (and caches) the Index of each constraint over one tokenizer's vocabulary, and hands
    out SequenceGuides over them."""

    def __init__(self, tokenizer, device: torch.device | str = "cpu"):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.biases = BiasCache(torch.device(device))
        self._token_bytes: dict[bytes, list[int]] | None = None
        self._indexes: OrderedDict[str, outlines_core.Index] = OrderedDict()
        self._cache_lock = threading.Lock()       # held only to read or change _indexes
        self._build_lock = threading.Lock()       # one build at a time: each may take a core and 1 GiB

    def index(self, spec: StructuredOutputs) -> outlines_core.Index:
        """The constraint's Index, built on first use (may take seconds: call it off the event loop).
        A cached one never waits for another constraint's build."""
        return self._index(constraint_regex(spec))

    def _index(self, regex: str) -> outlines_core.Index:
        if (index := self._cached(regex)) is not None:
            return index
        with self._build_lock:
            if (index := self._cached(regex)) is not None:      # built while this thread waited
                return index
            if self.eos_token_id is None:
                raise StructuredOutputError("structured outputs need a model with an end-of-sequence token")
            if self._token_bytes is None:
                self._token_bytes = token_bytes(self.tokenizer)
            index = build_index(regex, self.eos_token_id, self._token_bytes)
        with self._cache_lock:
            self._indexes[regex] = index
            if len(self._indexes) > CACHED_INDEXES:
                self._indexes.popitem(last=False)
        return index

    def _cached(self, regex: str) -> outlines_core.Index | None:
        with self._cache_lock:
            if regex in self._indexes:
                self._indexes.move_to_end(regex)
            return self._indexes.get(regex)

    def guide(self, spec: StructuredOutputs) -> SequenceGuide | ThinkingGate:
        """A fresh walk over the constraint's automaton, for one sequence (from the end of its thinking
        where spec.thinking says so)."""
        regex = constraint_regex(spec)
        guide = SequenceGuide(outlines_core.Guide(self._index(regex)), regex, self.biases)
        return guide if spec.thinking is None else ThinkingGate(guide, spec.thinking)


def build_index(regex: str, eos_token_id: int, vocabulary: dict[bytes, list[int]]) -> outlines_core.Index:
    """outlines_core.Index(regex, vocabulary), built in a child process (guide_build.py) under
    BUILD_MEMORY_BYTES of address space and BUILD_SECONDS."""
    request = pickle.dumps((regex, eos_token_id, vocabulary, BUILD_MEMORY_BYTES))
    child = subprocess.Popen([sys.executable, "-m", "asyncserve.guide_build", str(os.getpid())],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = child.communicate(request, timeout=BUILD_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise StructuredOutputError(f"the constraint's automaton takes more than {BUILD_SECONDS} s to build; "
                                    "simplify it") from None
    reason = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
    if child.returncode == 2:
        raise StructuredOutputError(f"cannot build the constraint's automaton: {reason[0]}")
    if child.returncode < 0 or b"memory" in err.lower():        # Rust aborts when an allocation fails
        raise StructuredOutputError(f"the constraint's automaton needs more than {BUILD_MEMORY_BYTES // 2**20} MiB "
                                    f"to build; simplify it")
    if child.returncode != 0:
        raise StructuredOutputError(f"building the constraint's automaton failed: {reason[0]}")
    return pickle.loads(out)


class SequenceGuide:
    """One sequence's walk over its constraint's automaton: advanced by the scheduler with each
    token sampled, read by the sampler as a logit bias."""
    constraining = True           # the next token is held to the constraint (ThinkingGate: not while thinking)

    def __init__(self, guide: outlines_core.Guide, key: str, biases: BiasCache):
        self._guide, self._key, self._biases = guide, key, biases

    def advance(self, token_id: int) -> None:
        self._guide.advance(token_id, return_tokens=False)

    def bias(self, vocab: int) -> torch.Tensor:
        """[vocab] float32: 0 for the tokens allowed next, -inf for the others."""
        return self._biases.get((self._key, self._guide.get_state(), vocab), self._guide)

    def free_bias(self, vocab: int) -> torch.Tensor:
        """[vocab] zeros: every token allowed (ThinkingGate's, while the model thinks)."""
        return self._biases.free(vocab)

    # speculative decoding: a draft's rows are sampled under the states the draft walks to
    def accepted(self, tokens: list[int]) -> int:
        """How many of tokens, from the first, the constraint allows to follow what it has seen."""
        n = 0
        while n < len(tokens) and self._guide.accepts_tokens(tokens[:n + 1]):
            n += 1
        return n

    def after(self, tokens: list[int]) -> SequenceGuide | GuideAfter:
        """The guide as it will be once ``tokens`` (which it accepts) follow, for the sampler's bias."""
        return GuideAfter(self, tokens) if tokens else self

    def bias_after(self, tokens: list[int], vocab: int) -> torch.Tensor:
        for token in tokens:
            self._guide.advance(token, return_tokens=False)
        try:
            return self.bias(vocab)
        finally:
            self._guide.rollback_state(len(tokens))


class GuideAfter:
    """SequenceGuide.after: reads as the guide would after some tokens, leaving its walk where it is."""

    def __init__(self, guide: SequenceGuide, tokens: list[int]):
        self.guide, self.tokens = guide, tokens

    def bias(self, vocab: int) -> torch.Tensor:
        return self.guide.bias_after(self.tokens, vocab)


class ThinkingGate:
    """A constraint that holds from the end of the model's thinking, as vLLM's structured outputs do with a
    reasoning parser: while the answer thinks every token is allowed, the end marker's token closes the
    thinking and the constraint's walk starts with the next token. Where the prompt has not left the
    answer thinking, its first token may be the begin marker's (it then thinks) or one the constraint
    allows (the walk starts there): a model that does not think is held from its first token."""

    def __init__(self, guide: SequenceGuide, marks: ThinkingMarks):
        self.guide, self.marks = guide, marks
        self.state = "thinking" if marks.open else "first"      # then "walk"

    @property
    def constraining(self) -> bool:
        return self.state != "thinking"

    def _next(self, state: str, token: int) -> str:
        if state == "thinking":
            return "walk" if token == self.marks.end else "thinking"
        if state == "first" and token == self.marks.begin:
            return "thinking"
        return "walk"

    def advance(self, token_id: int) -> None:
        self.state, before = self._walk([token_id])
        if self.state == "walk" and before == 0:       # the token is the walk's own, not the end of thinking
            self.guide.advance(token_id)

    def _bias(self, state: str, guide: SequenceGuide | GuideAfter, vocab: int) -> torch.Tensor:
        if state == "thinking":
            return self.guide.free_bias(vocab)
        bias = guide.bias(vocab)
        if state == "first" and self.marks.begin is not None and self.marks.begin < vocab:
            bias = bias.clone()
            bias[self.marks.begin] = 0.0
        return bias

    def bias(self, vocab: int) -> torch.Tensor:
        return self._bias(self.state, self.guide, vocab)

    def _walk(self, tokens: list[int]) -> tuple[str, int]:
        """(the state after tokens, how many of them come before the walk's)."""
        state = self.state
        for i, token in enumerate(tokens):
            if state == "walk" or (state == "first" and token != self.marks.begin):
                return "walk", i
            state = self._next(state, token)
        return state, len(tokens)

    def accepted(self, tokens: list[int]) -> int:
        state, before = self._walk(tokens)
        return before + (self.guide.accepted(tokens[before:]) if state == "walk" else 0)

    def after(self, tokens: list[int]) -> ThinkingGate | GateAfter:
        return GateAfter(self, tokens) if tokens else self


class GateAfter:
    """ThinkingGate.after: reads as the gate would after some tokens, leaving it where it is."""

    def __init__(self, gate: ThinkingGate, tokens: list[int]):
        self.gate, self.tokens = gate, tokens

    def bias(self, vocab: int) -> torch.Tensor:
        state, before = self.gate._walk(self.tokens)
        return self.gate._bias(state, self.gate.guide.after(self.tokens[before:]), vocab)


class BiasCache:
    """Logit biases by (constraint, automaton state, vocab size), least recently used dropped past
    CACHED_BIAS_BYTES. Writing a state's mask walks its allowed tokens (~50 us for a state inside a
    JSON string on a 49k vocabulary), and a masked_fill_ over the logits is slower still on CPU
    (~1.3 ms for 16 rows, against 32 us for adding a bias), while a stream of sequences keeps
    revisiting a few states. Only the stepper thread reads it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._biases: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._biases)

    def free(self, vocab: int) -> torch.Tensor:
        """[vocab] zeros: every token allowed."""
        key = ("free", vocab)
        if key not in self._biases:
            self._biases[key] = torch.zeros(vocab, device=self.device)
            self.nbytes += 4 * vocab
        self._biases.move_to_end(key)
        return self._biases[key]

    def get(self, key: tuple, guide: outlines_core.Guide) -> torch.Tensor:
        bias = self._biases.get(key)
        if bias is not None:
            self._biases.move_to_end(key)
            return bias
        vocab = key[2]
        words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        guide.write_mask_into(words.data_ptr(), words.numel(), 4)
        # bit j of word w stands for token 32 w + j; the words are little-endian, so byte k of word w
        # holds tokens 32 w + 8 k ... + 7
        bias = _BYTE_BIASES[words.view(torch.uint8).long()].view(-1)[:vocab].to(self.device)
        self._biases[key] = bias
        self.nbytes += bias.numel() * bias.element_size()
        while self.nbytes > CACHED_BIAS_BYTES and len(self._biases) > 1:
            _, dropped = self._biases.popitem(last=False)
            self.nbytes -= dropped.numel() * dropped.element_size()
        return bias


# per byte value, the biases of its 8 tokens (bit set: allowed, 0; clear: -inf)
_BYTE_BIASES = torch.zeros(256, 8).masked_fill_(((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0,
                                                float("-inf"))
