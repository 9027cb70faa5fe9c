"""Workload generators' statistics and the benchmark client against a fake OpenAI streaming server."""
from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_serving  # noqa: E402
import workloads  # noqa: E402

# ---------------------------------------------------------------- generators


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_gamma_arrivals_have_requested_mean_and_cv(cv: float) -> None:
    rate = 5.0
    arrivals = workloads.gamma_arrival_times(np.random.default_rng(7), 5000, rate, cv)
    intervals = np.diff(arrivals, prepend=0.0)
    assert np.all(intervals >= 0)
    assert intervals.mean() == pytest.approx(1 / rate, rel=0.06)
    assert intervals.std() / intervals.mean() == pytest.approx(cv, rel=0.1)


def test_gamma_arrivals_with_cv_zero_are_periodic() -> None:
    arrivals = workloads.gamma_arrival_times(np.random.default_rng(0), 10, rate=4.0, cv=0.0)
    assert np.allclose(arrivals, 0.25 * np.arange(1, 11))


def test_slora_power_law_popularity_matches_s_lora_distribution() -> None:
    n_adapters, alpha = 8, 0.3
    requests = workloads.slora_synthetic(
        n_adapters, alpha, rate=10.0, cv=1.0, input_range=(8, 16), output_range=(4, 8), num_requests=5000, seed=1
    )
    counts = Counter(r.model for r in requests)
    frequencies = np.array([counts[f"lora{k}"] for k in range(n_adapters)]) / len(requests)
    k = np.arange(n_adapters)
    expected = ((k + 1) / n_adapters) ** alpha - (k / n_adapters) ** alpha
    assert np.abs(frequencies - expected).max() < 0.02
    assert frequencies[0] > frequencies[1] > frequencies[-1]  # adapter 0 the most popular

    uniform = workloads.slora_synthetic(
        n_adapters, 1.0, rate=10.0, cv=1.0, input_range=(8, 16), output_range=(4, 8), num_requests=5000, seed=1
    )
    uniform_counts = Counter(r.model for r in uniform)
    assert len(uniform_counts) == n_adapters
    assert max(uniform_counts.values()) / min(uniform_counts.values()) < 1.3


