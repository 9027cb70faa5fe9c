"""The rank-aware step-time model (perf_model.py) against this machine's steps (step_profile.py),
its fit on synthetic timings, and the step profile an engine starts it from.

Bounds, from what the tiny model (float32, 1 thread) measured on a 2-core Zen 4 box shared with
other jobs. Profiled steps held out from the fit, median absolute relative error: 0.05-0.065 at load
1.9, 0.13-0.16 at load 5.5-5.8 (where timing the same steps twice differed by a median 0.14), against
MEDIAN_BOUND 0.35; per kind up to 0.47 at load 5.5 (the longest steps, mixed ones, are preempted
within every repeat on a busy box), against KIND_MEDIAN_BOUND 0.75. An engine's own generate loop:
0.13-0.16 at load 1.9, 0.26 at load 5.5, against LOOP_MEDIAN_BOUND 0.5 (its decode steps run ~15%
under the profile's of the same size and adapters).
START_MEDIAN_BOUND: the engine's start profile (36 steps, best of 2, sets of 0, 1 and 3 adapters;
see step_profile.measure_profile) on the same held-out steps (up to five adapters at once): 0.06-0.21
at load 1.5-2.5 over three starts (the 180 steps' own fit, held out: 0.03-0.04), its generate loop
0.10-0.37; profiled with one adapter only, 0.21-0.74 and 0.36-1.37 (the per-adapter term 7x off).
A shared box's speed drifts: on a 2-core Emerald Rapids VM (2026-11-26) one decode step's best of 5,
timed every 30 ms for 20 s, had medians over 0.25 s windows from 0.78 to 1.76 ms, so a profile
taken at start and steps timed seconds later differ by that much whatever the model (the start
profile's loop: 0.07-0.57 over eight starts, 0.51 once in CI). Steps measured after the
coefficients' own steps are therefore each paired with one of those re-timed right after, and
predictions scaled by that ratio (speed_now): over eight starts on that box, the held-out steps
0.05-0.22 and the loop 0.06-0.37 from the start profile, the loop 0.04-0.18 from the 180 steps' fit.
That scaling cannot mend a start profile timed while the box stalled under some of its steps and not
others (the held-out median once 0.61 in CI). Such a profile should fit its own steps badly, so the
module's engine starts again when its profile's own fit is worse than START_PROFILE_FIT. Nor does it
mend every measurement: in a later CI run a profile that fit its own steps within 0.093 predicted
the held-out steps within bound and then its generate loop at a median 1.05, the box's speed
changing between a loop step and the reference step re-timed after it. So a median over bound is
measured again from scratch, up to MEASURE_TRIES times; a model that is off fails every time.
"""
from __future__ import annotations

import logging
import random
import statistics
from pathlib import Path

import msgspec
import numpy as np
import pytest
from reference import TEST_DEVICE

from asyncserve import LLM, SamplingParams
from asyncserve import step_profile
from asyncserve.perf_model import (STEP_TIME_PRIOR, PerfCoefficients, StepChunk, StepLatencyModel, StepSample, fit,
                                   predict_step_seconds, step_sample)
from asyncserve.step_profile import (CACHED, MEASURED, SHIPPED, STEP_KINDS, ChunkSpec, holdout, profile_file,
                                     profile_key, profile_steps, read_profile, timed_step)

MEDIAN_BOUND = 0.35        # of the held-out steps, all kinds together
KIND_MEDIAN_BOUND = 0.75   # of each kind's
LOOP_MEDIAN_BOUND = 0.5    # of a generate loop's steps
START_MEDIAN_BOUND = 0.5   # of the held-out steps and of a generate loop, by the start profile's coefficients
START_PROFILE_FIT = 0.15   # a start profile's fit to its own steps (median), else the module's engine starts again
START_TRIES = 3
MEASURE_TRIES = 3          # measurements of a median error over its bound, each from scratch
REPEATS = 5                # runs of each step; the fastest counts
SHAPE = {"max_batch": 32, "prefill_tokens": (16, 256), "max_context": 200}


