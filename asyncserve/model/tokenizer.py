"""Tokenizer: a `tokenizers.Tokenizer` with the model's special tokens and chat template.

Built from an HF folder (tokenizer.json + tokenizer_config.json) or from a GGUF file's metadata,
where llama.cpp stores the vocabulary, merges and token types instead of a tokenizer.json.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from asyncserve.model.config import ModelLoadError, read_json

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# llama.cpp's token types (tokenizer.ggml.token_type)
_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6
# tokens llama.cpp ends generation at, by their spelling, whatever ids the file names
_END_OF_GENERATION_TOKENS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                             "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"}
# Phi-3's control tokens that keep the whitespace after them (llama.cpp's list)
_PHI3_KEEP_WHITESPACE = {"<unk>", "<s>", "<|endoftext|>"}
_SPACE = "\u2581"        # SentencePiece's "▁": a space inside a piece

# GGUF `tokenizer.ggml.pre` -> how llama.cpp splits text before byte-level BPE. The regexes are the
# published pre-tokenizer patterns of each family.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2/2.5/3 (and the DeepSeek-R1 distills of Qwen): Llama 3's split with every digit alone
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: Qwen2's with combining marks kept inside words
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (Phi-4-mini, Llama 4): words by case with their contractions, up to three digits together
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = {"gpt-2", "phi-2", "roberta-bpe"}                 # GPT-2's own regex
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact"}      # every digit alone, then GPT-2's regex
_SPLIT_THEN_BYTES_PRE = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
    "qwen35": _QWEN35_SPLIT, "tekken": _TEKKEN_SPLIT}


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, *, special_tokens: Mapping[str, str | None],
                 extra_eos_token_ids: Sequence[int] = (), chat_template: str | None = None):
        """special_tokens: bos/eos/unk/pad token strings (None when the model has none);
        extra_eos_token_ids: other ids that end generation (generation_config.json, GGUF end-of-turn)."""
        self.backend = backend
        self.special_tokens = {name: special_tokens.get(name) for name in SPECIAL_TOKEN_NAMES}
        self.chat_template = chat_template
        self.bos_token_id = self._id_of("bos_token")
        eos_id = self._id_of("eos_token")
        self.eos_token_ids = list(dict.fromkeys(([eos_id] if eos_id is not None else []) + list(extra_eos_token_ids)))
        named = {self._id_of(name) for name in SPECIAL_TOKEN_NAMES} - {None}
        added = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        self.all_special_ids: set[int] = named | added
        self._template: jinja2.Template | None = None
        self._token_texts = TokenTexts.of(backend)

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, path: str | Path, generation_eos_ids: Sequence[int] = ()) -> Tokenizer:
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{folder} has no tokenizer.json; asyncserve needs the fast-tokenizer file "
                "(create it with transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder))")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:
            raise ModelLoadError(f"cannot read {tokenizer_file}: {e}") from None
        config_file = folder / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        # like transformers, explicit add_bos_token / add_eos_token flags override tokenizer.json's post-processor
        if "add_bos_token" in config or "add_eos_token" in config:
            backend.post_processor = _bos_eos_processor(
                backend, special["bos_token"] if config.get("add_bos_token") else None,
                special["eos_token"] if config.get("add_eos_token") else None)
        return cls(backend, special_tokens=special, extra_eos_token_ids=generation_eos_ids,
                   chat_template=_hf_chat_template(folder, config))

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """From `gguf.GGUFReader(...).fields`: byte-level BPE ("gpt2" in llama.cpp's terms) or
        SentencePiece ("llama": pieces with scores, <0xNN> byte tokens, no merges)."""
        kind = _gguf_value(fields, "tokenizer.ggml.model")
        tokens: list[str] | None = _gguf_value(fields, "tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.model and tokenizer.ggml.tokens); "
                                 "asyncserve needs one to serve text")
        token_types: list[int] = _gguf_value(fields, "tokenizer.ggml.token_type", [])
        if kind == "gpt2":
            backend = _gguf_byte_level_bpe(fields, tokens)
            add_bos_default = False
        elif kind == "llama":
            backend = _gguf_sentencepiece(fields, tokens, token_types)
            add_bos_default = True       # llama.cpp's default for a SentencePiece vocabulary that does not say
        else:
            raise ModelLoadError(
                f"the GGUF's tokenizer model is {kind!r}; asyncserve reads byte-level BPE ('gpt2') and "
                "SentencePiece ('llama') tokenizers from GGUF files: serve the model's HF folder")
        # control tokens (<|im_start|> ...) and user-defined ones are matched whole in text, never split.
        # llama.cpp drops the whitespace after Phi-3's control tokens (as Phi-3's tokenizer.json does)
        rstrip = _is_phi3(fields)
        backend.add_special_tokens([
            AddedToken(token, special=True, normalized=False, rstrip=rstrip and token not in _PHI3_KEEP_WHITESPACE)
            for token, token_type in zip(tokens, token_types) if token_type in (_CONTROL, _UNKNOWN)])
        backend.add_tokens([AddedToken(token, special=False, normalized=False)
                            for token, token_type in zip(tokens, token_types) if token_type == _USER_DEFINED])

        def token_at(key: str) -> str | None:
            i = _gguf_value(fields, f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        special = {"bos_token": token_at("bos_token_id"), "eos_token": token_at("eos_token_id"),
                   "unk_token": token_at("unknown_token_id"), "pad_token": token_at("padding_token_id")}
        # a file without token types still names its special tokens: they are special (skipped in text) too
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                    for token in dict.fromkeys(special.values()) if token is not None])
        add_bos = _gguf_value(fields, "tokenizer.ggml.add_bos_token", add_bos_default)
        backend.post_processor = _bos_eos_processor(
            backend, special["bos_token"] if add_bos else None,
            special["eos_token"] if _gguf_value(fields, "tokenizer.ggml.add_eos_token", False) else None)
        # llama.cpp also ends generation at end-of-turn / end-of-message tokens: the ids the file names,
        # and, as it does, the tokens spelled as a known family's end of turn (Gemma's <end_of_turn>)
        end_of_turn = [_gguf_value(fields, f"tokenizer.ggml.{key}") for key in ("eot_token_id", "eom_token_id")]
        end_of_turn += [i for i, token in enumerate(tokens) if token in _END_OF_GENERATION_TOKENS]
        return cls(backend, special_tokens=special, extra_eos_token_ids=[i for i in end_of_turn if i is not None],
                   chat_template=_gguf_value(fields, "tokenizer.chat_template"))

    # ---- encode / decode -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # The batch calls release the GIL while they work (the single encode and decode do not: a 4 MB
    # prompt held every other thread 7 s), so a long text handled in a worker thread lets the event
    # loop run meanwhile. encode_batch_fast skips the offsets nobody here reads: the same ids, 1.5-3x
    # sooner.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def text_after(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str | None:
        """decode(ids) less decode(ids[:-1]) where the last token's own text is that (see TokenTexts),
        else None: a stream's next text, most often, without a call into the tokenizer."""
        if self._token_texts is None:
            return None
        return self._token_texts.text_after(ids, skip_special_tokens)

    def decode_long(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """decode for a worker thread: the same text, the GIL released while it is made (a thread hop
        more than decode's few microseconds for a handful of tokens, as a stream's are)."""
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ---- chat template ---------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """Render a conversation as transformers' apply_chat_template(tokenize=False) does.
        continue_final_message: the text ends where the last message's content does, so that the
        model continues it (what the template writes after it, as an end-of-turn token, is cut)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template, so it cannot take chat messages; "
                             "send a plain prompt to the completions endpoint instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set: the last "
                             "message is either continued or answered")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        variables = {name: token for name, token in self.special_tokens.items() if token is not None}
        variables.update(kwargs)
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        plain = [_plain_message(m) for m in messages]
        text = self._template.render(messages=plain, add_generation_prompt=add_generation_prompt, **variables)
        return _cut_after_final_message(text, plain) if continue_final_message else text

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens[name]
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"the tokenizer's {name} {token!r} is not in its vocabulary")
        return token_id


# ---- decoding from a table of the tokens' text --------------------------------------------------

class TokenTexts:
    """Each token's text where its bytes are whole characters by themselves, read once per vocabulary,
    for the decoders of byte-level BPE (ByteLevel) and SentencePiece (Replace "▁" by " ", ByteFallback,
    Fuse, Strip) vocabularies. Such a token adds its own text to the decoded text of the tokens before
    it, whatever they are: ByteLevel decodes all the tokens' bytes together, invalid UTF-8 as U+FFFD,
    and a token of whole characters starts on a character boundary, ending an unfinished character
    before it as the end of the text would; ByteFallback decodes runs of <0xNN> tokens, which any other
    token ends; Strip cuts the start of the whole text, which is the earlier tokens' once `start` of
    them have text of their own. A streaming detokenizer's next token is most often one of these: its
    text is a lookup, not two calls of decode."""

    def __init__(self, texts: dict[int, str | None], special: set[int], strip_start: int):
        """texts: id -> the token's text as the decoder makes it (None: not whole characters alone, as
        SentencePiece's <0xNN> tokens); special: the special tokens' ids; strip_start: the characters
        Strip may take off the text's start."""
        # skipping special tokens, they give no text: their ids too have None (decode() tells what they do)
        self._texts = {False: texts, True: {i: (None if i in special else text) for i, text in texts.items()}}
        self._strip_start = strip_start

    @classmethod
    def of(cls, backend: BackendTokenizer) -> TokenTexts | None:
        """The texts of a backend whose decoder is one of those above, else None."""
        if backend.decoder is None:
            return None
        decoder = json.loads(backend.decoder.__getstate__())
        steps = decoder["decoders"] if decoder.get("type") == "Sequence" else [decoder]
        kinds = [step.get("type") for step in steps]
        tokens = {i: t for t, i in backend.get_vocab(with_added_tokens=False).items()}
        added = backend.get_added_tokens_decoder()
        tokens.update((i, token.content) for i, token in added.items())     # the backend reads these first
        special_contents = {token.content for token in added.values() if token.special}
        special = {i for i, token in tokens.items() if token in special_contents}
        if kinds == ["ByteLevel"]:
            texts = {i: _whole_characters(_byte_level_bytes(token)) for i, token in tokens.items()}
            return cls(texts, special, 0)
        # Replace (of strings) steps, ByteFallback, Fuse, and Strip of the fused text's start alone
        replacing = 0
        while replacing < len(kinds) and kinds[replacing] == "Replace" and "String" in steps[replacing]["pattern"]:
            replacing += 1
        strip = steps[-1] if kinds[-1:] == ["Strip"] else None
        middle = kinds[replacing:len(kinds) - (strip is not None)]
        if middle not in (["ByteFallback", "Fuse"], ["ByteFallback"]) or \
                (strip is not None and (middle[-1] != "Fuse" or strip["stop"] != 0)):
            return None
        texts = {}
        for i, token in tokens.items():
            for step in steps[:replacing]:
                token = token.replace(step["pattern"]["String"], step["content"])
            texts[i] = None if _is_fallback_byte(token) else token
        return cls(texts, special, strip["start"] if strip else 0)

    def text_after(self, ids: Sequence[int], skip_special_tokens: bool) -> str | None:
        """decode(ids) less decode(ids[:-1]) when it is the last token's own text, else None."""
        texts = self._texts[skip_special_tokens]
        text = texts.get(ids[-1])
        if not text:
            return None
        if self._strip_start:       # the tokens before must give the characters Strip looks at
            given = 0
            for i in itertools.islice(ids, len(ids) - 1):
                if texts.get(i):
                    given += 1
                    if given >= self._strip_start:
                        break
            else:
                return None
        return text


def _byte_level_bytes(token: str) -> bytes:
    """ByteLevel's bytes of a token: GPT-2's byte alphabet read back, or the token's UTF-8 where a
    character is outside it."""
    try:
        return token.translate(_BYTE_OF_CHAR).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode()


def _whole_characters(spelled: bytes) -> str | None:
    try:
        return spelled.decode()
    except UnicodeDecodeError:
        return None


def _is_fallback_byte(token: str) -> bool:
    """Whether ByteFallback reads the token as a byte: 6 bytes, "<0x", a base-16 u8 as Rust parses one, ">"."""
    spelled = token.encode()
    if len(spelled) != 6 or not (spelled.startswith(b"<0x") and spelled.endswith(b">")):
        return False
    digits = spelled[4:5] if spelled[3:4] == b"+" else spelled[3:5]
    return bool(digits) and all(c in b"0123456789abcdefABCDEF" for c in digits)


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode): how byte-level BPE spells bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# GPT-2's characters -> the bytes they spell, as latin-1 characters; every other character below 256
# -> one latin-1 cannot encode (a token holding one is its own UTF-8 to ByteLevel)
_BYTE_OF_CHAR = {**{c: "\uffff" for c in range(256)}, **{ord(c): chr(b) for b, c in gpt2_byte_chars().items()}}


# ---- HF folder helpers ---------------------------------------------------------------------

def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(folder: Path, config: dict) -> str | None:
    # newer transformers save the template beside tokenizer_config.json rather than inside it
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if (folder / "chat_template.json").is_file():
        template = read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template


def _bos_eos_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """Post-processor that puts bos before / eos after the text (either may be None: nothing added)."""
    used = [token for token in dict.fromkeys((bos, eos)) if token is not None]
    ids = {token: backend.token_to_id(token) for token in used}
    for token, token_id in ids.items():
        if token_id is None:
            raise ModelLoadError(f"the tokenizer should add {token!r} to every text, but it is not in its vocabulary")

    def template(sequence: str, type_id: int) -> list[str]:
        return ([f"{bos}:{type_id}"] * (bos is not None) + [f"${sequence}:{type_id}"]
                + [f"{eos}:{type_id}"] * (eos is not None))

    return processors.TemplateProcessing(single=template("A", 0), pair=template("A", 0) + template("B", 1),
                                         special_tokens=list(ids.items()))


# ---- GGUF helpers --------------------------------------------------------------------------

def _gguf_value(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    field = fields.get(key)
    return default if field is None else field.contents()


def _gguf_byte_level_bpe(fields: Mapping[str, Any], tokens: list[str]) -> BackendTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in _gguf_value(fields, "tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    backend.pre_tokenizer = _gguf_pre_tokenizer(_gguf_value(fields, "tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece(fields: Mapping[str, Any], tokens: list[str], token_types: list[int]) -> BackendTokenizer:
    """llama.cpp's SentencePiece tokenizer: the text with a space in front (unless add_space_prefix is
    false, as for Gemma) and every space as "▁", then pieces joined pairwise, the pair whose joined
    piece scores best first, and what the vocabulary lacks as <0xNN> byte tokens. A BPE model whose
    merges are ranked by the joined piece's score does that (where two competing pairs' pieces score
    the same, llama.cpp joins the leftmost, this the piece of lower id; trained vocabularies' scores differ)."""
    scores: list[float] = _gguf_value(fields, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    add_space_prefix = _gguf_value(fields, "tokenizer.ggml.add_space_prefix", True)
    types = token_types or [1] * len(tokens)
    # the pieces text can be cut into: not control tokens (matched whole before), unknown or byte tokens
    pieces = {token: i for i, (token, token_type) in enumerate(zip(tokens, types))
              if token_type not in (_UNKNOWN, _CONTROL, _BYTE)}
    ranked = sorted((-scores[i], i, cut) for token, i in pieces.items() for cut in range(1, len(token))
                    if token[:cut] in pieces and token[cut:] in pieces)
    merges = [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]
    unknown_id = _gguf_value(fields, "tokenizer.ggml.unknown_token_id")
    backend = BackendTokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges, byte_fallback=True,
                                          unk_token=tokens[unknown_id] if unknown_id is not None else None))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE)] * add_space_prefix
                                              + [normalizers.Replace(" ", _SPACE)])
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + [decoders.Strip(" ", 1, 0)] * add_space_prefix)
    return backend


