"""metatp: GGUF language models split across GPUs with tensor parallelism.

    from metatp import LLM, SamplingParams
    llm = LLM()                                   # default small model, numpy or cupy backend
    llm.generate("The capital of France is", SamplingParams(max_tokens=8))

Drop-in for llama-cpp-python (`from metatp import Llama`: `metatp.llama`) and vLLM (`from
metatp import LLM, SamplingParams`): the README's "Drop-in for llama-cpp-python and vLLM".
"""

from metatp.ir.errors import (BackendUnavailableError, ConfigError, ContextOverflowError, MemoryPlanError,
                              MetatpError, ModelFormatError, ModelNotFoundError, NumericalError, SplitError,
                              UnsupportedArchitectureError, UnsupportedOpError)
from metatp.sampling import SamplingParams
from metatp.api import LLM, CompletionOutput, RequestOutput
from metatp.llama import Llama
from metatp.logprobs import Logprob

__version__ = "0.1.0"

__all__ = [
    "LLM", "Llama", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
    "MetatpError", "ModelFormatError", "ModelNotFoundError", "UnsupportedArchitectureError", "UnsupportedOpError",
    "SplitError", "ConfigError", "ContextOverflowError", "BackendUnavailableError", "MemoryPlanError",
    "NumericalError",
]
