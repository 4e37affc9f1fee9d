"""metatp: GGUF language models split across GPUs with tensor parallelism.

    from metatp import LLM, SamplingParams
    llm = LLM()                                   # default small model, numpy or cupy backend
    llm.generate("The capital of France is", SamplingParams(max_tokens=8))
"""

from metatp.ir.errors import (BackendUnavailableError, ConfigError, ContextOverflowError, MemoryPlanError,
                              MetatpError, ModelFormatError, ModelNotFoundError, NumericalError, SplitError,
                              UnsupportedArchitectureError, UnsupportedOpError)
from metatp.sampling import SamplingParams
from metatp.api import LLM, CompletionOutput, RequestOutput

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput",
    "MetatpError", "ModelFormatError", "ModelNotFoundError", "UnsupportedArchitectureError", "UnsupportedOpError",
    "SplitError", "ConfigError", "ContextOverflowError", "BackendUnavailableError", "MemoryPlanError",
    "NumericalError",
]
