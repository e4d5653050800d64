"""nanoserve: a long-context LLM inference engine with KV offload to host memory."""

from nanoserve.config import EngineConfig
from nanoserve.errors import InvalidParameter
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_outputs import StructuredOutputs

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "InvalidParameter", "RequestOutput",
           "SamplingParams", "StructuredOutputs", "TokenLogprobs"]
__version__ = "0.1.0"
