"""One exception hierarchy for everything metatp raises on purpose.

Users catch `MetatpError`; the CLI turns any of these into a one-line message.
"""


class MetatpError(Exception):
    """Base class of every error metatp raises deliberately."""


class ModelFormatError(MetatpError):
    """The model file is not a valid GGUF (bad magic, truncated, corrupt field...)."""


class ModelNotFoundError(MetatpError, FileNotFoundError):
    """The model path does not exist or cannot be downloaded."""


class UnsupportedArchitectureError(MetatpError):
    """The GGUF names an architecture metatp cannot build a graph for."""


class UnsupportedOpError(MetatpError):
    """A graph uses an op, or an op configuration, that a pass or backend cannot handle."""


class SplitError(MetatpError):
    """Split-state propagation met a combination of input states it does not support."""


class ConfigError(MetatpError, ValueError):
    """A user-supplied setting is invalid (tensor_split, n_ctx, sampling parameters...)."""


class ContextOverflowError(MetatpError):
    """The prompt (plus what must be generated) does not fit in the context window."""


class BackendUnavailableError(MetatpError):
    """The requested backend cannot run here (e.g. cupy without a usable GPU)."""


class MemoryPlanError(MetatpError):
    """The model, KV cache and buffers do not fit in the per-device memory budget."""


class NumericalError(MetatpError):
    """The model computed NaN or infinite logits: the model file is broken (NaN/inf weights, or
    hyper-parameters that overflow); sampling them would silently give token 0."""


class RequestStateError(MetatpError):
    """A request was asked for something its state does not allow (outputs after its end, a
    step for a request the scheduler no longer runs)."""
