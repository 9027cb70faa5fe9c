"""asyncserve: serve many LoRA fine-tunes of one base LLM."""
from asyncserve.llm import LLM, RequestOutput
from asyncserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
