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
from asyncserve.sampling_params import SamplingParams
from asyncserve.scheduler.policy import POLICIES
from asyncserve.scheduler.scheduler import Scheduler, SeqUpdate
from asyncserve.scheduler.sequence import Sequence
from asyncserve.stepper.runner import ModelRunner, StepResult, make_lora_backend
from asyncserve.structured import GuideCompiler, StructuredOutputError

log = logging.getLogger("asyncserve.engine")


class RequestError(ValueError):
    """A request the engine cannot take (too long, unknown adapter, ...): a client error."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class PoolStats:
    total: int
    free: int
    kv: int
    adapter: int
    adapters_resident: int
    adapters_registered: int
    cached: int                # free pages still holding prefix-cache blocks


class Engine:
    def __init__(self, config: Config):
        self.config = config
        self.device = config.resolved_device()
        if self.device.type == "cpu":
            torch.set_num_threads(config.resolved_threads())
        self.dtype = config.resolved_dtype(self.device)
        loaded = load_model(config.model)
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_model_name or mc.name
        self.max_model_len = min(config.max_model_len or mc.max_position, mc.max_position)
        weights = build_weights(mc, loaded.weights, self.dtype, self.device)
        weight_bytes = weights.nbytes()

        page_bytes = PagedPool.page_bytes(mc.num_layers, config.block_size, mc.kv_size, self.dtype)
        num_pages = config.pool_bytes(self.device, weight_bytes) // page_bytes
        self.pool = PagedPool(num_pages, mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim,
                              self.dtype, self.device)
        self.pager = AdapterPager(self.pool, mc)
        self.lora_backend_name = config.resolved_lora_backend(self.device)
        lora = make_lora_backend(self.lora_backend_name, self.pool, mc)
        eos = self.tokenizer.eos_token_ids
        self.runner = ModelRunner(mc, weights, self.pool, self.pager, lora, eos)
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}; choose one of {sorted(POLICIES)}")
        self.scheduler = Scheduler(self.pool, self.pager, self.tokenizer, POLICIES[config.policy](),
                                   max_running=config.max_running,
                                   max_step_tokens=config.resolved_max_step_tokens(self.device),
                                   max_model_len=self.max_model_len, prefix_caching=config.prefix_caching)
        self._seeds = random.Random(config.seed)
        self.guides = GuideCompiler(self.tokenizer, self.device)
        log.info("model %s: %d layers, %s on %s, LoRA backend %s; pool %d pages x %.1f KiB = %.2f GiB",
                 self.model_name, mc.num_layers, self.dtype, self.device, self.lora_backend_name,
                 num_pages, page_bytes / 1024, num_pages * page_bytes / 2**30)
        for name, path in config.adapters.items():
            self.load_adapter(name, path)

    # ---- adapters ----------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> None:
        if name in self.pager.host:
            raise AdapterError(f"adapter {name!r} is already loaded")
        if name == self.model_name:
            raise AdapterError(f"adapter name {name!r} is the base model's name")
        self.pager.register(load_peft_adapter(name, path, self.model_config, self.dtype))

    def register_adapter(self, adapter) -> None:
        """Register an adapter already read into host memory (the server reads off the event loop)."""
        if adapter.name in self.pager.host or adapter.name == self.model_name:
            raise AdapterError(f"adapter {adapter.name!r} is already loaded")
        self.pager.register(adapter)

    def unload_adapter(self, name: str) -> None:
        if name not in self.pager.host:
            raise AdapterError(f"adapter {name!r} is not loaded")
        self.pager.unregister(name)

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
        adapter_pages = self.pager.footprint(adapter) if adapter else 0
        if self.pool.pages_for_tokens(total) + adapter_pages > self.pool.num_pages:
            raise RequestError(f"prompt + max_tokens = {total} tokens need more KV memory than the pool "
                               f"holds ({self.pool.num_pages * self.pool.block_size} tokens)", "max_tokens")
        guide = None
        if params.structured_outputs is not None:
            try:
                guide = self.guides.guide(params.structured_outputs)
            except StructuredOutputError as e:
                raise RequestError(str(e), "structured_outputs") from None
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        return Sequence(request_id=request_id or uuid.uuid4().hex, prompt_ids=list(prompt_ids), params=params,
                        adapter=adapter, seed=seed, arrival=arrival, guide=guide,
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

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[SeqUpdate]:
        plan = self.scheduler.schedule()
        if not plan:
            return self.fail_unschedulable()
        result: StepResult = self.runner.run(plan)
        return self.scheduler.postprocess(plan, result.sampled, result.prompt_logprobs)

    def fail_unschedulable(self) -> list[SeqUpdate]:
        """Nothing runs and nothing can be admitted: the head request cannot fit even alone."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        log.warning("request %s cannot be scheduled in an idle pool; aborting it", seq.request_id)
        self.scheduler.abort(seq.request_id)
        return [SeqUpdate(seq, [], "", True, "abort")]

    def pool_stats(self) -> PoolStats:
        c = self.pool.counts()
        return PoolStats(c.total, c.free, c.kv, c.adapter, len(self.pager.resident), len(self.pager.host), c.cached)

