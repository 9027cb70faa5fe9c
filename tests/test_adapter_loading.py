"""Adapter loading at runtime and at start: refusals (non-finite weights, broken files), reloading a
name with other weights, and loading a large adapter in pieces between steps."""
from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save_file

import asyncserve.actors.pager as pager_actor
import asyncserve.pager.adapters as adapters_module
from asyncserve import LLM
from asyncserve.config import Config
from asyncserve.pager.adapters import AdapterError, build_host_adapter, read_peft_folder
from asyncserve.stepper.runner import ModelRunner
from reference import assert_greedy_matches, reference_greedy, save_random_adapter, save_tiny_llama
from server_harness import ServerThread


def _with_weight(src, dst, value: float, dtype=None):
    """A copy of adapter folder src whose first lora_B tensor has ``value`` in one element."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key][0, 0] = value
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


@pytest.fixture(scope="module")
def adapter_root(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter_root")
    shutil.copytree(tiny_model.adapters["r2_mlp"], root / "a")
    shutil.copytree(tiny_model.adapters["r8_attn_rs"], root / "b")
    _with_weight(tiny_model.adapters["r1_qv"], root / "nan", float("nan"))
    _with_weight(tiny_model.adapters["r1_qv"], root / "inf", float("-inf"), torch.bfloat16)
    return root


@pytest.fixture(scope="module")
def srv(tiny_model, adapter_root):
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_root=str(adapter_root)))
    yield st
    st.stop()


# ---- refusals -----------------------------------------------------------------------------------

def _model_config(tiny_model):
    from asyncserve.model.loader import load_model

    return load_model(str(tiny_model.root)).config


@pytest.mark.parametrize("folder", ["nan", "inf"])
def test_non_finite_weights_are_refused_over_http_and_the_server_goes_on(srv, adapter_root, folder):
    status, body, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": folder})
    assert status == 400, body
    assert body["error"]["param"] == "lora_path" and "NaN or infinite" in body["error"]["message"], body
    _, models, _ = srv.request("GET", "/v1/models")
    assert "bad" not in {m["id"] for m in models["data"]}
    status, out, _ = srv.request("POST", "/v1/completions", {"model": "tiny", "prompt": "the fox", "max_tokens": 2,
                                                             "ignore_eos": True})    # sampled: EOS could end it
    assert status == 200 and out["usage"]["completion_tokens"] == 2


def test_non_finite_weights_are_refused_at_start(tiny_model, adapter_root):
    with pytest.raises(AdapterError, match=r"adapter 'bad': tensor '.*lora_B.*' holds NaN or infinite values"):
        LLM(model=str(tiny_model.root), adapters={"bad": str(adapter_root / "nan")}, dtype="float32", device="cpu")


def test_weights_that_overflow_the_serving_dtype_are_refused(tiny_model, tmp_path):
    """Finite in the file (float32) but infinite in float16: as harmful as a NaN."""
    folder = _with_weight(tiny_model.adapters["r1_qv"], tmp_path / "big", 1e6)
    read = read_peft_folder("big", folder, _model_config(tiny_model))
    assert build_host_adapter(read, torch.float32).a_rows          # fine in float32
    with pytest.raises(AdapterError, match="too large for torch.float16"):
        build_host_adapter(read, torch.float16)


def _corrupt(data: bytes, how: str) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    if how == "truncated":
        return data[:len(data) - 4]
    if how == "header_length":
        return (len(data)).to_bytes(8, "little") + data[8:]
    if how == "not_json":
        return data[:8] + b"{" * n + data[8 + n:]
    key = next(k for k in header if k != "__metadata__")
    if how == "int_dtype":
        header[key]["dtype"] = "I32"
    elif how == "wrong_shape":
        header[key]["shape"] = [header[key]["shape"][0] + 1, header[key]["shape"][1]]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


@pytest.mark.parametrize("how,message", [
    ("truncated", "not a valid safetensors file"),
    ("header_length", "not a valid safetensors file"),
    ("not_json", "not a valid safetensors file"),
    ("int_dtype", "is I32; LoRA weights must be one of"),
    ("wrong_shape", "do not fit its shape"),
])
def test_broken_safetensors_are_refused_before_any_tensor_is_built(tiny_model, tmp_path, how, message):
    folder = tmp_path / how
    shutil.copytree(tiny_model.adapters["r8_attn_rs"], folder)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(_corrupt(weights.read_bytes(), how))
    with pytest.raises(AdapterError, match=message):
        read_peft_folder("x", folder, _model_config(tiny_model))


def test_adapter_for_another_base_model_is_refused_by_its_header(tiny_model, tmp_path):
    other = save_tiny_llama(tmp_path / "other", tiny_model.tokenizer, hidden=32, intermediate=64)
    save_random_adapter(other, tmp_path / "lora", r=4, targets=["q_proj"])
    with pytest.raises(AdapterError, match=r"this base model needs A \[r, 64\]"):
        read_peft_folder("x", tmp_path / "lora", _model_config(tiny_model))


# ---- reloading a name ---------------------------------------------------------------------------

def _sse_tokens(response):
    """Token ids of each chunk of a completions stream (return_token_ids), as they come."""
    for line in response:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                return
            yield from json.loads(data)["choices"][0].get("token_ids") or []


def _reference(tiny_model, folder, prompt_ids, n):
    from peft import PeftModel

    model = PeftModel.from_pretrained(tiny_model.base, folder).eval()
    try:
        return reference_greedy(model, prompt_ids, n)
    finally:
        model.unload()          # the base model is shared by the session's tests


def test_reloading_a_name_serves_the_new_weights_while_old_streams_finish_on_the_old(
        srv, tiny_model, adapter_root, monkeypatch):
    """Load hot=A, stream on it, unload, load hot=B while the A stream runs: new requests get B's
    tokens (transformers+PEFT), the stream keeps A's, and A's pages go once the stream ends."""
    real_run = ModelRunner.run

    def slow_run(self, plan):       # long enough steps that the A stream outlives the reload
        time.sleep(0.02)
        return real_run(self, plan)

    monkeypatch.setattr(ModelRunner, "run", slow_run)
    prompt = tiny_model.tokenizer.encode("the fox jumps over the lazy dog")
    assert srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "hot", "lora_path": "a"})[0] == 200
    body = {"model": "hot", "prompt": prompt, "max_tokens": 80, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    req = urllib.request.Request(srv.base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    a_tokens: list[int] = []
    a_done = threading.Event()
    with urllib.request.urlopen(req, timeout=60) as stream:
        tokens = _sse_tokens(stream)
        a_tokens.append(next(tokens))                    # the A stream is running

        def read_rest():
            a_tokens.extend(tokens)
            a_done.set()

        reader = threading.Thread(target=read_rest)
        reader.start()
        assert srv.request("POST", "/v1/unload_lora_adapter", {"lora_name": "hot"})[0] == 200
        status, text, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "hot", "lora_path": "b"})
        assert status == 200, text
        status, out, _ = srv.request("POST", "/v1/completions", {
            "model": "hot", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert status == 200, out
        assert not a_done.is_set(), "the A stream ended before the reload was tested; slow the steps more"
        engine = srv.server.engine
        resident_during = engine.pool_stats().adapters_resident
        reader.join(60)
    assert a_done.is_set()
    assert_greedy_matches(out["choices"][0]["token_ids"], _reference(tiny_model, adapter_root / "b", prompt, 8),
                          tie_tol=1e-3, label="new request after the reload (B)")
    assert_greedy_matches(a_tokens, _reference(tiny_model, adapter_root / "a", prompt, 80), tie_tol=1e-3,
                          label="stream admitted before the reload (A)")
    assert resident_during == 2                  # A's copy, held by the stream, and B's
    stats = engine.pool_stats()                  # A was evicted when its last stream ended
    assert stats.adapters_resident == 1 and stats.adapter == engine.pager.footprint("hot") and stats.kv == 0
    assert srv.request("POST", "/v1/unload_lora_adapter", {"lora_name": "hot"})[0] == 200
    assert engine.pool_stats().adapter == 0


# ---- a large adapter loads in pieces between steps ------------------------------------------------

def test_a_large_adapter_is_built_between_steps(tiny_model, tmp_path, monkeypatch):
    """Building an adapter's tensors runs in the torch thread a piece (here: a layer) per call, so a
    stream's steps go on between the pieces instead of waiting for the whole adapter (issue 12: 1.3 s
    stalls)."""
    base = save_tiny_llama(tmp_path / "deep", tiny_model.tokenizer, layers=12)
    root = tmp_path / "root"
    save_random_adapter(base, root / "big", r=256, targets=["q_proj", "k_proj", "v_proj", "o_proj",
                                                            "gate_proj", "up_proj", "down_proj"])
    order: list[str] = []           # appended in the torch thread only: the order calls ran
    real_run, real_pieces = ModelRunner.run, pager_actor.build_in_pieces

    def run(self, plan):
        order.append("step")
        return real_run(self, plan)

    def pieces(*args):
        for piece in real_pieces(*args):
            order.append("piece")
            yield piece

    monkeypatch.setattr(ModelRunner, "run", run)
    monkeypatch.setattr(pager_actor, "build_in_pieces", pieces)
    monkeypatch.setattr(adapters_module, "PIECE_BYTES", 1)     # a piece per layer
    st = ServerThread(Config(model=str(tmp_path / "deep"), dtype="float32", device="cpu", served_model_name="deep",
                             adapter_root=str(root)))
    try:
        body = {"model": "deep", "prompt": "the fox", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        req = urllib.request.Request(st.base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as stream:
            next(line for line in stream if line.startswith(b"data: "))      # the stream is running
            status, text, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": "big"})
            assert status == 200, text
            first, last = order.index("piece"), len(order) - 1 - order[::-1].index("piece")
            during = order[first:last + 1]
            assert during.count("piece") == 13                       # 12 layers, then the adapter
            # steps ran between the pieces (they queue behind each other in the one torch thread)
            assert during.count("step") >= 6, during
    finally:
        st.stop()
