"""Command line: `asyncserve serve` (the OpenAI-compatible server) and `asyncserve generate` (offline)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path


def _adapter_pairs(values: list[str]) -> dict[str, str]:
    adapters = {}
    for v in values or []:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--adapter expects NAME=PATH, got {v!r}")
        adapters[name] = path
    return adapters


def _refuse(parser: argparse.ArgumentParser, reason: Exception) -> None:
    """Exit 2 with the reason on one line (argparse's error() would print the whole usage first)."""
    parser.exit(2, f"{parser.prog}: error: {reason}\n")


def _engine_args(p: argparse.ArgumentParser, step_profile: str = "off") -> None:
    """step_profile: --step-profile's default (auto for `serve`, which measures once per machine and model;
    off for a one-off `generate`)."""
    p.add_argument("--model", default=None, metavar="PATH",
                   help="HF folder, .gguf file or Hugging Face Hub id (org/name: from the HF cache, downloaded when "
                        "online; HF_HOME, HF_HUB_OFFLINE; a repository of GGUF files as org/name:Q8_0, its Q4_K_M "
                        "file without a quantization, as llama.cpp's -hf) (default: SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None, help="the --model Hub id's branch, tag or commit (default: main)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="serve the PEFT LoRA folder, llama.cpp LoRA file (.gguf, as llama-server --lora takes), "
                        "Hub id (org/name) or URL (https://, s3://; a folder or a .tar/.tar.gz/.zip archive, pinned "
                        "by #sha256=HEX) PATH as model NAME, read into host memory at start; repeat for several "
                        "(default: none)")
    p.add_argument("--adapter-cache-dir", default=None, metavar="DIR",
                   help="where adapters fetched from URLs are kept, by their content's sha256 (default: "
                        "~/.cache/asyncserve/adapters)")
    p.add_argument("--adapter-cache-size", default="20GiB", metavar="SIZE",
                   help="bound of that cache: past it, the adapters least recently fetched go, except registered "
                        "ones'; 0 for no bound (default: 20GiB)")
    p.add_argument("--max-adapter-size", default="4GiB", metavar="SIZE",
                   help="most bytes one adapter fetched from a URL (or from a peer, in cluster mode) may download, "
                        "and as many unpacked from an archive (default: 4GiB)")
    p.add_argument("--adapter-fetch-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="longest one fetch of an adapter from a URL or a peer may take, start to end (default: 300)")
    p.add_argument("--device", default="auto",
                   help="auto (the CUDA GPU if torch sees one, else the CPU), cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="weights, KV cache and adapters: auto is bfloat16 on GPUs and on CPUs with AMX or "
                        "AVX512-BF16, float32 on other CPUs (default: auto)")
    p.add_argument("--keep-quantized", action=argparse.BooleanOptionalAction, default=None,
                   help="on CPU, keep a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors in their blocks (the "
                        "file's size in memory, int8 dot products; merged mode refuses them); "
                        "--no-keep-quantized dequantizes them to --dtype at load (default: auto: kept on a CPU "
                        "running float32, and for a file of mostly K-quants (Q4_K_M, Q5_K_M) on a CPU with AMX "
                        "int8 tiles, with one rank and a policy that never merges; dequantized otherwise)")
    p.add_argument("--quantize", default=None, choices=["q8_0", "q4_0"],
                   help="on CPU, quantize an HF folder's projections at load into GGUF blocks of this type (the "
                        "embeddings and head Q8_0), bit for bit as llama.cpp's converter would: their size in "
                        "memory, int8 dot products as --keep-quantized; merged mode refuses them (default: off)")
    p.add_argument("--lora-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: triton on CUDA, torch (native kernels where built) on CPU. On CUDA the torch "
                        "backend restacks weights whenever a step's adapters change: with 1,000 adapters it "
                        "ran at 0.14x its 5-adapter speed on an H100 (default: auto)")
    p.add_argument("--max-running", type=int, default=64, metavar="N",
                   help="most sequences in the running batch at once; more wait in the queue (default: 64)")
    p.add_argument("--max-step-tokens", type=int, default=None, metavar="N", help="per-step token budget (default: 256 on CPU, 512 on GPU)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="longest prompt + output in tokens, at most the model's context (default: the context)")
    p.add_argument("--pool-mem", default=None, metavar="SIZE", help="unified pool size, e.g. 2GiB (default: $ASYNCSERVE_POOL_MEM, else 2GiB on CPU, "
                                                    "85%% of free memory on CUDA)")
    p.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                   help="tokens per KV page of the pool, and the unit the prefix cache shares (default: 16)")
    p.add_argument("--host-adapter-mem", default=None, metavar="SIZE",
                   help="host memory (POSIX shared memory) caching adapters read from disk, least recently used "
                        "out first, e.g. 8GiB (default: a quarter of RAM, at most what /dev/shm has free)")
    p.add_argument("--pin-adapter", action="append", default=[], metavar="NAME",
                   help="keep this adapter (an --adapter or a folder of --adapter-dir) on the device for good; "
                        "repeat for several (default: none)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the model over N rank processes on this machine (Megatron-style, with each "
                        "adapter's A and B split as S-LoRA does): on its CPUs, or on N GPUs from --device's on "
                        "(default: 1)")
    p.add_argument("--tp-backend", default=None, choices=["shm", "gloo", "nccl"],
                   help="how the --tensor-parallel ranks all-reduce: shm (POSIX shared memory, CPU), gloo "
                        "(torch.distributed, CPU) or nccl (torch.distributed, a GPU per rank); named at "
                        "--tensor-parallel 1, the one rank runs through it (default: shm on CPU, nccl on CUDA)")
    p.add_argument("--tp-cores", default=None, metavar="SPEC",
                   help="each --tensor-parallel rank's cores, ranks separated by ';', e.g. 0-3;4-7 (default: one "
                        "NUMA node per rank where there are N nodes, else the usable CPUs split evenly)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: $ASYNCSERVE_THREADS, else the CPUs the process may use - the lesser "
                        "of its affinity mask and its cgroup CPU quota, e.g. a Kubernetes limits.cpu - less "
                        "--cpu-workers; logged at start)")
    p.add_argument("--policy", default="fcfs", metavar="NAME",
                   help="batch formation: fcfs (first come, first served), affinity (at most --max-step-adapters "
                        "adapters per step, with aging; S-LoRA), slo (early abort on --slo-ttft, admission within "
                        "--slo-tpot; S-LoRA, CaraServe), dlora (merged steps for a dominant adapter, credits "
                        "against starvation; dLoRA), merged-only (one adapter at a time; a baseline) "
                        "(default: fcfs)")
    p.add_argument("--max-step-adapters", type=int, default=4, metavar="D",
                   help="affinity: the most distinct adapters a step carries, the base model aside (default: 4)")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="SECONDS",
                   help="slo: answer a waiting request at once with a 429 (code slo_unattainable) when it can no "
                        "longer get its first token within this (default: none)")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="SECONDS",
                   help="slo: admit requests while the predicted decode step of the running batch stays within "
                        "this (default: none)")
    p.add_argument("--cpu-workers", type=int, default=None, metavar="N",
                   help="CPU LoRA worker processes for cold adapters' prefill (CaraServe); 0 turns them off; "
                        "under --tensor-parallel, per rank, on the rank's own cores (default: the cores the "
                        "device's threads leave free; under --tensor-parallel, 1 per rank with --cpu-assist on, "
                        "else 0)")
    p.add_argument("--cpu-assist", default="auto", choices=["auto", "on", "off"],
                   help="compute the LoRA of requests whose adapter is not on the device yet on the CPU workers: "
                        "auto when the workers' profile predicts a lower TTFT than waiting for the load "
                        "(default: auto)")
    p.add_argument("--cpu-profile-dir", default=None, metavar="DIR",
                   help="cached CPU worker profiles (default: ~/.cache/asyncserve/cpu-profiles)")
    p.add_argument("--step-profile", default=step_profile, choices=["auto", "off"],
                   help="where the step-time model (predicted step seconds: the slo and dlora policies, the "
                        "cluster's routing) starts: auto, from a profile of this device, model, dtype and threads "
                        "cached in --step-profile-dir, else measured at start (a few seconds) and cached; off, "
                        f"from a generic prior; either way refitted from the steps run (default: {step_profile})")
    p.add_argument("--step-profile-dir", default=None, metavar="DIR",
                   help="cached step profiles (default: ~/.cache/asyncserve/step-profiles)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute every prompt, even when an earlier one began with the same blocks "
                        "(default: prefix caching on)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run every step eagerly instead of replaying decode steps from CUDA graphs "
                        "(default: decode steps of up to --max-running sequences replay from graphs)")
    p.add_argument("--speculative-config", type=_speculative_config, default={}, metavar="JSON",
                   help="speculative decoding by prompt lookup, as vLLM's: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}' (0: off), optionally with prompt_lookup_max (4), "
                        "prompt_lookup_min (2) and disable_by_batch_size (8: no drafts while more sequences "
                        "decode). Each decoding sequence drafts up to that many tokens from the latest earlier "
                        "occurrence of its last n tokens and keeps those the model samples itself: the same "
                        "output, several tokens a step where text repeats its context (default: 4 tokens on CPU, "
                        "off on CUDA)")


