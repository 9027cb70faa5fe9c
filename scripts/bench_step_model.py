"""How well the rank-aware step-time model (asyncserve/perf_model.py) predicts this machine's steps.

Runs the real engine (offline, SmolLM2 by default) over --steps random steps (decode batches of
1..--max-batch, prefill chunks of --prefill-tokens tokens after up to --max-context cached ones,
decodes and a prefill chunk together) with adapters of --ranks (written here at random, PEFT
format), each step timed --repeats times keeping the fastest (asyncserve/step_profile.py); an active
set of adapters lasts a few steps and is warmed first (stacks built, packed, fused), as a server's
mostly does. Fits the model to every other step and prints the absolute relative error of its
predictions for the other half, median and p90 per step kind, for the full model and for
CaraServe's terms alone (beta + alpha_token * tokens + alpha_rank * rank work), and for the
coefficients of the step profile the engine measured at its start (--step-profile auto in a fresh
folder: asyncserve/step_profile.py), all of these steps held out from it.

    .venv/bin/python scripts/bench_step_model.py --threads 2
    .venv/bin/python scripts/bench_step_model.py --threads 1 --steps 120 --json-out /tmp/step-model.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from make_adapters import ALL, model_shapes, write_adapter

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_adapters(folder: Path, model: str | None, ranks: list[int]) -> dict[str, str]:
    """One adapter per rank, on all seven projections and on attention alone in turn."""
    base_name, num_layers, shapes = model_shapes(model or "default")
    generator = torch.Generator().manual_seed(0)
    adapters = {}
    for i, r in enumerate(ranks):
        name = f"r{r}_{'all' if i % 2 == 0 else 'attn'}"
        write_adapter(folder / name, base_name, num_layers, shapes, r, ALL if i % 2 == 0 else ATTENTION,
                      generator, torch.bfloat16)
        adapters[name] = str(folder / name)
    return adapters


def error_table(title: str, errors: dict[str, list[float]]) -> str:
    rows = [f"{title}", f"  {'steps':<10}{'held out':>9}{'median':>9}{'p90':>9}"]
    for kind, values in errors.items():
        rows.append(f"  {kind:<10}{len(values):>9}{100 * statistics.median(values):>8.1f}%"
                    f"{100 * float(np.quantile(values, 0.9)):>8.1f}%")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each step; the fastest counts")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, nargs=2, default=[16, 512], metavar=("LO", "HI"))
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from asyncserve import LLM
    from asyncserve.step_profile import holdout, profile_steps, relative_errors
    from ipc.profile import cpu_model

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        adapters = make_adapters(Path(folder), args.model, args.ranks)
        t0 = time.perf_counter()
        llm = LLM(model=args.model, adapters=adapters, dtype=args.dtype, device="cpu", threads=args.threads,
                  prefix_caching=False, step_profile="auto", step_profile_dir=str(Path(folder) / "p"))
        start_s = time.perf_counter() - t0
    start = llm.engine.latency.start
    shape = {"max_batch": args.max_batch, "prefill_tokens": tuple(args.prefill_tokens),
             "max_context": args.max_context}
    profile_steps(llm.engine, 3, list(adapters), seed=args.seed + 1, repeats=1, **shape)   # first-run costs
    t0 = time.perf_counter()
    steps = profile_steps(llm.engine, args.steps, list(adapters), seed=args.seed, repeats=args.repeats, **shape)
    seconds = time.perf_counter() - t0
    full, caraserve = holdout(steps), holdout(steps, caraserve_terms_only=True)
    load_after = os.getloadavg()

    print(f"{cpu_model()}, {args.threads} threads, {args.dtype}; {len(steps)} steps in {seconds:.0f} s; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(error_table("full model (absolute relative error of held-out steps)", full.errors))
    print(error_table("CaraServe's terms alone", caraserve.errors))
    print(error_table(f"the start profile ({start.source.split(' /')[0]}; engine built with it in {start_s:.1f} s)",
                      relative_errors(start, steps)))
    c = full.coefficients
    print(f"fitted: beta {1e3 * c.beta:.3f} ms, per token {1e6 * c.alpha_token:.2f} us, per rank unit "
          f"{1e9 * c.alpha_rank:.2f} ns, per sequence {1e6 * c.alpha_seq:.1f} us, per adapter "
          f"{1e6 * c.alpha_adapter:.1f} us, per attended pair {1e9 * c.alpha_attn:.2f} ns")
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "command": " ".join([sys.executable, *sys.argv]), "cpu": cpu_model(), "threads": args.threads,
            "dtype": args.dtype, "loadavg_before": load_before, "loadavg_after": load_after,
            "coefficients": {f: getattr(c, f) for f in c.__struct_fields__},
            "errors": {"full": full.errors, "caraserve_terms": caraserve.errors,
                       "start_profile": relative_errors(start, steps)},
            "start_profile": {f: getattr(start, f) for f in start.__struct_fields__},
            "steps": [{"kind": s.kind, "chunks": [list(ch) for ch in s.chunks], "seconds": s.seconds}
                      for s in steps]}, indent=1))


if __name__ == "__main__":
    main()