def start_engine(tiny_model, profile_dir, adapters: bool = True, step_profile: str = "auto") -> LLM:
    """The tiny model's engine (float32, 1 thread, no CPU workers), its step-time model started from its step profile
    (step_profile auto) cached in profile_dir."""
    return LLM(model=str(tiny_model.root), dtype="float32", device=TEST_DEVICE, threads=1, prefix_caching=False,
               adapters={name: str(path) for name, path in tiny_model.adapters.items()} if adapters else {},
               step_profile=step_profile, step_profile_dir=str(profile_dir), cpu_workers=0)


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    # its start profile cached however busy the box (a fit off its own steps is not, by default),
    # so test_start_profile_predicts_measured_steps can re-time the profile's own steps; a start
    # whose profile fits its own steps worse than START_PROFILE_FIT (the box stalled while its 36
    # steps were timed: six starts on box E fit theirs within 0.02-0.23) is measured again
    for attempt in range(START_TRIES):
        max_error, step_profile.PROFILE_MAX_ERROR = step_profile.PROFILE_MAX_ERROR, float("inf")
        try:
            llm = start_engine(tiny_model, tmp_path_factory.mktemp("step-profiles"))
        finally:
            step_profile.PROFILE_MAX_ERROR = max_error
        if start_profile(llm).median_error <= START_PROFILE_FIT or attempt == START_TRIES - 1:
            break
        llm.engine.close()
    yield llm
    llm.engine.close()


def start_profile(llm: LLM) -> step_profile.StepProfile:
    """The step profile the engine measured at its start, as it cached it."""
    source = llm.engine.latency.start.source
    assert source.startswith(f"{MEASURED} ")
    return read_profile(Path(source.removeprefix(f"{MEASURED} ")), profile_key(llm.engine))


@pytest.fixture(scope="module")
def steps(llm):
    """180 profiled steps of every kind (decode batches, prefill chunks after cached context, both
    together; active sets of 0-4 adapters of ranks 1-64), none of the start profile's shapes."""
    adapters = list(llm.engine.pager.registry)
    profile_steps(llm.engine, 3, adapters, seed=1, repeats=1, **SHAPE)          # first-run costs
    return profile_steps(llm.engine, 180, adapters, seed=0, repeats=REPEATS, **SHAPE)


def seconds_now(engine, step) -> float:
    """The profiled ``step`` (a TimedStep or ProfiledStep) timed again now, best of REPEATS runs."""
    chunks = [StepChunk(*c) for c in step.chunks]
    return timed_step(engine, step.kind, [ChunkSpec(c.tokens, c.context, c.adapter) for c in chunks], REPEATS).seconds


def speed_now(engine, reference) -> float:
    """How much slower the machine runs now than when the ``reference`` step was timed: its time
    re-measured now over its time then. A shared box's speed drifts by up to 2x within seconds (see
    the module's docstring), so each measured step is paired with a reference step re-timed right
    after it, and a prediction is scaled by that pair's ratio."""
    return seconds_now(engine, reference) / reference.seconds


def loop_errors(engine, coefficients: PerfCoefficients, reference: list) -> list[float]:
    """|predicted / measured - 1| of the steps of a generate loop (the engine's own plans: 24 requests
    of every adapter and the base model), predicted by engine.predict_step_seconds with
    ``coefficients`` (not refitted meanwhile) at the speed the ``reference`` steps (those the
    coefficients were fitted to) show now, in turn."""
    adapters = list(engine.pager.registry)
    latency, refit_every = engine.latency, engine.latency.refit_every
    latency.coefficients, latency.refit_every = coefficients, 10**9
    rng = random.Random(0)
    for i in range(24):
        prompt = [rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(4, 120))]
        params = SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0, ignore_eos=True)
        engine.add(engine.make_sequence(prompt, params, [None, *adapters][i % (len(adapters) + 1)]))
    errors = []
    try:
        while engine.has_unfinished():
            plan = engine.schedule()
            predicted = engine.predict_step_seconds(plan)
            runs = [engine.run(plan) for _ in range(REPEATS)]       # a run changes no state until postprocess
            speed = speed_now(engine, reference[len(errors) % len(reference)])
            errors.append(abs(predicted * speed / min(r.duration_s for r in runs) - 1))
            engine.postprocess(plan, runs[-1])
    finally:
        latency.refit_every = refit_every
    assert len(errors) >= 20
    return errors


