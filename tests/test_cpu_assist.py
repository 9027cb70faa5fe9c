"""CPU-assisted prefill (CaraServe §4, issue 14): cold adapters' LoRA computed by the CPU workers.

With --cpu-assist on, requests whose adapter is not on the device start at once, the workers adding
their LoRA layer by layer; their greedy tokens equal the device-only path's and transformers+PEFT's
(float32, all seven projections, mixed ranks, in one batch with warm adapters and the base model),
also when the adapter stays off the device for several steps (decodes assisted too) and when a
worker is killed mid-prefill (its jobs recomputed in torch, the worker restarted and counted).
``auto`` follows the profile; /dev/shm holds nothing of ours afterwards. Every worker started here is
stopped here (Engine.close), by pid.
"""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from reference import ADAPTERS, TEST_DEVICE, assert_greedy_matches, peft_references, record_steps

from asyncserve import LLM, SamplingParams
from asyncserve.config import Config
from asyncserve.cpus import usable_cpus
from asyncserve.metrics import Metrics
from ipc import leftovers
from ipc.profile import WorkerProfile

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.timeout(600)


def _prompts(tok, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    return [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(4, 30)))) for _ in range(n)]


@pytest.fixture(scope="module")
def cases(tiny_model):
    """Prompts x (base and every adapter: ranks 1-64, all seven projections among them), with their
    transformers+PEFT greedy references."""
    prompts = _prompts(tiny_model.tokenizer, 2, seed=3)
    cases = [(ids, a) for ids in prompts for a in [None, *ADAPTERS]]
    return cases, peft_references(tiny_model.base, tiny_model.adapters, cases, NEW_TOKENS)


@pytest.fixture(scope="module")
def device_only(tiny_model, cases):
    """The same requests with the CPU workers off: the device path's tokens."""
    cases, _ = cases
    llm = _llm(tiny_model, "off", None)
    try:
        return [o.token_ids for o in llm.generate([ids for ids, _ in cases], GREEDY, adapters=[a for _, a in cases])]
    finally:
        llm.engine.close()


def _llm(tiny_model, assist: str, profile_dir, **kwargs) -> LLM:
    return LLM(model=str(tiny_model.root), adapters={k: str(v) for k, v in tiny_model.adapters.items()},
               dtype="float32", device=TEST_DEVICE, max_step_tokens=24, cpu_workers=2, cpu_assist=assist,
               cpu_profile_dir=str(profile_dir) if profile_dir else None, **kwargs)


def _check(outs, cases, refs, device_only) -> None:
    same = 0
    for i, (out, (_, adapter)) in enumerate(zip(outs, cases)):
        assert out.finish_reason == "length", (adapter, out.finish_reason)
        assert_greedy_matches(out.token_ids, refs[i], tie_tol=1e-3, label=f"case {i} adapter {adapter}")
        same += out.token_ids == device_only[i]
    # float32 both ways, rounded differently (the workers fold the scaling in last): a near-tie may flip
    assert same >= len(cases) - 1, f"only {same}/{len(cases)} equal the device path's tokens"


def _shm_clean(engine) -> None:
    prefixes = [engine.assist.pool.prefix, engine.pager.arena.prefix]
    engine.close()
    assert all(leftovers(p) == [] for p in prefixes)


