"""Adapter tiers (issue 14): disk -> host -> device.

1,000 adapters registered from --adapter-dir with a host tier that holds about 20, driven by a trace
over many adapters with concurrent requests: greedy tokens equal transformers+PEFT, every host
eviction spares the adapters of queued and running requests, every device eviction the ones in use,
and no pool page or arena block is left behind. A corrupt adapter met at on-demand load fails its
own requests only; pinned adapters stay on the device; --preload-adapters fills the host tier's free
room, after the requests' own reads; /v1/models and /metrics tell the tiers; the
shared memory is gone after SIGTERM, and after SIGKILL once the next server starts. Every process
started here is stopped here, by pid.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import random
import re
import shutil
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from reference import assert_greedy_matches, reference_greedy

from asyncserve import LLM, SamplingParams
from asyncserve.config import Config
from asyncserve.engine import Engine
from asyncserve.pager.pager import AdapterPager
from ipc import leftovers
from server_harness import ServedProcess, ServerThread

REPO = Path(__file__).resolve().parent.parent
NUM_ADAPTERS = 1000
RANKS = ("1", "2", "4", "8")
TARGETS = ("q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj", "all")
HOST_MEM = "580KiB"        # 224 KiB of arena directory, then ~20 of these adapters (17 KiB on average)
NEW_TOKENS = 4

pytestmark = pytest.mark.timeout(300)


def _make_adapters(count: int, out: Path, seed: int = 0) -> None:
    spec = importlib.util.spec_from_file_location("make_adapters", REPO / "scripts/make_adapters.py")
    make_adapters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_adapters)
    make_adapters.main([str(count), str(out), "--model", "tiny", "--ranks", *RANKS, "--targets", *TARGETS,
                        "--seed", str(seed)])


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """scripts/make_adapters.py's 1,000 random PEFT adapters for the tiny model, mixed ranks and targets."""
    folder = tmp_path_factory.mktemp("many") / "adapters"
    _make_adapters(NUM_ADAPTERS, folder)
    return folder