def median_error_within(measure, bound: float) -> list[float]:
    """The median of measure()'s errors, measured again while over ``bound`` (MEASURE_TRIES at most):
    every median seen, the last the one to assert on."""
    medians = []
    while len(medians) < MEASURE_TRIES and (not medians or medians[-1] >= bound):
        medians.append(statistics.median(measure()))
    return medians


def test_fit_recovers_every_term_from_synthetic_steps():
    rng = np.random.default_rng(0)
    truth = PerfCoefficients(beta=5e-4, alpha_token=6e-6, alpha_rank=2e-7, alpha_seq=1.5e-5, alpha_adapter=1.6e-4,
                             alpha_attn=8e-8)
    samples = []
    for _ in range(300):
        # mostly decodes, some prefill chunks; the adapter's id is its rank
        chunks = [StepChunk(1 if rng.random() < 0.8 else int(rng.integers(2, 256)), int(r), int(rng.integers(0, 200)),
                            int(r)) for r in rng.choice([0, 1, 2, 8, 16, 64], size=int(rng.integers(1, 24)))]
        samples.append(step_sample(chunks, predict_step_seconds(truth, chunks) * (1 + rng.normal(0, 0.01))))
    got = fit(samples)
    assert got.r2 > 0.99
    for term in ("beta", "alpha_token", "alpha_rank", "alpha_seq", "alpha_adapter", "alpha_attn"):
        assert getattr(got, term) == pytest.approx(getattr(truth, term), rel=0.1), term
    # samples with CaraServe's terms only: the others are never exercised and stay zero
    three = fit([StepSample(s.tokens, s.rank_work, s.seconds) for s in samples])
    assert three.alpha_seq == three.alpha_adapter == three.alpha_attn == 0.0
    # a chunk given as (tokens, rank): no context, one adapter per distinct rank
    assert predict_step_seconds(truth, [(4, 8), (2, 8), (1, 16)]) == pytest.approx(
        predict_step_seconds(truth, [StepChunk(4, 8, 0, "a"), StepChunk(2, 8, 0, "a"), StepChunk(1, 16, 0, "b")]))


def test_step_model_predicts_measured_steps(llm, steps):
    """Fitted to half of the profiled steps, it predicts the other half within MEDIAN_BOUND; then,
    given to the engine, it predicts the steps of a real generate loop within LOOP_MEDIAN_BOUND."""
    result = holdout(steps)
    medians = {kind: statistics.median(errors) for kind, errors in result.errors.items()}
    assert set(medians) == {"all", *STEP_KINDS}
    assert medians["all"] < MEDIAN_BOUND, medians
    assert all(m < KIND_MEDIAN_BOUND for m in medians.values()), medians
    loop = median_error_within(lambda: loop_errors(llm.engine, result.coefficients, steps[0::2]), LOOP_MEDIAN_BOUND)
    assert loop[-1] < LOOP_MEDIAN_BOUND, loop


