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


def _size(n: int) -> str:
    """Bytes as a person reads them (ir imports no formatter of passes)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


class DeviceError(MetatpError):
    """A GPU refused or failed work (its memory, a kernel, a collective); `gpu` is its id, None
    where no one GPU is to blame. Raised by the CUDA backend's runtime in place of the device
    library's own exceptions."""

    gpu: int | None = None

    @property
    def device(self) -> str:
        return "a GPU" if self.gpu is None else f"GPU {self.gpu}"


class DeviceMemoryError(DeviceError, MemoryPlanError):
    """A device allocation failed: `needed` bytes were asked for (None: the library did not say)
    with `free` bytes free on the device (None: it could not be asked). The device stays usable:
    what fits still runs (a smaller batch, a shorter context). `what` names what the memory was
    for where the backend knows it (a weight, the KV cache, a plan's buffers)."""

    def __init__(self, gpu: int | None, needed: int | None, free: int | None, what: str | None = None) -> None:
        super().__init__(gpu, needed, free, what)
        self.gpu, self.needed, self.free, self.what = gpu, needed, free, what

    def __str__(self) -> str:
        asked = "" if self.needed is None else f" allocating {_size(self.needed)}"
        used = "" if self.what is None else f" for {self.what}"
        free = "" if self.free is None else f" with {_size(self.free)} free"
        return f"out of memory on {self.device}:{asked}{used}{free}"


class DeviceFaultError(DeviceError):
    """A kernel launch or device call failed: `error` is the library's words (e.g.
    "cudaErrorIllegalAddress: an illegal memory access was encountered"), `kernel` the kernel
    launched (None: the fault surfaced at a copy or a wait, after the kernel that caused it).
    `sticky`: the CUDA context is unusable from now on (an illegal address, an assert, a
    failed launch), so the backend refuses all further work; `earlier`: this is that refusal."""

    def __init__(self, gpu: int | None, error: str, kernel: str | None = None, sticky: bool = True,
                 earlier: bool = False) -> None:
        super().__init__(gpu, error, kernel, sticky, earlier)
        self.gpu, self.error, self.kernel, self.sticky, self.earlier = gpu, error, kernel, sticky, earlier

    def _doing(self) -> str:
        return f" running kernel {self.kernel!r}" if self.kernel else ""

    def __str__(self) -> str:
        if self.earlier:
            return (f"{self.device} failed earlier{self._doing()} ({self.error}) and can run nothing more; "
                    "restart the process")
        after = "; no more work runs there until the process restarts" if self.sticky else ""
        return f"{self.device} failed{self._doing()}: {self.error}{after}"

    def again(self) -> "DeviceFaultError":
        """The refusal of later work on the failed device: the same error, marked `earlier`."""
        return type(self)(*self.args[:-1], True)


class CollectiveError(DeviceFaultError):
    """An NCCL call failed: `op` ("all-reduce", "send", "recv", "init") over the GPUs `gpus`.
    A communicator that failed cannot be used again, so the backend refuses all further work
    (`sticky`), as for a faulted kernel."""

    def __init__(self, op: str, gpus: tuple[int, ...], error: str, sticky: bool = True, earlier: bool = False) -> None:
        DeviceError.__init__(self, op, tuple(gpus), error, sticky, earlier)
        self.op, self.gpus, self.error, self.sticky, self.earlier = op, tuple(gpus), error, sticky, earlier
        self.gpu = self.gpus[0] if len(self.gpus) == 1 else None
        self.kernel = None

    @property
    def device(self) -> str:
        return "GPUs " + ", ".join(str(g) for g in self.gpus) if len(self.gpus) > 1 else super().device

    def _doing(self) -> str:
        return f" in NCCL {self.op}"