def test_cold_adapters_prefill_on_the_workers_with_the_device_paths_tokens(tiny_model, cases, device_only, tmp_path):
    cases_, refs = cases
    llm = _llm(tiny_model, "on", tmp_path)
    engine = llm.engine
    plans = record_steps(engine)
    assert engine.assist.live == 2 and engine.pager.resident_names() == set()   # every adapter is cold
    outs = llm.generate([ids for ids, _ in cases_], GREEDY, adapters=[a for _, a in cases_])
    _check(outs, cases_, refs, device_only)
    # each adapter's first chunk ran on the workers beside warm adapters' and base tokens; then its
    # copy reached the device and its sequences switched to the device path
    assisted = {load for p in plans for load in p.assisted}
    assert len(assisted) == len(ADAPTERS)
    assert any(p.assisted and any(c.seq.adapter is None for c in p.chunks) for p in plans), \
        "no step mixed assisted and base tokens"
    assert any(p.assisted and any(c.seq.adapter_load not in p.assisted and c.seq.adapter for c in p.chunks)
               for p in plans), "no step mixed assisted and warm adapters"
    assert engine.pager.resident_names() == set(ADAPTERS)
    waiting = [w for p in plans for w in p.copies_waiting.values()]
    assert len(waiting) >= len(ADAPTERS) and all(waiting)
    assert engine.assist.fallbacks == 0
    cold_tokens = sum(c.num_tokens for p in plans for c in p.chunks if c.seq.adapter_load in p.assisted)
    assert engine.assist.tokens_total == cold_tokens > 0
    assert any(tmp_path.glob("*.json")), "the start-up profile was not cached"
    _shm_clean(engine)


def test_offline_adapter_dir_reads_then_assists(tiny_model, cases, device_only, tmp_path):
    """LLM(adapter_dir=..., cpu_workers=2, cpu_assist="on"): adapters read from disk on first use
    (into the host tier), then their first chunk runs on the workers."""
    cases_, refs = cases
    folder = tmp_path / "adapters"
    folder.mkdir()
    for name, path in tiny_model.adapters.items():
        (folder / name).symlink_to(path)
    llm = LLM(model=str(tiny_model.root), adapter_dir=str(folder), dtype="float32", device=TEST_DEVICE,
              max_step_tokens=24, cpu_workers=2, cpu_assist="on", cpu_profile_dir=str(tmp_path / "profiles"))
    engine = llm.engine
    assert not engine.pager.host
    outs = llm.generate([ids for ids, _ in cases_], GREEDY, adapters=[a for _, a in cases_])
    _check(outs, cases_, refs, device_only)
    assert engine.assist.tokens_total > 0 and engine.pager.resident_names() == set(ADAPTERS)
    _shm_clean(engine)


def test_adapter_without_room_stays_on_the_workers_then_moves_to_the_device(tiny_model, cases, device_only, tmp_path):
    """r64_all finds no room on the device for its first steps (its prefill and first decodes run on
    the workers), then fits and switches mid-generation."""
    cases_, refs = cases
    llm = _llm(tiny_model, "on", tmp_path)
    engine = llm.engine
    plans = record_steps(engine)
    ensure_resident = engine.pager.ensure_resident

    def no_room_at_first(name, admission=True):
        if name == "r64_all" and len(plans) < 8:
            return None
        return ensure_resident(name, admission)
    engine.pager.ensure_resident = no_room_at_first
    outs = llm.generate([ids for ids, _ in cases_], GREEDY, adapters=[a for _, a in cases_])
    _check(outs, cases_, refs, device_only)
    load = engine.pager.registration("r64_all")
    cold_decodes = [c for p in plans for c in p.decodes if c.seq.adapter_load == load and load in p.assisted]
    warm_decodes = [c for p in plans for c in p.decodes if c.seq.adapter_load == load and load not in p.assisted]
    assert cold_decodes and warm_decodes
    assert engine.pager.refs == {} and engine.pool.counts().kv == 0
    _shm_clean(engine)


