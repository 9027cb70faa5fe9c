"""The engine: model, unified pool, adapter pager, scheduler and runner wired together.

A step is schedule -> run -> postprocess. The offline ``LLM`` calls ``step()`` in a loop; the
server's actors call the same three parts from the scheduler and stepper actors.
"""
from __future__ import annotations

import logging
import random
import uuid
from dataclasses import dataclass

import torch

from asyncserve.config import Config
from asyncserve.model.llama import build_weights
from asyncserve.model.loader import load_model
from asyncserve.pager.adapters import AdapterError, load_peft_adapter
from asyncserve.pager.pager import AdapterPager
from asyncserve.pager.pool import PagedPool
from asyncserve.perf_model import PerfCoefficients, StepLatencyModel
from asyncserve.sampling_params import SamplingParams
from asyncserve.scheduler.policy import POLICIES
from asyncserve.scheduler.scheduler import Scheduler
from asyncserve.sequence import Sequence
from asyncserve.step import Failure, SeqUpdate, StepPlan, StepResult
from asyncserve.stepper.runner import ModelRunner, make_lora_backend
from asyncserve.structured import GuideCompiler, StructuredOutputError

log = logging.getLogger("asyncserve.engine")

# where the step-time model starts until this engine's own steps refit it (SmolLM2-sized on 2 CPU cores)
STEP_TIME_PRIOR = PerfCoefficients(beta=0.02, alpha_token=2e-4, alpha_rank=0.0, source="prior")

# the head request cannot fit even with the pool to itself (make_sequence admits few such): no retry helps
UNSCHEDULABLE = Failure("the request cannot be scheduled: its KV pages and its adapter's do not fit in the pool "
                        "even with nothing else running; ask for fewer tokens", 400, "insufficient_pool_memory")


class RequestError(ValueError):
    """A request the engine cannot take (too long, unknown adapter, ...): a client error."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class PoolStats:
    total: int
    free: int
    kv: int
    adapter: int
    adapters_resident: int
    adapters_registered: int
    cached: int                # free pages still holding prefix-cache blocks


@dataclass(frozen=True)
class LoadSnapshot:
    """What the server asks of the engine's state: the 429 check, /metrics and (later) the cluster
    digest all read this one snapshot instead of the engine's parts."""
    waiting: int
    running: int
    pool: PoolStats
    adapter_loads_total: int           # page-ins into the pool so far
    prefix_queried_tokens: int         # prompt tokens of admissions that looked up the prefix cache
    prefix_hit_tokens: int             # of those, tokens found cached


