"""The engine: model, unified pool, adapter pager, scheduler and runner wired together.

A step is schedule -> run -> postprocess. The offline ``LLM`` calls ``step()`` in a loop; the
server's actors call the same three parts from the scheduler and stepper actors.

Adapters live in three tiers (pager/pager.py): registered on disk, cached in host memory, paged into
the device pool. A request whose adapter is only on disk is parked here, outside the scheduler,
until its adapter is read into the host tier (by ``step()`` offline, by the pager actor in the
server), so it holds up no one; the load failing fails those requests alone.
"""
from __future__ import annotations

import logging
import os
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from asyncserve.config import Config
from asyncserve.cpus import describe as describe_cpus
from asyncserve.lora.dora import DoraBase
from asyncserve.model import hub
from asyncserve.model.config import ModelLoadError
from asyncserve.model.linear_attention import LinearStates
from asyncserve.model.llama import build_weights
from asyncserve.model.loader import gguf_k_quants, load_model
from asyncserve.model.shard import Shard, shard_config
from asyncserve.pager.adapters import (AdapterError, PeftFolder, build_host_adapter, check_adapter_name,
                                      inspect_peft_folder, printable, read_peft_folder)
from asyncserve.pager.pager import AdapterPager, Registration
from asyncserve.pager.pool import PagedPool
from asyncserve.pager.remote import FetchError, is_url
from asyncserve.pager.remote import fetch as fetch_adapter      # beside the pager's own fetches, disk -> host
from asyncserve.perf_model import STEP_TIME_PRIOR, PerfCoefficients, StepChunk, StepLatencyModel, adapter_load_seconds
from asyncserve.progress import Progress
from asyncserve.sampling_params import SamplingParams
from asyncserve.scheduler.drafts import NgramDrafter
from asyncserve.scheduler.policies import make_policy
from asyncserve.scheduler.policy import PolicySettings
from asyncserve.scheduler.scheduler import Scheduler
from asyncserve.sequence import SeqStatus, Sequence
from asyncserve.step import Failure, SeqUpdate, StepPlan, StepResult
from asyncserve.step_profile import starting_coefficients
from asyncserve.stepper.assist import CpuAssist
from asyncserve.stepper.runner import ModelRunner, make_lora_backend
from asyncserve.structured import GuideCompiler, StructuredOutputError
from ipc import cleanup_stale

log = logging.getLogger("asyncserve.engine")

# the head request cannot fit even with the pool to itself (make_sequence admits few such): no retry helps
UNSCHEDULABLE = Failure("the request cannot be scheduled: its KV pages and its adapter's do not fit in the pool "
                        "even with nothing else running; ask for fewer tokens", 400, "insufficient_pool_memory")


def adapter_load_failed(name: str, error: Exception) -> Failure:
    """A request whose adapter, registered from disk, could not be read when it was needed."""
    return Failure(f"adapter {name!r} could not be loaded: {error}", 500, "adapter_load_failed")


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
    adapters_resident: int     # on the device (tier counts are inclusive: these are on host and disk too)
    adapters_host: int         # in the host tier
    adapters_registered: int   # every adapter (the disk tier)
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
    cpu_workers: int = 0               # live CPU LoRA workers
    cpu_assist_tokens: int = 0         # tokens whose LoRA the CPU workers computed so far
    cpu_worker_restarts: int = 0       # workers replaced after dying or missing a deadline
    spec_draft_tokens: int = 0         # speculative decoding: tokens drafted so far
    spec_accepted_tokens: int = 0      # of those, tokens kept


@dataclass(frozen=True)
class MergeStats:
    """dLoRA's merged mode so far, for /metrics."""
    merged: str | None                 # the adapter merged into the base weights now
    switches: int                      # changes of what is merged
    switch_seconds: dict[str, float]   # by kind, "merge" | "unmerge": time spent switching
    step_seconds: dict[str, float]     # by mode, "merged" | "unmerged": time spent in steps


