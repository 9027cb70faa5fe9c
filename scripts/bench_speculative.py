"""Speculative decoding by prompt lookup over HTTP: one stream (where a CPU user waits most), asyncserve
without and with drafts (--speculative-config), and llama.cpp's llama-server without and with its ngram-simple
speculation, same client, the systems alternating round by round.

Two chat workloads of greedy requests, one at a time (--in-flight: more), from W1's prompts (make_w1.py):
    repeat   "Repeat the following text exactly" + four W1 prompts (256 words): text that repeats its
             context, where drafts are kept (as in code edits, quotes, extraction)
    continue "Continue this text" + one W1 prompt: text with little to look up, where drafts cost
             only their lookups (and the rows of those rejected)

    python scripts/bench_speculative.py --gguf MODEL.gguf --bench-dir /tmp/bench [--llama-server BIN]

Prints, per system and workload, output tokens/s over the requests and the mean request latency, and
whether asyncserve's texts with drafts equal its texts without.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cluster import stop_nodes  # noqa: E402
from bench_llamacpp import cpu_description, start  # noqa: E402
from workloads import w1_file  # noqa: E402



def workloads(bench_dir: Path, num: int) -> dict[str, list[tuple[str, int]]]:
    """name -> [(user message, max_tokens)]"""
    prompts = json.loads(w1_file(bench_dir, "prompts.json").read_text())
    repeat = [("Repeat the following text exactly, word for word:\n\n" + " ".join(prompts[4 * i:4 * i + 4]), 256)
              for i in range(num)]
    cont = [("Continue this text:\n\n" + prompts[i], 128) for i in range(num)]
    return {"repeat": repeat, "continue": cont}


def served_model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def chat(port: int, model: str, message: str, max_tokens: int, timeout: float) -> tuple[str, int]:
    body = {"model": model, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
            "temperature": 0, "seed": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]


def spec_counters(port: int) -> tuple[float, float]:
    """asyncserve's /metrics: (tokens drafted, tokens kept) so far."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    value = {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("asyncserve_spec_decode")}
    return (value["asyncserve_spec_decode_draft_tokens_total"], value["asyncserve_spec_decode_accepted_tokens_total"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--bench-dir", type=Path, default=Path(__file__).resolve().parents[1] / ".bench")
    ap.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary (default: asyncserve alone)")
    ap.add_argument("--draft-tokens", type=int, default=4, help="num_speculative_tokens, and llama-server's draft length")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="asyncserve's disable_by_batch_size (default: its own, 8)")
    ap.add_argument("--llama-lookup", type=int, default=3,
                    help="llama-server's --spec-ngram-simple-size-n, the n-gram it looks up (its default, 12, rarely "
                         "matches; ours tries 4, 3, then 2)")
    ap.add_argument("--asyncserve-flags", default="", help="more flags for asyncserve serve")
    ap.add_argument("--requests", type=int, default=4, help="per workload and round")
    ap.add_argument("--in-flight", type=int, default=1, help="requests at a time (a closed loop)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--port", type=int, default=8113)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=Path("bench-speculative"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ours = [sys.executable, "-m", "asyncserve.cli", "serve", "--model", str(args.gguf), "--port", str(args.port),
            "--threads", str(args.threads), "--no-prefix-caching", "--log-level", "WARNING",
            *args.asyncserve_flags.split()]
    speculative = {"method": "ngram", "num_speculative_tokens": args.draft_tokens}
    if args.disable_by_batch_size is not None:
        speculative["disable_by_batch_size"] = args.disable_by_batch_size
    off = {"method": "ngram", "num_speculative_tokens": 0}          # drafting is the CPU default
    systems = {"asyncserve": ours + ["--speculative-config", json.dumps(off)],
               "asyncserve-ngram": ours + ["--speculative-config", json.dumps(speculative)]}
    if args.llama_server:
        llama = [str(args.llama_server), "-m", str(args.gguf), "-t", str(args.threads), "-np", "1", "-c", "4096",
                 "--no-cache-prompt", "--host", "127.0.0.1", "--port", str(args.port)]
        systems["llama-server"] = llama
        systems["llama-server-ngram"] = llama + ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n",
                                                 str(args.llama_lookup), "--spec-ngram-simple-size-m",
                                                 str(args.draft_tokens)]
    loads = workloads(args.bench_dir, args.requests)
    print(f"CPU: {cpu_description()}; {args.gguf.name}; {args.requests} requests per workload, {args.in_flight} at a time; "
          f"{args.draft_tokens} draft tokens", flush=True)
    rows, texts = [], {}
    for round_ in range(args.rounds):
        order = list(systems) if round_ % 2 == 0 else list(reversed(systems))
        for system in order:
            proc = start(f"{system}-{round_}", systems[system], args.port, args)
            try:
                model = served_model(args.port)
                for load, requests in loads.items():
                    loadavg = os.getloadavg()[0]
                    drafts_before = spec_counters(args.port) if system == "asyncserve-ngram" else None

                    def one(i: int, message: str, max_tokens: int) -> tuple[int, str, int, float]:
                        t = time.perf_counter()
                        text, n = chat(args.port, model, message, max_tokens, args.request_timeout)
                        return i, text, n, time.perf_counter() - t
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(args.in_flight) as pool:
                        done = list(pool.map(lambda r: one(r[0], *r[1]), enumerate(requests)))
                    wall = time.perf_counter() - t0
                    texts.update({(system, load, i): text for i, text, _, _ in done})
                    tokens = sum(n for _, _, n, _ in done)
                    row = {"round": round_, "system": system, "load": load, "loadavg_before": loadavg,
                           "tok_s": tokens / wall, "tokens": tokens,
                           "latency_mean_s": statistics.mean(t for _, _, _, t in done)}
                    kept = ""
                    if drafts_before is not None:
                        drafted, accepted = (b - a for a, b in zip(drafts_before, spec_counters(args.port)))
                        row.update(drafted=drafted, accepted=accepted)
                        kept = f", {accepted:.0f} of {drafted:.0f} drafted tokens kept"
                    rows.append(row)
                    print(f"round {round_} {system:18s} {load:8s}: {row['tok_s']:.1f} tok/s, {tokens} tokens, "
                          f"latency mean {row['latency_mean_s']:.2f} s{kept} (load average {loadavg:.2f})", flush=True)
            finally:
                stop_nodes([proc])
    print("medians over rounds:")
    for load in loads:
        speeds = {s: statistics.median(r["tok_s"] for r in rows if r["system"] == s and r["load"] == load)
                  for s in systems}
        gains = [f"{s} {speeds[s + '-ngram'] / speeds[s]:.2f}x" for s in ("asyncserve", "llama-server") if s in speeds]
        same = sum(texts[("asyncserve", load, i)] == texts[("asyncserve-ngram", load, i)]
                   for i in range(len(loads[load])))
        print(f"  {load}: " + ", ".join(f"{s} {v:.1f} tok/s" for s, v in speeds.items())
              + f"; drafts: {', '.join(gains)}; asyncserve's texts equal with and without: {same}/{len(loads[load])}")
    (args.out / "results.json").write_text(json.dumps({"cpu": cpu_description(), "args": {k: str(v) for k, v in
                                                       vars(args).items()}, "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
