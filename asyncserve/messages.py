"""Messages between the server's actors (msgspec Structs carried through asyncio mailboxes).

A request's life:  ingress --Submit--> scheduler --RunStep--> stepper --StepDone--> scheduler
                   --TokenEvent--> the request's stream (read by ingress).
In cluster mode the cluster actor also Submits (requests peers forward here) and Exports (requests
moving to a peer).
The pager takes LoadAdapter / UnloadAdapter from ingress, Prefetch and FetchAdapters from the scheduler,
and answers a fetch with AdapterReady (or Aborts of the requests that waited for it).
"""
from __future__ import annotations

import asyncio

import msgspec

from asyncserve.sequence import Sequence
from asyncserve.step import Failure, StepPlan, StepResult


class Submit(msgspec.Struct):
    seq: Sequence                     # validated by the ingress (Engine.make_sequence)
    stream: asyncio.Queue             # where the scheduler puts this request's TokenEvents


def adapter_unloaded(name: str) -> Failure:
    """A queued request whose adapter was unloaded before it ran. 404 model_not_found, what the same
    request gets if sent again: a 503 would invite retries that can only end in that 404."""
    return Failure(f"adapter {name!r} was unloaded before this request ran", 404, "model_not_found")


class Abort(msgspec.Struct):
    request_id: str
    reason: str = "abort"
    failure: Failure | None = None    # set when the server ends the request; None: its client went away


class Export(msgspec.Struct):
    """Take a request out of the scheduler, between steps, to continue it on another server (cluster
    mode). The reply gets (its Sequence, its stream) once every token it generated here has been
    put on the stream, or None if it is no longer here."""
    request_id: str
    reply: asyncio.Future


class RunStep(msgspec.Struct):
    step_id: int
    plan: StepPlan


class StepDone(msgspec.Struct):
    step_id: int
    plan: StepPlan
    result: StepResult | None = None
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
    num_cached_tokens: int = 0        # of the prompt, found in the prefix cache
    error: Failure | None = None      # the request failed: the client gets this instead of a finish_reason


class LoadAdapter(msgspec.Struct):
    name: str
    path: str
    reply: asyncio.Future
    pinned: bool = False              # kept on the device for good


class FetchAdapters(msgspec.Struct):
    adapters: list[str]               # on the disk tier, wanted by parked requests: read them into the host tier


class AdapterReady(msgspec.Struct):
    name: str                         # fetched into the host tier: its parked requests can queue


class UnloadAdapter(msgspec.Struct):
    name: str
    reply: asyncio.Future


class Prefetch(msgspec.Struct):
    adapters: list[str]               # adapters of the waiting queue's head, most urgent first


class Shutdown(msgspec.Struct):
    pass
