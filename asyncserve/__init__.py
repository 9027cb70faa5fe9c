"""asyncserve: serve many LoRA fine-tunes of one base LLM."""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("asyncserve")
except PackageNotFoundError:        # run from a source checkout on PYTHONPATH, not installed
    __version__ = "0+source"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputs"]


def __getattr__(name: str):
    # imported on first use, so that what needs no engine (the guide builder's child process, the
    # CLI's --help) starts without loading torch
    if name in ("LLM", "RequestOutput"):
        from asyncserve import llm
        return getattr(llm, name)
    if name in ("SamplingParams", "StructuredOutputs"):
        from asyncserve import sampling_params
        return getattr(sampling_params, name)
    raise AttributeError(f"module 'asyncserve' has no attribute {name!r}")
