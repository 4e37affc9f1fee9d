"""llama.cpp through llama-cpp-python, for `bench --compare` and `batched-bench --compare`.

One place loads the model (`load`: default llama.cpp settings, f16 KV cache, no flash
attention, the thread count metatp's kernels use) and says what went wrong in one line.
`LlamaCppEngine` is bench's single-sequence view; `BatchedLlamaCpp` drives llama.cpp's batch API
the way llama-batched-bench does (one `llama_batch` per step carrying every sequence's tokens,
distinct `seq_id`s, a context with `n_seq_max` = B); `LlamaCppChild` runs it in a child process,
so a crash there (ggml's AMX matmul dies with SIGILL on VMs whose CPU reports AMX tiles the
kernel does not enable) leaves metatp's own rows standing.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import signal
import time

import numpy as np

__all__ = ["AMX_FIX", "INSTALL_HINT", "ComparisonFailed", "import_llama_cpp", "load", "version",
           "LlamaCppEngine", "BatchedLlamaCpp", "LlamaCppChild", "death_line"]

INSTALL_HINT = "pip install llama-cpp-python, or metatp[bench]"
#: the build that works where the default native one dies with SIGILL in ggml's AMX matmul
AMX_FIX = ("CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
           "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" "
           "pip install --force-reinstall --no-cache-dir llama-cpp-python")


class ComparisonFailed(RuntimeError):
    """The llama.cpp side could not run; str() is the one line to print."""


def import_llama_cpp():
    """The llama_cpp module, or a ComparisonFailed saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise ComparisonFailed(f"--compare llama-cpp needs llama-cpp-python ({INSTALL_HINT})") from None
    return llama_cpp


def available() -> bool:
    """Whether llama_cpp can be imported, without loading its library (the child does that)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def version() -> str:
    lib = import_llama_cpp()
    return f"llama-cpp-python {getattr(lib, '__version__', '?')}"


def load(model_path: str, n_ctx: int, n_threads: int, n_batch: int = 512):
    """A `llama_cpp.Llama` with llama.cpp's defaults and `n_threads` for decode and batches."""
    lib = import_llama_cpp()
    return lib.Llama(model_path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512), n_threads=n_threads,
                     n_threads_batch=n_threads, logits_all=False, verbose=False)


class LlamaCppEngine:
    """llama-cpp-python behind the two calls bench's timers make (`reset`, `forward` -> the last
    position's logits), so its rows are timed by the same code as metatp's."""

    def __init__(self, model_path: str, n_ctx: int, n_threads: int) -> None:
        self._lib = import_llama_cpp()
        self.llm = load(model_path, n_ctx, n_threads)
        self.n_vocab = self.llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()

    def forward(self, tokens: list[int]) -> np.ndarray:
        self.llm.eval(tokens)
        ptr = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))