def _is_phi3(fields: Mapping[str, Any]) -> bool:
    name = str(_gguf_value(fields, "general.name", "")).lower()
    return _gguf_value(fields, "general.architecture") == "phi3" or "phi-3" in name or "phi3" in name


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _SPLIT_THEN_BYTES_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLIT_THEN_BYTES_PRE[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    supported = sorted(_GPT2_PRE | _DIGITS_THEN_GPT2_PRE | set(_SPLIT_THEN_BYTES_PRE))
    raise ModelLoadError(f"the GGUF's pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                         f"supported: {', '.join(supported)}. Serve the model's HF folder instead")


# ---- chat template helpers -----------------------------------------------------------------

class _GenerationTag(Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for training masks; rendering keeps the body."""
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    # the same environment as transformers, so templates written for it render identically
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """The rendered text up to the end of the last message's content (templates may strip it: then
    up to the end of its stripped text, as transformers does)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text to continue")
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's text")
    whole = final.lstrip()
    return text[:at + len(whole)] if text.startswith(whole, at) else text[:at + len(final.strip())]


def _template_call(call: Any) -> Any:
    """An earlier tool call as chat templates take it: OpenAI sends its arguments as JSON text, templates
    write them with tojson, so an object (as vLLM passes them)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call


def _plain_message(message: Mapping[str, Any]) -> dict:
    """A copy without None values (templates test for missing keys), content parts joined into one string,
    tool calls' arguments as objects, earlier thinking under the name templates read (vLLM's newer
    ``reasoning`` is Qwen3's ``reasoning_content``)."""
    out = {k: v for k, v in message.items() if v is not None}
    if "reasoning" in out:
        out.setdefault("reasoning_content", out.pop("reasoning"))
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_template_call(call) for call in out["tool_calls"]]
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"only text content parts are supported, got {part!r}")
            texts.append(part["text"])
        out["content"] = "".join(texts)
    return out
