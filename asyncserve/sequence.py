"""A request's state inside the engine: tokens, KV pages, adapter, sampling position."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from asyncserve.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None                 # None = base model
    seed: int                           # params.seed, or drawn at arrival (exportable with the tokens)
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None       # Qwen3.5: its linear-attention states' slot while it holds pages
    num_computed: int = 0               # tokens whose KV is in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    migrations: int = 0                 # times moved between servers for load (cluster mode)
    adapter_load: int | None = None     # while running: which load of the adapter it holds (AdapterPager)
    cold: bool = False                  # running while that load is not on the device: CPU workers compute its LoRA
    adapter_rank: int = 0               # its adapter's largest rank (0: base model), for step-time estimates
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # params.prompt_logprobs: entry j is prompt token j + 1's, as predicted from the tokens before it
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    first_token_time: float | None = None
    # params.structured_outputs: its walk over the constraint's automaton (structured.SequenceGuide)
    guide: object | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)   # params.bad_words, tokenized
    # prefix cache (Scheduler): what block 0's key hangs from (None: not cached), the keys of the
    # full blocks so far, and how many of this sequence's pages are registered under them
    cache_root: tuple | None = None
    block_keys: list[tuple] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int | None = None   # of its prompt, found cached when it was first admitted
    # speculative decoding: where its n-grams occurred (scheduler/drafts.NgramIndex), built on first draft
    ngram_index: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, lo: int, hi: int) -> list[int]:
        """token_ids[lo:hi] without building token_ids."""
        n = len(self.prompt_ids)
        return self.prompt_ids[lo:hi] + self.output_ids[max(lo - n, 0):max(hi - n, 0)]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def in_prefill(self) -> bool:
        """True while more than the last token still needs its KV computed."""
        return self.num_tokens - self.num_computed > 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