class BatchedLlamaCpp:
    """llama-batched-bench's measurement: B sequences with distinct seq_ids in one context
    (`n_seq_max` = B, n_ctx = B*(PP+TG)); the prompts go in position by position, every
    sequence's token at that position side by side, in `llama_decode` calls of at most n_batch
    tokens; then TG steps of one token of each sequence."""

    def __init__(self, model_path: str, n_threads: int, n_batch: int) -> None:
        self._lib = import_llama_cpp()
        self.n_batch = n_batch
        self.llm = load(model_path, 256, n_threads, n_batch)
        self.n_vocab = self.llm.n_vocab()
        self._key: tuple[int, int] | None = None
        self._ctx = None
        self._batch = None
        self._cap = 0
        self._step = n_batch

    def _context(self, b: int, n_ctx: int):
        """A context for b sequences of n_ctx cells in all; kept while (b, n_ctx) stays."""
        lib = self._lib
        if self._key != (b, n_ctx):
            self.close()
            params = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
            params.n_ctx, params.n_seq_max = n_ctx, b
            params.n_batch, params.n_ubatch = self.n_batch, min(self.n_batch, 512)
            self._ctx = lib.llama_init_from_model(self.llm.model, params)
            if not self._ctx:
                raise ComparisonFailed(f"--compare llama-cpp: llama.cpp could not create a context for B={b}, "
                                       f"n_ctx={n_ctx}")
            self._key = (b, n_ctx)
            self._step = lib.llama_n_batch(self._ctx)         # llama.cpp caps n_batch at n_ctx
        if self._batch is None or self._cap < max(b, self.n_batch):
            if self._batch is not None:
                lib.llama_batch_free(self._batch)
            self._cap = max(b, self.n_batch)
            self._batch = lib.llama_batch_init(self._cap, 0, 1)
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
        return self._ctx

    def _decode(self, ctx, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, pos, seq_id, wants logits) entries in calls of at most n_batch tokens."""
        lib, batch = self._lib, self._batch
        for start in range(0, len(entries), self._step):
            chunk = entries[start:start + self._step]
            for i, (tok, pos, seq, out) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, out
            batch.n_tokens = len(chunk)
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                raise ComparisonFailed(f"--compare llama-cpp: llama_decode returned {rc}")
            lib.llama_synchronize(ctx)

    def timed(self, pp: int, tg: int, b: int, seed: int = 0) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of b sequences of pp prompt and tg generated tokens."""
        per_seq = -(-max(pp + tg, 1) // 256) * 256          # llama.cpp pads a sequence's cells to 256
        ctx = self._context(b, b * per_seq)
        rng = np.random.default_rng(seed)
        prompts = rng.integers(1, self.n_vocab, (b, pp))
        entries = [(int(prompts[j, i]), i, j, i == pp - 1) for i in range(pp) for j in range(b)]
        t0 = time.perf_counter()
        if entries:
            self._decode(ctx, entries)
        t1 = time.perf_counter()
        for k in range(tg):
            self._decode(ctx, [(int(1 + (k * 7 + j) % (self.n_vocab - 1)), pp + k, j, True) for j in range(b)])
        return t1 - t0, time.perf_counter() - t1

    def close(self) -> None:
        if self._ctx is not None:
            self._lib.llama_free(self._ctx)
            self._ctx, self._key = None, None


def _child(conn, model_path: str, n_threads: int, n_batch: int) -> None:
    """The child's loop: load, say ready, then answer (pp, tg, b, seed) with ("ok", times)."""
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")      # a GGML_ASSERT prints its line, not a gdb session
    try:
        eng = BatchedLlamaCpp(model_path, n_threads, n_batch)
        conn.send(("ready", version()))
    except Exception as e:                                   # one line back to the parent
        conn.send(("error", str(e) if isinstance(e, ComparisonFailed) else
                   f"--compare llama-cpp: llama.cpp could not load {model_path}: {type(e).__name__}: {e}"))
        return
    while (msg := conn.recv()) is not None:
        try:
            conn.send(("ok", eng.timed(*msg)))
        except Exception as e:
            conn.send(("error", str(e) if isinstance(e, ComparisonFailed) else
                       f"--compare llama-cpp: {type(e).__name__}: {e}"))
    eng.close()


def death_line(exitcode: int | None) -> str:
    """The one line for a child that died (a negative exit code: killed by that signal)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        line = f"--compare llama-cpp: the llama.cpp process died with {name}"
        if name == "SIGILL":
            line += (" (an illegal instruction: ggml's AMX matmul on a CPU that reports AMX tiles the kernel does "
                     f"not enable); rebuild llama-cpp-python without AMX: {AMX_FIX}")
        elif name == "SIGABRT":
            line += " (ggml aborted: its GGML_ASSERT message is above)"
        return line + "; metatp's rows follow without llama.cpp's"
    return f"--compare llama-cpp: the llama.cpp process exited (code {exitcode}); metatp's rows follow without llama.cpp's"


class LlamaCppChild:
    """BatchedLlamaCpp in a child process (spawned: a clean interpreter, no forked threads)."""

    target = staticmethod(_child)      # what the child runs (a test stands in a child that crashes)

    def __init__(self, model_path: str, n_threads: int, n_batch: int) -> None:
        if not available():                     # the child would only say the same, later
            raise ComparisonFailed(f"--compare llama-cpp needs llama-cpp-python ({INSTALL_HINT})")
        mp = multiprocessing.get_context("spawn")
        self._conn, child_conn = mp.Pipe()
        self._proc = mp.Process(target=self.target, args=(child_conn, model_path, n_threads, n_batch), daemon=True)
        self._proc.start()
        child_conn.close()
        self.version = self._answer()

    def _answer(self):
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(10)
            raise ComparisonFailed(death_line(self._proc.exitcode)) from None
        if kind == "error":
            self.close()
            raise ComparisonFailed(value)
        return value

    def timed(self, pp: int, tg: int, b: int, seed: int = 0) -> tuple[float, float]:
        self._conn.send((pp, tg, b, seed))
        return tuple(self._answer())

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

