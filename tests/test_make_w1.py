"""scripts/make_w1.py: W1 (BENCHMARKS.md) is generated inside the repository, the same bytes every time:
64 prompts of exactly 64 SmolLM2 tokens that share no first block, and four PEFT adapters of ranks
8, 16, 8, 16 on q, k, v, o (alpha 2r) that our loader takes for SmolLM2."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from asyncserve.model.loader import load_model
from asyncserve.pager.adapters import inspect_peft_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_w1  # noqa: E402
import workloads  # noqa: E402


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(str(smollm2_gguf))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_w1_is_generated_the_same_every_time(smollm2, tmp_path):
    make_w1.write_w1(tmp_path / "first", smollm2)
    make_w1.write_w1(tmp_path / "second", smollm2)
    first = _files(tmp_path / "first")
    assert sorted(first) == ["w1/adapters/a0/adapter_config.json", "w1/adapters/a0/adapter_model.safetensors",
                             "w1/adapters/a1/adapter_config.json", "w1/adapters/a1/adapter_model.safetensors",
                             "w1/adapters/a2/adapter_config.json", "w1/adapters/a2/adapter_model.safetensors",
                             "w1/adapters/a3/adapter_config.json", "w1/adapters/a3/adapter_model.safetensors",
                             "w1/prompts.json"]
    assert first == _files(tmp_path / "second")

    prompts = json.loads((tmp_path / "first" / "w1" / "prompts.json").read_text())
    tok = smollm2.tokenizer
    assert len(prompts) == 64
    assert [len(tok.encode(p, add_special_tokens=False)) for p in prompts] == [64] * 64
    assert [len(tok.encode(p)) for p in prompts] == [64] * 64          # and no BOS is added to them
    first_blocks = {tuple(tok.encode(p, add_special_tokens=False)[:16]) for p in prompts}
    assert len(first_blocks) == 64                                       # no prefix-cache hits between them

    requests = workloads.w1(tmp_path / "first", "smollm2")
    assert [r.prompt for r in requests] == prompts and workloads.adapters_needed(requests) == ["a0", "a1", "a2", "a3"]
    for k, rank in enumerate((8, 16, 8, 16)):
        folder = tmp_path / "first" / "w1" / "adapters" / f"a{k}"
        config = json.loads((folder / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"]) == (rank, 2 * rank)
        assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
        info = inspect_peft_folder(f"a{k}", str(folder), smollm2.config)      # shapes checked against SmolLM2
        assert set(info.ranks) - {0} == {rank}