_SPECULATIVE_KEYS = {"num_speculative_tokens": "speculative_tokens", "prompt_lookup_max": "prompt_lookup_max",
                     "prompt_lookup_min": "prompt_lookup_min", "disable_by_batch_size": "speculative_max_batch"}


def _speculative_config(text: str) -> dict:
    """--speculative-config's JSON -> Config's speculative fields."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"method\": \"ngram\", "
                                         "\"num_speculative_tokens\": 4}'")
    method = spec.pop("method", None)
    if method != "ngram":
        raise argparse.ArgumentTypeError(f"method {method!r}: asyncserve drafts by prompt lookup only; use "
                                         "\"method\": \"ngram\"")
    unknown = sorted(set(spec) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown keys {unknown}; the ngram method takes {sorted(_SPECULATIVE_KEYS)}")
    if "num_speculative_tokens" not in spec:
        raise argparse.ArgumentTypeError("num_speculative_tokens is required")
    if not all(type(v) is int and v >= (0 if k == "num_speculative_tokens" else 1) for k, v in spec.items()):
        raise argparse.ArgumentTypeError(f"values must be positive integers (num_speculative_tokens 0: off), got {spec}")
    fields = {_SPECULATIVE_KEYS[k]: v for k, v in spec.items()}
    if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
        fields["prompt_lookup_min"] = min(2, fields["prompt_lookup_max"])
    return fields


class _MarkdownHelp(argparse.Action):
    """--help-markdown: print flag_reference(parser) and exit, as --help prints the usage."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(flag_reference(parser))
        parser.exit()