def test_worker_killed_mid_prefill(tiny_model, cases, device_only, tmp_path):
    cases_, refs = cases
    llm = _llm(tiny_model, "on", tmp_path)
    engine = llm.engine
    pool = engine.assist.pool
    victim = pool.workers[0].proc
    submit, killed = pool.submit, []

    def submit_and_kill(layer, group, x, tasks, workers=None):
        if killed or layer != 1:
            return submit(layer, group, x, tasks, workers)
        os.kill(victim.pid, signal.SIGSTOP)    # it cannot finish: the job is surely in flight when it dies
        used = submit(layer, group, x, tasks, workers)
        os.kill(victim.pid, signal.SIGKILL)
        killed.append(group)
        return used
    pool.submit = submit_and_kill
    outs = llm.generate([ids for ids, _ in cases_], GREEDY, adapters=[a for _, a in cases_])
    _check(outs, cases_, refs, device_only)
    assert killed and victim.poll() == -signal.SIGKILL
    assert engine.assist.fallbacks == 1 and engine.assist.restarts == 1
    assert pool.wait_ready(60) == 2
    metrics = Metrics()
    metrics.observe_engine(engine)
    text = metrics.render().decode()
    assert "asyncserve_cpu_worker_restarts_total 1.0" in text
    assert "asyncserve_cpu_workers 2.0" in text
    assert f"asyncserve_cpu_assist_tokens_total {float(engine.assist.tokens_total)}" in text
    _shm_clean(engine)


