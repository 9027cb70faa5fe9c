"""Messages between the server's actors (msgspec Structs carried through asyncio mailboxes).

A request's life:  ingress --Submit--> scheduler --RunStep--> stepper --StepDone--> scheduler
                   --TokenEvent--> the request's stream (read by ingress).
The pager takes LoadAdapter / UnloadAdapter from ingress and Prefetch from the scheduler.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec


class Submit(msgspec.Struct):
    seq: Any                          # scheduler.sequence.Sequence, validated by the ingress
    stream: asyncio.Queue             # where the scheduler puts this request's TokenEvents


class Abort(msgspec.Struct):
    request_id: str
    reason: str = "abort"


class RunStep(msgspec.Struct):
    step_id: int
    plan: Any                         # scheduler.scheduler.StepPlan


class StepDone(msgspec.Struct):
    step_id: int
    plan: Any
    result: Any = None                # stepper.runner.StepResult
    error: BaseException | None = None


class TokenEvent(msgspec.Struct):
    """New output of one request; the last one has finished=True."""
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # with the first token, when asked: the prompt's, from its second token on (Sequence.prompt_logprobs)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


class LoadAdapter(msgspec.Struct):
    name: str
    path: str
    reply: asyncio.Future


class UnloadAdapter(msgspec.Struct):
    name: str
    reply: asyncio.Future


class Prefetch(msgspec.Struct):
    adapters: list[str]               # adapters of the waiting queue's head, most urgent first


class Shutdown(msgspec.Struct):
    pass
