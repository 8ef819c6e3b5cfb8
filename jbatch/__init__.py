"""jbatch: a JAX/XLA continuous-batching LLM inference engine."""

from jbatch.engine.config import EngineConfig
from jbatch.engine.llm_engine import LLMEngine
from jbatch.llm import LLM
from jbatch.outputs import CompletionOutput, RequestOutput
from jbatch.sampling_params import SamplingParams
from jbatch.structured_output import StructuredOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]
__version__ = "0.1.0"