def _prompts(tok, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def _trace(n: int, seed: int) -> list[str]:
    """Adapter names of n requests, popularity by a power law (S-LoRA's α = 1) over all adapters."""
    rng = random.Random(seed)
    names = [f"a{i:04d}" for i in range(NUM_ADAPTERS)]
    rng.shuffle(names)
    weights = [1 / (i + 1) for i in range(NUM_ADAPTERS)]
    return rng.choices(names, weights, k=n)


def _watch_evictions(engine, monkeypatch) -> dict:
    """Check every host eviction and every device eviction as it happens."""
    seen = {"host": 0, "device": 0, "violations": []}
    host_room, evict = AdapterPager.host_room, AdapterPager._evict

    def checked_host_room(self, name, in_use):
        needed = engine.in_use() | {seq.adapter for seq in engine.scheduler.running if seq.adapter}
        before = set(self.host)
        ok = host_room(self, name, in_use)
        gone = before - set(self.host)
        seen["host"] += len(gone)
        seen["violations"] += [f"host evicted {n}, needed by a request" for n in gone & needed]
        seen["violations"] += [f"host evicted pinned {n}" for n in gone if self.registry[n].pinned]
        return ok

    def checked_evict(self, load):
        if load in self.resident:
            seen["device"] += 1
            if self.refs.get(load, 0):
                seen["violations"].append(f"device evicted load {load} held by {self.refs[load]} sequences")
            reg = self.registry.get(self.resident[load].name)
            if reg is not None and reg.pinned and reg.load == load:
                seen["violations"].append(f"device evicted pinned {reg.name}")
        return evict(self, load)

    monkeypatch.setattr(AdapterPager, "host_room", checked_host_room)
    monkeypatch.setattr(AdapterPager, "_evict", checked_evict)
    return seen


def _assert_nothing_leaked(engine) -> None:
    """Idle: no KV page held, adapter pages exactly the resident adapters', arena blocks exactly the
    host tier's."""
    pager, counts = engine.pager, engine.pool.counts()
    assert not engine.has_unfinished() and not engine.parked
    assert counts.kv == 0, counts
    assert counts.adapter == sum(len(d.pages) for d in pager.resident.values()), counts
    assert counts.free + counts.adapter == counts.total, counts
    assert not pager.refs
    host_loads = {pager.registry[name].load for name in pager.host}
    assert set(pager._blocks) == host_loads
    assert set(pager.resident) <= host_loads                           # inclusive tiers
    used = sum(h.nbytes for h in pager._blocks.values())
    assert pager.arena.free_bytes == pager.host_capacity - used


def _completion(base: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _peft_reference(base_model, folder: Path, prompt_ids: list[int]):
    from peft import PeftModel

    model = PeftModel.from_pretrained(base_model, folder).eval()
    try:
        return reference_greedy(model, prompt_ids, NEW_TOKENS)
    finally:
        model.unload()


def test_a_thousand_adapters_driven_by_a_trace(tiny_model, adapter_dir, monkeypatch):
    # max_running 4 and steps of at least 10 ms: most of the 32 concurrent requests wait in the queue,
    # their adapters on the host tier, oldest first in its LRU: fetches for later ones must evict
    # around them, or wait
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_dir=str(adapter_dir), host_adapter_mem=HOST_MEM, max_running=4, threads=1))
    try:
        engine = st.server.engine
        run = engine.runner.run
        monkeypatch.setattr(engine.runner, "run", lambda plan: (time.sleep(0.01), run(plan))[1])
        pager = engine.pager
        # registered, nothing read: the host tier is empty and every adapter is on the disk tier
        assert len(pager.registry) == NUM_ADAPTERS and not pager.host and not pager.resident
        assert pager.arena.free_bytes == pager.host_capacity
        status, models, _ = st.request("GET", "/v1/models")
        assert status == 200 and len(models["data"]) == NUM_ADAPTERS + 1
        assert {m["tier"] for m in models["data"][1:]} == {"disk"} and not any(m["pinned"] for m in models["data"][1:])
        mean_size = sum(r.host_bytes for r in pager.registry.values()) / NUM_ADAPTERS
        assert 18 <= pager.host_capacity / mean_size <= 24                      # the tier holds about 20

        seen = _watch_evictions(engine, monkeypatch)
        trace = _trace(240, seed=1)
        prompts = _prompts(tiny_model.tokenizer, len(trace), seed=2)
        bodies = [{"model": name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                   "return_token_ids": True} for name, prompt in zip(trace, prompts)]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:     # more requests at once than the host tier holds
            results = list(pool.map(lambda b: _completion(st.base, b), bodies))
        assert [s for s, _ in results] == [200] * len(bodies), [r for s, r in results if s != 200][:3]
        distinct = set(trace)
        assert len(distinct) > 3 * 20                 # far more adapters than the host tier holds
        assert seen["host"] >= len(distinct) - 30 and seen["device"] > 0, seen
        assert seen["violations"] == []

        # greedy tokens of a sample equal transformers+PEFT
        rng = random.Random(3)
        for i in rng.sample(range(len(bodies)), 6):
            choice = results[i][1]["choices"][0]
            ref = _peft_reference(tiny_model.base, adapter_dir / trace[i], choice["prompt_token_ids"])
            assert_greedy_matches(choice["token_ids"], ref, 1e-3, f"request {i} ({trace[i]})")

        _assert_nothing_leaked(engine)
        assert 0 < len(pager.host) <= 30 and len(pager.resident) <= len(pager.host)
        status, models, _ = st.request("GET", "/v1/models")
        tiers = {m["id"]: m["tier"] for m in models["data"][1:]}
        assert {n for n, t in tiers.items() if t != "disk"} == set(pager.host) <= distinct
        assert {n for n, t in tiers.items() if t == "device"} == pager.resident_names()

        metric = st.metric
        assert metric("asyncserve_adapters_loaded", 'tier="disk"') == NUM_ADAPTERS
        assert metric("asyncserve_adapters_loaded", 'tier="host"') == len(pager.host)
        assert metric("asyncserve_adapters_loaded", 'tier="device"') == len(pager.resident)
        assert metric("asyncserve_adapter_load_seconds_count", 'from="disk"') >= len(distinct)
        # a page-in evicted before its copy never lands, so never counts as a load from host
        host_loads = metric("asyncserve_adapter_load_seconds_count", 'from="host"')
        assert 0 < host_loads <= metric("asyncserve_adapter_loads_total")
        _, text, _ = st.request("GET", "/metrics")
        labels = set(re.findall(r'^asyncserve_adapter_requests_total\{adapter="([^"]+)"\}', text, re.M))
        assert len(labels) == 21 and "other" in labels                 # top 20 by traffic, then the rest
        total = sum(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("asyncserve_adapter_requests_total{"))
        assert total == len(bodies)
        top = max(distinct, key=trace.count)
        assert metric("asyncserve_adapter_requests_total", f'adapter="{top}"') == trace.count(top)
        assert metric("asyncserve_adapter_device_hits_total", f'adapter="{top}"') >= 1
    finally:
        st.stop()
    assert leftovers(pager.arena.prefix) == []