def test_slora_trace_shape_lengths_and_reproducibility() -> None:
    kwargs = dict(n_adapters=20, alpha=1.0, rate=2.0, cv=1.0, input_range=(8, 12), output_range=(3, 5), duration_s=60)
    requests = workloads.slora_synthetic(**kwargs, seed=3)
    assert len(requests) == 120  # rate × duration
    assert [r.index for r in requests] == list(range(120))
    arrivals = [r.arrival_time_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert {r.prompt_len for r in requests} == set(range(8, 13))  # uniform over the closed range
    assert {r.max_tokens for r in requests} == {3, 4, 5}
    assert all(len(r.prompt.split()) == r.prompt_len for r in requests)
    assert len({r.prompt for r in requests}) == len(requests)
    assert workloads.slora_synthetic(**kwargs, seed=3) == requests
    assert workloads.slora_synthetic(**kwargs, seed=4) != requests


def test_token_id_prompts_have_exact_length_and_range() -> None:
    requests = workloads.slora_synthetic(
        4, 1.0, rate=1.0, cv=1.0, input_range=(5, 9), output_range=(1, 2), num_requests=50, prompt_vocab_size=49152
    )
    for r in requests:
        assert r.prompt is None and len(r.prompt_token_ids) == r.prompt_len
        assert all(1000 <= t < 49152 for t in r.prompt_token_ids)


@pytest.mark.parametrize(
    "kind, n_requests, expected_counts",
    [
        ("distinct", 64, [1] * 64),
        ("uniform", 64, [8] * 8),
        ("uniform", 50, [7, 7] + [6] * 6),  # ⌈√50⌉ = 8 adapters
        ("skewed", 64, [17, 17, 11, 7, 5, 3, 2, 1, 1]),  # floors of 1.5^k, the remainder on one more adapter
        ("identical", 64, [64]),
    ],
)
def test_punica_mix_adapter_counts(kind: str, n_requests: int, expected_counts: list[int]) -> None:
    requests = workloads.punica_mix(kind, n_requests, seed=5, max_len=64)
    counts = Counter(r.model for r in requests)
    assert [counts[f"lora{k}"] for k in range(len(counts))] == expected_counts  # lora0 the most popular
    assert len(requests) == n_requests
    assert all(r.arrival_time_s == 0 for r in requests)
    assert all(r.prompt_len >= 1 and r.max_tokens >= 2 and r.prompt_len + r.max_tokens <= 64 for r in requests)


def test_punica_skewed_popularity_ratio_is_about_one_and_a_half() -> None:
    counts = workloads.punica_adapter_counts("skewed", 1000)
    assert sum(counts) == 1000 and counts == sorted(counts, reverse=True)
    geometric = [math.floor(1.5**k) for k in range(15)]  # 1, 1, 2, 3, 5, ..., 291: sums to 867 ≤ 1000
    assert counts == sorted(geometric + [1000 - sum(geometric)], reverse=True)
    head = np.array(geometric[::-1][:8])
    assert np.allclose(head[:-1] / head[1:], 1.5, atol=0.03)


def test_punica_mix_with_rate_has_poisson_arrivals() -> None:
    requests = workloads.punica_mix("distinct", 3000, seed=2, max_len=32, rate=9.0)
    intervals = np.diff([0.0] + [r.arrival_time_s for r in requests])
    assert intervals.mean() == pytest.approx(1 / 9, rel=0.06)
    assert intervals.std() / intervals.mean() == pytest.approx(1.0, rel=0.1)


def test_adapters_needed_in_numeric_order_without_base() -> None:
    requests = [
        workloads.Request(index=i, arrival_time_s=0.0, model=name, max_tokens=1, prompt="x")
        for i, name in enumerate(["lora10", "base", "lora2", "lora10", "lora0"])
    ]
    assert workloads.adapters_needed(requests, "base") == ["lora0", "lora2", "lora10"]


def test_w1_has_64_requests_cycling_four_adapters(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="scripts/make_w1.py"):
        workloads.w1(tmp_path, "smollm2")
    prompts = write_w1_prompts(tmp_path)
    requests = workloads.w1(tmp_path, "smollm2")
    assert len(requests) == 64
    assert [r.model for r in requests] == [f"a{i % 4}" for i in range(64)]
    assert [r.prompt for r in requests] == prompts[:64]
    assert all(r.max_tokens == 64 and r.arrival_time_s == 0 for r in requests)
    assert workloads.adapters_needed(requests) == ["a0", "a1", "a2", "a3"]
    assert {r.model for r in workloads.w1(tmp_path, "smollm2", use_adapters=False)} == {"smollm2"}
    sweep = workloads.w1(tmp_path, "smollm2", num_requests=130)      # a concurrency sweep's size
    assert [r.prompt for r in sweep] == prompts[:64] * 2 + prompts[:2]
    assert [r.model for r in sweep] == [f"a{i % 4}" for i in range(130)]


def test_shared_prefix_leads_every_prompt_with_the_same_words() -> None:
    requests = workloads.punica_mix("uniform", 20, seed=1)
    led = workloads.with_shared_prefix(requests, 100, seed=3)
    prefix = led[0].prompt.split()[:100]
    assert all(r.prompt.split()[:100] == prefix and r.prompt.split()[100:] == q.prompt.split()
               for r, q in zip(led, requests))
    assert all(r.prompt_len == q.prompt_len + 100 and r.model == q.model for r, q in zip(led, requests))
    assert set(prefix) <= set(workloads.COMMON_WORDS)
    with pytest.raises(ValueError):
        workloads.with_shared_prefix(workloads.slora_synthetic(4, 1.0, 2.0, 1.0, (8, 16), (8, 16), num_requests=2,
                                                               prompt_vocab_size=5000), 4)


# ---------------------------------------------------------------- client against a fake server


class FakeOpenAIServer:
    """Streams max_tokens tokens per request: the first after first_token_delay_s, then one chunk each
    token_delay_s; answers 404 for rejected models. Runs its own event loop in a thread."""

    def __init__(
        self,
        first_token_delay_s: float,
        token_delay_s: float,
        send_usage: bool = True,
        tokens_per_chunk: int = 1,
        rejected_models: tuple[str, ...] = (),
    ) -> None:
        self.first_token_delay_s = first_token_delay_s
        self.token_delay_s = token_delay_s
        self.send_usage = send_usage
        self.tokens_per_chunk = tokens_per_chunk
        self.rejected_models = rejected_models
        self.payloads: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.base_url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        if payload["model"] in self.rejected_models:
            return web.json_response({"error": {"message": "model not found"}}, status=404)
        chat = request.path.endswith("/chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(event: dict) -> None:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())

        def choice(text: str) -> dict:
            return {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}

        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if chat:  # the role chunk has empty content and must not count as the first token
                await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(self.first_token_delay_s)
            sent = 0
            while sent < payload["max_tokens"]:
                if sent:
                    await asyncio.sleep(self.token_delay_s)
                tokens = min(self.tokens_per_chunk, payload["max_tokens"] - sent)
                await send({"choices": [choice(" tok" * tokens)]})
                sent += tokens
            await send({"choices": [{**choice(""), "finish_reason": "length"}]})
            if self.send_usage and payload.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 7, "completion_tokens": sent, "total_tokens": sent + 7}
                await send({"choices": [], "usage": usage})
            await response.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return response

    async def _models(self, request: web.Request) -> web.Response:
        # an adapter listed first: the client must pick the entry without a parent
        models = [{"id": "a0", "object": "model", "parent": "served-base"}, {"id": "served-base", "object": "model"}]
        return web.json_response({"object": "list", "data": models})

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)  # port 0: the OS picks a free one
        await site.start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def write_w1_prompts(bench_dir: Path) -> list[str]:
    prompts = [f"prompt number {i}" for i in range(64)]
    (bench_dir / "w1").mkdir(parents=True)
    (bench_dir / "w1" / "prompts.json").write_text(json.dumps(prompts))
    return prompts


