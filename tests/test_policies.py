"""Scheduling policies (scheduler/policies.py) on a tiny random Llama: each policy changes only when
requests run, never their tokens (greedy, compared with FCFS on the same engine), and keeps its
stated bound: affinity's adapter cap and aging, dLoRA's merged steps and credits, the slo policy's
early abort and TPOT admission. Step times come from a fixed step-time model, never the wall clock."""
from __future__ import annotations

import math
import random

import pytest
from reference import TEST_DEVICE

from asyncserve import LLM, SamplingParams
from asyncserve.config import Config
from asyncserve.perf_model import PerfCoefficients
from asyncserve.scheduler.affinity import AdapterAffinity
from asyncserve.scheduler.dlora import DLoRA, MergedOnly
from asyncserve.scheduler.policies import make_policy
from asyncserve.scheduler.policy import FirstComeFirstServed, PolicySettings
from asyncserve.scheduler.slo import SloAware

NAMES = ("r1_qv", "r2_mlp", "r8_attn_rs", "r16_patterns")
BUDGET = 48
MAX_RUNNING = 12
# a fixed step-time model where LoRA compute is dear, so merging one adapter pays (dLoRA)
FIXED = PerfCoefficients(beta=0.01, alpha_token=1e-4, alpha_rank=2e-3, source="test")


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = LLM(model=str(tiny_model.root), adapters={n: str(tiny_model.adapters[n]) for n in NAMES}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=BUDGET, max_running=MAX_RUNNING, prefix_caching=False)
    latency = llm.engine.latency
    latency.coefficients, latency.refit_every = FIXED, 10**9      # deterministic predictions
    return llm


def use(llm, cls, **kwargs):
    """Swap the engine's policy for a fresh one (the engine is idle between tests)."""
    engine = llm.engine
    assert not engine.has_unfinished()
    c = engine.config
    settings = PolicySettings(max_running=c.max_running, max_step_tokens=BUDGET, latency=engine.latency,
                              max_step_adapters=kwargs.pop("max_step_adapters", 4),
                              slo_ttft_s=kwargs.pop("slo_ttft_s", None), slo_tpot_s=kwargs.pop("slo_tpot_s", None))
    engine.scheduler.policy = cls(settings, **kwargs)
    return engine.scheduler.policy


def prompts(tok, n, seed):
    rng = random.Random(seed)
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    return [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))) for _ in range(n)]


class Run:
    """Drives the engine step by step on a fake clock advanced by the step-time model's prediction."""

    def __init__(self, engine):
        self.engine = engine
        self.now = 0.0
        self.steps = 0
        self.plans = []
        self.tokens: dict[str, list[int]] = {}
        self.first_token_step: dict[str, int] = {}
        self.first_token_time: dict[str, float] = {}
        self.finished_step: dict[str, int] = {}
        self.errors: dict[str, tuple] = {}      # request id -> (failure, now, ranks of the running sequences)

    def add(self, ids, adapter, max_tokens):
        seq = self.engine.make_sequence(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                        adapter, arrival=self.now)
        self.tokens[seq.request_id] = []
        self.engine.add(seq)
        return seq

    def step(self):
        engine = self.engine
        running = [s.adapter_rank for s in engine.scheduler.running]
        for u in engine.abort_unattainable(self.now):
            self.errors[u.seq.request_id] = (u.error, self.now, running)
        plan = engine.schedule()
        if not plan:
            return
        self.plans.append(plan)
        self.steps += 1
        self.now += engine.predict_step_seconds(plan)
        for u in engine.postprocess(plan, engine.run(plan)):
            rid = u.seq.request_id
            if u.new_token_ids and rid not in self.first_token_step:
                self.first_token_step[rid], self.first_token_time[rid] = self.steps, self.now
            self.tokens[rid] += u.new_token_ids
            if u.finished:
                self.finished_step[rid] = self.steps

    def drain(self, limit=2000):
        while self.engine.has_unfinished():
            assert self.steps < limit, "the requests did not finish"
            self.step()


def adapters_of(plan):
    return {c.seq.adapter for c in plan.chunks if c.seq.adapter is not None}


def reference(llm, cases):
    """FCFS tokens of (prompt ids, adapter, max_tokens) cases, all at once."""
    use(llm, FirstComeFirstServed)
    run = Run(llm.engine)
    seqs = [run.add(ids, adapter, n) for ids, adapter, n in cases]
    run.drain()
    return [run.tokens[s.request_id] for s in seqs]


