"""Benchmark client for any OpenAI-compatible streaming server (asyncserve, vLLM, ...).

Sends a workload from workloads.py with `stream: true`, greedy decoding and `ignore_eos`, and measures
per request TTFT (time to the first non-empty content chunk), TPOT ((latency − TTFT)/(output tokens − 1)),
latency and output tokens (from the usage chunk, else the number of content chunks). It talks raw
HTTP + SSE through aiohttp, so its own overhead is small and the same for every server.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000/v1 --workload w1 \
        --json-out w1.json --plot w1.png

Servers with a prefix cache (asyncserve, vLLM) answer a repeated run's prompts from the blocks of the
run before: measure a fixed workload such as W1 on a freshly started server, or with the cache off.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

from workloads import (PUNICA_KINDS, Request, adapters_needed, punica_mix, skewed_popularity, slora_synthetic, w1,
                       with_shared_prefix)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCH_DIR = REPO_ROOT / ".bench"             # scripts/make_w1.py writes W1 there
WORKLOADS = ("w1", "w1-base", "slora", "skew") + tuple(f"punica-{kind}" for kind in PUNICA_KINDS)
PERCENTILES = (50, 90, 99)
METRICS = ("ttft_s", "tpot_s", "latency_s")
METRIC_LABELS = {"ttft_s": "TTFT (s)", "tpot_s": "TPOT (s)", "latency_s": "latency (s)"}


@dataclass
class RequestResult:
    index: int
    model: str
    prompt_len: int | None
    max_tokens: int
    start_s: float = 0.0  # send time, seconds after the run started
    end_s: float = 0.0  # when the response ended or failed, seconds after the run started
    ttft_s: float | None = None
    latency_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the usage chunk, when the server sends one
    content_chunks: int = 0
    error: str | None = None


def build_payload(request: Request, endpoint: str, extra_body: dict | Callable[[Request], dict] | None = None) -> dict:
    """The request's JSON; extra_body's fields are added to it (e.g. a response_format), or those it gives for
    the request where it is a function (llama-server's per-request lora, scripts/bench_llamacpp.py)."""
    payload = {
        "model": request.model,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        if request.prompt is None:
            raise ValueError("token-id prompts need --endpoint completions")
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt if request.prompt is not None else request.prompt_token_ids
    return {**payload, **((extra_body(request) if callable(extra_body) else extra_body) or {})}


def chunk_text(event: dict, endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """Yield the decoded JSON of each `data:` line until `[DONE]` or the end of the stream."""
    buffer = b""
    async for data in response.content.iter_any():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event: / id: fields
            body = line[len(b"data:"):].strip()
            if body == b"[DONE]":
                return
            yield json.loads(body)


async def receive_stream(
    session: aiohttp.ClientSession, url: str, headers: dict, payload: dict, endpoint: str, start: float,
    result: RequestResult,
) -> int | None:
    """Fill in TTFT, content chunks, prompt tokens or the error; return the usage chunk's completion tokens."""
    completion_tokens = None
    async with session.post(url, json=payload, headers=headers) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return None
        async for event in sse_events(response):
            if "error" in event or event.get("object") == "error":  # newer and older vLLM error events
                result.error = f"stream error: {json.dumps(event)[:200]}"
                return None
            if chunk_text(event, endpoint):
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - start
                result.content_chunks += 1
            usage = event.get("usage")
            if usage:
                completion_tokens = usage.get("completion_tokens")
                result.prompt_tokens = usage.get("prompt_tokens")
    return completion_tokens


async def send_request(
    session: aiohttp.ClientSession, url: str, headers: dict, request: Request, endpoint: str, run_start: float,
    extra_body: dict | Callable[[Request], dict] | None = None,
) -> RequestResult:
    result = RequestResult(request.index, request.model, request.prompt_len, request.max_tokens)
    payload = build_payload(request, endpoint, extra_body)
    start = time.perf_counter()
    result.start_s = start - run_start
    try:
        completion_tokens = await receive_stream(session, url, headers, payload, endpoint, start, result)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    end = time.perf_counter()
    result.end_s = end - run_start
    if result.error is not None:
        return result
    if result.ttft_s is None:
        result.error = "no content in the response"
        return result
    result.latency_s = end - start
    result.output_tokens = completion_tokens if completion_tokens is not None else result.content_chunks
    if result.output_tokens > 1:
        result.tpot_s = (result.latency_s - result.ttft_s) / (result.output_tokens - 1)
    return result


async def run_requests(
    requests: list[Request],
    url: str,
    api_key: str | None,
    endpoint: str,
    open_loop: bool,
    max_in_flight: int,
    request_timeout_s: float,
    show_progress: bool = True,
    extra_body: dict | Callable[[Request], dict] | None = None,
) -> list[RequestResult]:
    """Closed loop: max_in_flight workers take requests in index order, a new one when one ends.
    Open loop: each request is sent at its arrival time (relative to the first), however many are in flight."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[RequestResult] = []
    progress = tqdm(total=len(requests), unit="req", desc="bench", disable=not show_progress)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    # limit=0: the client never queues requests itself; the loop discipline alone sets concurrency
    # a connection per request: llama-server closes a kept-alive connection after a stream, and a
    # request written to it fails ("Can not write request body"); every system is measured alike
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        run_start = time.perf_counter()

        async def send_and_record(request: Request) -> None:
            result = await send_request(session, url, headers, request, endpoint, run_start, extra_body)
            results.append(result)
            progress.update(1)
            if result.error:
                progress.set_postfix(errors=sum(r.error is not None for r in results))

        if open_loop:
            first_arrival = min(r.arrival_time_s for r in requests)

            async def send_at_arrival(request: Request) -> None:
                delay = run_start + request.arrival_time_s - first_arrival - time.perf_counter()
                await asyncio.sleep(max(delay, 0.0))
                await send_and_record(request)

            await asyncio.gather(*(send_at_arrival(r) for r in requests))
        else:
            queue = iter(sorted(requests, key=lambda r: r.index))

            async def worker() -> None:
                for request in queue:  # one shared iterator: each request is taken by exactly one worker
                    await send_and_record(request)

            await asyncio.gather(*(worker() for _ in range(min(max_in_flight, len(requests)))))
    progress.close()
    return sorted(results, key=lambda r: r.index)


def distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


def slo_attainment(results: list[RequestResult], slos: dict[str, float]) -> dict[str, float]:
    """Fraction of all requests meeting each SLO and all of them at once; failed requests miss every SLO.
    A request with one output token has no TPOT and meets any TPOT SLO."""

    def meets(result: RequestResult, metric: str, limit: float) -> bool:
        if result.error is not None:
            return False
        value = getattr(result, metric)
        return value is None or value <= limit  # only TPOT can be None here

    attainment = {metric: float(np.mean([meets(r, metric, limit) for r in results])) for metric, limit in slos.items()}
    attainment["all"] = float(np.mean([all(meets(r, m, limit) for m, limit in slos.items()) for r in results]))
    return attainment


def summarize(results: list[RequestResult], slos: dict[str, float]) -> dict:
    done = [r for r in results if r.error is None]
    wall_s = max(r.end_s for r in results) - min(r.start_s for r in results)  # first send to last finish
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    summary = {
        "num_requests": len(results),
        "completed": len(done),
        "errors": len(results) - len(done),
        "error_examples": dict(Counter(r.error for r in results if r.error).most_common(5)),
        "wall_time_s": wall_s,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(done) / wall_s if wall_s > 0 else None,
    }
    for metric in METRICS:
        summary[metric] = distribution([getattr(r, metric) for r in done if getattr(r, metric) is not None])
    if slos:
        summary["slo"] = {"limits_s": slos, "attainment": slo_attainment(results, slos)}
    return summary


def format_table(summary: dict, title: str, loadavg_before: tuple[float, float, float]) -> str:
    def number(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
        return "—" if value is None else f"{value * scale:.{digits}f}"

    lines = [
        f"=== {title} ===",
        f"{'requests completed / errors':<30}{summary['completed']} / {summary['errors']}",
        f"{'wall time (s)':<30}{number(summary['wall_time_s'], digits=2)}",
        f"{'output tokens':<30}{summary['output_tokens']}",
        f"{'output tokens/s':<30}{number(summary['output_tokens_per_s'], digits=1)}",
        f"{'requests/s':<30}{number(summary['requests_per_s'])}",
        f"{'load average before (1/5/15)':<30}{' '.join(f'{x:.2f}' for x in loadavg_before)}",
        "",
        f"{'':<16}" + "".join(f"{name:>10}" for name in ("mean", *(f"p{p}" for p in PERCENTILES))),
    ]
    for metric, label, scale in (("ttft_s", "TTFT (s)", 1.0), ("tpot_s", "TPOT (ms)", 1e3), ("latency_s", "latency (s)", 1.0)):
        stats = summary[metric]
        lines.append(f"{label:<16}" + "".join(f"{number(stats[key], scale):>10}" for key in stats))
    if "slo" in summary:
        attainment = summary["slo"]["attainment"]
        limits = ", ".join(f"{metric} ≤ {limit:g}" for metric, limit in summary["slo"]["limits_s"].items())
        lines += ["", f"SLO attainment ({limits}):"]
        lines += [f"  {metric:<12}{100 * value:6.1f} %" for metric, value in attainment.items()]
    for error, count in summary["error_examples"].items():
        lines.append(f"error ×{count}: {error}")
    return "\n".join(lines)


def plot_cdfs(results: list[RequestResult], slos: dict[str, float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4))
    for axis, metric in zip(axes, METRICS):
        values = np.sort([getattr(r, metric) for r in results if r.error is None and getattr(r, metric) is not None])
        if len(values):
            axis.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
        if metric in slos:
            axis.axvline(slos[metric], color="red", linestyle="--", label="SLO")
            axis.legend()
        axis.set_xlabel(METRIC_LABELS[metric])
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


async def served_base_model(base_url: str, api_key: str | None) -> str:
    """The base model's served name from GET /models: the first entry that is not an adapter of another."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base_url}/models", headers=headers) as response:
            response.raise_for_status()
            models = (await response.json())["data"]
    bases = [m["id"] for m in models if not m.get("parent")]
    return (bases or [m["id"] for m in models])[0]


def workload_generator(args: argparse.Namespace, base_model_name: str | None) -> tuple[Callable[..., list[Request]], dict]:
    """The workloads.py generator for --workload and its keyword arguments (recorded in the JSON report)."""
    if args.workload in ("w1", "w1-base"):
        return w1, {"bench_dir": str(args.bench_dir), "base_model_name": base_model_name, "use_adapters": args.workload == "w1",
                    **({"num_requests": args.num_requests} if args.num_requests else {})}
    common = {"seed": args.seed, "adapter_prefix": args.adapter_prefix, "prompt_vocab_size": args.prompt_vocab_size}
    if args.workload == "slora":
        return slora_synthetic, {
            "n_adapters": args.n_adapters,
            "alpha": args.alpha,
            "rate": args.rate,
            "cv": args.cv,
            "input_range": tuple(args.input_range),
            "output_range": tuple(args.output_range),
            "duration_s": None if args.num_requests else args.duration,
            "num_requests": args.num_requests,
            **common,
        }
    if args.workload == "skew":
        return skewed_popularity, {
            "n_requests": args.num_requests or 256,
            "top_share": args.top_share,
            "n_adapters": args.n_adapters,
            "rate": args.skew_rate,
            **common,
        }
    return punica_mix, {
        "kind": args.workload.removeprefix("punica-"),
        "n_requests": args.num_requests or 1000,
        "max_len": args.punica_max_len,
        "rate": args.punica_rate,
        **common,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--workload", choices=WORKLOADS, default="w1")
    parser.add_argument("--bench-dir", type=Path, default=DEFAULT_BENCH_DIR,
                        help="the folder holding w1/prompts.json (scripts/make_w1.py writes it into .bench)")
    parser.add_argument("--model-name", help="base model's served name (default: first base model in GET /models)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--max-in-flight", type=int, default=16, help="closed loop: requests in flight at once")
    parser.add_argument(
        "--loop", choices=("auto", "closed", "open"), default="auto",
        help="open follows the workload's arrival times; auto = open when the workload has any",
    )
    parser.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    parser.add_argument("--json-out", help="write the summary and per-request results here")
    parser.add_argument("--plot", help="PNG of the TTFT, TPOT and latency CDFs")
    parser.add_argument("--slo-ttft", type=float, help="seconds")
    parser.add_argument("--slo-tpot", type=float, help="seconds")
    parser.add_argument("--slo-latency", type=float, help="seconds")
    parser.add_argument("--list-adapters", action="store_true", help="print the adapter names the workload needs and exit")
    parser.add_argument(
        "--adapter-sources", nargs="+", metavar="DIR",
        help="with --list-adapters: print name=DIR, DIRs assigned round robin (vLLM --lora-modules syntax)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    parser.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                        help='fields added to every request, e.g. \'{"response_format": {"type": "json_object"}}\'')
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="lead every prompt with one common text of N tokens (exercises prefix caches)")

    synthetic = parser.add_argument_group("synthetic workloads (slora, skew, punica-*)")
    synthetic.add_argument("--seed", type=int, default=42)
    synthetic.add_argument("--num-requests", type=int, help="slora: instead of rate × duration; skew: default 256; "
                                                            "punica: default 1000; w1: default 64 (more cycle its prompts)")
    synthetic.add_argument("--adapter-prefix", default="lora", help="adapters are named PREFIX0, PREFIX1, ...")
    synthetic.add_argument(
        "--prompt-vocab-size", type=int,
        help="send random token-id prompts of exact length with ids below this (completions only); default: word prompts",
    )
    synthetic.add_argument("--n-adapters", type=int, default=200, help="slora, skew: number of adapters n")
    synthetic.add_argument("--alpha", type=float, default=1.0, help="slora: power-law exponent (1 = uniform)")
    synthetic.add_argument("--rate", type=float, default=2.0, help="slora: total requests/s R")
    synthetic.add_argument("--cv", type=float, default=1.0, help="slora: coefficient of variation of inter-arrivals")
    synthetic.add_argument("--input-range", type=int, nargs=2, default=[8, 512], metavar=("LO", "HI"))
    synthetic.add_argument("--output-range", type=int, nargs=2, default=[8, 512], metavar=("LO", "HI"))
    synthetic.add_argument("--duration", type=float, default=300.0, help="slora: trace length in seconds")
    synthetic.add_argument("--top-share", type=float, default=0.9,
                           help="skew: share of adapter 0, the rest even over the others (1/n: uniform)")
    synthetic.add_argument("--skew-rate", type=float, help="skew: Poisson arrivals at this rate (default closed loop)")
    synthetic.add_argument("--punica-max-len", type=int, default=2048, help="punica: prompt + output length bound")
    synthetic.add_argument("--punica-rate", type=float, help="punica: Poisson arrivals at this rate (default closed loop)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base_url = args.base_url.rstrip("/")
    base_model_name = args.model_name
    if args.workload == "w1-base" and base_model_name is None:
        base_model_name = asyncio.run(served_base_model(base_url, args.api_key))
        print(f"base model (from /models): {base_model_name}", file=sys.stderr)
    generator, workload_arguments = workload_generator(args, base_model_name)
    requests = generator(**workload_arguments)
    if args.shared_prefix:
        requests = with_shared_prefix(requests, args.shared_prefix, args.seed)

    if args.list_adapters:
        for k, name in enumerate(adapters_needed(requests, base_model_name)):
            print(f"{name}={args.adapter_sources[k % len(args.adapter_sources)]}" if args.adapter_sources else name)
        return 0

    open_loop = args.loop == "open" or (args.loop == "auto" and any(r.arrival_time_s > 0 for r in requests))
    slos = {
        metric: limit
        for metric, limit in (("ttft_s", args.slo_ttft), ("tpot_s", args.slo_tpot), ("latency_s", args.slo_latency))
        if limit is not None
    }
    url = f"{base_url}/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    loadavg_before = os.getloadavg()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results = asyncio.run(
        run_requests(requests, url, args.api_key, args.endpoint, open_loop, args.max_in_flight,
                     args.request_timeout, show_progress=not args.no_progress, extra_body=args.extra_body)
    )
    loadavg_after = os.getloadavg()
    summary = summarize(results, slos)

    loop_description = "open loop" if open_loop else f"closed loop, {args.max_in_flight} in flight"
    title = f"{args.workload}: {len(requests)} requests, {loop_description}, {args.endpoint} at {base_url}"
    print(format_table(summary, title, loadavg_before))
    if args.json_out:
        report = {
            "started_at": started_at,
            "workload": {
                "name": args.workload,
                "num_requests": len(requests),
                "generator": generator.__name__,
                "arguments": workload_arguments,
            },
            "config": {
                "base_url": base_url,
                "endpoint": args.endpoint,
                "loop": "open" if open_loop else "closed",
                "max_in_flight": None if open_loop else args.max_in_flight,
                "base_model_name": base_model_name,
                "extra_body": args.extra_body,
            },
            "machine": {
                "loadavg_before": list(loadavg_before),
                "loadavg_after": list(loadavg_after),
                "cpu_count": os.cpu_count(),
                "hostname": platform.node(),
            },
            "summary": summary,
            "requests": [asdict(r) for r in results],
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_cdfs(results, slos, args.plot, title)
    return 1 if summary["completed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