def _corrupt_copies(source: Path, folder: Path) -> tuple[Path, Path]:
    """Two adapters that register (their config and header check out) but fail at load: one whose
    weights hold NaN, one whose file was cut short after registration."""
    from safetensors.torch import load_file, save_file

    nan, cut = folder / "nan", folder / "cut"
    for target in (nan, cut):
        shutil.copytree(source, target)
    tensors = load_file(nan / "adapter_model.safetensors")
    first = next(iter(tensors))
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(nan / "adapter_model.safetensors"), metadata={"format": "pt"})
    return nan, cut


def test_a_corrupt_adapter_met_at_load_fails_its_requests_only(tiny_model, tmp_path):
    folder = tmp_path / "adapters"
    _make_adapters(4, folder, seed=5)
    nan, cut = _corrupt_copies(folder / "a0000", folder)
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_dir=str(folder), host_adapter_mem=HOST_MEM, threads=1))
    try:
        assert set(st.server.engine.adapter_names) == {"a0000", "a0001", "a0002", "a0003", "nan", "cut"}
        data = (cut / "adapter_model.safetensors").read_bytes()
        (cut / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
        names = ["a0001", "nan", "a0002", "cut", "a0003", "nan", None, "cut"]
        prompt = "the fox jumps over"
        bodies = [{"model": n or "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                   "return_token_ids": True} for n in names]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            results = list(pool.map(lambda b: _completion(st.base, b), bodies))
        for name, (status, body) in zip(names, results):
            if name in ("nan", "cut"):
                assert status == 500, body
                error = body["error"]
                assert error["code"] == "adapter_load_failed" and error["type"] == "server_error"
                assert f"adapter {name!r} could not be loaded" in error["message"]
                assert ("NaN" if name == "nan" else "safetensors") in error["message"], error
            else:
                assert status == 200, body
        choice = results[0][1]["choices"][0]
        ref = _peft_reference(tiny_model.base, folder / "a0001", choice["prompt_token_ids"])
        assert_greedy_matches(choice["token_ids"], ref, 1e-3, "a0001 beside the corrupt adapters")

        # streamed: an error event, then [DONE]; the corrupt adapter stays registered, on disk
        chunks = st.stream("/v1/completions", {"model": "nan", "prompt": prompt, "max_tokens": 2, "stream": True})
        assert chunks[-1]["error"]["code"] == "adapter_load_failed"
        _, models, _ = st.request("GET", "/v1/models")
        assert {m["id"]: m["tier"] for m in models["data"][1:]}["nan"] == "disk"
        status, body = _completion(st.base, bodies[0])
        assert status == 200 and body["choices"][0]["token_ids"] == choice["token_ids"]
        _assert_nothing_leaked(st.server.engine)
    finally:
        st.stop()


def test_pinned_adapters_stay_on_the_device(tiny_model, tmp_path, monkeypatch):
    folder = tmp_path / "adapters"
    _make_adapters(24, folder, seed=7)
    root = tmp_path / "root"
    shutil.copytree(tiny_model.adapters["r8_attn_rs"], root / "late")
    # a pool of 64 pages (8 KiB each): a few adapters beside the KV, so the pager evicts all the time
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_dir=str(folder), adapter_root=str(root), host_adapter_mem="512KiB",
                             pool_mem="512KiB", pinned_adapters=["a0003"], threads=1))
    try:
        engine = st.server.engine
        seen = _watch_evictions(engine, monkeypatch)
        status, body, _ = st.request("POST", "/v1/load_lora_adapter",
                                     {"lora_name": "late", "lora_path": "late", "pinned": True})
        assert status == 200, body
        _, models, _ = st.request("GET", "/v1/models")
        by_id = {m["id"]: m for m in models["data"]}
        assert by_id["a0003"]["tier"] == "device" and by_id["a0003"]["pinned"] is True
        assert by_id["late"]["tier"] == "device" and by_id["late"]["pinned"] is True
        assert by_id["a0004"]["tier"] == "disk" and by_id["a0004"]["pinned"] is False

        names = [f"a{i:04d}" for i in range(24)] * 2 + ["a0003", "late"] * 4
        random.Random(8).shuffle(names)
        bodies = [{"model": n, "prompt": "the lazy dog", "max_tokens": NEW_TOKENS, "temperature": 0.0}
                  for n in names]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            statuses = [s for s, _ in pool.map(lambda b: _completion(st.base, b), bodies)]
        assert statuses == [200] * len(bodies)
        assert seen["device"] > 0 and seen["host"] > 0 and seen["violations"] == []
        assert engine.pager.is_resident("a0003") and engine.pager.is_resident("late")
        _, models, _ = st.request("GET", "/v1/models")
        assert {m["id"]: m["tier"] for m in models["data"][1:]}["a0003"] == "device"
        assert st.metric("asyncserve_adapter_device_hits_total", 'adapter="a0003"') == names.count("a0003")
        _assert_nothing_leaked(engine)
        # unloading a pinned adapter is allowed, and frees it
        status, _, _ = st.request("POST", "/v1/unload_lora_adapter", {"lora_name": "late"})
        assert status == 200 and "late" not in engine.pager.registry
        _assert_nothing_leaked(engine)
    finally:
        st.stop()


def test_offline_adapter_dir_and_host_tier(tiny_model, adapter_dir):
    """LLM(adapter_dir=..., host_adapter_mem=...): one batch over more adapters than the host tier holds."""
    llm = LLM(model=str(tiny_model.root), dtype="float32", device="cpu", adapter_dir=str(adapter_dir),
              host_adapter_mem=HOST_MEM)
    names = [f"a{i:04d}" for i in range(0, 1000, 20)]           # 50 adapters, one request each
    prompts = _prompts(tiny_model.tokenizer, len(names), seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), adapters=names)
    assert [o.finish_reason for o in outs] == ["length"] * len(names)
    for i in (0, 17, 49):
        ref = _peft_reference(tiny_model.base, adapter_dir / names[i], outs[i].prompt_token_ids)
        assert_greedy_matches(outs[i].token_ids, ref, 1e-3, names[i])
    _assert_nothing_leaked(llm.engine)
    assert len(llm.engine.pager.host) <= 30
    llm.engine.close()


