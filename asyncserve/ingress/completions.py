"""/v1/completions: prompts (text or token ids, one or many), echo, and OpenAI's completions logprobs."""
from __future__ import annotations

from aiohttp import web

from asyncserve.ingress.prepare import (max_tokens, new_sequence, num_samples, ready_server, sample_params,
                                        served_adapter, structured_outputs)
from asyncserve.ingress.protocol import (ApiError, CompletionRequest, decode_body, prompts_of, refuse_unsupported,
                                         sampling_params, truncated_prompt)
from asyncserve.ingress.relay import Choice, Collected, Reply
from asyncserve.ingress.tokenizing import decode, encode
from asyncserve.messages import TokenEvent


class EchoedChoice(Choice):
    def __init__(self, index: int, seq, echo: str):
        super().__init__(index, seq)
        self.echo = echo           # the echoed prompt: before the choice's first text
        self.prefix = echo         # streamed: what is still owed before the next text
        self.offset = 0            # characters of text sent (logprobs' text_offset)


async def completions(request: web.Request) -> web.StreamResponse:
    server = ready_server(request)
    req = decode_body(await request.read(), CompletionRequest)
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of > 1 is not supported", param="best_of", code="invalid_value")
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix", code="invalid_value")
    refuse_unsupported(req)
    adapter = await served_adapter(server, req.model)
    n = num_samples(req)
    structured = await structured_outputs(server, req)
    choices, prompt_tokens = [], 0
    for prompt in prompts_of(req):
        given = await encode(server, prompt, req.add_special_tokens) if isinstance(prompt, str) else list(prompt)
        prompt_ids = truncated_prompt(given, req, server.engine.max_model_len)
        # echo with logprobs scores the echoed prompt too (as vLLM does; lm-eval's loglikelihood relies on it)
        params = sampling_params(req, max_tokens(server, prompt_ids, req.max_tokens, 16, "max_tokens"), req.logprobs,
                                 req.logprobs if req.echo else None, structured)
        whole = isinstance(prompt, str) and len(prompt_ids) == len(given)
        echo = (prompt if whole else await decode(server, prompt_ids)) if req.echo else ""
        for sample in range(n):
            seq = new_sequence(server, prompt_ids, sample_params(params, sample), adapter)
            choices.append(EchoedChoice(len(choices), seq, echo))
        prompt_tokens += len(prompt_ids)
    return await CompletionReply(server, req, choices, prompt_tokens).answer(request)


class CompletionReply(Reply):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def logprobs_block(self, event: TokenEvent, offset: int, prompt_ids: list[int]) -> dict | None:
        """The event's tokens from text offset ``offset``, after the prompt's when the event carries
        its logprobs (echo: the first prompt token has none). As in OpenAI's completions, each
        top_logprobs entry also holds the token itself: up to logprobs + 1 items."""
        if self.req.logprobs is None or not event.token_ids:
            return None
        ids, lps, tops = event.token_ids, event.logprobs, event.top_logprobs
        if event.prompt_logprobs is not None:
            ids, lps = prompt_ids + ids, [None] + event.prompt_logprobs + lps
            tops = [None] + event.prompt_top_logprobs + tops
        tokens = [self.token_text(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top_dicts = [None if top is None else {**{self.token_text(i): v for i, v in top}, text: lp}
                     for top, text, lp in zip(tops, tokens, lps)]
        return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets, "top_logprobs": top_dicts}

    async def stream_event(self, choice: EchoedChoice, event: TokenEvent) -> None:
        text, choice.prefix = choice.prefix + event.text, ""      # the echoed prompt goes out first
        if not (text or event.token_ids or event.finished):
            return
        scored_echo = event.prompt_logprobs is not None         # its tokens start at the echo
        lp = self.logprobs_block(event, choice.offset + (0 if scored_echo else len(text) - len(event.text)),
                                 choice.seq.prompt_ids)
        choice.offset += len(text)
        await self.send(self.head(self.chunk_object, [
            {"index": choice.index, "text": text, "logprobs": lp,
             "finish_reason": event.finish_reason if event.finished else None,
             **self.returned_ids(choice, event.token_ids)}]))

    def collected_choice(self, choice: EchoedChoice, c: Collected) -> dict:
        lp = None
        if self.req.logprobs is not None:
            event = TokenEvent(choice.seq.request_id, c.tokens, "", logprobs=c.logprobs, top_logprobs=c.top,
                               prompt_logprobs=c.prompt_logprobs, prompt_top_logprobs=c.prompt_top)
            lp = self.logprobs_block(event, 0 if c.prompt_logprobs is not None else len(choice.echo),
                                     choice.seq.prompt_ids)
        return {"index": choice.index, "text": choice.echo + c.text, "logprobs": lp, "finish_reason": c.finish,
                **self.returned_ids(choice, c.tokens)}
