"""The types that define a step, on the ground floor: the scheduler plans a StepPlan, the runner
computes it into a StepResult, and the scheduler turns that into one SeqUpdate per request. The
offline loop and the server's actors pass these same objects (messages.py carries them)."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from asyncserve.sequence import Sequence


class Failure(msgspec.Struct):
    """Why the server ended a request it had accepted, as its client sees it: OpenAI's error shape
    with this HTTP status (the response's, or the error event's in a stream that already began)."""
    message: str
    status: int = 500
    code: str = "internal_error"


class EngineFailed(RuntimeError):
    """The engine cannot run another step (a tensor-parallel rank died): its requests get 503 and the
    server exits."""


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int
    # speculative decoding (scheduler/drafts.py): tokens guessed to follow the sequence's last one; the
    # chunk is that token and these, each position sampled, kept while the draft matches the samples
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence's known tokens (so a token is sampled)."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens + len(self.draft)

    @property
    def num_sampled(self) -> int:
        """Rows of the step's SampleOutput that are this chunk's: one per drafted token and one more."""
        return len(self.draft) + 1 if self.samples else 0

    def token_at(self, pos: int) -> int:
        """The chunk's token at position pos: the sequence's, then the draft's."""
        known = self.seq.num_tokens
        return self.seq.token_at(pos) if pos < known else self.draft[pos - known]


@dataclass
class StepPlan:
    # grouped by adapter; one token each, or with a draft its last token and the draft (a decode row each)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)   # grouped by adapter
    # dLoRA's merged mode: the adapter whose weights are merged into the base weights for this step
    # (its chunks then need no LoRA compute, and the plan holds no other adapter's or base chunks);
    # None: the base weights, every adapter's LoRA computed unmerged
    merged: str | None = None
    # CPU assist (CaraServe §4): adapter loads whose LoRA the CPU workers compute this step, from the host
    # tier, because they are not on the device (or their copy there waits until after this step)
    assisted: frozenset[int] = frozenset()

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


@dataclass
class SeqUpdate:
    """What one step changed for one request: new tokens and text, and whether it ended."""
    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: Failure | None = None        # the request failed (finish_reason "error"): what its client gets


@dataclass
class SampleOutput:
    # None for a row that leaves nothing to choose (see errors)
    token_ids: list[int | None]
    # logprob of each chosen token; None for rows that did not ask (the whole field is None when none asked)
    logprobs: list[float | None] | None
    # top-N (token id, logprob) per row, best first; [] for rows that asked for logprobs=0 or none
    top_logprobs: list[list[tuple[int, float]]] | None
    # row -> why it has no token: its logits hold NaN or +inf (a corrupt adapter, say), or its own
    # constraints set every token to -inf; the caller ends those requests with that error
    errors: dict[int, Failure] = field(default_factory=dict)


@dataclass
class StepResult:
    sampled: SampleOutput
    duration_s: float
    num_tokens: int
    # request id -> logprobs and top logprobs of the prompt tokens this step's chunk predicted
    prompt_logprobs: dict[str, tuple[list[float], list[list[tuple[int, float]]]]] = field(default_factory=dict)
