"""llama.cpp LoRA adapter files (what convert_lora_to_gguf.py writes, llama-server --lora takes) served
as adapters, against transformers+PEFT on the PEFT folders they were written from, fp32.

The files are written here as the converter writes them (``write_lora_gguf``): general.type "adapter",
adapter.type "lora", adapter.lora.alpha; per adapted base tensor its lora_a [r, in] and lora_b [out, r]
under the base GGUF's names; Llama's Q/K lora_b rows interleaved per head as the base's; a mixture's
per-expert LoRA stacked [experts, r, in] / [experts, out, r]; Phi-3's fused qkv and gate_up. That
writer was checked once against the converter itself (docs/adapters-and-tiers.md). Families: Llama
(the interleave), Qwen3-MoE (experts and router), Phi-3 (fused); F32, F16 and Q8_0 tensors. Then the
ways a file is given (--adapter NAME=FILE, --adapter-dir, load_adapter) and what is refused.
"""
import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from asyncserve import LLM, SamplingParams
from asyncserve.model.loader_gguf import _FAMILY_LAYER_TENSORS, _LAYER_TENSORS, interleaves_qk
from family_models import (ALL, FAMILIES, GREEDY_TOKENS, assert_each_refused, build_with_adapters, check_greedy,
                           greedy_tokens, split_stacked_experts, with_references)
from model_io_helpers import llama_cpp_permute
from reference import TEST_DEVICE

STACKED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# family -> adapters (no rsLoRA: a GGUF adapter has none, llama.cpp scales by alpha / r)
ADAPTERS = {
    "llama": {"all": (4, ALL, {}), "qk": (8, ["q_proj", "k_proj", "down_proj"], {"alpha": 5.0})},
    "qwen3_moe": {"attention": (4, ["q_proj", "k_proj", "v_proj", "o_proj"], {}),
                  "experts": (2, ["k_proj"], {"target_parameters": STACKED + ["mlp.gate.weight"]})},
    "phi3": {"all": (4, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], {}),
             "fused": (8, ["qkv_proj", "gate_up_proj"], {})},
}
_KEY = re.compile(r"layers\.(\d+)\.(.+)\.lora_A\.weight$")


def _llm(model, **kwargs) -> LLM:
    """The model in float32 on the test device (Phi-3: within its pretraining context, as transformers
    rotates it there)."""
    if model.family == "phi3":
        kwargs["max_model_len"] = FAMILIES["phi3"]["original_max_position_embeddings"]
    return LLM(model=str(model.folder), dtype="float32", device=TEST_DEVICE, max_step_tokens=16, **kwargs)


def _gguf_names(family: str) -> dict[str, str]:
    """HF module (self_attn.q_proj) -> the base GGUF tensor's name in a layer (attn_q)."""
    return {hf: g for g, hf in {**_LAYER_TENSORS, **_FAMILY_LAYER_TENSORS.get(family, {})}.items()}


