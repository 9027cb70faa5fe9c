"""Output processing: each request's text as its tokens arrive, and the rules that end it (stop
strings and tokens, EOS, structured-output completion, max_tokens, the context length)."""
from __future__ import annotations

import logging

from asyncserve.model.detokenizer import IncrementalDetokenizer
from asyncserve.model.tokenizer import Tokenizer
from asyncserve.sequence import Sequence

log = logging.getLogger("asyncserve.scheduler")


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.detoks: dict[str, IncrementalDetokenizer] = {}

    def start(self, seq: Sequence) -> None:
        p = seq.params
        detok = self.detoks[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_ids, skip_special_tokens=p.skip_special_tokens,
            stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)
        for token in seq.output_ids:    # continued from another server: its client has this text already
            detok.add(token)

    def drop(self, request_id: str) -> None:
        self.detoks.pop(request_id, None)

    def append(self, seq: Sequence, token: int) -> tuple[str, str | None]:
        """Append a sampled token: (the text it adds, the finish reason if the sequence ends here)."""
        p = seq.params
        seq.output_ids.append(token)
        detok = self.detoks[seq.request_id]
        text = detok.add(token)
        n_out = len(seq.output_ids)
        reason = None
        # a guide allows the end-of-sequence token only where its text is complete: that ends the
        # sequence whatever ignore_eos and min_tokens say
        guide_done = seq.guide is not None and seq.guide.constraining and token in self.tokenizer.eos_token_ids
        if seq.guide is not None and not guide_done:
            try:
                seq.guide.advance(token)
            except ValueError as e:     # the sampler gives only allowed tokens; never let one request stop the rest
                log.error("request %s: token %d is outside its constraint (%s); ending it", seq.request_id, token, e)
                guide_done = True
        if detok.stopped_by is not None or guide_done:
            reason = "stop"
        elif n_out >= p.min_tokens and (token in p.stop_token_ids or
                                        (not p.ignore_eos and token in self.tokenizer.eos_token_ids)):
            reason = "stop"
        elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            text += detok.finish()
        return text, reason
