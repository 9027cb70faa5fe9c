"""The one configuration dataclass, for the engine and the server."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncserve.cpus import usable_cpus
from asyncserve.ingress.chat_output import check_format_names
from asyncserve.model.paths import check_model_path


def parse_size(text: str | int | None) -> int | None:
    """'2GiB', '512MB', '1.5G', 1073741824 -> bytes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 2GiB or 512MB")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3).lower().startswith("i")
    base = 1024 if binary or not m.group(3) else 1000
    return int(number * base ** " KMGT".index(unit or " "))


# drafted tokens per step at most: a structured-output guide walks a draft and back (outlines' rollback of 32)
MAX_SPECULATIVE_TOKENS = 32


@dataclass
class Config:
    model: str | None = None                 # HF folder, .gguf file, Hub id (org/name), or None for the default SmolLM2
    revision: str | None = None              # the Hub id's branch, tag or commit (default: main)
    served_model_name: str | None = None
    adapters: dict[str, str] = field(default_factory=dict)   # name -> PEFT folder or Hub id
    dtype: str = "auto"                      # auto | bfloat16 | float16 | float32
    # GGUF files' Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors kept in their blocks on CPU (model/linear.py,
    # QuantLinear); off: dense dtype weights, which merged mode needs; None: auto (resolved_keep_quantized)
    keep_quantized: bool | None = None
    # q8_0 | q4_0: an HF folder's projections (q4_0: Q4_0; the embeddings and head Q8_0) quantized at load
    # into GGUF blocks for QuantLinear, on CPU (model/quantize.py); merged mode refuses them as it does GGUF's
    quantize: str | None = None
    device: str = "auto"                     # auto | cpu | cuda[:N]
    lora_backend: str = "auto"               # auto | torch | triton
    max_running: int = 64
    max_step_tokens: int | None = None       # per-step token budget (decodes + prefill chunks); default per device
    max_model_len: int | None = None         # default: the model's context length
    pool_mem: int | str | None = None        # bytes of the unified pool; default depends on device
    block_size: int = 16
    threads: int | None = None               # torch intra-op threads on CPU
    policy: str = "fcfs"                     # fcfs | affinity | slo | dlora | merged-only (scheduler/policies.py)
    max_step_adapters: int = 4               # affinity: distinct adapters per step, base aside
    slo_ttft_s: float | None = None          # slo: refuse (429) waiting requests that cannot get a first token in time
    slo_tpot_s: float | None = None          # slo: admit while the predicted decode step stays within this
    prefix_caching: bool = True              # reuse the KV of full blocks of earlier prompts (per adapter)
    seed: int | None = None                  # seeds drawn for requests without one
    enforce_eager: bool = False              # CUDA: no decode steps replayed from CUDA graphs (stepper/cuda_graphs.py)
    # speculative decoding by prompt lookup (scheduler/drafts.py, vLLM's "ngram" method): tokens drafted per
    # sequence and step at most, 0: off, None: resolved_speculative_tokens; from the latest earlier occurrence
    # of the last n tokens, n from prompt_lookup_max down to prompt_lookup_min; only while at most
    # speculative_max_batch sequences decode
    speculative_tokens: int | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_max_batch: int = 8
    # tensor parallelism (docs/tensor-parallel.md): the model sharded over this many rank processes, on CPU
    # cores or one GPU each
    tensor_parallel: int = 1
    tp_cores: str | None = None              # CPU ranks' cores, "0-3;4-7"; None: NUMA nodes, else an even split
    # how the ranks communicate: shm (POSIX shared memory, CPU) | gloo (torch.distributed, CPU) | nccl
    # (torch.distributed, GPUs); None: shm on CPU, nccl on CUDA. Given at tensor_parallel 1, the one rank
    # runs through that group (the NCCL path on one GPU)
    tp_backend: str | None = None
    # CPU-assisted LoRA (CaraServe §4): worker processes compute cold adapters' LoRA from the host tier
    cpu_workers: int | None = None           # None: cores the device's threads leave free (default_workers); 0: none;
                                             # per rank under tensor_parallel
    cpu_assist: str = "auto"                 # auto (when the profile says it pays) | on | off
    cpu_profile_dir: str | None = None       # cached worker profiles; default ~/.cache/asyncserve/cpu-profiles
    # the step-time model's start (step_profile.py): auto (a cached or shipped profile of this device and
    # model, else measured at start, a few seconds) | off (the prior; `asyncserve serve` defaults to auto)
    step_profile: str = "off"
    step_profile_dir: str | None = None      # cached step profiles; default ~/.cache/asyncserve/step-profiles
    # server
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    tokenize_public: bool = False            # /tokenize and /detokenize open without the API key
    metrics_public: bool = False             # /metrics' per-adapter series open without the API key
    max_prompt_bytes: int | str | None = None   # longest text prompt tokenized; default max_model_len * 32 bytes
    # chat outputs read into reasoning and tool calls (ingress/chat_output.py): a format's name, "auto"
    # (what the chat template shows) or "none"
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    enable_auto_tool_choice: bool = False    # tool_choice "auto" reads the calls from the output (vLLM's flag)
    adapter_root: str | None = None          # runtime load_lora_adapter only below this folder
    adapter_dir: str | None = None           # register every adapter folder in it (read on demand)
    # adapters from URLs and S3 (pager/remote.py): runtime loads only from sources under these prefixes
    adapter_url_prefixes: list[str] = field(default_factory=list)
    adapter_resolver: str | None = None      # URL template with {name}: a request's unknown adapter is fetched from it
    adapter_cache_dir: str | None = None     # fetched adapters; default ~/.cache/asyncserve/adapters
    max_adapter_size: int | str = "4GiB"     # most bytes one fetch downloads (and as many unpacked)
    adapter_fetch_timeout_s: float = 300.0   # one fetch, start to end
    adapter_cache_size: int | str = "20GiB"  # the fetched adapters' cache: least recently used go past it (0: no bound)
    preload_adapters: bool = False           # read the registered adapters into the host tier's free room at start
    host_adapter_mem: int | str | None = None   # bytes of the host tier (shared memory); default: RAM / 4
    pinned_adapters: list[str] = field(default_factory=list)   # kept on the device for good
    max_waiting: int = 1024                  # queued requests beyond this get 429
    max_body_bytes: int = 4 * 2**20
    shutdown_grace_s: float = 30.0           # SIGTERM: finish in-flight requests for this long, then abort
    # cluster mode (actors/cluster.py), on when peers is set
    peers: str | None = None                 # URL[,URL...] and/or dns:NAME:PORT entries
    node_id: str | None = None               # unique in the cluster; default: hostname:port
    advertise_url: str | None = None         # how peers reach this node; default: http://host:port
    cluster_key: str | None = None           # HMAC-SHA256 key of every peer call; cluster mode needs one
    gossip_interval_s: float = 0.2
    dispatch: str = "rank-aware"             # routing policy (cluster/routing.py POLICIES)
    migration_threshold_s: float = 2.0       # pending-seconds spread between nodes that triggers a migration; 0: never

    def validate(self) -> None:
        """Raise ValueError for settings that are wrong before anything loads (missing paths, unknown
        names, sizes that do not parse, counts below 1): these fail at once, not after the model loads."""
        from asyncserve.scheduler.policies import POLICIES

        from asyncserve.model.hub import is_remote

        # a Hub id (org/name) is resolved, from the cache or downloaded, when the engine loads
        if not is_remote(self.model):
            check_model_path(self.model)    # exists, is a model folder or starts like a GGUF file
        from asyncserve.pager.gguf_adapter import is_gguf_file
        from asyncserve.pager.remote import check_prefix, is_url, parse_source, template_source

        for name, path in self.adapters.items():
            if is_url(path):
                parse_source(path)        # a FetchError is a ValueError
            elif not ((Path(path).expanduser() / "adapter_config.json").is_file() or is_gguf_file(path)
                      or is_remote(path)):
                raise ValueError(f"adapter {name!r}: {path} is neither a PEFT adapter folder (no adapter_config.json) "
                                 "nor a llama.cpp GGUF adapter file")
        for prefix in self.adapter_url_prefixes:
            check_prefix(prefix)
        if self.adapter_resolver is not None:
            if "{name}" not in self.adapter_resolver:
                raise ValueError(f"adapter_resolver {self.adapter_resolver!r} must hold {{name}}, e.g. "
                                 "s3://bucket/adapters/{name} or https://host/adapters/{name}.tar.gz")
            parse_source(template_source(self.adapter_resolver, "name"))
        if not parse_size(self.max_adapter_size) > 0:
            raise ValueError(f"max_adapter_size must be positive, got {self.max_adapter_size!r}")
        if not parse_size(self.adapter_cache_size) >= 0:
            raise ValueError(f"adapter_cache_size must be 0 (no bound) or positive, got {self.adapter_cache_size!r}")
        if not self.adapter_fetch_timeout_s > 0:
            raise ValueError(f"adapter_fetch_timeout_s must be positive, got {self.adapter_fetch_timeout_s}")
        for flag, folder in (("adapter_dir", self.adapter_dir), ("adapter_root", self.adapter_root)):
            if folder is not None and not Path(folder).expanduser().is_dir():
                raise ValueError(f"{flag} {folder} is not a folder")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        for name in ("slo_ttft_s", "slo_tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.policy == "slo" and self.slo_ttft_s is None and self.slo_tpot_s is None:
            raise ValueError("policy slo needs slo_ttft_s (--slo-ttft) and/or slo_tpot_s (--slo-tpot)")
        if self.policy != "slo" and (self.slo_ttft_s is not None or self.slo_tpot_s is not None):
            raise ValueError(f"slo_ttft_s and slo_tpot_s are the slo policy's; policy {self.policy!r} ignores them")
        if self.dtype != "auto":
            self.resolved_dtype(torch.device("cpu"))
        if self.lora_backend != "auto":
            self.resolved_lora_backend(torch.device("cpu"))
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"unknown device {self.device!r}; use auto, cpu or cuda[:N]") from None
        if self.quantize is not None:
            self.validate_quantize()
        if self.pool_mem is not None and not parse_size(self.pool_mem) > 0:
            raise ValueError(f"pool_mem must be positive, got {self.pool_mem!r}")
        if self.host_adapter_mem is not None:
            self.host_adapter_bytes()
        if self.max_prompt_bytes is not None and not parse_size(self.max_prompt_bytes) > 0:
            raise ValueError(f"max_prompt_bytes must be positive, got {self.max_prompt_bytes!r}")
        check_format_names(self.tool_call_parser, self.reasoning_parser)
        for name in self.pinned_adapters:
            in_dir = self.adapter_dir is not None and (Path(self.adapter_dir).expanduser() / name).is_dir()
            if name not in self.adapters and not in_dir:
                raise ValueError(f"pinned adapter {name!r} is neither an --adapter nor a folder of --adapter-dir")
        for name in ("max_running", "max_step_tokens", "max_step_adapters", "max_model_len", "block_size", "threads",
                     "max_waiting", "max_body_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.speculative_tokens is not None:
            self.validate_speculative()
        if self.cpu_workers is not None and self.cpu_workers < 0:
            raise ValueError(f"cpu_workers must not be negative, got {self.cpu_workers}")
        if self.cpu_assist not in ("auto", "on", "off"):
            raise ValueError(f"cpu_assist must be auto, on or off, got {self.cpu_assist!r}")
        if self.step_profile not in ("auto", "off"):
            raise ValueError(f"step_profile must be auto or off, got {self.step_profile!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be at least 1, got {self.tensor_parallel}")
        if self.uses_tp_group:
            self.validate_tensor_parallel()
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must not be negative, got {self.shutdown_grace_s}")
        if self.peers is not None:
            self.validate_cluster()

    @property
    def uses_tp_group(self) -> bool:
        """Whether the model runs as tensor-parallel ranks over a group: tensor_parallel above 1, or a
        tp_backend named at 1."""
        return self.tensor_parallel > 1 or self.tp_backend is not None

    def validate_tensor_parallel(self) -> None:
        """What tensor parallelism does not do (yet) is refused before the model loads."""
        n = self.tensor_parallel
        if self.tp_backend not in (None, "shm", "gloo", "nccl"):
            raise ValueError(f"unknown tp_backend {self.tp_backend!r}; choose shm, gloo or nccl")
        device = self.resolved_device()
        backend = self.resolved_tp_backend(device)
        if device.type == "cuda":
            if backend != "nccl":
                raise ValueError(f"tp_backend {backend} connects CPU ranks; on {device} the ranks all-reduce with "
                                 "nccl (or serve with --device cpu)")
            first, count = device.index or 0, torch.cuda.device_count()
            if first + n > count:
                raise ValueError(f"tensor_parallel {n} on {self.device} needs a GPU per rank, cuda:{first}.."
                                 f"cuda:{first + n - 1}; this machine has {count} CUDA device(s)")
            if self.tp_cores is not None:
                raise ValueError("tp_cores pins CPU ranks to cores; on CUDA each rank drives its own GPU")
            if self.cpu_assist == "on" or self.cpu_workers:
                raise ValueError("CPU assist (cpu_assist on, cpu_workers) runs per shard on CPU ranks; under "
                                 f"tensor_parallel on {device} it is not built")
            return
        if backend == "nccl":
            raise ValueError(f"tp_backend nccl all-reduces between GPUs, one per rank, but device {self.device} runs "
                             f"on CPU ({torch.cuda.device_count()} CUDA devices here); on CPU use shm or gloo")
        if n > usable_cpus():
            raise ValueError(f"tensor_parallel {n} needs a core per rank; this process may use {usable_cpus()} CPUs")
        if self.threads is not None:
            raise ValueError("under tensor_parallel each rank runs one torch thread per core of its own (tp_cores); "
                             "threads does not apply")

    def validate_speculative(self) -> None:
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be 0 to {MAX_SPECULATIVE_TOKENS}, got {self.speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be at least 1, got {self.speculative_max_batch}")

    def validate_quantize(self) -> None:
        if self.quantize not in ("q8_0", "q4_0"):
            raise ValueError(f"quantize must be q8_0 or q4_0 (the types the CPU kernels run that asyncserve "
                             f"quantizes to), got {self.quantize!r}")
        if self.model is not None and Path(self.model).expanduser().suffix == ".gguf":
            raise ValueError(f"quantize applies to HF model folders; {self.model} is a GGUF file, whose quantized "
                             "tensors stay in their blocks with --keep-quantized")
        if self.resolved_device().type != "cpu":
            raise ValueError("quantize runs on CPU (the quantized kernels are CPU ones); use --device cpu")
        if self.policy == "merged-only":
            raise ValueError("policy merged-only merges each adapter into the base weights, which quantize keeps "
                             "in blocks that cannot take one exactly; use another policy")

    def validate_cluster(self) -> None:
        from asyncserve.cluster.membership import parse_peer_spec
        from asyncserve.cluster.routing import POLICIES as DISPATCH

        parse_peer_spec(self.peers)
        if not self.cluster_key:
            raise ValueError("cluster mode (peers) needs a cluster key (--cluster-key or ASYNCSERVE_CLUSTER_KEY): "
                             "peer calls are signed with it")
        if self.dispatch not in DISPATCH:
            raise ValueError(f"unknown dispatch {self.dispatch!r}; choose one of {sorted(DISPATCH)}")
        if not self.gossip_interval_s > 0:
            raise ValueError(f"gossip_interval_s must be positive, got {self.gossip_interval_s}")
        if self.migration_threshold_s < 0:
            raise ValueError(f"migration_threshold_s must not be negative, got {self.migration_threshold_s}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":      # tensor-parallel ranks: a GPU each where there are enough, else CPU cores
            cuda = (torch.cuda.is_available() and torch.cuda.device_count() >= self.tensor_parallel
                    and self.tp_backend in (None, "nccl"))
            return torch.device("cuda" if cuda else "cpu")
        return torch.device(self.device)

    def resolved_tp_backend(self, device: torch.device) -> str:
        return self.tp_backend or ("nccl" if device.type == "cuda" else "shm")

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                 "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32}
        if self.dtype == "auto":
            if device.type == "cuda":
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            # bf16 GEMMs are fast only with AMX or AVX512-BF16; without them the CPU emulates bf16 and
            # float32 is several times faster (measured in BENCHMARKS.md)
            fast_bf16 = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
            return torch.bfloat16 if fast_bf16 else torch.float32
        try:
            return names[self.dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, bfloat16, float16 or float32") from None

    def resolved_keep_quantized(self, device: torch.device, dtype: torch.dtype, k_quants: bool = False) -> bool:
        """auto keeps a GGUF file's blocks where that measured faster than dense weights, with one rank (a
        shard splits blocks only on their boundaries) and a policy that never merges (merged mode needs dense
        weights): on a CPU running float32 (no fast bf16 GEMM: W1 1.4x, BENCHMARKS.md), and for a file of
        mostly K-quants (k_quants: a Q4_K_M, Q5_K_M) on a CPU with AMX int8 tiles, where a 1B Q4_K_M file
        decoded one stream 2.9x as fast as in bf16 and W1 as fast, in a quarter of the memory."""
        if device.type != "cpu":
            return False
        if self.keep_quantized is not None:
            return self.keep_quantized
        if self.tensor_parallel != 1 or self.policy in ("dlora", "merged-only"):
            return False
        return dtype == torch.float32 or (k_quants and _quant_amx_available())

    def resolved_speculative_tokens(self, device: torch.device) -> int:
        """auto drafts 4 tokens on CPU, where one stream's step is weight-bandwidth bound and a step of 5 rows
        costs ~10% more than one of 1 (one stream 2.1-3.1x, BENCHMARKS.md); none on CUDA, where a drafted
        step would run eagerly instead of replaying its decode graph."""
        if self.speculative_tokens is not None:
            return self.speculative_tokens
        return 4 if device.type == "cpu" else 0

    def resolved_lora_backend(self, device: torch.device) -> str:
        if self.lora_backend == "auto":
            return "triton" if device.type == "cuda" else "torch"
        if self.lora_backend not in ("torch", "triton"):
            raise ValueError(f"unknown lora_backend {self.lora_backend!r}; choose auto, torch or triton")
        return self.lora_backend

    def resolved_max_step_tokens(self, device: torch.device) -> int:
        """A CPU step's time grows with its tokens, so smaller prefill chunks let a burst of arrivals
        start streaming sooner at equal throughput (W1 over HTTP on 2 cores: TTFT mean 1.85 s at 512,
        1.15 s at 256; BENCHMARKS.md). A GPU step of a small model costs about the same up to
        thousands of tokens, so there fewer, larger steps win."""
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        return 256 if device.type == "cpu" else 512

    def resolved_threads(self) -> int:
        """torch threads: the CPUs this process may use (affinity mask and cgroup quota, cpus.py), less
        those given to CPU LoRA workers by --cpu-workers."""
        cores = max(1, usable_cpus() - (self.cpu_workers or 0))
        return self.threads or int(os.environ.get("ASYNCSERVE_THREADS", 0)) or cores

    def resolved_cpu_workers(self, device: torch.device) -> int:
        """CPU LoRA worker processes to start (under tensor_parallel, per rank): 0 with cpu_assist off; at
        least 1 with it on."""
        from asyncserve.stepper.assist import default_workers

        if self.cpu_assist == "off" or (self.uses_tp_group and device.type != "cpu"):
            return 0
        if self.cpu_workers is not None:
            return self.cpu_workers
        if self.tensor_parallel > 1:
            # a rank's workers share its cores (tp_cores), which its own threads take: none spare for auto
            return 1 if self.cpu_assist == "on" else 0
        auto = default_workers(device, self.resolved_threads() if device.type == "cpu" else 1)
        return max(auto, 1) if self.cpu_assist == "on" else auto

    def resolved_cpu_profile_dir(self) -> Path:
        return Path(self.cpu_profile_dir or "~/.cache/asyncserve/cpu-profiles").expanduser()

    def fetch_limits(self):
        """What one fetch of an adapter from a URL may take (pager/remote.py)."""
        from asyncserve.pager.remote import FetchLimits

        return FetchLimits(Path(self.adapter_cache_dir or "~/.cache/asyncserve/adapters").expanduser(),
                           parse_size(self.max_adapter_size), self.adapter_fetch_timeout_s,
                           parse_size(self.adapter_cache_size))

    def resolved_step_profile_dir(self) -> Path:
        return Path(self.step_profile_dir or "~/.cache/asyncserve/step-profiles").expanduser()

    def host_adapter_bytes(self) -> int:
        """The host tier's size: host_adapter_mem, else a quarter of RAM; at most what /dev/shm has free
        (past that, writing the shared segment would kill the process with SIGBUS)."""
        shm = os.statvfs("/dev/shm")
        room = shm.f_bavail * shm.f_frsize
        if self.host_adapter_mem is None:
            return min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4, room)
        size = parse_size(self.host_adapter_mem)
        if not size > 0:
            raise ValueError(f"host_adapter_mem must be positive, got {self.host_adapter_mem!r}")
        if size > room:
            raise ValueError(f"host_adapter_mem {self.host_adapter_mem} is more than /dev/shm has free "
                             f"({room / 2**30:.2f} GiB)")
        return size

    def pool_bytes(self, device: torch.device, weight_bytes: int) -> int:
        explicit = parse_size(self.pool_mem or os.environ.get("ASYNCSERVE_POOL_MEM"))
        if explicit:
            return explicit
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * 0.85) - 512 * 2**20      # leave room for activations
        return 2 * 2**30


def _quant_amx_available() -> bool:
    """Whether the native kernels run the K-quants on AMX int8 tiles here (kernels/cpu/quant_amx.h)."""
    import kernels.cpu as cpu_kernels

    return not cpu_kernels.disabled() and cpu_kernels.library() is not None and cpu_kernels.quant_amx_available()