class Engine:
    def __init__(self, config: Config):
        config.validate()                    # before the seconds of loading
        self.config = config
        self.device = config.resolved_device()
        tp = config.tensor_parallel
        # tensor parallelism: this process is rank 0 and loads its shard; on CPU one torch thread per core of its own
        self.tp_cores = None
        if config.uses_tp_group and self.device.type == "cpu":
            from ipc.collective import cores_for_ranks
            self.tp_cores = cores_for_ranks(tp, config.tp_cores)
        if self.device.type == "cpu":
            torch.set_num_threads(len(self.tp_cores[0]) if self.tp_cores else config.resolved_threads())
            log.info("%d torch threads (%s)", torch.get_num_threads(), describe_cpus())
        self.dtype = config.resolved_dtype(self.device)
        model_path = None if config.model is None else hub.resolve(config.model, config.revision)
        loading = Progress(f"loading {config.model or 'the default model'}", "tensors")
        try:
            # GGUF blocks stay blocks on CPU (build_weights dequantizes them where the quantized kernels don't run)
            k_quants = self.device.type == "cpu" and config.keep_quantized is None and gguf_k_quants(model_path)
            keep = config.resolved_keep_quantized(self.device, self.dtype, k_quants=k_quants)
            loaded = load_model(model_path, loading, keep_quantized=keep, quantize=config.quantize,
                                shard=Shard(0, tp) if tp > 1 else None)
        finally:
            loading.close()
        if model_path != config.model:        # a Hub id names the model, not its snapshot's commit folder
            loaded.config.name = config.model
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_model_name or mc.name
        if config.max_model_len is not None and config.max_model_len > mc.max_position:
            raise ValueError(f"max_model_len {config.max_model_len} is beyond the model's context of "
                             f"{mc.max_position} tokens")
        self.max_model_len = config.max_model_len or mc.max_position
        if mc.rope_scaling and mc.rope_scaling.get("rope_type") == "longrope":
            original = mc.rope_scaling["original_max_position_embeddings"]
            mc.rope_scaling = {**mc.rope_scaling, "long_factors": self.max_model_len > original}
            if self.max_model_len > original:
                log.warning("longrope: the long-context factors rotate every position, as sequences may grow to "
                            "%d tokens; for sequences of at most %d (the pretraining context) set max_model_len "
                            "to %d, which rotates them with the short factors as transformers does",
                            self.max_model_len, original, original)
        # a window no sequence outgrows hides nothing: those layers attend globally (and natively)
        windows = [w if w is not None and w < self.max_model_len else None for w in mc.layer_windows]
        mc.layer_windows = windows if any(windows) else []
        # the decoder this process runs: the whole model, or rank 0's shard of it (model/shard.py)
        self.shard_config = sc = shard_config(mc, tp)
        if mc.linear_layers:
            _check_linear_attention_settings(config, self.device)
        weights = build_weights(sc, loaded.weights, self.dtype, self.device)
        weight_bytes = weights.nbytes()

        # a page holds the KV of the rank's KV heads: every rank's pool has the same pages (pool_mem each)
        page_bytes = PagedPool.page_bytes(mc.kv_layers, config.block_size, sc.kv_size, self.dtype)
        # linear-attention layers keep a state per running sequence instead, out of the same memory
        state_slots = config.max_running if mc.linear_layers else 0
        state_bytes = state_slots * LinearStates.nbytes_per_slot(mc.linear_attention, sum(mc.linear_layers),
                                                                 self.dtype) if state_slots else 0
        num_pages = (config.pool_bytes(self.device, weight_bytes) - state_bytes) // page_bytes
        if num_pages < 1:
            raise ValueError(f"the pool ({config.pool_bytes(self.device, weight_bytes)} bytes, {state_bytes} of them "
                             f"for linear-attention states) is smaller than one page of {page_bytes} bytes "
                             f"({config.block_size} tokens of KV); raise pool_mem")
        if state_slots:
            log.info("linear-attention states: %d slots (max_running) x %.1f MiB = %.2f GiB of the pool's memory",
                     state_slots, state_bytes / state_slots / 2**20, state_bytes / 2**30)
        self.pool = PagedPool(num_pages, mc.kv_layers, config.block_size, sc.num_kv_heads, mc.head_dim,
                              self.dtype, self.device)
        removed = cleanup_stale()          # shared memory of asyncserve processes killed before their exit
        if removed:
            log.info("removed %d shared-memory objects of dead asyncserve processes", len(removed))
        self.pager = AdapterPager(self.pool, mc, self.dtype, config.host_adapter_bytes(), Shard(0, tp))
        self.tp = None                   # stepper/tp.py's TensorParallel
        self.on_fatal: Callable[[str], None] | None = None   # the server's: a rank died, stop (exit 1)
        if config.uses_tp_group:         # the ranks load their shards while this process goes on
            self.tp = self._start_ranks(model_path, num_pages)
        self.parked: dict[str, list[Sequence]] = {}    # adapter on disk -> requests waiting for its load
        self._loading: dict[str, float] = {}            # parked adapter whose load has started (server) -> when
        self._preload: deque[str] = deque()             # registered adapters still to read into the host tier
        self.preloading = False                         # until take_preload finds no more
        self.lora_backend_name = config.resolved_lora_backend(self.device)
        lora = make_lora_backend(self.lora_backend_name, self.pool, sc)
        eos = self.tokenizer.eos_token_ids
        self.runner = ModelRunner(sc, weights, self.pool, self.pager, lora, eos, state_slots)
        if self.tp is not None:
            self._wait_ranks()
        # ASYNCSERVE_ENFORCE_EAGER=1: --enforce-eager for every engine of the process (the GPU test runs)
        graphs = self.device.type == "cuda" and not (config.enforce_eager or os.environ.get("ASYNCSERVE_ENFORCE_EAGER") == "1")
        if graphs and (mc.layer_windows or mc.attn_softcap):
            # the graphs' decode attention is kernels.paged_attention, which takes neither a window nor a cap
            log.info("CUDA graphs off: %s has sliding windows or attention soft-capping (--enforce-eager)", mc.name)
            graphs = False
        if graphs and mc.moe is not None:
            # which expert runs which tokens is read back from the router mid-step: nothing to capture
            log.info("CUDA graphs off: %s is a mixture of experts, routed on the host each step", mc.name)
            graphs = False
        if graphs and mc.linear_layers:
            log.info("CUDA graphs off: %s has linear-attention layers, run eagerly", mc.name)
            graphs = False
        if graphs and self.tp is not None:
            # a replayed decode step skips the plan every rank runs; replaying on every rank in step would
            # need each rank's own graphs and LoRA slot tables kept alike, so TP steps run eagerly
            log.info("CUDA graphs off under tensor parallelism: every rank runs each step eagerly")
            graphs = False
        if graphs:
            from asyncserve.stepper.cuda_graphs import CudaSeam
            self.runner.enable_graphs(CudaSeam(self.device), config.max_running,
                                      -(-self.max_model_len // config.block_size))
        compile_s = lora.warm_up()
        if compile_s:
            log.info("LoRA backend %s: kernels warmed up in %.1f s", self.lora_backend_name, compile_s)
        self._merge_refs: set[int] = set()             # adapter loads held for being merged (see postprocess)
        self._mode_seconds = {"merged": 0.0, "unmerged": 0.0}
        self.latency = StepLatencyModel(STEP_TIME_PRIOR, attention_windows=mc.layer_windows)
        max_step_tokens = config.resolved_max_step_tokens(self.device)
        policy = make_policy(config.policy, PolicySettings(
            max_running=config.max_running, max_step_tokens=max_step_tokens, latency=self.latency,
            max_step_adapters=config.max_step_adapters, slo_ttft_s=config.slo_ttft_s, slo_tpot_s=config.slo_tpot_s,
            switch_seconds=self.merge_seconds, merge_refusal=self.merge_refusal))
        draft_tokens = 0 if mc.linear_layers else config.resolved_speculative_tokens(self.device)
        drafter = NgramDrafter(draft_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                               config.speculative_max_batch) if draft_tokens else None
        self.scheduler = Scheduler(self.pool, self.pager, self.tokenizer, policy, max_running=config.max_running,
                                   max_step_tokens=max_step_tokens, max_model_len=self.max_model_len,
                                   prefix_caching=config.prefix_caching and not mc.linear_layers, drafter=drafter,
                                   state_slots=state_slots)
        self._seeds = random.Random(config.seed)
        self.guides = GuideCompiler(self.tokenizer, self.device)
        log.info("model %s: %d layers, %s on %s, LoRA backend %s; pool %d pages x %.1f KiB = %.2f GiB",
                 self.model_name, mc.num_layers, self.dtype, self.device, self.lora_backend_name,
                 num_pages, page_bytes / 1024, num_pages * page_bytes / 2**30)
        for name, path in config.adapters.items():
            self.load_adapter(name, path)
        if config.adapter_dir:
            self.register_adapter_dir(config.adapter_dir)
        for name in config.pinned_adapters:
            self.pin_adapter(name)
        if config.preload_adapters:
            self._preload.extend(sorted(self.pager.registry))
            self.preloading = True
        if config.step_profile == "auto":         # on the idle engine, before the CPU workers start
            start = starting_coefficients(self, config.resolved_step_profile_dir())
            if start is not None:
                self.latency.start_from(start)
        self.assist: CpuAssist | None = None
        workers = 0 if mc.linear_layers else config.resolved_cpu_workers(self.device)
        if workers:       # last: nothing after it can fail and leave the workers running
            # under tensor parallelism rank 0's workers compute its shard, on its cores (each rank has its own)
            self.assist = CpuAssist(self.pager.arena, sc, workers, self.dtype, self.device,
                                    self.scheduler.max_step_tokens, config.resolved_cpu_profile_dir(), weights,
                                    Shard(0, tp), self.tp_cores[0] if tp > 1 else None)
            self.runner.assist = self.assist
            self.scheduler.cold_admission = self._assist_pays
            log.info("CPU assist %s: %d workers", config.cpu_assist, self.assist.live)

    # ---- adapters ----------------------------------------------------------------------------
    def check_adapter_name(self, name: str) -> None:
        """The one check a new adapter's name passes: printable, bounded, neither an adapter's nor the
        base model's."""
        check_adapter_name(name)
        if name in self.pager.registry:
            raise AdapterError(f"adapter {name!r} is already loaded")
        if name == self.model_name:
            raise AdapterError(f"adapter name {name!r} is the base model's name")

    def register_adapter_folder(self, name: str, path: str) -> Registration:
        """Register a PEFT folder on the disk tier: its config and safetensors header are read and
        checked now, its weights when a request first needs them."""
        self.check_adapter_name(name)
        return self.pager.register(inspect_peft_folder(name, path, self.model_config))

    def register_adapter_dir(self, folder: str) -> int:
        """Every adapter folder inside ``folder`` onto the disk tier, named after its folder, and every
        llama.cpp adapter file (NAME.gguf), named NAME; one that does not check out, whatever the error,
        is skipped with a one-line warning (a name already loaded is kept). Returns how many."""
        count = 0
        for sub in sorted(Path(folder).expanduser().iterdir()):
            gguf_file = sub.suffix == ".gguf" and sub.is_file()
            name = sub.stem if gguf_file else sub.name
            if not (sub.is_dir() or gguf_file) or sub.name.startswith(".") or name in self.pager.registry:
                continue
            if not gguf_file and not (sub / "adapter_config.json").is_file():
                log.warning("--adapter-dir: skipping %s: no adapter_config.json", printable(str(sub)))
                continue
            try:
                self.register_adapter_folder(name, str(sub))
                count += 1
            except Exception as e:       # a bad folder must never stop the server (or a replica) starting
                why = str(e) if isinstance(e, (AdapterError, OSError)) else f"{type(e).__name__}: {e}"
                log.warning("--adapter-dir: skipping %s: %s", printable(str(sub)), printable(why))
        log.info("--adapter-dir %s: %d adapters registered", folder, count)
        return count

    def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Read an adapter (a folder, a Hub id, a URL) into the host tier now, in the calling thread;
        ``pinned``: and onto the device for good."""
        self.check_adapter_name(name)
        try:
            if is_url(path):
                path = fetch_adapter(path, self.config.fetch_limits(), keep=self.adapter_paths().values())
                log.info("adapter %s: fetched into %s", name, path)
            else:
                path = hub.resolve(path, files=hub.ADAPTER_FILES, what="adapter")
        except (ModelLoadError, FetchError) as e:
            raise AdapterError(f"adapter {name!r}: {e}") from None
        self.pager.add(build_host_adapter(read_peft_folder(name, path, self.model_config), self.dtype,
                                          self.dora_base))
        if pinned:
            self.pin_adapter(name)

    def pin_adapter(self, name: str) -> None:
        """Keep a registered adapter on the device for good (read from disk first if need be)."""
        if name not in self.pager.registry:
            raise AdapterError(f"adapter {name!r} to pin is not registered")
        if name not in self.pager.host:
            self._load_now(name)
        self.pager.pin(name)

    def unload_adapter(self, name: str) -> list[str]:
        """Forget an adapter (KeyError if unknown). Running sequences finish with their resident copy
        (one merged into the base weights keeps its pages until a step unmerges it); the queued ones
        can no longer run: their ids are returned for the caller to end."""
        if name not in self.pager.registry:
            raise KeyError(name)
        queued = [seq.request_id for seq in self.scheduler.waiting if seq.adapter == name]
        queued += [seq.request_id for seq in self.parked.get(name, [])]
        self.pager.unregister(name)
        return queued

    # ---- disk -> host ------------------------------------------------------------------------
    def in_use(self) -> set[str]:
        """Adapters that queued or running requests need: the host tier keeps them."""
        return {seq.adapter for seq in self.scheduler.requests.values() if seq.adapter is not None} | set(self.parked)

    def take_fetches(self) -> list[str]:
        """Adapters that parked requests wait for and whose load has not begun; marked begun."""
        names = [name for name in self.parked if name not in self._loading]
        self._loading.update(dict.fromkeys(names, time.monotonic()))
        return names

    def take_preload(self) -> str | None:
        """preload_adapters: the next registered adapter, in name order, that is neither in the host tier
        nor being read and fits the tier's free room now (none is evicted for it); marked begun. None
        when no more is left to preload."""
        while self._preload:
            name = self._preload.popleft()
            reg = self.pager.registry.get(name)
            if reg is None or name in self.pager.host or name in self._loading:
                continue
            if self.pager.arena.fits(reg.host_bytes):
                self._loading[name] = time.monotonic()
                return name
        self.preloading = False
        return None

    def preload_pending(self) -> int:
        """preload_adapters: registered adapters that take_preload has not yet handed out or passed over."""
        return len(self._preload)

    def preload_now(self) -> None:
        """Offline: preload in the calling thread; an adapter that fails to load is skipped with a
        warning (its requests fail when they come)."""
        t0, count, progress = time.perf_counter(), 0, Progress("preloading adapters", "adapters")
        while (name := self.take_preload()) is not None:
            try:
                self._load_now(name)
                count += 1
            except (AdapterError, OSError) as e:
                log.warning("preload: adapter %s could not be loaded: %s", name, e)
            finally:
                self._loading.pop(name, None)
            progress(count, count + self.preload_pending())
        progress.close()
        log.info("preloaded %d adapters into the host tier in %.1f s", count, time.perf_counter() - t0)

    def host_room(self, name: str) -> bool:
        """Evict idle host adapters until the name's block fits; False while the tier is full of
        adapters in use. AdapterError if it never can fit."""
        return self.pager.host_room(name, self.in_use())

    def read_adapter(self, name: str) -> tuple[Registration, PeftFolder]:
        """The name's registration and its folder read and checked from disk: no torch, any thread."""
        reg = self.pager.registry[name]
        folder = read_peft_folder(name, reg.path, self.model_config)
        if folder.ranks != reg.ranks:
            raise AdapterError(f"adapter {name!r}: its ranks {folder.ranks} on disk are no longer the {reg.ranks} "
                               "it was registered with; unload it and load it again")
        return reg, folder

    def unpark(self, name: str) -> None:
        """The name's adapter is on the host tier: its parked requests join the scheduler's queue."""
        self._loading.pop(name, None)
        for seq in self.parked.pop(name, []):
            self.scheduler.add(seq)

    def load_failed(self, name: str) -> list[str]:
        """The name's load failed: the ids of the requests parked for it (the caller ends them)."""
        self._loading.pop(name, None)
        return [seq.request_id for seq in self.parked.get(name, [])]

    def _load_now(self, name: str) -> None:
        """Read a registered adapter into the host tier in the calling thread (offline and start-up);
        the pager actor does the same in the server's threads."""
        t0 = time.perf_counter()
        if not self.host_room(name):
            raise AdapterError(f"adapter {name!r} does not fit in the host tier beside the adapters in use")
        pager = self.pager
        load, handle = pager.registry[name].load, pager.host_allocate(name)
        try:
            _, folder = self.read_adapter(name)
            view = pager.host_write(handle, build_host_adapter(folder, self.dtype, self.dora_base))
        except BaseException:
            pager.host_abandon(handle)
            raise
        pager.host_admit(name, load, handle, view)
        pager.record_load("disk", name, time.perf_counter() - t0)

    def _load_parked(self) -> list[SeqUpdate]:
        """Offline: read the parked requests' adapters now; a load that fails ends its requests alone."""
        updates = []
        for name in list(self.parked):
            try:
                if not self.host_room(name):
                    break                      # the host tier is full of adapters in use: after they finish
                self._load_now(name)
            except (AdapterError, OSError) as e:
                log.warning("adapter %s could not be loaded: %s", name, e)
                failure = adapter_load_failed(name, e)
                for seq in self.parked.pop(name):
                    seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
                    updates.append(SeqUpdate(seq, [], "", True, "error", error=failure))
                continue
            self.unpark(name)
        return updates

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
            if self.pager.ensure_resident(name, admission=False) is not None:
                spare -= need
                paged += 1
        return paged

    @property
    def adapter_names(self) -> list[str]:
        return list(self.pager.registry)

    @property
    def dora_base(self) -> DoraBase:
        """What builds a DoRA adapter's scales from the base weights (build_in_pieces' ``dora``)."""
        return self.runner.dora_base

    # ---- requests ----------------------------------------------------------------------------
    def make_sequence(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
                      request_id: str | None = None, arrival: float = 0.0) -> Sequence:
        """Validate a request against the model and pool; raises RequestError for client mistakes."""
        if adapter is not None and adapter not in self.pager.registry:
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
                        adapter_rank=self.adapter_rank(adapter) if adapter else 0,
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
        """Queue a request; one whose adapter is only on disk is parked until it is read (take_fetches)."""
        if seq.adapter is not None and seq.adapter not in self.pager.host:
            self.parked.setdefault(seq.adapter, []).append(seq)
            return
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seqs in self.parked.values():
            for seq in seqs:
                if seq.request_id == request_id:
                    self._unpark_one(seq)
                    seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
                    return seq
        return self.scheduler.abort(request_id)

    def _unpark_one(self, seq: Sequence) -> None:
        seqs = self.parked[seq.adapter]
        seqs.remove(seq)
        if not seqs:
            del self.parked[seq.adapter]

    # ---- requests that move between servers (cluster mode: dLoRA §5.2, Punica §5) -----------------
    def export_sequence(self, request_id: str) -> Sequence | None:
        """Take a request out to continue it elsewhere by recompute: its sequence, with its seed and
        the tokens generated so far; its pages are freed. None if it is not here (or finished)."""
        return self.scheduler.abort(request_id)

    def adopt(self, prompt_ids: list[int], output_ids: list[int], params: SamplingParams, adapter: str | None,
              request_id: str, seed: int, arrival: float = 0.0) -> Sequence:
        """A request continued from another server: validated as a new one, then given its seed and
        the tokens generated so far, which its guide replays (the detokenizer replays them when it is
        added). Its next token is sampled at position len(output_ids) of the seed's stream, so the
        output equals an unmoved run's. Raises RequestError for what cannot continue here."""
        if output_ids and params.prompt_logprobs is not None:      # they went out with the first token
            params = replace(params, prompt_logprobs=None)
        seq = self.make_sequence(prompt_ids, params, adapter, request_id=request_id, arrival=arrival)
        bad = [t for t in output_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"output token id {bad[0]} is out of range [0, {self.vocab_size})", "output_ids")
        if len(output_ids) >= params.max_tokens or len(prompt_ids) + len(output_ids) >= self.max_model_len:
            raise RequestError(f"{len(output_ids)} tokens generated already: the request is complete", "output_ids")
        if seq.guide is not None:
            try:
                for token in output_ids:
                    seq.guide.advance(token)
            except ValueError as e:
                raise RequestError(f"the tokens generated so far break the request's constraint: {e}",
                                   "output_ids") from None
        seq.seed = seed
        seq.output_ids = list(output_ids)
        if output_ids:
            seq.first_token_time = arrival     # its first token's time was measured where it began
        return seq

    def unfinished(self) -> list[Sequence]:
        """Running sequences, then waiting ones, each in admission order."""
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    @property
    def max_running(self) -> int:
        return self.scheduler.max_running

    @property
    def num_parked(self) -> int:
        return sum(len(seqs) for seqs in self.parked.values())

    def parked_requests(self) -> list[list[Sequence]]:
        """The requests parked while their adapter is read from disk: one list per adapter, each in
        arrival order."""
        return [list(seqs) for seqs in self.parked.values()]

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.parked)

    # ---- the step: schedule -> run -> postprocess ------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's plan (empty: nothing can run now; see fail_unschedulable). A plan the policy
        wants merged runs unmerged instead where the adapter cannot be merged (merge_refusal), its
        chunks hold two loads of the name (reloaded while old requests run) or its rows are not on the
        device yet (the CPU workers assist it; a merge reads the pool): same tokens, LoRA computed. (The
        policy, which refuses merges by merge_refusal, sees such a rare step as merged.)"""
        plan = self.scheduler.schedule()
        if plan.merged is not None and (self.merge_refusal(plan.merged) is not None or plan.assisted or
                                        {c.seq.adapter_load for c in plan.chunks} != {self.pager.registration(plan.merged)}):
            plan.merged = None
        return plan

    def run(self, plan: StepPlan) -> StepResult:
        """Compute the step: the model's forward and sampling (in the one thread that runs torch)."""
        return self.runner.run(plan)

    def postprocess(self, plan: StepPlan, result: StepResult) -> list[SeqUpdate]:
        """Apply a computed step: tokens appended, stop rules, finished sequences freed."""
        self._hold_merged()
        self._mode_seconds["merged" if plan.merged else "unmerged"] += result.duration_s
        self.latency.record(_rank_chunks(plan), result.duration_s)
        return self.scheduler.postprocess(plan, result.sampled, result.prompt_logprobs)

    def _hold_merged(self) -> None:
        """A merged adapter counts as in use: its load keeps a pager reference while merged, so neither
        eviction nor an unload frees its pages before a step unmerges it. Taken before the step's
        finished sequences release theirs; the load of an adapter unmerged by the step is let go."""
        merged = self.runner.merger.merged_load
        if merged is not None and merged not in self._merge_refs and merged in self.pager.resident:
            self.pager.acquire(merged)
            self._merge_refs.add(merged)
        for load in self._merge_refs - {merged}:
            self._merge_refs.discard(load)
            self.pager.release(load)

    @property
    def step_coefficients(self) -> PerfCoefficients:
        """The step-time model's coefficients now (refitted from the steps run)."""
        return self.latency.coefficients

    @property
    def step_model_measured(self) -> bool:
        """Whether the step-time model is measured on this device (a step profile or a refit), not the prior."""
        return self.latency.measured

    @property
    def mean_disk_load_seconds(self) -> float | None:
        """The mean seconds of this engine's adapter reads from disk into the host tier; None before any."""
        return self.pager.mean_load_seconds.get("disk")

    def predict_step_seconds(self, plan: StepPlan) -> float:
        """The rank-aware step-time model's estimate for a plan (CaraServe §5): from this device's step
        profile (config.step_profile "auto"; else a generic prior), refitted from the steps this engine
        has run; a merged plan (plan.merged) costs what the base model's step does.
        Not counted: a switch of the merged adapter before it (merge_switch_seconds)."""
        return self.latency.predict(_rank_chunks(plan))

    def abort_unattainable(self, now: float | None = None) -> list[SeqUpdate]:
        """End the waiting requests that can no longer meet the policy's SLO (429 slo_unattainable),
        parked ones included; ``now`` on the clock of the requests' arrival times (default:
        time.monotonic())."""
        now = time.monotonic() if now is None else now
        updates = self.scheduler.abort_unattainable(now)
        for name in list(self.parked):
            # a parked request starts no sooner than its adapter is read: as if it had waited that long already
            later = now + self.disk_load_seconds_left(name)
            for seq, failure in self.scheduler.policy.unattainable(self.scheduler.running, self.parked[name], later,
                                                                   self.scheduler.blocks.cached_prefix_tokens):
                self._unpark_one(seq)
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
                updates.append(SeqUpdate(seq, [], "", True, "error", failure))
        return updates

    def disk_load_seconds_left(self, name: str) -> float:
        """Predicted seconds until a parked adapter is in the host tier: the mean disk load this engine
        measured (before any, the step-time model's disk price: 0 unless profiled), less the time its
        load has run so far."""
        mean = self.mean_disk_load_seconds
        if mean is None:
            mean = adapter_load_seconds(self.latency.coefficients, self.adapter_rank(name), None)
        started = self._loading.get(name)
        return max(0.0, mean - (time.monotonic() - started)) if started is not None else mean

    # ---- dLoRA's merged mode (stepper/merge.py) --------------------------------------------------
    @property
    def merged_adapter(self) -> str | None:
        """The adapter merged into the base weights now (by the last step run), None if none."""
        merged = self.runner.merger.merged
        return merged.name if merged is not None else None

    def merge_refusal(self, name: str) -> str | None:
        """Why ``name`` cannot be merged (plan.merged must not name it): this model's base weights take
        no merge, its current load overflowed them once, or it has LoRA on the embeddings or the head
        (kept apart, lora/vocab.py), on the linear-attention layers or on the routed experts or the router;
        None if it may be merged."""
        reg = self.pager.registry.get(name)
        if reg is None:
            return f"adapter {name!r} is not loaded"
        if reg.vocab:
            return f"adapter {name!r} has LoRA on the embeddings or the head, which is not merged"
        if reg.linear_attn:
            return f"adapter {name!r} has LoRA on the linear-attention layers, which is not merged"
        if reg.experts:
            return f"adapter {name!r} has LoRA on the routed experts or the router, which is not merged"
        return self.runner.merger.refusal(reg.load)

    def merge_switch_seconds(self, name: str | None) -> float:
        """Estimated seconds to switch the base weights from what is merged now to ``name`` merged (None:
        unmerged): an unmerge and a merge, each at the rate this engine has measured (a prior from the
        weights they rewrite before any). 0 when ``name`` is what is merged."""
        merger = self.runner.merger
        if name is not None and self.pager.registration(name) == merger.merged_load:
            return 0.0
        seconds = merger.estimate_seconds("unmerge", merger.merged.ranks) if merger.merged is not None else 0.0
        return seconds + (self.merge_seconds(name) if name is not None else 0.0)

    def merge_seconds(self, name: str) -> float:
        """dLoRA's t_M: the estimated seconds of one merge of ``name``, whatever is merged now."""
        reg = self.pager.registry.get(name)
        return self.runner.merger.estimate_seconds("merge", reg.ranks) if reg is not None else 0.0

    def merge_stats(self) -> MergeStats:
        merger = self.runner.merger
        return MergeStats(self.merged_adapter, merger.switches, dict(merger.seconds), dict(self._mode_seconds))

    def _assist_pays(self, seq: Sequence, tokens: int) -> bool:
        """Whether seq, whose adapter is not on the device, starts now with CPU assist (the scheduler's
        cold_admission): always with --cpu-assist on (while a worker lives); with auto when the
        workers' predicted stall over the chunk is below the wait for the adapter's load, i.e. its
        copy to the device, plus a step if the pool has no room for it now (room comes only as
        running requests finish, so that is the least it waits)."""
        reg = self.pager.registry[seq.adapter]
        if self.assist.live < 1 or reg.experts:       # the workers compute no expert's LoRA
            return False
        if self.config.cpu_assist == "on":
            return True
        wait = self.assist.copy_seconds(reg.host_bytes)
        if self.pool.num_free + self.pager.idle_pages() < reg.footprint:
            wait += self.latency.predict([(tokens, seq.adapter_rank)])
        return self.assist.pays(reg.ranks, tokens, wait)

    def step(self) -> list[SeqUpdate]:
        failed = self._load_parked() if self.parked else []
        failed += self.abort_unattainable()
        plan = self.schedule()
        if not plan:
            return failed + self.fail_unschedulable()
        return failed + self.postprocess(plan, self.run(plan))

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
        return PoolStats(c.total, c.free, c.kv, c.adapter, len(self.pager.resident), len(self.pager.host),
                         len(self.pager.registry), c.cached)

    # ---- what the server's parts ask -----------------------------------------------------------
    def has_adapter(self, name: str) -> bool:
        return name in self.pager.registry

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window under max_model_len (empty: every layer global): what the
        step-time model prices attention over."""
        return self.model_config.layer_windows

    def adapter_rank(self, name: str) -> int:
        """A registered adapter's largest rank: what the step-time model prices its tokens by."""
        return max(self.pager.registry[name].ranks)

    def host_adapters(self) -> list[str]:
        """Adapters whose weights are in the host tier (and may be on the device too)."""
        return list(self.pager.host)

    def adapter_paths(self) -> dict[str, str]:
        """Registered adapters, name -> the folder each was read from."""
        return {name: reg.path for name, reg in self.pager.registry.items()}

    def adapter_source(self, name: str) -> tuple[str, int] | None:
        """A registered adapter's (folder it was read from, registration number: a name registered anew,
        even from the same folder, has a new one); None if it is not registered."""
        reg = self.pager.registry.get(name)
        return None if reg is None else (reg.path, reg.load)

    def adapter_registry_version(self) -> tuple[int, int]:
        """Changes whenever an adapter is registered or unregistered."""
        return self.pager.registry_version()

    def adapter_tiers(self) -> dict[str, tuple[str, bool]]:
        """Registered adapters, name -> (fastest tier holding it: "device" | "host" | "disk", pinned)."""
        return {name: (self.pager.tier(name), reg.pinned) for name, reg in self.pager.registry.items()}

    def take_load_times(self) -> list[tuple[str, str, float]]:
        """Adapter loads since the last call: (tier loaded from: "disk" | "host", adapter, seconds)."""
        times = self.pager.load_times
        return [times.popleft() for _ in range(len(times))]

    def device_hits(self) -> dict[str, int]:
        """Per adapter: admissions that found it already on the device."""
        return self.pager.device_hits

    def close(self) -> None:
        """Free what outlives the process otherwise: the CPU workers, the tensor-parallel ranks, the host
        tier's shared memory."""
        if self.assist is not None:
            self.assist.close()
        if self.tp is not None:
            self.tp.close()
        self.pager.close()

    # ---- tensor parallelism ------------------------------------------------------------------
    def _start_ranks(self, model_path: str | None, num_pages: int):
        """Ranks 1..N-1, loading their shards (stepper/tp_rank.py); the pager's arena is their host tier."""
        from asyncserve.stepper.tp import TensorParallel, step_bytes

        config, mc = self.config, self.model_config
        settings = {"model": model_path, "dtype": str(self.dtype).removeprefix("torch."),
                    "keep_quantized": config.resolved_keep_quantized(self.device, self.dtype), "quantize": config.quantize,
                    "lora_backend": config.resolved_lora_backend(self.device),
                    "layer_windows": mc.layer_windows, "rope_scaling": mc.rope_scaling,
                    "block_size": config.block_size, "num_pages": num_pages, "arena": self.pager.arena.name,
                    "arena_slots": len(self.pager.arena.directory)}
        max_tokens = config.resolved_max_step_tokens(self.device)
        # CPU assist: each rank starts as many workers as rank 0, for jobs as large as its steps
        settings.update(cpu_workers=config.resolved_cpu_workers(self.device), max_step_tokens=max_tokens)
        max_bytes = max(max_tokens * mc.hidden_size * self.dtype.itemsize,
                        step_bytes(max_tokens, config.max_running, -(-self.max_model_len // config.block_size),
                                   num_pages))
        try:
            return TensorParallel(config.tensor_parallel, config.resolved_tp_backend(self.device), self.tp_cores,
                                  self.device, settings, max_bytes, self._rank_died)
        except BaseException:
            self.pager.close()
            raise

    def _wait_ranks(self) -> None:
        self.runner.tp = self.tp
        try:
            self.tp.wait_ready()
        except BaseException:
            self.tp.close()
            self.pager.close()
            raise

    def tp_stats(self) -> dict[str, float] | None:
        """Tensor parallelism's per-step communication so far (TensorParallel.stats), None without it."""
        return self.tp.stats() if self.tp is not None else None

    def _rank_died(self, reason: str) -> None:
        if self.on_fatal is not None:
            self.on_fatal(reason)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def block_size(self) -> int:
        """Tokens per KV page."""
        return self.pool.block_size

    @property
    def max_step_tokens(self) -> int:
        """The most tokens a step computes (the scheduler's token budget)."""
        return self.scheduler.max_step_tokens

    @property
    def lm_head(self):
        """The output projection (model/linear.py): its class is the GEMM the projections run."""
        return self.runner.weights.lm_head

    def compile_constraint(self, spec) -> None:
        """Build and cache a structured-output constraint's automaton (seconds for a large one: call it
        off the event loop), so that make_sequence finds it ready; raises StructuredOutputError."""
        self.guides.index(spec)

    def load_snapshot(self) -> LoadSnapshot:
        s, blocks = self.scheduler, self.scheduler.blocks
        return LoadSnapshot(waiting=len(s.waiting) + self.num_parked, running=len(s.running), pool=self.pool_stats(),
                            adapter_loads_total=self.pager.loads_total,
                            prefix_queried_tokens=blocks.prefix_queried_tokens,
                            prefix_hit_tokens=blocks.prefix_hit_tokens,
                            **({} if s.drafter is None else dict(
                                spec_draft_tokens=s.drafter.drafted, spec_accepted_tokens=s.drafter.accepted)),
                            **({} if self.assist is None else dict(
                                cpu_workers=self.assist.live, cpu_assist_tokens=self.assist.tokens_total,
                                cpu_worker_restarts=self.assist.restarts)))


    # ---- steps outside the scheduler (step_profile.py times plans of chosen shapes) ----------------
    def place_sequence(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
                       computed: int) -> Sequence:
        """A sequence the scheduler does not know, ready for a plan run by hand (``run``): its KV pages
        allocated, its first ``computed`` tokens taken as cached, its adapter paged onto the device and
        held. The idle pool's pages only; free them with release_placed. RuntimeError if the adapter
        does not fit in the pool."""
        seq = self.make_sequence(prompt_ids, params, adapter)
        if not self.scheduler.blocks.hold_state_slot(seq):
            raise RuntimeError("no linear-attention state slot is free (max_running)")
        seq.block_table = self.pool.allocate(self.pool.pages_for_tokens(len(prompt_ids)), "kv")
        seq.num_computed = computed
        if adapter is not None:
            if self.pager.ensure_resident(adapter, admission=False) is None:
                self.scheduler.blocks.free(seq)
                raise RuntimeError(f"adapter {adapter!r} does not fit in the pool")
            seq.adapter_load = self.pager.registration(adapter)
            self.pager.acquire(seq.adapter_load)
        return seq

    def release_placed(self, seq: Sequence) -> None:
        """Free a place_sequence's pages, state slot and hold on its adapter."""
        self.scheduler.blocks.free(seq)
        if seq.adapter_load is not None:
            self.pager.release(seq.adapter_load)


def _check_linear_attention_settings(config: Config, device: torch.device) -> None:
    """A model with linear-attention layers (Qwen3.5) keeps each sequence's state where others keep KV pages:
    what rests on pages alone is off (prefix caching, speculative decoding's drafts, CPU assist; said in
    the log when they would have been on by default), and refused when asked for."""
    asked = [what for what, on in (("speculative decoding", bool(config.speculative_tokens)),
                                   ("--cpu-assist on", config.cpu_assist == "on")) if on]
    if asked:
        raise ValueError(f"{' and '.join(asked)}: not served with linear-attention layers, whose per-sequence state "
                         "cannot take back a rejected draft token nor be computed by the CPU workers")
    off = [what for what, on in (("prefix caching", config.prefix_caching),
                                 ("speculative decoding", config.resolved_speculative_tokens(device) > 0),
                                 ("CPU assist", config.resolved_cpu_workers(device) > 0)) if on]
    if off:
        log.info("%s off: the model has linear-attention layers, whose state a cached prefix, a draft or a CPU "
                 "worker does not carry", ", ".join(off))


def _rank_chunks(plan: StepPlan) -> list[StepChunk]:
    """A step as the latency model sees it: tokens, adapter rank, cached context and adapter load per
    chunk; merged, no rank at all."""
    return [StepChunk(c.num_tokens, 0 if plan.merged else c.seq.adapter_rank, c.seq.num_computed, c.seq.adapter_load)
            for c in plan.chunks]
