"""How the server fails: start-up errors exit non-zero, requests it ends are errors (never a
finish_reason "abort"), builds die with their server, and refusals are logged."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import asyncserve
from asyncserve import LLM, SamplingParams
from asyncserve.cli import main as cli_main
from asyncserve.config import Config
from asyncserve.engine import RequestError
from server_harness import ServerThread

REPO = Path(asyncserve.__file__).resolve().parents[1]


def _serve(*args: str, timeout: float = 90) -> tuple[int, str]:
    """Run `asyncserve serve ARGS` on a free port until it exits by itself: (exit status, its log)."""
    proc = subprocess.Popen([sys.executable, "-m", "asyncserve.cli", "serve", "--port", "0", "--threads", "1",
                             "--device", "cpu", "--dtype", "float32", "--step-profile", "off", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.parametrize("args, reason", [
    (["--model", "/nonexistent/model"], "model path /nonexistent/model does not exist"),
    (["--policy", "sjf"], "unknown policy 'sjf'"),
    (["--pool-mem", "lots"], "cannot parse size 'lots'"),
    (["--adapter", "a=/nonexistent/adapter"], "/nonexistent/adapter is neither a PEFT adapter folder"),
])
def test_settings_wrong_before_loading_exit_at_once(tiny_model, args, reason):
    status, log = _serve("--model", str(tiny_model.root), *args)
    assert status == 2 and reason in log, log
    assert "listening" not in log


def test_a_failed_start_up_exits_non_zero_with_the_reason(tiny_model, tmp_path):
    """Errors found while loading (an adapter that does not fit the model, a context beyond the
    model's): the process logs the reason and exits 1, instead of answering 503 for ever."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model.adapters["r1_qv"], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    status, log = _serve("--model", str(tiny_model.root), "--adapter", f"bad={bad}")
    assert status == 1, log
    assert "could not start" in log and "adapter 'bad'" in log and "not a valid safetensors file" in log
    status, log = _serve("--model", str(tiny_model.root), "--max-model-len", "100000")
    assert status == 1, log
    assert "max_model_len 100000 is beyond the model's context of 512 tokens" in log


def test_adapter_dir_skips_a_bad_folder_and_refusals_are_logged(tiny_model, tmp_path, caplog):
    folder = tmp_path / "adapters"
    shutil.copytree(tiny_model.adapters["r1_qv"], folder / "good")
    shutil.copytree(tiny_model.adapters["r2_mlp"], folder / "corrupt")
    (folder / "corrupt" / "adapter_model.safetensors").write_bytes(b"\0" * 100)
    (folder / "notes").mkdir()
    caplog.set_level(logging.INFO)
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_dir=str(folder), adapter_root=str(folder)))
    try:
        status, models, _ = st.request("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny", "good"]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("skipping" in w and "corrupt" in w and "safetensors" in w for w in warnings), warnings
        assert any("skipping" in w and "notes" in w and "no adapter_config.json" in w for w in warnings), warnings
        status, body, _ = st.request("POST", "/v1/completions", {"model": "good", "prompt": "the fox", "max_tokens": 2})
        assert status == 200, body

        caplog.clear()
        status, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "corrupt"})
        assert status == 400 and "safetensors" in body["error"]["message"]
        status, body, _ = st.request("POST", "/v1/completions", {"model": "nope", "prompt": "x"})
        assert status == 404
        lines = [r.getMessage() for r in caplog.records if r.name == "asyncserve.ingress"]
        assert [line.split(":")[0] for line in lines] == ["POST /v1/load_lora_adapter -> 400 invalid_value",
                                                          "POST /v1/completions -> 404 model_not_found"], lines
        assert "adapter 'c'" in lines[0]
    finally:
        st.stop()


def _slow_steps(st: ServerThread, monkeypatch, seconds: float) -> None:
    """Each step takes at least ``seconds``, so that requests stay queued or running while a test acts."""
    runner = st.server.engine.runner
    real = runner.run

    def slow(plan):
        time.sleep(seconds)
        return real(plan)

    monkeypatch.setattr(runner, "run", slow)


def _wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _in_thread(results: dict, key: str, fn, *args) -> threading.Thread:
    def run():
        try:
            results[key] = fn(*args)
        except BaseException as e:        # reported by the test's assertions
            results[key] = e
    t = threading.Thread(target=run)
    t.start()
    return t


def test_requests_queued_for_an_unloaded_adapter_get_an_error(tiny_model, monkeypatch):
    """Without stream: 404 model_not_found in OpenAI's shape. In a stream: an error event, then [DONE],
    and no finish_reason. The running request on the base model is not touched."""
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapters={"r1_qv": str(tiny_model.adapters["r1_qv"])}, max_running=1))
    try:
        _slow_steps(st, monkeypatch, 0.01)
        scheduler = st.server.engine.scheduler
        results: dict = {}
        long_body = {"model": "tiny", "prompt": "the fox", "max_tokens": 150, "ignore_eos": True}
        threads = [_in_thread(results, "base", st.request, "POST", "/v1/completions", long_body)]
        _wait_for(lambda: scheduler.running, "the base request should run")
        body = {"model": "r1_qv", "prompt": "the fox", "max_tokens": 4}
        threads.append(_in_thread(results, "plain", st.request, "POST", "/v1/completions", body))
        threads.append(_in_thread(results, "stream", st.stream, "/v1/chat/completions",
                                  {"model": "r1_qv", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 4, "stream": True}))
        _wait_for(lambda: len(scheduler.waiting) == 2, "both adapter requests should queue")
        status, text, _ = st.request("POST", "/v1/unload_lora_adapter", {"lora_name": "r1_qv"})
        assert status == 200, text
        for t in threads:
            t.join(60)

        status, out, _ = results["plain"]
        assert status == 404, out
        assert out["error"]["code"] == "model_not_found" and "unloaded" in out["error"]["message"]
        assert set(out["error"]) == {"message", "type", "param", "code"}
        chunks = results["stream"]
        assert isinstance(chunks, list), chunks               # ended with data: [DONE]
        errors = [c["error"] for c in chunks if "error" in c]
        assert len(errors) == 1 and errors[0]["code"] == "model_not_found", chunks
        assert "error" in chunks[-1]                          # the last event before [DONE]
        assert all(ch["finish_reason"] is None for c in chunks for ch in c.get("choices", [])), chunks
        status, out, _ = results["base"]
        assert status == 200 and out["choices"][0]["finish_reason"] == "length"
    finally:
        st.stop()