def write_lora_gguf(folder: Path, path: Path, config, dtype: str = "f32", alpha: float | None = None,
                    edit=None) -> Path:
    """A PEFT folder as llama.cpp's convert_lora_to_gguf.py writes it (see the module's doc); config: the
    base's ModelConfig; dtype f32, f16 or q8_0; edit(tensors) may change the {name: array} before writing."""
    acfg = json.loads((folder / "adapter_config.json").read_text())
    weights = {k: v.float() for k, v in load_file(folder / "adapter_model.safetensors").items()}
    if acfg.get("target_parameters"):          # v5's stacked experts: as v4's per-expert tensors
        weights = split_stacked_experts(weights, acfg["target_parameters"], config.moe.num_experts)
    names = _gguf_names(config.family.name)
    tensors, stacks = {}, {}
    for key in [k for k in weights if _KEY.search(k)]:
        layer, module = _KEY.search(key).groups()
        a, b = weights[key], weights[key.replace("lora_A", "lora_B")]
        if (m := re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)", module)) is not None:
            stacks.setdefault((layer, f"ffn_{m.group(2).removesuffix('_proj')}_exps"), {})[int(m.group(1))] = (a, b)
            continue
        name = names[module]
        if interleaves_qk(config.family) and name in ("attn_q", "attn_k"):
            b = llama_cpp_permute(b, config.num_heads if name == "attn_q" else config.num_kv_heads)
        tensors[f"blk.{layer}.{name}.weight.lora_a"] = a.numpy()
        tensors[f"blk.{layer}.{name}.weight.lora_b"] = b.numpy()
    for (layer, name), experts in stacks.items():
        order = [experts[e] for e in sorted(experts)]
        tensors[f"blk.{layer}.{name}.weight.lora_a"] = torch.stack([a for a, _ in order]).numpy()
        tensors[f"blk.{layer}.{name}.weight.lora_b"] = torch.stack([b for _, b in order]).numpy()
    if edit is not None:
        edit(tensors)
    writer = gguf.GGUFWriter(path, config.family.gguf_architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", acfg["lora_alpha"] if alpha is None else alpha)
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if dtype == "f16":
            writer.add_tensor(name, array.astype(np.float16))
        elif dtype == "q8_0" and array.shape[-1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    _finish(writer)
    return path


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _model_config(model):
    from asyncserve.model.loader_hf import model_config
    return model_config(json.loads((model.folder / "config.json").read_text()), name="tiny")


@pytest.fixture(scope="module", params=list(ADAPTERS))
def family_model(request, tmp_path_factory):
    return with_references(build_with_adapters(tmp_path_factory.mktemp(request.param), request.param,
                                               ADAPTERS[request.param]))


def test_gguf_adapters_give_the_peft_folders_tokens(family_model, tmp_path):
    """The base and both adapters as F32 GGUF files in one generate call give the PEFT folders' tokens
    (transformers+PEFT's)."""
    model, cases, refs = family_model
    config = _model_config(model)
    files = {name: str(write_lora_gguf(path, tmp_path / f"{name}.gguf", config))
             for name, path in model.adapters.items()}
    llm = _llm(model, adapters=files)
    tokens = greedy_tokens(llm, cases)
    check_greedy(tokens, cases, refs, f"{model.family} gguf")
    assert {name: reg.path for name, reg in llm.engine.pager.registry.items()} == files


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_rounded_gguf_adapters_hold_the_rounded_rows(family_model, dtype, tmp_path):
    """F16 and Q8_0 files (convert_lora_to_gguf --outtype): every row read is the F32 file's within the
    type's rounding, and Q8_0's rows differ from F32's (its blocks were read, not skipped)."""
    model, _, _ = family_model
    config = _model_config(model)
    name, folder = next(iter(model.adapters.items()))
    llm = _llm(model, adapters={
        "f32": str(write_lora_gguf(folder, tmp_path / "f32.gguf", config)),
        dtype: str(write_lora_gguf(folder, tmp_path / f"{dtype}.gguf", config, dtype))})
    for adapter in ("f32", dtype):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), adapters=[adapter])     # reads it into the host tier
    exact, rounded = llm.engine.pager.host["f32"], llm.engine.pager.host[dtype]
    assert exact.ranks == rounded.ranks and torch.equal(exact.scaling, rounded.scaling)
    differs = False
    for rows in ("a_rows", "b_rows"):
        for key, want in getattr(exact, rows).items():
            got = getattr(rounded, rows)[key]
            tol = 1e-3 * want.abs().max() if dtype == "f16" else want.abs().max() / 100
            torch.testing.assert_close(got, want, rtol=0, atol=float(tol))
            differs |= not torch.equal(got, want)
    assert differs
def test_adapter_dir_and_runtime_loads_take_gguf_files(family_model, tmp_path):
    """--adapter-dir registers NAME.gguf as NAME beside folders; load_adapter takes a file; the tokens
    are the PEFT folders'."""
    model, cases, refs = family_model
    config = _model_config(model)
    first, second = list(model.adapters)
    write_lora_gguf(model.adapters[first], tmp_path / f"{first}.gguf", config)
    (tmp_path / "notes.txt").write_text("not an adapter")
    llm = _llm(model, adapter_dir=str(tmp_path))
    assert set(llm.engine.pager.registry) == {first}
    llm.load_adapter(second, str(write_lora_gguf(model.adapters[second], tmp_path / "other.gguf", config)))
    tokens = greedy_tokens(llm, cases)
    check_greedy(tokens, cases, refs, f"{model.family} adapter dir")


