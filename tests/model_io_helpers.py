"""Helpers for the model I/O tests: cached SmolLM2 tokenizers (ours and transformers'), a text battery,
and writers for tiny GGUF files and HF tokenizer folders."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
import torch

from asyncserve.model.tokenizer import Tokenizer

# ASCII, code, whitespace runs, newlines, emoji, CJK, accents, digits, special tokens written as text
TEXT_BATTERY = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))  # 5\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "    leading spaces, trailing spaces    ",
    "tabs\tand\t\ttabs, a\u00a0non-breaking space and many          spaces",
    "\n\n\nnewlines\r\nand carriage returns\r\n\n",
    "emoji 🙂🚀👍🏽 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "中文字符，日本語のテキスト、한국어 문장。",
    "Ünïcödé àccénts: façade, naïve, Ångström, Œuvre, straße",
    "numbers 1234567890, 3.14159, -42, 1e-10, 2024-06-01 12:34:56, $1,000,000.00",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "almost special <|im_start| and <im_end|> and <|im_start|x",
    "I'm sure they'll say it's fine, don't you think? We've seen it; you'd agree.",
    "",
    " ",
    "\n",
    "a",
    "x" * 200 + " " + "ab" * 50,
]


@lru_cache(maxsize=None)
def smollm2_fields(path: Path) -> dict:
    """The SmolLM2 GGUF's metadata fields (GGUFReader takes seconds to parse the vocabulary), once per session."""
    return gguf.GGUFReader(path).fields


@lru_cache(maxsize=None)
def smollm2_tokenizer(path: Path) -> Tokenizer:
    """Our tokenizer from the SmolLM2 GGUF, built once per test session."""
    return Tokenizer.from_gguf(smollm2_fields(path))


@lru_cache(maxsize=None)
def transformers_smollm2_tokenizer(path: Path):
    """transformers' tokenizer from the same GGUF (slow to build: a few seconds), once per session."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def save_hf_tokenizer(tokenizer: Tokenizer, folder: Path, **init_kwargs):
    """Save our tokenizer as a transformers fast tokenizer (tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    special = {name: token for name, token in tokenizer.special_tokens.items() if token is not None}
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, **{**special, **init_kwargs})
    if tokenizer.chat_template and "chat_template" not in init_kwargs:
        hf.chat_template = tokenizer.chat_template
    hf.save_pretrained(folder)
    return hf


def backend_vocab(tokenizer) -> tuple[list[str], list[str], set[str]]:
    """(tokens by id, merges as "a b" strings, special token strings) of a byte-level BPE backend tokenizer."""
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    return tokens, merges, special


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The Q/K row order llama.cpp's converter writes (the inverse of the loader's un-permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, *, architecture: str = "llama", tokens: list[str], merges: list[str], special: set[str],
               pre: str = "gpt-2", tokenizer_model: str = "gpt2", add_bos: bool | None = None,
               scores: list[float] | None = None, token_types: list[int] | None = None,
               bos_id: int = 1, eos_id: int = 2, chat_template: str | None = None,
               llama: dict | None = None, extra: dict | None = None,
               tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] | None = None) -> Path:
    """A GGUF file with the given tokenizer (token_types: llama.cpp's, else control for `special`, normal
    for the rest; no types or merges written when empty), `{architecture}.*` metadata (llama) and other keys (extra), and
    tensors: float32/float16 arrays (type None) or bytes already quantized to the given type."""
    writer = gguf.GGUFWriter(path, architecture)
    for key, value in (llama or {}).items():
        if isinstance(value, list):
            writer.add_array(f"{architecture}.{key}", value)
        else:
            writer.add_key_value(f"{architecture}.{key}", value, _value_type(value))
    for key, value in (extra or {}).items():
        writer.add_key_value(key, value, _value_type(value))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    token_types = [3 if t in special else 1 for t in tokens] if token_types is None else token_types
    if token_types:
        writer.add_token_types(token_types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, (data, qtype) in (tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _value_type(value) -> gguf.GGUFValueType:
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.UINT32


# ---- SentencePiece vocabularies, as llama.cpp's converter writes them from a tokenizer.model -----

SPM_CORPUS = [
    " Leading spaces,  two spaces,   three and    four; trailing ones too  ",
    "Lines\nand\n\nblank lines\n\n\n, tabs\tand indentation:\n    return x\n        pass",
    "<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\nHello, how can I help?<end_of_turn>",
    "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\nIt is 4.<|end|>",
]


@lru_cache(maxsize=None)
def sentencepiece_model(gemma: bool, vocab_size: int = 500):
    """A SentencePiece BPE model trained on the test corpus as Llama's and Gemma's are made (byte
    fallback, no whitespace folding; Gemma's: no leading space added, <pad> <eos> <bos> <unk> <mask>
    first), with control and user-defined symbols, and its vocabulary in GGUF terms: (processor,
    tokens, scores, llama.cpp token types)."""
    import io

    import sentencepiece as spm
    from reference import CORPUS

    layout = (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, bos_piece="<bos>", eos_piece="<eos>") if gemma
              else dict(unk_id=0, bos_id=1, eos_id=2))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((CORPUS + SPM_CORPUS + TEXT_BATTERY[:11]) * 4), model_writer=model, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, character_coverage=1.0, add_dummy_prefix=not gemma,
        remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True, hard_vocab_limit=False,
        allow_whitespace_only_pieces=True, minloglevel=2, **layout,
        control_symbols=["<mask>"] * gemma + ["<start_of_turn>", "<end_of_turn>", "<|user|>", "<|system|>",
                                               "<|assistant|>", "<|end|>", "<|endoftext|>"],
        user_defined_symbols=["<think>", "</think>"])
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]
    # llama.cpp's types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i)
             else 4 if tokens[i] in ("<think>", "</think>") else 1 for i in range(len(tokens))]
    return sp, tokens, scores, types


def write_sentencepiece_gguf(path: Path, gemma: bool, architecture: str = "llama", **kwargs) -> Path:
    """A GGUF with the SentencePiece vocabulary as `tokenizer.ggml.model` "llama" (scores, types, no
    merges), as llama.cpp's converter writes it (Gemma's: add_space_prefix false)."""
    sp, tokens, scores, types = sentencepiece_model(gemma)
    extra = {"tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_space_prefix": not gemma,
             **({"tokenizer.ggml.padding_token_id": sp.pad_id()} if gemma else {}), **kwargs.pop("extra", {})}
    return write_gguf(path, architecture=architecture, tokens=tokens, merges=[], special=set(), pre="default",
                      tokenizer_model="llama", scores=scores, token_types=types, bos_id=sp.bos_id(),
                      eos_id=sp.eos_id(), extra=extra, **kwargs)