def _wait_preloaded(st: ServerThread, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while st.metric("asyncserve_adapters_preloading"):
        assert time.monotonic() < deadline, "the preload did not end"
        time.sleep(0.05)


def test_preload_fills_the_host_tiers_free_room_and_yields_to_requests(tiny_model, tmp_path, monkeypatch):
    """--preload-adapters: the adapters are read into the host tier in name order while it has free
    room, none evicted for them; a request for one the preload is reading waits for that read (no
    second one), a request for one it has not reached yet is read first, and requests then skip the
    disk."""
    folder = tmp_path / "adapters"
    _make_adapters(40, folder, seed=9)
    reads: list[str] = []
    read_adapter = Engine.read_adapter

    def slow_read(self, name):                   # so that requests meet the preload under way
        reads.append(name)
        time.sleep(0.1)
        return read_adapter(self, name)

    monkeypatch.setattr(Engine, "read_adapter", slow_read)
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_dir=str(folder), host_adapter_mem=HOST_MEM, preload_adapters=True, threads=1))
    try:
        engine = st.server.engine
        seen = _watch_evictions(engine, monkeypatch)
        names = sorted(engine.pager.registry)
        # the first in name order (being read now or next) and one the preload reaches last, if ever
        bodies = [{"model": name, "prompt": "the lazy dog jumps", "max_tokens": NEW_TOKENS, "temperature": 0.0,
                   "return_token_ids": True} for name in (names[0], names[17])]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda b: _completion(st.base, b), bodies))
        assert [s for s, _ in results] == [200, 200], results
        assert st.metric("asyncserve_adapters_preloading") == 1          # answered while the preload goes on
        _wait_preloaded(st)
        assert len(reads) == len(set(reads))                              # nothing read twice
        host = set(engine.pager.host)
        assert names[0] in host and names[17] in host
        assert 15 <= len(host) < 40 and seen["host"] == 0 and seen["violations"] == []
        assert host == set(reads) and reads[0] == names[0]               # none evicted: all read are kept
        assert reads.index(names[17]) < reads.index(names[16])           # the request's read went first
        pager = engine.pager
        assert all(pager.registry[n].host_bytes > pager.arena.free_bytes for n in names if n not in host)
        preloaded = sorted(host - {names[0], names[17]})
        assert st.metric("asyncserve_adapters_loaded", 'tier="host"') == len(host)
        for name, (_, body) in zip((names[0], names[17]), results):
            choice = body["choices"][0]
            ref = _peft_reference(tiny_model.base, folder / name, choice["prompt_token_ids"])
            assert_greedy_matches(choice["token_ids"], ref, 1e-3, name)

        # a preloaded adapter's request reads nothing from disk; one never preloaded still works
        before = len(reads)
        status, _ = _completion(st.base, {**bodies[0], "model": preloaded[-1]})
        assert status == 200 and len(reads) == before
        missing = next(n for n in names if n not in host)
        status, _ = _completion(st.base, {**bodies[0], "model": missing})
        assert status == 200 and reads[-1] == missing
        _assert_nothing_leaked(engine)
    finally:
        st.stop()