def _state(pid: int) -> str:
    """A process's state letter from /proc (Z: a zombie, dead and not reaped), "gone" once reaped;
    read without waiting on it, which would reap it here and hide the pool's own work."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return "gone"
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))


def test_idle_worker_killed_twice_is_reaped_and_replaced_by_the_watchdog(tiny_model, cases, device_only, tmp_path):
    """No job comes while the workers die: the pool's watchdog reaps each (no zombie), replaces it (the
    second time after its backoff), the gauge goes back to 2, and then the workers assist with the
    same tokens."""
    cases_, refs = cases
    llm = _llm(tiny_model, "on", tmp_path)
    engine = llm.engine
    pool = engine.assist.pool
    metrics = Metrics()
    try:
        for kill in (1, 2):
            victim = pool.workers[0].proc
            os.kill(victim.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while _state(victim.pid) != "gone" or pool.live < 2:       # reaped (no zombie), replaced, ready
                assert time.monotonic() < deadline, (_state(victim.pid), pool.live)
                time.sleep(0.02)
            assert pool.restarts == kill and pool.workers[0].proc.pid != victim.pid
            metrics.observe_engine(engine)
            text = metrics.render().decode()
            assert "asyncserve_cpu_workers 2.0" in text
            assert f"asyncserve_cpu_worker_restarts_total {float(kill)}" in text
        outs = llm.generate([ids for ids, _ in cases_], GREEDY, adapters=[a for _, a in cases_])
        _check(outs, cases_, refs, device_only)
        assert engine.assist.tokens_total > 0 and engine.assist.fallbacks == 0
        assert all(_state(w.proc.pid) not in ("gone", "Z") for w in pool.workers)
    finally:
        _shm_clean(engine)


def test_auto_follows_the_profile(tiny_model, tmp_path):
    """auto assists when the workers' predicted stall is below the load's wait, not otherwise; on a
    CPU device whose threads leave the workers no cores nothing overlaps them, so their whole job
    time is the stall."""
    llm = _llm(tiny_model, "auto", tmp_path)
    assist = llm.engine.assist
    try:
        measured = dict(assist.device_s_per_token)
        shares_cores = set(measured.values()) == {0.0}
        if TEST_DEVICE == "cpu":
            assert shares_cores == (torch.get_num_threads() + 2 > usable_cpus())
        else:
            assert not shares_cores
        assist.device_s_per_token = dict.fromkeys(measured, 0.0)
        ranks = [64] * 7
        per_job = 1e-3
        assist.profile = WorkerProfile(overhead_s=per_job, per_mac_s=0.0, per_worker_s=0.0, cpu_model="test")
        jobs = 4 * llm.engine.model_config.num_layers           # every group of every layer
        assert assist.pays(ranks, 16, load_seconds=jobs * per_job * 1.5)
        assert not assist.pays(ranks, 16, load_seconds=jobs * per_job * 0.5)
        assert assist.pays([1, 0, 1, 0, 0, 0, 0], 16, load_seconds=2 * per_job * 1.5)   # q, v: the qkv group only
        # a job that fits the device's own projections' time costs only its fixed part
        assist.profile = WorkerProfile(overhead_s=per_job / 10, per_mac_s=1e-12, per_worker_s=0.0, cpu_model="test")
        assist.device_s_per_token = dict.fromkeys(measured, 1.0)
        assert assist.pays(ranks, 16, load_seconds=jobs * per_job / 10 * 1.5)
        assert not assist.pays(ranks, 16, load_seconds=jobs * per_job / 10 * 0.5)
        if not shares_cores:
            return
        # the measured profile where the workers take turns with the device's threads: the tiny
        # adapters' copies take microseconds, no job does
        assist.device_s_per_token = measured
        assist.profile = WorkerProfile.load(next(tmp_path.glob("*.json")))
        seq = llm.engine.make_sequence(list(range(1, 17)), GREEDY, "r64_all")
        assert not llm.engine._assist_pays(seq, 16)
        outs = llm.generate([list(range(1, 17))], GREEDY, adapters=["r64_all"])
        assert outs[0].finish_reason == "length" and assist.tokens_total == 0
    finally:
        _shm_clean(llm.engine)


def test_config_and_flags():
    from asyncserve.cli import _config, _engine_args
    import argparse

    ap = argparse.ArgumentParser()
    _engine_args(ap)
    c = _config(ap.parse_args(["--cpu-workers", "3", "--cpu-assist", "on"]))
    assert (c.cpu_workers, c.cpu_assist) == (3, "on")
    assert Config(cpu_assist="off", cpu_workers=4).resolved_cpu_workers(torch.device("cpu")) == 0
    assert Config(cpu_assist="on").resolved_cpu_workers(torch.device("cpu")) >= 1
    assert Config(cpu_workers=0).resolved_cpu_workers(torch.device("cpu")) == 0
    for bad in (dict(cpu_workers=-1), dict(cpu_assist="sometimes")):
        with pytest.raises(ValueError):
            Config(**bad).validate()


def test_server_assists_cold_adapters_and_reports_the_workers(tiny_model, cases, device_only, tmp_path):
    """Over HTTP, concurrent requests of cold adapters beside warm ones and the base model: the
    device path's tokens; /metrics has the workers and the assisted tokens; after stop, no worker
    lives and /dev/shm holds nothing of the server's."""
    import concurrent.futures

    from server_harness import ServerThread

    cases_, _ = cases
    st = ServerThread(Config(model=str(tiny_model.root), served_model_name="tiny", dtype="float32", device="cpu",
                             adapters={k: str(v) for k, v in tiny_model.adapters.items()}, max_step_tokens=24,
                             cpu_workers=2, cpu_assist="on", cpu_profile_dir=str(tmp_path)))
    engine = st.server.engine
    procs = [w.proc for w in engine.assist.pool.workers]
    prefixes = [engine.assist.pool.prefix, engine.pager.arena.prefix]
    try:
        bodies = [{"model": a or "tiny", "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                   "ignore_eos": True, "return_token_ids": True} for ids, a in cases_]
        # one cold request alone first: it is admitted with assist at once, where in a concurrent
        # burst a base or warm request may take the first step and the pager's prefetch may warm the
        # others' adapters before their turn (nothing assisted then, legitimately)
        lone = next(i for i, (_, a) in enumerate(cases_) if a is not None)
        first = st.request("POST", "/v1/completions", bodies[lone])
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: st.request("POST", "/v1/completions", b), bodies))
        answers.append(first)
        device_only = [*device_only, device_only[lone]]
        same = 0
        for (status, body, _), want in zip(answers, device_only):
            assert status == 200, body
            same += body["choices"][0]["token_ids"] == want
        assert same >= len(bodies) - 1
        assert st.metric("asyncserve_cpu_workers") == 2
        assert st.metric("asyncserve_cpu_assist_tokens_total") == engine.assist.tokens_total > 0
        assert st.metric("asyncserve_cpu_worker_restarts_total") == 0
    finally:
        st.stop()
    assert all(p.poll() is not None for p in procs)
    assert all(leftovers(p) == [] for p in prefixes)
