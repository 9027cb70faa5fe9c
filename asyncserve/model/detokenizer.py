"""Streaming detokenization with stop strings.

Each step decodes only a small window of recent tokens (vLLM's prefix/read offsets): the context
tokens, whose text was already released, and the new ones. The new text is the window's text minus
the context's text; decoding the context along with the new tokens keeps decoder effects that
depend on neighbours (SentencePiece's leading-space strip, bytes of one character split across
byte-level tokens) out of the delta. A window whose text ends in U+FFFD ends mid-character, so
its tokens wait for the rest of the character. Where the one new token's text is known to be that
difference (Tokenizer.text_after: whole characters, after context that has text), it is looked up
instead of decoding the window twice.

Released text never contains any part of a stop string: text that could still grow into one is held
back until it cannot, and a stop string is searched for in the held text plus the new text, so it
is found even when it spans tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

from asyncserve.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# prompt tokens decoded as context ahead of the first output token
_PROMPT_CONTEXT_TOKENS = 4
# a character is at most 4 UTF-8 bytes and a token carries at least one, so tokens still ending
# mid-character after this many hold invalid bytes (U+FFFD for good): release them. Also bounds the window.
_MAX_WINDOW_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self._text_after = tokenizer.text_after
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped_by: str | None = None
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        context = list(prompt_ids[max(0, len(prompt_ids) - _PROMPT_CONTEXT_TOKENS):])
        if self._decode(context).endswith(_REPLACEMENT):
            context = []    # the prompt ends mid-character: the output's first bytes complete it, not new text
        self._window = context          # token ids: [context (already released) | not yet decoded]
        self._read = len(context)       # where the not-yet-decoded tokens start in _window
        self._held = ""                 # decoded text not released yet: it may be the start of a stop string
        self._released: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All output text released so far (by add and finish)."""
        return "".join(self._released)

    def add(self, token_id: int) -> str:
        """Take the next output token; return the text that can now be released (often "")."""
        if self.stopped_by is not None or self._finished:
            return ""
        self._window.append(token_id)
        return self._release(self._decode_new(flush=False), final=False)

    def finish(self) -> str:
        """The output is complete: release what was held back (an unfinished character, a stop-string prefix)."""
        if self.stopped_by is not None or self._finished:
            return ""
        self._finished = True
        return self._release(self._decode_new(flush=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, flush: bool) -> str:
        """Text of the not-yet-decoded tokens, or "" while they end mid-character (unless flushing)."""
        if self._read == len(self._window):
            return ""
        if self._read == len(self._window) - 1:
            # what decoding the window and its context would give, when the tokenizer knows it at once
            new_text = self._text_after(self._window, self.skip_special_tokens)
            if new_text and not new_text.endswith(_REPLACEMENT):
                del self._window[:self._read]
                self._read = 1
                return new_text
        context_text = self._decode(self._window[:self._read])
        window_text = self._decode(self._window)
        if not flush and window_text.endswith(_REPLACEMENT) and len(self._window) - self._read < _MAX_WINDOW_TOKENS:
            return ""
        new_text = window_text[len(context_text):]
        # the decoded tokens become the next context; tokens that produced no text (skipped special
        # tokens) are added to the context rather than replacing it, up to the window bound
        if new_text or len(self._window) > _MAX_WINDOW_TOKENS:
            del self._window[:self._read]
        self._read = len(self._window)
        return new_text

    def _release(self, new_text: str, final: bool) -> str:
        # a stop string found now must end in new_text, so it starts at most len(stop)-1 before it
        search_from = max(0, len(self._held) - self._longest_stop + 1)
        self._held += new_text
        stop_at = self._find_stop(search_from)
        if stop_at is not None:
            position, self.stopped_by = stop_at
            end = position + len(self.stopped_by) if self.include_stop_str_in_output else position
            out, self._held = self._held[:end], ""
        else:
            keep = 0 if final else self._stop_prefix_length()
            cut = len(self._held) - keep
            out, self._held = self._held[:cut], self._held[cut:]
        if out:
            self._released.append(out)
        return out

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """(position, stop string) of the stop string that ends first in the held text, the earliest-starting
        one among those ending together: the one a token-by-token stream completes first, however the
        text is split into tokens."""
        best, best_key = None, None
        for stop in self.stop:
            position = self._held.find(stop, start)
            if position != -1 and (best_key is None or (position + len(stop), position) < best_key):
                best, best_key = (position, stop), (position + len(stop), position)
        return best

    def _stop_prefix_length(self) -> int:
        """Length of the longest end of the held text that a stop string begins with."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:length]):
                    longest = length
                    break
        return longest