def test_offline_preload(tiny_model, adapter_dir):
    """LLM(preload_adapters=True): the host tier is filled before the constructor returns."""
    llm = LLM(model=str(tiny_model.root), dtype="float32", device="cpu", adapter_dir=str(adapter_dir),
              host_adapter_mem=HOST_MEM, preload_adapters=True)
    pager = llm.engine.pager
    host = sorted(pager.host)
    assert 15 <= len(host) <= 30 and not llm.engine.preloading
    assert host[0] == "a0000" and all(pager.registry[n].host_bytes > pager.arena.free_bytes
                                      for n in pager.registry if n not in pager.host)    # nothing more fits
    disk_loads = lambda: [name for tier, name, _ in llm.engine.take_load_times() if tier == "disk"]  # noqa: E731
    assert sorted(disk_loads()) == host
    out = llm.generate(["the fox jumps"], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), adapters=host[-1])[0]
    assert disk_loads() == []
    ref = _peft_reference(tiny_model.base, adapter_dir / host[-1], out.prompt_token_ids)
    assert_greedy_matches(out.token_ids, ref, 1e-3, host[-1])
    llm.engine.close()


SERVE_ARGS = ("--port", "0", "--threads", "1", "--device", "cpu", "--dtype", "float32", "--host-adapter-mem",
              HOST_MEM, "--step-profile", "off")


def test_shared_memory_is_gone_after_sigterm_and_after_sigkill_and_restart(tiny_model, tmp_path):
    folder = tmp_path / "adapters"
    _make_adapters(3, folder, seed=9)
    args = ("--model", str(tiny_model.root), "--adapter-dir", str(folder))
    servers = []
    try:
        first = ServedProcess(*SERVE_ARGS, *args, cwd=REPO)
        servers.append(first)
        assert _completion(first.base, {"model": "a0001", "prompt": "the fox", "max_tokens": 2})[0] == 200
        assert leftovers(first.shm_prefix)                     # the host tier's arena, with a0001 in it
        assert first.stop(signal.SIGTERM) == 0
        assert leftovers(first.shm_prefix) == []

        killed = ServedProcess(*SERVE_ARGS, *args, cwd=REPO)
        servers.append(killed)
        assert _completion(killed.base, {"model": "a0002", "prompt": "the fox", "max_tokens": 2})[0] == 200
        assert leftovers(killed.shm_prefix)
        killed.stop(signal.SIGKILL)
        assert leftovers(killed.shm_prefix)                    # nothing ran at its exit

        restarted = ServedProcess(*SERVE_ARGS, *args, cwd=REPO)
        servers.append(restarted)
        assert leftovers(killed.shm_prefix) == []              # removed at start, as the dead pid's
        assert leftovers(restarted.shm_prefix)
        assert restarted.stop(signal.SIGTERM) == 0
        assert leftovers(restarted.shm_prefix) == []
    finally:
        for s in servers:
            s.close()
