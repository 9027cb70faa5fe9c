"""asyncserve: serve many LoRA fine-tunes of one base LLM."""
from importlib.metadata import version as _version

from asyncserve.llm import LLM, RequestOutput
from asyncserve.sampling_params import SamplingParams, StructuredOutputs

__version__ = _version("asyncserve")
__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputs"]