def test_client_closed_loop_w1_timings_tokens_and_json(tmp_path: Path) -> None:
    bench_dir = tmp_path / "bench"
    prompts = write_w1_prompts(bench_dir)
    json_out, plot = tmp_path / "w1.json", tmp_path / "w1.png"
    first_token_delay, token_delay = 0.1, 0.004

    with FakeOpenAIServer(first_token_delay, token_delay) as server:
        exit_code = bench_serving.main([
            "--base-url", server.base_url, "--workload", "w1", "--bench-dir", str(bench_dir),
            "--max-in-flight", "16", "--json-out", str(json_out), "--plot", str(plot), "--slo-ttft", "5",
        ])
    assert exit_code == 0
    assert server.max_in_flight == 16
    sent = sorted(server.payloads, key=lambda p: prompts.index(p["prompt"]))
    for i, payload in enumerate(sent):
        assert payload == {
            "model": f"a{i % 4}", "prompt": prompts[i], "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }

    report = json.loads(json_out.read_text())
    summary = report["summary"]
    assert report["config"]["loop"] == "closed" and report["config"]["max_in_flight"] == 16
    assert report["workload"]["generator"] == "w1" and report["workload"]["arguments"]["use_adapters"]
    assert len(report["machine"]["loadavg_before"]) == 3
    assert summary["completed"] == 64 and summary["errors"] == 0
    assert summary["output_tokens"] == 64 * 64 and summary["prompt_tokens"] == 64 * 7
    ideal_latency = first_token_delay + 63 * token_delay
    # 4 closed-loop rounds of 16, each as long as one request; far below 64 requests one after another
    assert 4 * ideal_latency <= summary["wall_time_s"] < 16 * ideal_latency
    assert summary["output_tokens_per_s"] == pytest.approx(4096 / summary["wall_time_s"])
    assert summary["requests_per_s"] == pytest.approx(64 / summary["wall_time_s"])
    assert summary["slo"]["attainment"] == {"ttft_s": 1.0, "all": 1.0}
    for r in report["requests"]:
        assert r["error"] is None and r["output_tokens"] == 64 and r["content_chunks"] == 64
        assert first_token_delay <= r["ttft_s"] < first_token_delay + 0.3
        assert 0.9 * token_delay <= r["tpot_s"] < token_delay + 0.02  # a late first chunk shortens the rest
        assert r["latency_s"] == pytest.approx(r["ttft_s"] + 63 * r["tpot_s"])
        assert r["latency_s"] >= ideal_latency
    assert summary["ttft_s"]["p50"] <= summary["ttft_s"]["p90"] <= summary["ttft_s"]["p99"]
    assert plot.stat().st_size > 0


def test_w1_base_finds_the_served_base_model_and_adds_extra_body(tmp_path: Path) -> None:
    bench_dir, json_out = tmp_path / "bench", tmp_path / "base.json"
    write_w1_prompts(bench_dir)
    extra = {"response_format": {"type": "json_object"}, "temperature": 0.5}
    with FakeOpenAIServer(0.0, 0.0) as server:
        argv = ["--base-url", server.base_url, "--workload", "w1-base", "--bench-dir", str(bench_dir),
                "--json-out", str(json_out), "--no-progress", "--extra-body", json.dumps(extra)]
        assert bench_serving.main(argv) == 0
    assert {p["model"] for p in server.payloads} == {"served-base"}
    assert all(p["response_format"] == {"type": "json_object"} and p["temperature"] == 0.5 for p in server.payloads)
    report = json.loads(json_out.read_text())
    assert report["config"]["base_model_name"] == "served-base" and report["config"]["extra_body"] == extra
    assert report["summary"]["completed"] == 64 and report["summary"]["output_tokens"] == 64 * 64


def test_client_chat_without_usage_counts_chunks_and_reports_errors(tmp_path: Path, capsys) -> None:
    json_out = tmp_path / "chat.json"
    with FakeOpenAIServer(0.05, 0.002, send_usage=False, rejected_models=("lora1",)) as server:
        exit_code = bench_serving.main([
            "--base-url", server.base_url, "--workload", "punica-uniform", "--num-requests", "9",
            "--punica-max-len", "12", "--seed", "11", "--endpoint", "chat", "--slo-ttft", "1",
            "--slo-latency", "5", "--json-out", str(json_out), "--no-progress",
        ])
    assert exit_code == 0
    assert all(p["messages"][0]["role"] == "user" for p in server.payloads)
    requests = workloads.punica_mix("uniform", 9, seed=11, max_len=12)
    served = [r for r in requests if r.model != "lora1"]

    summary = json.loads(json_out.read_text())["summary"]
    assert summary["completed"] == 6 and summary["errors"] == 3
    assert summary["output_tokens"] == sum(r.max_tokens for r in served)
    assert summary["prompt_tokens"] is None
    assert list(summary["error_examples"]) == ['HTTP 404: {"error": {"message": "model not found"}}']
    # failed requests miss every SLO
    assert summary["slo"]["attainment"] == {"ttft_s": 6 / 9, "latency_s": 6 / 9, "all": 6 / 9}
    assert 0.05 <= summary["ttft_s"]["mean"] < 0.2  # the empty role chunk did not count
    printed = capsys.readouterr().out
    assert "requests completed / errors   6 / 3" in printed and "SLO attainment" in printed


def test_client_open_loop_follows_arrival_times_and_prefers_usage_counts(tmp_path: Path) -> None:
    json_out = tmp_path / "open.json"
    args = ["--workload", "slora", "--num-requests", "8", "--rate", "10", "--n-adapters", "3",
            "--input-range", "4", "8", "--output-range", "4", "7", "--seed", "9"]
    with FakeOpenAIServer(0.02, 0.002, tokens_per_chunk=2) as server:
        assert bench_serving.main(["--base-url", server.base_url, *args, "--json-out", str(json_out)]) == 0
    requests = workloads.slora_synthetic(3, 1.0, 10.0, 1.0, (4, 8), (4, 7), num_requests=8, seed=9)
    report = json.loads(json_out.read_text())
    assert report["config"]["loop"] == "open"
    for request, result in zip(requests, report["requests"]):
        assert result["start_s"] == pytest.approx(request.arrival_time_s - requests[0].arrival_time_s, abs=0.05)
        assert result["output_tokens"] == request.max_tokens  # from usage, not the merged chunks
        assert result["content_chunks"] == -(-request.max_tokens // 2)


def test_list_adapters_prints_vllm_lora_modules(capsys) -> None:
    argv = ["--workload", "punica-skewed", "--num-requests", "64", "--list-adapters", "--adapter-sources", "A", "B"]
    assert bench_serving.main(argv) == 0
    assert capsys.readouterr().out.split() == [f"lora{k}={'AB'[k % 2]}" for k in range(9)]


def test_extra_body_per_request() -> None:
    """A function as extra_body adds its fields for each request (bench_llamacpp.py's llama-server lora)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_llamacpp

    requests = [workloads.Request(index=i, arrival_time_s=0.0, model=f"a{i % 4}", max_tokens=4, prompt="hi")
                for i in range(6)]
    payloads = [bench_serving.build_payload(r, "completions", bench_llamacpp.llama_lora) for r in requests]
    assert [p["lora"] for p in payloads] == [[{"id": i % 4, "scale": 1.0}] for i in range(6)]
    assert all(p["model"] == r.model and p["prompt"] == "hi" for p, r in zip(payloads, requests))
    fixed = bench_serving.build_payload(requests[0], "completions", {"seed": 3})
    assert fixed["seed"] == 3 and "lora" not in fixed