POLICY_CASES = {
    "affinity": (AdapterAffinity, {"max_step_adapters": 1, "aging_steps": 6}),
    "slo": (SloAware, {"slo_ttft_s": 1e3, "slo_tpot_s": 0.05}),
    "dlora": (DLoRA, {"alpha": 0.3, "beta": 0.2, "starve_credit": 6, "normal_credit": 2, "period": 8}),
    "merged-only": (MergedOnly, {"phase_steps": 5}),
}


@pytest.mark.parametrize("name", POLICY_CASES)
def test_tokens_under_every_policy_equal_fcfs(llm, tiny_model, name):
    tok = tiny_model.tokenizer
    adapters = [None, *NAMES, NAMES[0], NAMES[0], NAMES[0]]
    cases = [(ids, adapters[i % len(adapters)], 6 + i % 5) for i, ids in enumerate(prompts(tok, 16, seed=3))]
    expected = reference(llm, cases)
    cls, kwargs = POLICY_CASES[name]
    use(llm, cls, **dict(kwargs))
    run = Run(llm.engine)
    seqs = [run.add(ids, adapter, n) for ids, adapter, n in cases]
    run.drain()
    assert [run.tokens[s.request_id] for s in seqs] == expected
    assert not run.errors
    for plan in run.plans:
        if plan.merged is not None:          # a merged step carries its adapter's requests only
            assert {c.seq.adapter for c in plan.chunks} == {plan.merged}
    if name == "affinity":
        assert max(len(adapters_of(p)) for p in run.plans) == 1
    if name in ("dlora", "merged-only"):
        assert any(p.merged for p in run.plans) and any(p.merged is None for p in run.plans)


def test_affinity_caps_adapters_per_step_and_ages_out_starvation(llm, tiny_model):
    """d adapters at most in every step; an adapter that keeps getting requests cannot shut another
    out: the lone request of another adapter runs within aging_steps + ceil((m + 1) / d) steps (m = 0
    aged adapters ahead of it, the batch has free slots), whatever the popular adapter's waiting work;
    without aging it waits until its request-steps outweigh the popular adapter's requests."""
    tok = tiny_model.tokenizer
    stream = prompts(tok, 60, seed=5)
    lone = prompts(tok, 1, seed=6)[0]
    max_tokens, aging = 8, 3

    def serve(aging_steps):
        use(llm, AdapterAffinity, max_step_adapters=1, aging_steps=aging_steps)
        run = Run(llm.engine)
        run.add(stream[0], NAMES[0], max_tokens)
        other = run.add(lone, NAMES[1], max_tokens)
        base = run.add(lone, None, max_tokens)
        for ids in stream[1:]:                  # one more request of the popular adapter every step
            run.step()
            assert len(llm.engine.scheduler.running) < MAX_RUNNING
            run.add(ids, NAMES[0], max_tokens)
        run.drain()
        assert max(len(adapters_of(p)) for p in run.plans) == 1
        assert all(rid in run.finished_step for rid in run.tokens)
        assert run.first_token_step[base.request_id] <= 2     # no adapter place needed: its prefill is 2 chunks
        return run.first_token_step[other.request_id]

    assert serve(aging_steps=aging) <= aging + 1 + 1       # its first token comes with the step that runs it
    assert serve(aging_steps=10**9) > aging + 2


def test_dlora_merges_a_dominant_adapter_and_serves_others_within_the_credit_bound(llm, tiny_model):
    """Requests of another adapter and of the base model arriving while one adapter runs merged wait
    at most starve_credit + 1 merged steps for each step FCFS would give them."""
    tok = tiny_model.tokenizer
    starve = 4
    policy = use(llm, DLoRA, alpha=0.5, beta=0.3, starve_credit=starve, normal_credit=1, period=8,
                 debt_limit=10**6)
    run = Run(llm.engine)
    dominant = [run.add(ids, NAMES[2], 30) for ids in prompts(tok, 6, seed=7)]
    for _ in range(3):
        run.step()
    assert run.plans[-1].merged == NAMES[2] and policy.merged == NAMES[2]
    arrived = run.steps
    late = prompts(tok, 2, seed=8)
    others = [run.add(late[0], NAMES[0], 6), run.add(late[1], None, 6)]
    run.drain()
    merged_while_waiting = [p for p in run.plans[arrived:arrived + starve + 2] if p.merged == NAMES[2]]
    assert len(merged_while_waiting) >= starve       # they did arrive during merged mode
    for seq in others:
        assert run.first_token_step[seq.request_id] - arrived <= starve + 2
        assert run.finished_step[seq.request_id] - arrived <= 6 * (starve + 2)
    for plan in run.plans:
        if plan.merged is not None:
            assert {c.seq.adapter for c in plan.chunks} == {plan.merged}
    expected = reference(llm, [(s.prompt_ids, s.adapter, s.params.max_tokens) for s in dominant + others])
    assert [run.tokens[s.request_id] for s in dominant + others] == expected


