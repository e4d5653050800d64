"""nanoserve: a long-context LLM inference engine with KV offload to host memory."""

from nanoserve.config import EngineConfig
from nanoserve.llm import LLM, RequestOutput
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
