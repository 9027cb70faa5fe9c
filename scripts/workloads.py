"""Benchmark workloads: reproducible lists of requests for bench_serving.py.

Every generator is a pure function of its arguments (a seed included) and returns a list of `Request`.
A request with arrival_time_s == 0 everywhere is meant for a closed loop; generators with arrival
processes give each request its send time in seconds from the start of the trace.

Generated prompts are text made of common English words that are each one token in SmolLM2's
vocabulary (and usually in other Llama-style BPE vocabularies), so a prompt of n words is n tokens.
The words are drawn at random so prompts differ from their first tokens on, which keeps prefix caches
from turning synthetic prompts into free prefills. Pass `prompt_vocab_size` to get token-id prompts
of exact length instead (the completions endpoint of vLLM accepts them; not every server does).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

W1_NUM_REQUESTS = 64
W1_NUM_ADAPTERS = 4
W1_OUTPUT_TOKENS = 64
W1_PROMPT_TOKENS = 64

# Punica §7: "the number of requests to the i-th most popular model is α times that of the i+1-th's".
PUNICA_SKEW = 1.5
PUNICA_KINDS = ("distinct", "uniform", "skewed", "identical")

# Random token-id prompts skip the low ids, where byte-fallback and special tokens usually sit.
_LOWEST_PLAIN_TOKEN_ID = 1000

# Each is a single SmolLM2 token both with a leading space and at the start of a text (checked with its
# tokenizer), so a prompt of n of them is exactly n SmolLM2 tokens.
COMMON_WORDS = (
    "about after all also an and answer any are as at back be because been before bridge but by can city "
    "computer could did do doctor down each engine even first for forest from has have he her his history "
    "if in into is it just language letter library like made man many market may me more most much music "
    "must my new no not now ocean of on one only or other our out over people planet question river said "
    "science she should so some student such summer teacher that the their then there these they this "
    "those through time to two up was way we well were what when where which who window winter with would "
    "years you your"
).split()


@dataclass(frozen=True)
class Request:
    index: int
    arrival_time_s: float
    model: str  # adapter name, or the base model's served name
    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # intended prompt length in tokens: exact for W1 and token-id prompts, approximate for generated text
    prompt_len: int | None = None


def adapter_name(prefix: str, k: int) -> str:
    return f"{prefix}{k}"


def adapters_needed(requests: list[Request], base_model_name: str | None = None) -> list[str]:
    """Distinct adapter names the requests use (the base model excluded), in numeric order of their suffix."""
    names = {r.model for r in requests if r.model != base_model_name}

    def numeric_suffix_order(name: str) -> tuple[str, int]:
        match = re.fullmatch(r"(.*?)(\d+)", name)
        return (match.group(1), int(match.group(2))) if match else (name, -1)

    return sorted(names, key=numeric_suffix_order)


def w1_file(bench_dir: str | Path, name: str) -> Path:
    """bench_dir/w1/name; FileNotFoundError saying how to make W1 if it is not there."""
    path = Path(bench_dir) / "w1" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: write W1 with `python scripts/make_w1.py` "
                                f"(into .bench/), or pass the folder holding w1/ as --bench-dir")
    return path


def w1(bench_dir: str | Path, base_model_name: str | None, use_adapters: bool = True,
       num_requests: int = W1_NUM_REQUESTS) -> list[Request]:
    """W1 of BENCHMARKS.md (bench_dir/w1, written by scripts/make_w1.py): request i = prompts.json[i] on
    adapter a{i % 4} (or the base model). Another num_requests (a concurrency sweep's) cycles through
    the 64 prompts: serve it with prefix caching off, or the repeats are cache hits."""
    prompts = json.loads(w1_file(bench_dir, "prompts.json").read_text())
    if len(prompts) < W1_NUM_REQUESTS:
        raise ValueError(f"W1 needs {W1_NUM_REQUESTS} prompts, found {len(prompts)}")
    return [
        Request(
            index=i,
            arrival_time_s=0.0,
            model=adapter_name("a", i % W1_NUM_ADAPTERS) if use_adapters else base_model_name,
            max_tokens=W1_OUTPUT_TOKENS,
            prompt=prompts[i % W1_NUM_REQUESTS],
            prompt_len=W1_PROMPT_TOKENS,
        )
        for i in range(num_requests)
    ]


def gamma_arrival_times(rng: np.random.Generator, n: int, rate: float, cv: float) -> np.ndarray:
    """Send times of a Gamma renewal process: inter-arrivals with mean 1/rate and coefficient of variation cv.

    Shape 1/cv² and scale cv²/rate give mean shape·scale = 1/rate and cv = 1/√shape; cv = 1 is Poisson,
    cv = 0 a fixed period. As in S-LoRA's trace.py, the first request arrives after one interval.
    """
    if cv == 0:
        intervals = np.full(n, 1.0 / rate)
    else:
        intervals = rng.gamma(shape=1.0 / cv**2, scale=cv**2 / rate, size=n)
    return np.cumsum(intervals)


def power_law_adapter_indices(rng: np.random.Generator, n: int, n_adapters: int, alpha: float) -> np.ndarray:
    """S-LoRA's adapter draw: floor(n_adapters · X) with X ~ Power(alpha), density alpha·x^(alpha-1) on [0, 1).

    Adapter k gets probability ((k+1)/n)^alpha − (k/n)^alpha: alpha = 1 is uniform, smaller alpha
    concentrates requests on the low-numbered adapters (adapter 0 the most popular).
    """
    return np.minimum((rng.power(alpha, size=n) * n_adapters).astype(int), n_adapters - 1)


def _prompt_fields(rng: np.random.Generator, n_tokens: int, prompt_vocab_size: int | None) -> dict:
    if prompt_vocab_size is not None:
        ids = rng.integers(_LOWEST_PLAIN_TOKEN_ID, prompt_vocab_size, size=n_tokens)
        return {"prompt_token_ids": ids.tolist(), "prompt_len": n_tokens}
    words = rng.choice(COMMON_WORDS, size=n_tokens)
    return {"prompt": " ".join(words), "prompt_len": n_tokens}


def slora_synthetic(
    n_adapters: int,
    alpha: float,
    rate: float,
    cv: float,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int = 42,
    adapter_prefix: str = "lora",
    prompt_vocab_size: int | None = None,
) -> list[Request]:
    """S-LoRA §7.2 / Table 2 synthetic trace (paper defaults: n=200, alpha=1, R=2, cv=1, [8,512], [8,512], 5 min).

    Follows S-LoRA's released generator: one Gamma process of total rate R, each request's adapter drawn
    independently from the power law (so adapter k's stream is a thinned Gamma process of rate R·p_k),
    and rate·duration requests unless num_requests is given. Lengths are uniform over the closed ranges.
    """
    if (duration_s is None) == (num_requests is None):
        raise ValueError("give exactly one of duration_s and num_requests")
    n = num_requests if num_requests is not None else int(rate * duration_s)
    rng = np.random.default_rng(seed)
    adapter_ids = power_law_adapter_indices(rng, n, n_adapters, alpha)
    input_lens = rng.integers(input_range[0], input_range[1] + 1, size=n)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=n)
    arrivals = gamma_arrival_times(rng, n, rate, cv)
    return [
        Request(
            index=i,
            arrival_time_s=float(arrivals[i]),
            model=adapter_name(adapter_prefix, int(adapter_ids[i])),
            max_tokens=int(output_lens[i]),
            **_prompt_fields(rng, int(input_lens[i]), prompt_vocab_size),
        )
        for i in range(n)
    ]


def skewed_popularity(
    n_requests: int,
    top_share: float,
    n_adapters: int = 8,
    prompt_tokens: int = W1_PROMPT_TOKENS,
    output_tokens: int = W1_OUTPUT_TOKENS,
    rate: float | None = None,
    seed: int = 0,
    adapter_prefix: str = "lora",
    prompt_vocab_size: int | None = None,
) -> list[Request]:
    """dLoRA's skew sweep (§7.3) on W1-like requests (fixed prompt and output lengths): adapter 0 gets
    top_share of the requests, the other n_adapters - 1 share the rest evenly, each request drawn
    independently; top_share = 1/n_adapters is uniform, 0.9 is 90% one adapter. Closed loop by default;
    with `rate`, Poisson arrivals at that many requests/s."""
    if not 0 <= top_share <= 1:
        raise ValueError(f"top_share must be in [0, 1], got {top_share}")
    rng = np.random.default_rng(seed)
    rest = (1.0 - top_share) / (n_adapters - 1) if n_adapters > 1 else 0.0
    probabilities = np.array([top_share] + [rest] * (n_adapters - 1))
    adapter_ids = rng.choice(n_adapters, size=n_requests, p=probabilities / probabilities.sum())
    return _poisson_requests(rng, adapter_ids, [prompt_tokens] * n_requests, [output_tokens] * n_requests, rate,
                             adapter_prefix, prompt_vocab_size)


def punica_adapter_counts(kind: str, n_requests: int) -> list[int]:
    """Requests per adapter, most popular first, for Punica §7's popularity mixes.

    distinct: one request per adapter; uniform: ⌈√n⌉ adapters as equal as n allows; identical: one
    adapter; skewed: Punica's "Zipf-1.5", which the paper defines (and its benchmark code builds) as
    geometric counts 1, 1.5, 1.5², ... (floored) until the next would overflow n, the rest on one more
    adapter, so each adapter has about 1.5× the requests of the next most popular one.
    """
    if kind == "distinct":
        return [1] * n_requests
    if kind == "identical":
        return [n_requests]
    if kind == "uniform":
        n_adapters = math.ceil(math.sqrt(n_requests))
        base, extra = divmod(n_requests, n_adapters)
        return [base + 1] * extra + [base] * (n_adapters - extra)
    if kind == "skewed":
        counts: list[int] = []
        size = 1.0
        while sum(counts) + math.floor(size) < n_requests:
            counts.append(math.floor(size))
            size *= PUNICA_SKEW
        counts.append(n_requests - sum(counts))
        return sorted(counts, reverse=True)
    raise ValueError(f"unknown Punica mix {kind!r}; expected one of {PUNICA_KINDS}")


def punica_mix(
    kind: str,
    n_requests: int,
    seed: int = 0,
    max_len: int = 2048,
    adapter_prefix: str = "lora",
    rate: float | None = None,
    prompt_vocab_size: int | None = None,
) -> list[Request]:
    """Punica §7 workload: adapter counts from `punica_adapter_counts`, shuffled into a random order.

    Lengths follow Punica's benchmark generator (its fit to ShareGPT): prompt ~ lognormal with median 18
    and sigma 0.8, minus 1, clipped to [1, max_len − 2]; total ~ U[0, max_len) but at least prompt + 2;
    output = total − prompt. Closed loop by default; with `rate`, Poisson arrivals at that many
    requests/s (CaraServe §7's synthetic workload is punica_mix("distinct", n, rate=9)).
    """
    rng = np.random.default_rng(seed)
    counts = punica_adapter_counts(kind, n_requests)
    adapter_ids = np.repeat(np.arange(len(counts)), counts)
    rng.shuffle(adapter_ids)
    prompt_lens = np.clip(rng.lognormal(mean=math.log(18.0), sigma=0.8, size=n_requests) - 1.0, 1, max_len - 2)
    prompt_lens = prompt_lens.astype(int)
    total_lens = np.maximum(prompt_lens + 2, rng.integers(0, max_len, size=n_requests))
    output_lens = total_lens - prompt_lens
    return _poisson_requests(rng, adapter_ids, prompt_lens, output_lens, rate, adapter_prefix, prompt_vocab_size)


def _poisson_requests(rng, adapter_ids, prompt_lens, output_lens, rate: float | None, adapter_prefix: str,
                      prompt_vocab_size: int | None) -> list[Request]:
    """Requests i = 0.. with these adapters and lengths: a closed loop (all at 0), or Poisson arrivals at
    ``rate`` per second."""
    n = len(adapter_ids)
    arrivals = gamma_arrival_times(rng, n, rate, cv=1.0) if rate is not None else np.zeros(n)
    return [
        Request(
            index=i,
            arrival_time_s=float(arrivals[i]),
            model=adapter_name(adapter_prefix, int(adapter_ids[i])),
            max_tokens=int(output_lens[i]),
            **_prompt_fields(rng, int(prompt_lens[i]), prompt_vocab_size),
        )
        for i in range(n)
    ]


def with_shared_prefix(requests: list[Request], n_tokens: int, seed: int = 0) -> list[Request]:
    """The same requests, each prompt led by one common n-token text (a system prompt, say), which a
    server's prefix cache can compute once. Text prompts only: token-id prompts would need the model's
    vocabulary size."""
    if any(r.prompt is None for r in requests):
        raise ValueError("a shared prefix needs text prompts")
    prefix = " ".join(np.random.default_rng(seed).choice(COMMON_WORDS, size=n_tokens))
    return [dataclasses.replace(r, prompt=f"{prefix} {r.prompt}",
                                prompt_len=None if r.prompt_len is None else r.prompt_len + n_tokens)
            for r in requests]
