"""Hub ids for the model and adapters, offline, from a cache laid out as huggingface_hub lays it out
(HF_HOME/hub/models--org--name/snapshots/<commit>/..., refs/<revision>). One subprocess, since
huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from asyncserve.model.hub import is_remote, is_repo_id
from family_models import build_family_model

SCRIPT = r"""
import json, shutil, sys
from asyncserve import LLM, SamplingParams
from asyncserve.model.config import ModelLoadError
from asyncserve.pager.adapters import AdapterError

params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
prompt = [5, 6, 7, 8]
out = {}
llm = LLM(model="org/tiny", adapters={"a": "org/tiny-lora"}, dtype="float32", device="cpu")
out["name"] = llm.engine.model_name
out["main"] = [o.token_ids for o in llm.generate([prompt, prompt], params, adapters=[None, "a"])]
out["v2"] = LLM(model="org/tiny", revision="v2", dtype="float32", device="cpu").generate([prompt], params)[0].token_ids
out["errors"] = []
for kwargs in ({"model": "org/missing"}, {"model": "org/tiny", "revision": "v3"},
               {"model": "org/tiny", "adapters": {"b": "org/missing-lora"}}):
    try:
        LLM(dtype="float32", device="cpu", **kwargs)
        out["errors"].append(None)
    except (ModelLoadError, AdapterError) as e:
        out["errors"].append(str(e))
shutil.copytree(sys.argv[1], "org/tiny")            # a local folder of the same name wins over the cache
out["local"] = LLM(model="org/tiny", dtype="float32", device="cpu").generate([prompt], params)[0].token_ids
print(json.dumps(out))
"""


def cache_repo(hf_home: Path, repo_id: str, snapshots: dict[str, Path]) -> None:
    """snapshots: revision -> folder copied as that revision's snapshot (commits made up per revision)."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    for i, (revision, folder) in enumerate(snapshots.items()):
        commit = f"{i + 1:040x}"
        shutil.copytree(folder, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)


def test_hub_ids_resolve_offline_from_the_cache_and_a_local_folder_wins(tmp_path):
    main = build_family_model(tmp_path / "main", "qwen2")
    other = build_family_model(tmp_path / "v2", "qwen3")        # another revision: other weights
    hf_home = tmp_path / "hf"
    cache_repo(hf_home, "org/tiny", {"main": main.folder, "v2": other.folder})
    cache_repo(hf_home, "org/tiny-lora", {"main": main.adapters["all"]})
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(other.folder)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    from asyncserve import LLM, SamplingParams
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    local = LLM(model=str(main.folder), adapters={"a": str(main.adapters["all"])}, dtype="float32", device="cpu")
    assert out["name"] == "org/tiny"                 # the id, not the snapshot's commit folder
    assert out["main"] == [o.token_ids for o in local.generate([prompt, prompt], params, adapters=[None, "a"])]
    assert out["main"][0] != out["main"][1]
    v2 = LLM(model=str(other.folder), dtype="float32", device="cpu").generate([prompt], params)[0].token_ids
    assert out["v2"] == v2 and out["local"] == v2
    missing, bad_revision, missing_adapter = out["errors"]
    assert "'org/missing' is neither a local file or folder nor in the Hugging Face cache" in missing
    assert "HF_HUB_OFFLINE is set" in missing
    assert "revision 'v3'" in bad_revision
    assert missing_adapter.startswith("adapter 'b': adapter 'org/missing-lora' is neither")


def test_what_counts_as_a_hub_id():
    for repo_id in ("Qwen/Qwen2.5-0.5B-Instruct", "google/gemma-2-2b-it", "org/name", "a/b.c_d-e"):
        assert is_repo_id(repo_id), repo_id
    for path in ("model.gguf", "./org/name", "/abs/path", "org/name/sub", "~/models/x", "org/model.gguf", "name"):
        assert not is_repo_id(path) and not is_remote(path), path
    for ref in ("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", "org/name:q8_0", "Qwen/Qwen3-0.6B-GGUF:Q8_0"):
        assert is_remote(ref) and not is_repo_id(ref), ref
    for path in ("org/name:", "org/name:Q8 0", "org:Q8_0", "/abs/org/name:Q8_0"):
        assert not is_remote(path), path


GGUF_SCRIPT = r"""
import json
from asyncserve import LLM, SamplingParams
from asyncserve.model.config import ModelLoadError

params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
out = {"errors": []}
for model in ("org/tiny-GGUF:Q8_0", "org/tiny-GGUF", "org/tiny-GGUF:q6_k"):
    llm = LLM(model=model, dtype="float32", device="cpu")
    out[model] = [llm.engine.model_name, llm.generate([[5, 6, 7, 8]], params)[0].token_ids]
for model in ("org/tiny-GGUF:Q5_K_S", "org/tiny-GGUF:Q6", "org/missing-GGUF:Q8_0"):
    try:
        LLM(model=model, dtype="float32", device="cpu")
        out["errors"].append(None)
    except ModelLoadError as e:
        out["errors"].append(str(e))
print(json.dumps(out))
"""


def test_a_repository_of_gguf_files_serves_one_quantization_as_llama_cpp_names_it(tmp_path):
    """org/name:QUANT is the repository's file of that quantization (any case; Q6_K is not Q6_K_L, and a
    vision projector's mmproj file is never taken), plain org/name its Q4_K_M file, as llama.cpp's -hf
    takes them, offline from the cache; a quantization it lacks and a missing repository are clear errors."""
    from asyncserve import LLM, SamplingParams
    from family_models import write_family_gguf

    first, second = build_family_model(tmp_path / "a", "qwen2"), build_family_model(tmp_path / "b", "qwen3")
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, model in (("tiny-Q8_0", first), ("tiny-Q4_K_M", second), ("tiny-Q6_K", first), ("tiny-Q6_K_L", second),
                        ("mmproj-tiny-Q8_0", second)):
        write_family_gguf(model, repo / f"{name}.gguf")
    (repo / "README.md").write_text("GGUF files of a tiny model")
    hf_home = tmp_path / "hf"
    cache_repo(hf_home, "org/tiny-GGUF", {"main": repo})
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", GGUF_SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {name: LLM(model=str(repo / f"{name}.gguf"), dtype="float32", device="cpu").generate(
        [[5, 6, 7, 8]], params)[0].token_ids for name in ("tiny-Q8_0", "tiny-Q4_K_M")}
    assert tokens["tiny-Q8_0"] != tokens["tiny-Q4_K_M"]
    assert out["org/tiny-GGUF:Q8_0"] == ["org/tiny-GGUF:Q8_0", tokens["tiny-Q8_0"]]
    assert out["org/tiny-GGUF"] == ["org/tiny-GGUF", tokens["tiny-Q4_K_M"]]
    assert out["org/tiny-GGUF:q6_k"][1] == tokens["tiny-Q8_0"]          # tiny-Q6_K is the first model
    no_quant, partial, missing = out["errors"]
    assert "has no GGUF file of quantization 'Q5_K_S'" in no_quant and "org/tiny-GGUF:Q8_0" in no_quant
    assert "has no GGUF file of quantization 'Q6'" in partial
    assert "'org/missing-GGUF' is neither a local file or folder nor in the Hugging Face cache" in missing