def test_bad_gguf_adapters_are_refused_each_alone(family_model, tmp_path):
    """Each refused with its reason, the adapters loaded before keeping their tokens: bytes that are not
    GGUF past the magic, a base model's GGUF, another architecture's, LoRA on the embeddings, an unknown
    tensor, lora_a without lora_b, a lora_b of another width, NaN, an alpha that is NaN, alpha 0 over
    tensors of different ranks; alpha 0 over one rank is llama.cpp's scaling 1 (served)."""
    model, cases, refs = family_model
    config = _model_config(model)
    first = next(iter(model.adapters))
    source = model.adapters[first]
    layer0 = next(k for k in _lora_names(source, config) if k.endswith("lora_b"))

    def write(name, **kwargs):
        return write_lora_gguf(source, tmp_path / f"{name}.gguf", config, **kwargs)

    def drop(key):
        return lambda t: t.pop(key)

    def nan(t):
        t[layer0] = t[layer0].copy()
        t[layer0][0, 0] = np.nan

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(200)))
    base_file = tmp_path / "base.gguf"
    writer = gguf.GGUFWriter(base_file, config.family.gguf_architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    _finish(writer)
    other_arch = "gemma2" if config.family.gguf_architecture != "gemma2" else "llama"
    wrong_arch = write("arch")
    _rewrite_arch(wrong_arch, other_arch)
    ranks = {t.shape[0] for k, t in load_file(source / "adapter_model.safetensors").items() if "lora_A" in k}
    bad = {
        "garbage": (garbage, "unreadable as GGUF"),
        "a model file": (base_file, "a LoRA adapter has 'adapter' and 'lora'"),
        "another architecture": (wrong_arch, f"made for a '{other_arch}' model"),
        "embeddings": (write("embd", edit=lambda t: t.update({"token_embd.weight.lora_a": np.zeros((2, 8), np.float32),
                                                             "token_embd.weight.lora_b": np.zeros((8, 2), np.float32)})),
                       "LoRA on the embeddings or the output head is not read"),
        "unknown tensor": (write("unknown", edit=lambda t: t.update({"blk.0.attn_zz.weight.lora_a": t[layer0],
                                                                    "blk.0.attn_zz.weight.lora_b": t[layer0]})),
                           "not a tensor of the"),
        "lora_a alone": (write("alone", edit=drop(layer0)), "but not both lora_a and lora_b"),
        "another width": (write("width", edit=lambda t: t.update({layer0: t[layer0][:-2]})), "this base model needs"),
        "NaN": (write("nan", edit=nan), "NaN or infinite"),
        "alpha NaN": (write("alpha_nan", alpha=float("nan")), "not a finite number"),
    }
    if len(ranks) > 1:
        bad["alpha 0, ranks differ"] = (write("alpha0", alpha=0.0), "adapter.lora.alpha 0")
    llm = _llm(model, adapters={k: str(v) for k, v in model.adapters.items()})
    assert_each_refused(llm, bad, cases, refs)
    if len(ranks) == 1:       # alpha 0: scaling 1
        llm.load_adapter("alpha0", str(write("alpha0", alpha=0.0)))
        assert float(llm.engine.pager.host["alpha0"].scaling.max()) == 1.0


def _lora_names(folder: Path, config) -> list[str]:
    tensors = {}
    write_lora_gguf(folder, folder.parent / f"{folder.name}-names.gguf", config, edit=tensors.update)
    return list(tensors)


def _rewrite_arch(path: Path, architecture: str) -> None:
    """The file's general.architecture value replaced (same length or not: the file is written again)."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(path.with_suffix(".tmp"), architecture)
    for key in ("general.type", "adapter.type"):
        writer.add_string(key, reader.fields[key].contents())
    writer.add_float32("adapter.lora.alpha", reader.fields["adapter.lora.alpha"].contents())
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    _finish(writer)
    path.with_suffix(".tmp").replace(path)


def test_runtime_load_over_http_takes_a_gguf_file_inside_the_root(family_model, tmp_path):
    """/v1/load_lora_adapter with a .gguf file inside --adapter-root: loaded and served with the PEFT
    folder's tokens; a file of another kind there is 404, a .gguf outside the root 400, both in OpenAI's
    error shape."""
    from asyncserve.config import Config
    from server_harness import ServerThread

    model, cases, refs = family_model
    if model.family != "llama":
        pytest.skip("one family is enough for the HTTP path")
    name, folder = next(iter(model.adapters.items()))
    root = tmp_path / "root"
    root.mkdir()
    write_lora_gguf(folder, root / "x.gguf", _model_config(model))
    (root / "notes.txt").write_text("not an adapter")
    write_lora_gguf(folder, tmp_path / "outside.gguf", _model_config(model))
    srv = ServerThread(Config(model=str(model.folder), dtype="float32", device="cpu", served_model_name="tiny",
                              adapter_root=str(root)))
    try:
        status, text, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "g", "lora_path": "x.gguf"})
        assert status == 200, text
        for path, code in (("notes.txt", 404), ("../outside.gguf", 400)):
            status, body, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "h", "lora_path": path})
            assert status == code and body["error"]["param"] == "lora_path", body
        case, ref = next((c, r) for c, r in zip(cases, refs) if c[1] == name)
        status, out, _ = srv.request("POST", "/v1/completions", {
            "model": "g", "prompt": case[0], "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert status == 200, out
        check_greedy([out["choices"][0]["token_ids"]], [case], [ref], "over HTTP")
    finally:
        srv.stop()