def flag_reference(parser: argparse.ArgumentParser) -> str:
    """Every subcommand's flags as Markdown tables, flag and help as --help shows them (README.md's flag
    reference is this text: scripts/flag_reference.py --write puts it there)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines, shown = [], {}                # shown: table row -> the subcommand whose table has it
    for name, command in commands.choices.items():
        lines += [f"### `asyncserve {name}`", ""]
        formatter = command._get_formatter()
        for group in command._action_groups:
            rows, same = [], {}
            for action in group._group_actions:
                if not action.option_strings or isinstance(action, argparse._HelpAction):
                    continue
                meaning = " ".join(formatter._expand_help(action).split()).replace("|", "\\|")
                row = f"| `{formatter._format_action_invocation(action)}` | {meaning} |"
                if row in shown:
                    same.setdefault(shown[row], []).append(f"`{action.option_strings[0]}`")
                else:
                    rows.append(row)
                    shown[row] = name
            if group.description and rows:
                lines += [f"{group.title.capitalize()}: {group.description}.", ""]
            for other, flags in same.items():
                lines += [f"The flags {', '.join(flags)} as in `asyncserve {other}`, and:", ""]
            if rows:
                lines += ["| flag | meaning |", "|---|---|", *rows, ""]
    return "\n".join(lines)


def _config(args):
    from asyncserve.config import Config

    return Config(model=args.model, revision=args.revision, adapters=_adapter_pairs(args.adapter),
                  device=args.device, dtype=args.dtype, keep_quantized=args.keep_quantized,
                  quantize=args.quantize, lora_backend=args.lora_backend, max_running=args.max_running,
                  max_step_tokens=args.max_step_tokens, max_model_len=args.max_model_len, pool_mem=args.pool_mem,
                  block_size=args.block_size, host_adapter_mem=args.host_adapter_mem,
                  pinned_adapters=args.pin_adapter, threads=args.threads, policy=args.policy,
                  max_step_adapters=args.max_step_adapters, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                  prefix_caching=args.prefix_caching, cpu_workers=args.cpu_workers, cpu_assist=args.cpu_assist,
                  cpu_profile_dir=args.cpu_profile_dir, step_profile=args.step_profile,
                  step_profile_dir=args.step_profile_dir, enforce_eager=args.enforce_eager,
                  tensor_parallel=args.tensor_parallel, tp_cores=args.tp_cores, tp_backend=args.tp_backend,
                  adapter_cache_dir=args.adapter_cache_dir, max_adapter_size=args.max_adapter_size,
                  adapter_fetch_timeout_s=args.adapter_fetch_timeout, adapter_cache_size=args.adapter_cache_size,
                  **args.speculative_config)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="asyncserve", description="Serve many LoRA adapters of one base LLM.")
    ap.add_argument("--help-markdown", action=_MarkdownHelp,
                    help="print every subcommand's flags as Markdown (README.md's flag reference) and exit")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    _engine_args(s, step_profile="auto")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the base model's name in the API (the `model` field, /v1/models) (default: the name in "
                        "the model's config)")
    s.add_argument("--adapter-dir", default=None, metavar="DIR",
                   help="register every adapter folder inside DIR at startup, and every llama.cpp LoRA file "
                        "NAME.gguf as NAME (each read from disk when a request first needs it; thousands are fine) "
                        "(default: none)")
    s.add_argument("--preload-adapters", action="store_true",
                   help="read the --adapter-dir adapters into the host tier at start, in the background, while "
                        "it has free room (none is evicted for them; requests' own loads go first), so that "
                        "first requests skip the disk read (S-LoRA keeps every adapter in host memory) "
                        "(default: off)")
    s.add_argument("--adapter-root", default=None, metavar="DIR",
                   help="allow /v1/load_lora_adapter for folders and .gguf adapter files inside DIR (default: none, "
                        "no runtime loads)")
    s.add_argument("--adapter-resolver", default=None, metavar="TEMPLATE",
                   help="a request for a model that is not loaded fetches the adapter at TEMPLATE with {name} "
                        "filled in (e.g. s3://bucket/adapters/{name}, https://host/adapters/{name}.tar.gz, "
                        "https://huggingface.co/{name}/resolve/main with HF_TOKEN for private repositories), "
                        "loads and serves it, as LoRAX does; names the template lacks get 404 (default: none)")
    s.add_argument("--adapter-url-prefix", action="append", default=[], metavar="URL",
                   help="allow /v1/load_lora_adapter for URLs under this folder URL, e.g. s3://bucket/adapters/ "
                        "or https://host/adapters/; repeat for several (default: none, no runtime loads from URLs)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for every interface (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: 8000)")
    s.add_argument("--api-key", default=os.environ.get("ASYNCSERVE_API_KEY"), metavar="KEY",
                   help="clients must send it (Authorization: Bearer KEY) on /v1/*, /tokenize and /detokenize; "
                        "/metrics shows its per-adapter series only with it (default: $ASYNCSERVE_API_KEY; unset: "
                        "no key asked)")
    s.add_argument("--tokenize-public", action="store_true",
                   help="with --api-key, leave /tokenize and /detokenize open without it, as vLLM does (default: off)")
    s.add_argument("--metrics-public", action="store_true",
                   help="with --api-key, show /metrics' per-adapter series without it too (default: off)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="answer tool_choice 'auto' (OpenAI's default with tools): the calls the model writes are "
                        "read from its output by the --tool-call-parser (default: off, a 400 as in vLLM)")
    s.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                   help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), qwen3_coder (Qwen3-Coder, "
                        "Qwen3.5), llama3_json (Llama "
                        "3.1-3.3), mistral, pythonic (Llama 3.2/4's pythonic templates), auto (the one its chat "
                        "template shows) or none (default: auto)")
    s.add_argument("--reasoning-parser", default="auto", metavar="NAME",
                   help="split the model's thinking (<think>...</think>) into the message's reasoning: qwen3, "
                        "deepseek_r1, auto (when the chat template thinks) or none (default: auto)")
    s.add_argument("--max-prompt-bytes", default=None, metavar="SIZE",
                   help="longest text prompt (or chat, rendered) tokenized, in UTF-8 bytes, e.g. 1MiB; longer "
                        "ones get 400 before any tokenizing (default: 32 bytes per token of --max-model-len)")
    s.add_argument("--max-waiting", type=int, default=1024, metavar="N",
                   help="queued sequences (prompts x n) beyond this are refused with 429 (default: 1024)")
    s.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, let in-flight requests finish for this long, then end them with "
                        "a 503 error (default: 30)")
    s.add_argument("--max-body-size", default="4MiB", metavar="SIZE",
                   help="largest request body, e.g. 4MiB; larger ones get 413 (default: 4MiB)")
    c = s.add_argument_group("cluster mode", "peer servers gossip load, forward and migrate requests")
    c.add_argument("--peers", default=None, metavar="URL[,URL...]",
                   help="the other servers: http(s) URLs and/or dns:NAME:PORT (every address NAME resolves to, "
                        "re-resolved every few seconds, e.g. a Kubernetes headless Service); turns cluster mode on "
                        "(default: none, one server alone)")
    c.add_argument("--node-id", default=None, metavar="NAME", help="this server's name in the cluster (default: hostname:port)")
    c.add_argument("--advertise-url", default=None, metavar="URL",
                   help="how peers reach this server (default: http://HOST:PORT)")
    c.add_argument("--cluster-key", default=os.environ.get("ASYNCSERVE_CLUSTER_KEY"), metavar="KEY",
                   help="shared secret signing every peer call (default: $ASYNCSERVE_CLUSTER_KEY); required "
                        "in cluster mode")
    c.add_argument("--gossip-interval", type=float, default=0.2, metavar="SECONDS",
                   help="how often the load digest is pushed to the peers (default: 0.2)")
    c.add_argument("--dispatch", default="rank-aware", metavar="NAME",
                   help="where a request runs: local, round-robin, least-pending, rank-aware (default: the "
                        "least predicted completion time, the adapter's load included), consolidate, random")
    c.add_argument("--migration-threshold", type=float, default=2.0, metavar="SECONDS",
                   help="move running requests when the predicted pending time of the busiest and idlest "
                        "servers differs by more than this; 0: never (default: 2)")
    s.add_argument("--log-level", default="INFO", metavar="LEVEL",
                   help="log messages from this level up, to stderr: DEBUG, INFO, WARNING or ERROR (default: INFO)")

    g = sub.add_parser("generate", help="generate offline and print the outputs")
    _engine_args(g, step_profile="off")
    g.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="a prompt; repeat for several (required)")
    g.add_argument("--use-adapter", default=None, metavar="NAME",
                   help="adapter name for all prompts (default: the base model)")
    g.add_argument("--chat", action="store_true", help="apply the chat template to each prompt (default: off)")
    g.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate per prompt at most (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is greedy (default: 0)")
    g.add_argument("--seed", type=int, default=None, metavar="N", help="sampling seed (default: a random one)")
    held = g.add_mutually_exclusive_group()
    held.add_argument("--json-schema", default=None, metavar="SCHEMA",
                      help="hold the output to this JSON schema (JSON text or a file) (default: none)")
    held.add_argument("--json-object", action="store_true", help="hold the output to any JSON object (default: off)")
    held.add_argument("--regex", default=None, metavar="REGEX", help="hold the output to this regular expression (default: none)")
    held.add_argument("--choice", action="append", default=None, metavar="TEXT",
                      help="the output is one of these; repeat (default: none)")

    args = ap.parse_args(argv)
    from asyncserve.model.hub import is_remote
    from asyncserve.model.paths import check_model_path
    try:
        if not is_remote(args.model):     # a Hub id resolves when the engine loads
            check_model_path(args.model)   # a wrong --model fails at once, before torch is imported
    except ValueError as e:
        _refuse(s if args.command == "serve" else g, e)
    if args.command == "serve":
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from asyncserve.config import parse_size
        from asyncserve.server import run

        config = _config(args)
        config.served_model_name = args.served_model_name
        config.adapter_dir, config.adapter_root = args.adapter_dir, args.adapter_root
        config.adapter_url_prefixes, config.adapter_resolver = args.adapter_url_prefix, args.adapter_resolver
        config.preload_adapters = args.preload_adapters
        config.host, config.port, config.api_key = args.host, args.port, args.api_key
        config.tokenize_public, config.metrics_public = args.tokenize_public, args.metrics_public
        config.max_prompt_bytes = args.max_prompt_bytes
        config.tool_call_parser, config.reasoning_parser = args.tool_call_parser, args.reasoning_parser
        config.enable_auto_tool_choice = args.enable_auto_tool_choice
        config.max_waiting, config.shutdown_grace_s = args.max_waiting, args.shutdown_grace
        config.peers, config.node_id, config.advertise_url = args.peers, args.node_id, args.advertise_url
        config.cluster_key, config.gossip_interval_s = args.cluster_key, args.gossip_interval
        config.dispatch, config.migration_threshold_s = args.dispatch, args.migration_threshold
        try:
            config.max_body_bytes = parse_size(args.max_body_size)
            config.validate()              # wrong paths, names, sizes: exit now, not after loading
        except ValueError as e:
            _refuse(s, e)
        sys.exit(run(config))
    else:
        from asyncserve import LLM, SamplingParams, StructuredOutputs

        structured = None
        if args.json_schema is not None:
            schema = Path(args.json_schema)
            structured = StructuredOutputs(json=schema.read_text() if schema.is_file() else args.json_schema)
        elif args.json_object or args.regex is not None or args.choice:
            structured = StructuredOutputs(json_object=args.json_object, regex=args.regex, choice=args.choice)
        config = _config(args)
        try:
            config.validate()
            llm = LLM(**dataclasses.asdict(config))
        except (ValueError, OSError) as e:     # a model or adapter that cannot be read, ...
            _refuse(g, e)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                structured_outputs=structured)
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, args.use_adapter)
        else:
            outs = llm.generate(args.prompt, params, args.use_adapter)
        for out in outs:
            sys.stdout.write(out.text + "\n")


if __name__ == "__main__":
    main()