class Engine:
    def __init__(self, config: Config):
        config.validate()                    # before the seconds of loading
        self.config = config
        self.device = config.resolved_device()
        if self.device.type == "cpu":
            torch.set_num_threads(config.resolved_threads())
        self.dtype = config.resolved_dtype(self.device)
        loaded = load_model(config.model)
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_model_name or mc.name
        if config.max_model_len is not None and config.max_model_len > mc.max_position:
            raise ValueError(f"max_model_len {config.max_model_len} is beyond the model's context of "
                             f"{mc.max_position} tokens")
        self.max_model_len = config.max_model_len or mc.max_position
        weights = build_weights(mc, loaded.weights, self.dtype, self.device)
        weight_bytes = weights.nbytes()

        page_bytes = PagedPool.page_bytes(mc.num_layers, config.block_size, mc.kv_size, self.dtype)
        num_pages = config.pool_bytes(self.device, weight_bytes) // page_bytes
        if num_pages < 1:
            raise ValueError(f"the pool ({config.pool_bytes(self.device, weight_bytes)} bytes) is smaller than one "
                             f"page of {page_bytes} bytes ({config.block_size} tokens of KV); raise pool_mem")
        self.pool = PagedPool(num_pages, mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim,
                              self.dtype, self.device)
        self.pager = AdapterPager(self.pool, mc)
        self.lora_backend_name = config.resolved_lora_backend(self.device)
        lora = make_lora_backend(self.lora_backend_name, self.pool, mc)
        eos = self.tokenizer.eos_token_ids
        self.runner = ModelRunner(mc, weights, self.pool, self.pager, lora, eos)
        self.scheduler = Scheduler(self.pool, self.pager, self.tokenizer, POLICIES[config.policy](),
                                   max_running=config.max_running,
                                   max_step_tokens=config.resolved_max_step_tokens(self.device),
                                   max_model_len=self.max_model_len, prefix_caching=config.prefix_caching)
        self._seeds = random.Random(config.seed)
        self.latency = StepLatencyModel(STEP_TIME_PRIOR)
        self.guides = GuideCompiler(self.tokenizer, self.device)
        log.info("model %s: %d layers, %s on %s, LoRA backend %s; pool %d pages x %.1f KiB = %.2f GiB",
                 self.model_name, mc.num_layers, self.dtype, self.device, self.lora_backend_name,
                 num_pages, page_bytes / 1024, num_pages * page_bytes / 2**30)
        for name, path in config.adapters.items():
            self.load_adapter(name, path)

    # ---- adapters ----------------------------------------------------------------------------
    def check_adapter_name(self, name: str) -> None:
        """The one check a new adapter's name passes: neither an adapter's nor the base model's."""
        if name in self.pager.host:
            raise AdapterError(f"adapter {name!r} is already loaded")
        if name == self.model_name:
            raise AdapterError(f"adapter name {name!r} is the base model's name")

    def load_adapter(self, name: str, path: str) -> None:
        self.check_adapter_name(name)
        self.pager.register(load_peft_adapter(name, path, self.model_config, self.dtype))

    def register_adapter(self, adapter) -> None:
        """Register an adapter already read into host memory (the server reads off the event loop)."""
        self.check_adapter_name(adapter.name)
        self.pager.register(adapter)

    def unload_adapter(self, name: str) -> list[str]:
        """Forget an adapter (KeyError if unknown). Running sequences finish with their resident copy;
        the queued ones can no longer run: their ids are returned for the caller to end."""
        if name not in self.pager.host:
            raise KeyError(name)
        queued = [seq.request_id for seq in self.scheduler.waiting if seq.adapter == name]
        self.pager.unregister(name)
        return queued

    def prefetch_candidates(self, limit: int = 8) -> list[str]:
        """Adapters of the waiting queue's first ``limit`` requests, most urgent first."""
        heads = [seq.adapter for seq in list(self.scheduler.waiting)[:limit] if seq.adapter is not None]
        return list(dict.fromkeys(heads))

    def prefetch(self, names: list[str]) -> int:
        """Page in queued requests' adapters while a step runs, using only pages that admission would
        leave free anyway (S-LoRA §5.2); returns how many were paged in."""
        spare = self.pool.num_free - self.scheduler.blocks.watermark - len(self.scheduler.running)
        paged = 0
        for name in names:
            if name not in self.pager.host or self.pager.is_resident(name):
                continue
            need = self.pager.footprint(name)
            if need > spare:
                break
            if self.pager.ensure_resident(name) is not None:
                spare -= need
                paged += 1
        return paged

    @property
    def adapter_names(self) -> list[str]:
        return list(self.pager.host)

    # ---- requests ----------------------------------------------------------------------------
    def make_sequence(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
                      request_id: str | None = None, arrival: float = 0.0) -> Sequence:
        """Validate a request against the model and pool; raises RequestError for client mistakes."""
        if adapter is not None and adapter not in self.pager.host:
            raise RequestError(f"adapter {adapter!r} is not loaded", "model", 404)
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is out of range [0, {vocab})", "prompt")
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestError(f"{name} names token id {bad[0]}, past the vocabulary ({vocab} tokens)", name)
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                               f"{self.max_model_len} tokens, leaving no room to generate", "prompt")
        total = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        kv_pages = self.pool.pages_for_tokens(total)
        adapter_pages = self.pager.footprint(adapter) if adapter else 0
        if kv_pages > self.pool.num_pages:
            raise RequestError(f"prompt + max_tokens = {total} tokens need more KV memory than the pool "
                               f"holds ({self.pool.num_pages * self.pool.block_size} tokens)", "max_tokens")
        if kv_pages + adapter_pages > self.pool.num_pages:     # the request alone would fit; its adapter tips it over
            room = (self.pool.num_pages - adapter_pages) * self.pool.block_size
            raise RequestError(f"adapter {adapter!r} takes {adapter_pages} of the pool's {self.pool.num_pages} pages, "
                               f"leaving KV room for {max(room, 0)} tokens; prompt + max_tokens = {total} tokens "
                               f"do not fit beside it", "max_tokens")
        guide = None
        if params.structured_outputs is not None:
            try:
                guide = self.guides.guide(params.structured_outputs)
            except StructuredOutputError as e:
                raise RequestError(str(e), "structured_outputs") from None
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        return Sequence(request_id=request_id or uuid.uuid4().hex, prompt_ids=list(prompt_ids), params=params,
                        adapter=adapter, seed=seed, arrival=arrival, guide=guide,
                        adapter_rank=max(self.pager.host[adapter].ranks) if adapter else 0,
                        bad_words_ids=self._bad_words_ids(params.bad_words))

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as it would start the text and after a space (as vLLM bans them)."""
        out = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step: schedule -> run -> postprocess ------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's plan (empty: nothing can run now; see fail_unschedulable)."""
        return self.scheduler.schedule()

    def run(self, plan: StepPlan) -> StepResult:
        """Compute the step: the model's forward and sampling (in the one thread that runs torch)."""
        return self.runner.run(plan)

    def postprocess(self, plan: StepPlan, result: StepResult) -> list[SeqUpdate]:
        """Apply a computed step: tokens appended, stop rules, finished sequences freed."""
        self.latency.record(_rank_chunks(plan), result.duration_s)
        return self.scheduler.postprocess(plan, result.sampled, result.prompt_logprobs)

    def predict_step_seconds(self, plan: StepPlan) -> float:
        """The rank-aware step-time model's estimate for a plan (CaraServe §5), refitted from the
        steps this engine has run."""
        return self.latency.predict(_rank_chunks(plan))

    def step(self) -> list[SeqUpdate]:
        plan = self.schedule()
        if not plan:
            return self.fail_unschedulable()
        return self.postprocess(plan, self.run(plan))

    def fail_unschedulable(self) -> list[SeqUpdate]:
        """Nothing runs and nothing can be admitted: the head request cannot fit even alone."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        log.warning("request %s cannot be scheduled in an idle pool; ending it", seq.request_id)
        self.scheduler.abort(seq.request_id)
        return [SeqUpdate(seq, [], "", True, "error", error=UNSCHEDULABLE)]

    def pool_stats(self) -> PoolStats:
        c = self.pool.counts()
        return PoolStats(c.total, c.free, c.kv, c.adapter, len(self.pager.resident), len(self.pager.host), c.cached)

    # ---- what the server's parts ask -----------------------------------------------------------
    def has_adapter(self, name: str) -> bool:
        return name in self.pager.host

    def adapter_paths(self) -> dict[str, str]:
        """Registered adapters, name -> the folder each was read from."""
        return {name: adapter.path for name, adapter in self.pager.host.items()}

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def compile_constraint(self, spec) -> None:
        """Build and cache a structured-output constraint's automaton (seconds for a large one: call it
        off the event loop), so that make_sequence finds it ready; raises StructuredOutputError."""
        self.guides.index(spec)

    def load_snapshot(self) -> LoadSnapshot:
        s, blocks = self.scheduler, self.scheduler.blocks
        return LoadSnapshot(waiting=len(s.waiting), running=len(s.running), pool=self.pool_stats(),
                            adapter_loads_total=self.pager.loads_total,
                            prefix_queried_tokens=blocks.prefix_queried_tokens,
                            prefix_hit_tokens=blocks.prefix_hit_tokens)


def _rank_chunks(plan: StepPlan) -> list[tuple[int, int]]:
    """A step as the latency model sees it: (tokens, adapter rank) per chunk."""
    return [(c.num_tokens, c.seq.adapter_rank) for c in plan.chunks]
