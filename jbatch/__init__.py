"""jbatch: a JAX/XLA continuous-batching LLM inference engine."""

from jbatch.engine.config import EngineConfig
from jbatch.engine.llm_engine import LLMEngine
from jbatch.llm import LLM
from jbatch.outputs import CompletionOutput, RequestOutput
from jbatch.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