def test_dlora_thresholds_rise_when_the_step_model_says_lora_is_free(llm, tiny_model):
    """Algorithm 2 with t_M: a dominant adapter is merged at once, but when merged steps turn out no
    faster (LoRA costs nothing in this step model) beta and alpha rise until the mix runs unmerged."""
    engine = llm.engine
    engine.latency.coefficients = PerfCoefficients(beta=0.01, alpha_token=1e-3, alpha_rank=0.0, source="test")
    try:
        policy = use(llm, DLoRA, alpha=0.9, beta=0.6, period=4)
        run = Run(engine)
        for ids in prompts(tiny_model.tokenizer, 10, seed=9):
            run.add(ids, NAMES[1], 40)
        run.add(prompts(tiny_model.tokenizer, 1, seed=10)[0], None, 40)
        run.drain()
        assert run.plans[0].merged == NAMES[1]
        last_merged = max(i for i, p in enumerate(run.plans) if p.merged)
        mixed_after = [p for p in run.plans[last_merged + 1:] if {c.seq.adapter for c in p.chunks} == {None, NAMES[1]}]
        assert len(mixed_after) >= 10
        assert policy.beta > 0.6 and policy.alpha > 0.9
    finally:
        engine.latency.coefficients = FIXED


def test_early_abort_answers_only_requests_that_cannot_meet_the_ttft_slo(llm, tiny_model):
    """A burst larger than the server can serve in time: the slo policy answers with 429
    slo_unattainable exactly requests whose fastest first token (their wait so far, then their
    prefill beside the running decodes) misses the SLO; every request that met the SLO under FCFS
    is served, with FCFS's tokens."""
    tok = tiny_model.tokenizer
    slo = 0.35
    cases = [(ids, [None, *NAMES][i % 5], 8) for i, ids in enumerate(prompts(tok, 40, seed=11))]

    def serve(cls, **kwargs):
        use(llm, cls, **kwargs)
        run = Run(llm.engine)
        seqs = []
        for i, (ids, adapter, n) in enumerate(cases):
            if i and i % 10 == 0:               # four bursts, a few steps apart
                for _ in range(3):
                    run.step()
            seqs.append(run.add(ids, adapter, n))
        run.drain()
        return run, seqs

    fcfs, fcfs_seqs = serve(FirstComeFirstServed)
    met = {i for i, s in enumerate(fcfs_seqs) if fcfs.first_token_time[s.request_id] - s.arrival <= slo}
    assert 0 < len(met) < len(cases)            # the SLO is tight: FCFS misses some, meets others

    run, seqs = serve(SloAware, slo_ttft_s=slo)
    aborted = {i for i, s in enumerate(seqs) if s.request_id in run.errors}
    assert aborted and not aborted & met
    c = FIXED
    for i in aborted:
        s = seqs[i]
        failure, now, running = run.errors[s.request_id]
        assert (failure.status, failure.code) == (429, "slo_unattainable")
        assert run.tokens[s.request_id] == []
        # its prompt in chunks of the budget left beside the running decodes, each step at FIXED's price
        left, fastest = len(s.prompt_ids), 0.0
        while left:
            n = min(left, BUDGET - len(running))
            fastest += c.beta + c.alpha_token * (len(running) + n) + c.alpha_rank * (sum(running) + n * s.adapter_rank)
            left -= n
        assert now - s.arrival + fastest > slo
    served = [i for i in range(len(cases)) if i not in aborted]
    for i in served:
        assert run.tokens[seqs[i].request_id] == fcfs.tokens[fcfs_seqs[i].request_id]


