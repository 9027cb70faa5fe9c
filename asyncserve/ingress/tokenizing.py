"""The handlers' tokenizer work: every text checked against the prompt byte limit before it is
tokenized, and large inputs encoded, templated or decoded in the server's tokenizer threads.

A 4 MB prompt took 7 s to tokenize; on the event loop that paused every other tenant's stream for
as long. In a thread the tokenizers library's batch calls release the GIL (Tokenizer.encode,
decode_long), so the loop goes on serving; a chat template renders in Python, which the
interpreter interleaves with the loop every few milliseconds. Small inputs stay inline: below about
a thousand characters (or tokens) the encode costs about what the hop to a thread does (~0.2 ms;
~1 us a character on a loaded 2-core EPYC box).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from asyncserve.config import parse_size
from asyncserve.ingress.prepare import chat_text
from asyncserve.ingress.protocol import ApiError

INLINE_CHARS = 1024
INLINE_TOKENS = 1024
# Two threads: one long input does not hold up another's; more would take cores from the steps.
TOKENIZER_THREADS = 2
# The default prompt byte limit per token of context: real text runs 3-5 bytes a token, and
# byte-level vocabularies' longest tokens (runs of spaces or of one character) a few dozen, so a
# prompt over this many bytes a token cannot fit the context, whatever it holds.
BYTES_PER_TOKEN = 32


def new_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="asyncserve-tokenize")


def prompt_byte_limit(server) -> int:
    return parse_size(server.config.max_prompt_bytes) or server.engine.max_model_len * BYTES_PER_TOKEN


def check_prompt_bytes(server, texts: Sequence[str], param: str) -> None:
    """400 if the texts' UTF-8 bytes together exceed the limit, before any of them is tokenized."""
    limit = prompt_byte_limit(server)
    chars = sum(len(t) for t in texts)
    if chars * 4 <= limit:           # a character is 1 to 4 bytes: no need to count them
        return
    if chars > limit:
        size = f"{chars} characters"
    else:
        nbytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if nbytes <= limit:
            return
        size = f"{nbytes} bytes"
    raise ApiError(400, f"the {param} is {size} long; this server tokenizes at most {limit} bytes of it (its "
                   f"context is {server.engine.max_model_len} tokens)", param=param, code="context_length_exceeded")


async def off_loop(server, large: bool, fn: Callable, *args):
    """fn(*args), in a tokenizer thread when the input is large."""
    if not large:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(server.tokenizer_executor, fn, *args)


async def encode(server, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
    check_prompt_bytes(server, [text], param)
    tok = server.engine.tokenizer
    return await off_loop(server, len(text) > INLINE_CHARS, tok.encode, text, add_special_tokens)


async def decode(server, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    tok = server.engine.tokenizer
    if len(ids) > INLINE_TOKENS:
        return await off_loop(server, True, tok.decode_long, ids, skip_special_tokens)
    return tok.decode(ids, skip_special_tokens)


async def chat_prompt(server, req, add_special_tokens: bool, tools: list[dict] | None = None
                      ) -> tuple[str, list[int]]:
    """The conversation rendered and its token ids: its messages checked against the byte limit before
    the template renders them, the rendered text (tools and template added) again before it is tokenized."""
    texts = message_texts(req.messages)
    check_prompt_bytes(server, texts, "messages")
    large = tools is not None or sum(len(t) for t in texts) > INLINE_CHARS
    text = await off_loop(server, large, chat_text, server.engine.tokenizer, req, tools)
    return text, await encode(server, text, add_special_tokens, "messages")


def message_texts(messages) -> list[str]:
    """The text of each message's content (a string or text parts), for the byte limit; parts that
    are not text are refused later, by chat_messages."""
    texts = []
    for m in messages or ():
        if isinstance(m.content, str):
            texts.append(m.content)
        elif isinstance(m.content, list):
            texts += [p["text"] for p in m.content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return texts