def test_requests_cut_at_the_shutdown_grace_get_503(tiny_model, monkeypatch):
    """Requests still running when the grace period ends: 503 without stream, an error event in a
    stream (after the tokens already sent, before [DONE]); never a finish_reason "abort"."""
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             shutdown_grace_s=0.3))
    _slow_steps(st, monkeypatch, 0.02)
    results: dict = {}
    body = {"model": "tiny", "prompt": "the fox", "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}
    threads = [_in_thread(results, "plain", st.request, "POST", "/v1/completions", body),
               _in_thread(results, "stream", st.stream, "/v1/completions", {**body, "stream": True}),
               _in_thread(results, "responses", st.stream, "/v1/responses",
                          {"model": "tiny", "input": "the fox", "max_output_tokens": 400, "temperature": 0.0,
                           "ignore_eos": True, "stream": True}, False)]
    _wait_for(lambda: len(st.server.engine.scheduler.running) == 3 and
              all(s.output_ids for s in st.server.engine.scheduler.running), "both requests should be generating")
    st.stop()
    for t in threads:
        t.join(60)

    status, out, _ = results["plain"]
    assert status == 503, out
    assert out["error"]["code"] == "server_shutting_down" and out["error"]["type"] == "server_error"
    chunks = results["stream"]
    assert isinstance(chunks, list), chunks
    # the tokens sent before the cut came first (a token may add no text of its own: count the text)
    assert "".join(ch["text"] for c in chunks[:-1] for ch in c["choices"]) and "error" in chunks[-1]
    assert chunks[-1]["error"]["code"] == "server_shutting_down"
    assert all(ch["finish_reason"] is None for c in chunks for ch in c.get("choices", [])), chunks
    # /v1/responses: the text deltas, then response.failed with the reason
    events = results["responses"]
    assert isinstance(events, list), events
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["code"] == "server_shutting_down"
    message, = events[-1]["response"]["output"]           # what was sent before the cut, kept
    assert message["status"] == "incomplete" and message["content"][0]["text"] == \
        "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def _is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")            # exited; reaped or not by whoever adopted it


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_killed_server_leaves_no_guide_build_running():
    """A SIGKILLed process's guide_build child dies at once. The child here waits for its request on a
    pipe this test holds open, so nothing but its parent's death can end it."""
    read_end, write_end = os.pipe()
    starter = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys\n"
         "child = subprocess.Popen([sys.executable, '-m', 'asyncserve.guide_build', str(os.getpid())])\n"
         "print(child.pid, flush=True)\n"
         "child.wait()\n"],
        stdin=read_end, stdout=subprocess.PIPE, cwd=REPO)
    os.close(read_end)
    child = None
    try:
        child = int(starter.stdout.readline())
        time.sleep(1.0)                       # the child is up and waiting for its request
        assert not _is_gone(child)
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 5
        while not _is_gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _is_gone(child), "the build outlived the process that started it"
    finally:
        os.close(write_end)
        if starter.poll() is None:
            starter.kill()
        if child is not None and not _is_gone(child):
            os.kill(child, signal.SIGKILL)


def test_pool_error_names_the_adapter_that_tips_it_over_and_max_model_len_is_checked(tiny_model):
    probe = LLM(model=str(tiny_model.root), adapters={"big": str(tiny_model.adapters["r8_attn_rs"])},
                dtype="float32", device="cpu")
    engine = probe.engine
    adapter_pages = engine.pager.footprint("big")
    page_bytes = engine.pool.page_numel * engine.pool.data.element_size()
    llm = LLM(model=str(tiny_model.root), adapters={"big": str(tiny_model.adapters["r8_attn_rs"])}, dtype="float32",
              device="cpu", pool_mem=(adapter_pages + 4) * page_bytes)
    block = llm.engine.pool.block_size
    params = SamplingParams(max_tokens=5 * block - 8)      # 5 pages with the 8-token prompt: fits alone
    llm.engine.make_sequence(list(range(1, 9)), params, None)
    with pytest.raises(RequestError, match=rf"adapter 'big' takes {adapter_pages} of the pool's "
                                           rf"{adapter_pages + 4} pages, leaving KV room for {4 * block} tokens"):
        llm.engine.make_sequence(list(range(1, 9)), params, "big")
    with pytest.raises(ValueError, match="max_model_len 513 is beyond the model's context of 512 tokens"):
        LLM(model=str(tiny_model.root), dtype="float32", device="cpu", max_model_len=513)


def test_help_explains_the_serving_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("--max-running N most sequences in the running batch",
                     "--max-waiting N queued sequences (prompts x n) beyond this are refused with 429",
                     "--policy NAME batch formation: fcfs (first come, first served), affinity",
                     "--slo-ttft SECONDS slo: answer a waiting request at once with a 429",
                     "--served-model-name NAME the base model's name in the API",
                     "--shutdown-grace SECONDS", "--max-body-size SIZE"):
        assert expected in text, expected