def test_offline_an_unattainable_request_finishes_with_its_error(llm):
    """Offline, with an SLO no step can meet, each request is an output with finish_reason "error";
    before the step-time model has been fitted (only its prior), none is refused."""
    use(llm, SloAware, slo_ttft_s=1e-6)
    latency = llm.engine.latency
    latency.coefficients = latency.start
    try:
        # ignore_eos: a sampled end-of-sequence token would finish it sooner, with "stop"
        outs = llm.generate(["the fox jumps"], SamplingParams(max_tokens=4, ignore_eos=True), NAMES[0])
        assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 4
    finally:
        latency.coefficients = FIXED
    outs = llm.generate(["the fox jumps", "over the lazy dog"], SamplingParams(max_tokens=4), NAMES[0])
    for out in outs:
        assert out.finish_reason == "error" and out.token_ids == []
        assert (out.error.status, out.error.code) == (429, "slo_unattainable")


def test_over_http_an_unattainable_request_is_a_429_and_counted(tiny_model):
    from server_harness import ServerThread

    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             policy="slo", slo_ttft_s=1e-6))
    try:
        st.server.engine.latency.coefficients = FIXED    # as if refitted from its steps
        status, out, _ = st.request("POST", "/v1/completions", {"model": "tiny", "prompt": "the fox", "max_tokens": 4})
        assert status == 429, out
        assert out["error"]["code"] == "slo_unattainable" and out["error"]["type"] == "rate_limit_error"
        assert set(out["error"]) == {"message", "type", "param", "code"}
        chunks = st.stream("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 4, "stream": True})
        assert [c["error"]["code"] for c in chunks if "error" in c] == ["slo_unattainable"]
        assert st.metric("asyncserve_requests_aborted_total", 'reason="slo_unattainable"') == 2
    finally:
        st.stop()


@pytest.mark.parametrize("settings, reason", [
    ({"policy": "slo"}, "policy slo needs slo_ttft_s"),
    ({"slo_ttft_s": 1.0}, "policy 'fcfs' ignores them"),
    ({"policy": "slo", "slo_tpot_s": 0.0}, "slo_tpot_s must be positive"),
    ({"policy": "affinity", "max_step_adapters": 0}, "max_step_adapters must be at least 1"),
    ({"policy": "sjf"}, "unknown policy 'sjf'"),
])
def test_policy_settings_are_checked_before_loading(settings, reason):
    with pytest.raises(ValueError, match=reason):
        Config(**settings).validate()


def test_every_policy_is_built_from_the_config_by_name(llm):
    from asyncserve.scheduler.policies import POLICIES

    assert set(POLICIES) == {"fcfs", "affinity", "slo", "dlora", "merged-only"}
    settings = PolicySettings(max_running=4, max_step_tokens=32, latency=llm.engine.latency)
    assert {name: type(make_policy(name, settings)).name for name in POLICIES} == {n: n for n in POLICIES}


def test_tpot_slo_keeps_the_running_batch_within_it(llm, tiny_model):
    """Admission with --slo-tpot: the predicted decode step of the running batch (Σ rank model) stays
    within the SLO, where FCFS's batch exceeds it; every request still runs."""
    tok = tiny_model.tokenizer
    tpot = 0.05
    cases = [(ids, NAMES[i % 4], 6) for i, ids in enumerate(prompts(tok, 16, seed=12))]

    def worst_decode_step(cls, **kwargs):
        use(llm, cls, **kwargs)
        run = Run(llm.engine)
        for ids, adapter, n in cases:
            run.add(ids, adapter, n)
        worst = 0.0
        while llm.engine.has_unfinished():
            run.step()
            running = llm.engine.scheduler.running
            if len(running) > 1:
                worst = max(worst, llm.engine.latency.predict([(1, s.adapter_rank) for s in running]))
        assert len(run.finished_step) == len(cases) and not run.errors
        return worst

    assert worst_decode_step(FirstComeFirstServed) > tpot
    assert worst_decode_step(SloAware, slo_tpot_s=tpot) <= tpot


def test_dlora_full_batch_an_older_request_takes_the_first_slot_after_its_credit_bound(llm, tiny_model):
    """The batch is full of the merged adapter's requests and more of them arrive with another
    adapter's request: when slots free, merged mode fills them with the merged adapter's newer
    requests, but the older request earns credit for each such step (FCFS would run it), so within
    starve_credit + 2 steps it is first in line, and it runs as soon as a slot frees after that."""
    tok = tiny_model.tokenizer
    starve, max_tokens = 3, 8
    use(llm, DLoRA, alpha=0.5, beta=0.3, starve_credit=starve, normal_credit=1, period=8, debt_limit=10**6)
    run = Run(llm.engine)
    ids = prompts(tok, 2 * MAX_RUNNING + 1, seed=13)
    first = [run.add(p, NAMES[2], max_tokens) for p in ids[:MAX_RUNNING]]
    run.step()
    older = run.add(ids[MAX_RUNNING], NAMES[0], max_tokens)
    for p in ids[MAX_RUNNING + 1:]:
        run.add(p, NAMES[2], max_tokens)
    run.drain()
    freed = min(run.finished_step[s.request_id] for s in first)      # the first slot frees after this step
    assert [p.merged for p in run.plans[freed:freed + starve]] == [NAMES[2]] * starve   # newer ones jump it ...
    longest = 1 + max_tokens                                          # L: one prefill chunk, then its tokens
    assert run.first_token_step[older.request_id] - freed <= starve + 2 + longest      # ... within the bound
    expected = reference(llm, [(older.prompt_ids, NAMES[0], max_tokens)])
    assert run.tokens[older.request_id] == expected[0]


@pytest.mark.parametrize("cls, kwargs", [(FirstComeFirstServed, {}), (SloAware, {"slo_tpot_s": 0.05})])
def test_fcfs_and_slo_admit_in_arrival_order(llm, tiny_model, cls, kwargs):
    """Their bound: nobody jumps the queue. With more requests than batch slots, of adapters with
    different ranks, each request starts no earlier than those that arrived before it."""
    use(llm, cls, **kwargs)
    run = Run(llm.engine)
    seqs = [run.add(ids, [None, *NAMES][i % 5], 4 + i % 7) for i, ids in enumerate(prompts(tiny_model.tokenizer, 30, 14))]
    run.drain()
    started = {}
    for step, plan in enumerate(run.plans):
        for c in plan.chunks:
            started.setdefault(c.seq.request_id, step)
    order = [started[s.request_id] for s in seqs]
    assert order == sorted(order) and order[-1] > order[0]


def test_early_abort_counts_the_prefix_cache(llm, tiny_model):
    """A prompt whose first blocks are cached needs less prefill: the same SLO refuses an uncached
    prompt of its length and keeps it."""
    blocks = llm.engine.scheduler.blocks
    blocks.prefix_caching = True
    try:
        tok = tiny_model.tokenizer
        words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
        rng = random.Random(15)
        cached, fresh = ([tok.encode(" ".join(rng.choice(words) for _ in range(60)))[:40] for _ in range(2)])
        policy = use(llm, SloAware, slo_ttft_s=1.0)
        run = Run(llm.engine)
        run.add(cached, NAMES[2], 1)                          # its blocks go into the cache
        run.drain()
        hit = blocks.cached_prefix_tokens(llm.engine.make_sequence(cached, SamplingParams(), NAMES[2]))
        assert hit == 32
        full, rest = (policy.fastest_prefill_seconds(n, 8, []) for n in (40, 40 - hit))
        policy.settings.slo_ttft_s = (full + rest) / 2
        again, other = run.add(cached, NAMES[2], 2), run.add(fresh, NAMES[2], 2)
        run.drain()
        assert other.request_id in run.errors and again.request_id not in run.errors
        assert run.tokens[again.request_id] == reference(llm, [(cached, NAMES[2], 2)])[0]
    finally:
        blocks.prefix_caching = False


def test_affinity_serves_the_popular_adapter_while_others_age(llm, tiny_model):
    """S-LoRA's trace in steps: one adapter gets two thirds of the requests, three others the rest, at
    most d = 2 adapters a step. Every request starts within the stated bound of its arrival,
    aging_steps + ceil(A / d) steps (A adapters with requests; the batch keeps a free slot), so the
    popular adapter's requests never wait for a batch to drain while the others age (the policy that
    capped the batch at d adapters let requests wait up to 14 steps here, and filled the batch)."""
    tok = tiny_model.tokenizer
    aging, d = 6, 2
    use(llm, AdapterAffinity, max_step_adapters=d, aging_steps=aging)
    run = Run(llm.engine)
    arrived, batch = {}, []
    for i, ids in enumerate(prompts(tok, 48, seed=16)):
        seq = run.add(ids, NAMES[0] if i % 3 else NAMES[1 + i // 3 % 3], 6)
        arrived[seq.request_id] = (run.steps, seq.adapter)
        run.step()
        batch.append(len(llm.engine.scheduler.running))
    run.drain()
    waits = {rid: run.first_token_step[rid] - step for rid, (step, _) in arrived.items()}
    assert max(waits.values()) <= aging + math.ceil(len(NAMES) / d) + 1
    assert max(w for rid, w in waits.items() if arrived[rid][1] == NAMES[0]) <= 2
    assert max(batch) < MAX_RUNNING
    assert max(len(adapters_of(p)) for p in run.plans) == d
    assert all(rid in run.finished_step for rid in run.tokens)


def test_early_abort_counts_a_parked_request_s_adapter_load(llm, tiny_model):
    """A request parked while its adapter is read from disk starts no sooner than the read ends: the
    slo policy refuses it (429 slo_unattainable) when its wait, the predicted rest of the read (the
    mean disk load the engine measured, less what has run of it) and its prefill miss --slo-ttft,
    and only then; the one it keeps is served once the adapter is read."""
    engine = llm.engine
    engine.register_adapter_folder("on_disk", str(tiny_model.adapters["r8_attn_rs"]))
    engine.pager.mean_load_seconds["disk"] = load = 0.5
    try:
        policy = use(llm, SloAware, slo_ttft_s=1.0)
        ids = prompts(tiny_model.tokenizer, 1, seed=17)[0]
        prefill = policy.fastest_prefill_seconds(len(ids), 8, [])
        policy.settings.slo_ttft_s = slo = 0.6 + prefill + load / 2
        run = Run(engine)
        old = run.add(ids, "on_disk", 4)
        run.now = 0.6
        fresh = run.add(ids, "on_disk", 4)
        assert engine.num_parked == 2 and engine.disk_load_seconds_left("on_disk") == load   # its read has not begun
        assert 0.6 + prefill <= slo < 0.6 + load + prefill      # old misses the SLO only for the read
        refused = engine.abort_unattainable(run.now)
        assert [u.seq for u in refused] == [old] and engine.parked["on_disk"] == [fresh]
        assert (refused[0].error.status, refused[0].error.code) == (429, "slo_unattainable")
        assert old.finish_reason == "error" and old.output_ids == []
        # 0.6 s later fresh has waited as long as old had, but its read has run 0.3 s of its 0.5 s
        assert engine.take_fetches() == ["on_disk"]
        engine._loading["on_disk"] -= 0.3
        assert engine.disk_load_seconds_left("on_disk") <= load - 0.3
        assert engine.abort_unattainable(1.2) == [] and engine.parked["on_disk"] == [fresh]
        run.now = 1.6                   # 0.4 s later it cannot make it, with 0.25 s of slack for the read's clock
        assert run.now - 0.6 + load - 0.3 - 0.25 + prefill > slo
        assert [u.seq for u in engine.abort_unattainable(run.now)] == [fresh]
        kept = run.add(ids, "on_disk", 4)
        engine._load_parked()
        run.drain()
        assert run.tokens[kept.request_id] == reference(llm, [(ids, "r8_attn_rs", 4)])[0]
    finally:
        engine.pager.mean_load_seconds.pop("disk", None)


def test_affinity_cap_holds_when_pages_run_short(tiny_model):
    """A pool of 48 pages: an aged adapter's request often does not fit, so the step its rule asks for
    cannot run; the step that runs instead (progress_rule: the oldest sequences' adapters) still
    carries one adapter (d = 1), where running anything would mix up to three, and all finish."""
    llm = LLM(model=str(tiny_model.root), adapters={n: str(tiny_model.adapters[n]) for n in NAMES}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=BUDGET, max_running=MAX_RUNNING, prefix_caching=False,
              pool_mem="384KiB")
    engine = llm.engine
    assert engine.pool.num_pages == 48
    policy = AdapterAffinity(PolicySettings(max_running=MAX_RUNNING, max_step_tokens=BUDGET, latency=engine.latency,
                                            max_step_adapters=1), aging_steps=1)
    engine.scheduler.policy = policy
    progress = []
    rule = policy.progress_rule
    policy.progress_rule = lambda running, waiting: progress.append(1) or rule(running, waiting)
    rng = random.Random(1)
    run = Run(engine)
    for i in range(24):
        run.add([rng.randrange(5, 380) for _ in range(rng.randint(10, 40))], NAMES[i % 4], 40)
    run.drain()
    assert progress and max(len(adapters_of(p)) for p in run.plans) == 1
    assert len(run.finished_step) == 24 and not run.errors