def test_start_profile_predicts_measured_steps(llm, steps):
    """The engine started from a step profile measured at its start (sets of 0, 1 and 3 adapters):
    it predicts held-out steps (every fifth profiled one, timed again), and its own generate loop's,
    within START_MEDIAN_BOUND, at the speed the profile's own steps show at the time."""
    latency, profile = llm.engine.latency, start_profile(llm)
    assert latency.measured
    reference, fitted = profile.steps, f"the profile's fit to its own steps: {profile.median_error:.3f}"

    def held_out_errors() -> list[float]:
        errors = []
        for i, step in enumerate(steps[::5]):
            now = seconds_now(llm.engine, step)
            speed = speed_now(llm.engine, reference[i % len(reference)])
            errors.append(abs(predict_step_seconds(latency.start, step.chunks) * speed / now - 1))
        return errors

    held_out = median_error_within(held_out_errors, START_MEDIAN_BOUND)
    assert held_out[-1] < START_MEDIAN_BOUND, (fitted, held_out)
    loop = median_error_within(lambda: loop_errors(llm.engine, latency.start, reference), START_MEDIAN_BOUND)
    assert loop[-1] < START_MEDIAN_BOUND, (fitted, loop)


def test_step_profile_cached_shipped_and_measured_again(tiny_model, tmp_path, monkeypatch, caplog):
    """Measured at the first start and cached with the command that made it; read at the next start
    without measuring (the file unchanged; the source says so); measured again when the cached file
    is unreadable or was made with fewer adapters than are loaded now; a shipped file serves when
    none is cached; a fit far off its own steps is not cached."""
    monkeypatch.setattr(step_profile, "SHIPPED_PROFILE_DIR", tmp_path / "shipped")
    cache = tmp_path / "cache"

    def start(**kwargs):
        llm = start_engine(tiny_model, cache, **kwargs)
        llm.engine.close()
        return llm.engine, llm.engine.latency.coefficients

    engine, base_only = start(adapters=False)
    path = profile_file(cache, profile_key(engine))
    assert base_only.source == f"{MEASURED} {path}" and engine.latency.measured
    saved = read_profile(path, profile_key(engine))
    assert saved.adapter_ranks == [] and "at start-up" in saved.command and saved.coefficients.alpha_rank == 0
    # keyed by the GEMM that runs the projections too (AMX exposed or not under one CPU name)
    assert saved.key.gemm.startswith(type(engine.runner.weights.lm_head).__name__)
    assert len(saved.steps) >= 2 * len(STEP_KINDS)

    engine, first = start()                          # adapters now: measured again, with the highest-ranked
    saved = read_profile(path, profile_key(engine))
    ranks = sorted((max(reg.ranks) for reg in engine.pager.registry.values()), reverse=True)
    assert first.source == f"{MEASURED} {path}" and sorted(saved.adapter_ranks, reverse=True) == ranks[:3]
    assert list(cache.iterdir()) == [path]
    written = path.read_bytes()

    engine, second = start()
    assert second.source == f"{CACHED} {path}" and path.read_bytes() == written
    assert {f: getattr(second, f) for f in second.__struct_fields__ if f != "source"} == \
        {f: getattr(first, f) for f in first.__struct_fields__ if f != "source"}
    assert engine.latency.measured and engine.latency.start is second

    path.write_text('{"key": "not a profile"')
    with caplog.at_level(logging.WARNING, logger="asyncserve.step_profile"):
        engine, third = start()
    assert "unreadable" in caplog.text
    assert third.source == f"{MEASURED} {path}" and read_profile(path, profile_key(engine)).coefficients.beta > 0

    shipped = profile_file(tmp_path / "shipped", profile_key(engine), shipped=True)
    shipped.parent.mkdir()
    path.rename(shipped)
    engine, fourth = start()
    assert fourth.source == f"{SHIPPED} {shipped}" and not path.exists()

    engine, off = start(step_profile="off")
    assert off.source == "prior" and not engine.latency.measured

    # a fit far off its own steps (a busy machine) is not cached; it serves where the prior is further off
    monkeypatch.setattr(step_profile, "PROFILE_MAX_ERROR", -1.0)
    shipped.unlink()
    engine, busy = start()
    assert busy.source == f"{MEASURED} (not cached)" and not path.exists()


