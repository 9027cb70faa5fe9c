"""Offline API: batch generation over many adapters in one call.

    llm = LLM(model=None, adapters={"name": "peft-folder"})
    llm = LLM(adapter_dir="folder-of-adapters", host_adapter_mem="4GiB")   # registered; read when first used
    llm = LLM(adapter_dir="folder-of-adapters", preload_adapters=True)     # read into host memory now
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0), adapters=[...])
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

from asyncserve.config import Config
from asyncserve.engine import Engine
from asyncserve.sampling_params import SamplingParams
from asyncserve.step import Failure


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    adapter: str | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # params.prompt_logprobs: entry j is prompt token j + 1's (the first token has none)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    error: Failure | None = None     # finish_reason "error": why (e.g. code slo_unattainable, status 429)


class LLM:
    def __init__(self, model: str | None = None, adapters: dict[str, str] | None = None, dtype: str = "auto",
                 device: str = "auto", lora_backend: str = "auto", **engine_kwargs):
        self.engine = Engine(Config(model=model, adapters=dict(adapters or {}), dtype=dtype, device=device,
                                          lora_backend=lora_backend, **engine_kwargs))
        if self.engine.preloading:
            self.engine.preload_now()
        self.tokenizer = self.engine.tokenizer

    def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        self.engine.load_adapter(name, path, pinned)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def generate(self, prompts: Seq[str] | Seq[Seq[int]] | str, params: SamplingParams | None = None,
                 adapters: str | None | Seq[str | None] = None) -> list[RequestOutput]:
        """One request per prompt (text, or token ids); ``adapters`` is one name for all or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if adapters is None or isinstance(adapters, str):
            adapters = [adapters] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapters given for {len(prompts)} prompts")
        outputs: dict[str, RequestOutput] = {}
        order = []
        for prompt, adapter in zip(prompts, adapters):
            if isinstance(prompt, str):
                ids, text = self.tokenizer.encode(prompt), prompt
            else:
                ids, text = list(prompt), None
            seq = self.engine.make_sequence(ids, params, adapter, arrival=time.monotonic())   # TTFT SLO's clock
            outputs[seq.request_id] = RequestOutput(seq.request_id, text, ids, adapter)
            order.append(seq)
        for seq in order:
            self.engine.add(seq)
        while self.engine.has_unfinished():
            for update in self.engine.step():
                out = outputs[update.seq.request_id]
                out.token_ids += update.new_token_ids
                out.text += update.new_text
                if update.finished:
                    out.finish_reason, out.error = update.finish_reason, update.error
        for seq in order:
            out = outputs[seq.request_id]
            if seq.params.logprobs is not None:
                out.logprobs, out.top_logprobs = seq.logprobs, seq.top_logprobs
            if seq.params.prompt_logprobs is not None:
                out.prompt_logprobs, out.prompt_top_logprobs = seq.prompt_logprobs, seq.prompt_top_logprobs
        return [outputs[seq.request_id] for seq in order]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             adapters: str | None | Seq[str | None] = None, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Applies the model's chat template; one conversation or a list of them. The keywords are
        vLLM's LLM.chat's: the tools shown to the template, more template variables (as
        enable_thinking), and the last assistant message continued rather than answered."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(
            c, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, **(chat_template_kwargs or {})), add_special_tokens=False) for c in conversations]
        return self.generate(prompts, params, adapters)