def test_online_refit_starts_from_the_profile_and_keeps_terms_its_steps_never_exercise():
    """Refitted from base-model steps alone, the model keeps the start profile's rank and adapter
    terms (nothing in those steps bears on them) and stays measured."""
    profile = PerfCoefficients(beta=5e-4, alpha_token=6e-6, alpha_rank=2e-7, alpha_seq=1.5e-5, alpha_adapter=1.6e-4,
                               alpha_attn=8e-8, source="cached step profile x")
    truth = msgspec.structs.replace(profile, beta=1e-3, alpha_token=1e-5)
    latency = StepLatencyModel(STEP_TIME_PRIOR, refit_every=32, warmup=0)
    latency.start_from(profile)
    assert latency.measured and latency.start is profile
    rng = np.random.default_rng(0)
    for _ in range(32):
        sizes = rng.choice([1, 1, 1, 64], size=int(rng.integers(1, 16)))        # decodes, some prefill chunks
        chunks = [StepChunk(int(n), 0, int(rng.integers(0, 100))) for n in sizes]
        latency.record(chunks, predict_step_seconds(truth, chunks))
    got = latency.coefficients
    assert got.source == "fitted online" and latency.measured
    assert (got.alpha_rank, got.alpha_adapter) == (profile.alpha_rank, profile.alpha_adapter)
    for term in ("beta", "alpha_token", "alpha_seq", "alpha_attn"):
        assert getattr(got, term) == pytest.approx(getattr(truth, term), rel=0.05), term


def test_step_profile_flags():
    import argparse

    from asyncserve.cli import _config, _engine_args
    from asyncserve.config import Config

    for default in ("auto", "off"):                  # serve's, generate's
        ap = argparse.ArgumentParser()
        _engine_args(ap, step_profile=default)
        assert _config(ap.parse_args([])).step_profile == default
    c = _config(ap.parse_args(["--step-profile", "auto", "--step-profile-dir", "/p"]))
    assert (c.step_profile, c.resolved_step_profile_dir().as_posix()) == ("auto", "/p")
    assert Config().step_profile == "off" and Config().resolved_step_profile_dir().name == "step-profiles"
    with pytest.raises(ValueError, match="step_profile"):
        Config(step_profile="sometimes").validate()


def test_sliding_window_layers_price_attention_over_the_window():
    """A sliding-window layer reads min(position + 1, window) keys per token, not the whole context:
    the attention term is those pairs averaged over the layers (brute force per layer and position),
    so a long-context decode on Gemma 2's alternating layers costs about half a global model's."""
    from asyncserve.perf_model import StepChunk, StepLatencyModel, attention_pairs, step_sample

    def brute_force(tokens, context, windows):
        layers = windows or [None]
        return sum(min(p + 1, w or p + 1) for w in layers for p in range(context, context + tokens)) / len(layers)

    for windows in ([], [None, None], [8, None], [8, 8, None, 8], [8], [4, 16, None]):
        for tokens, context in ((1, 0), (1, 7), (1, 8), (1, 500), (5, 0), (8, 0), (9, 0), (6, 5), (20, 3), (3, 30)):
            assert attention_pairs(tokens, context, windows) == pytest.approx(brute_force(tokens, context, windows))
    chunks = [StepChunk(1, 8, 10_000, "a"), StepChunk(1, 0, 100), StepChunk(64, 16, 4_000, "b")]
    gemma2 = [4096, None] * 13
    global_sample, windowed = step_sample(chunks, 0.1), step_sample(chunks, 0.1, windows=gemma2)
    assert global_sample.attention == 10_001 + 101 + 64 * (4_000 + 32.5)
    # the prefill chunk ends inside the window: all its pairs in both kinds of layer
    assert windowed.attention == (10_001 + 4096 + 2 * 101 + 2 * 64 * (4_000 + 32.5)) / 2
    assert windowed[:5] == global_sample[:5]                          # the other terms do not change
    coefficients = PerfCoefficients(beta=1e-3, alpha_token=1e-5, alpha_rank=0.0, alpha_attn=1e-7)
    decode = [StepChunk(1, 0, 100_000)]
    assert (StepLatencyModel(coefficients, attention_windows=[4096, None]).predict(decode)
            < 0.6 * StepLatencyModel(coefficients).predict(decode))
