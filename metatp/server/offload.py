"""Work that grows with a request's size, run off the event loop so that the loop only routes.

Parsing a body, rendering a chat template, tokenizing, checking prompt ids, building
SamplingParams (a structured-output constraint's check), submitting (a constraint's guide is
built then) and rendering a large answer run on a bounded pool of threads: /health and small
requests keep answering while one request carries megabytes. A flood of large requests queues
here, not on the loop, and past `max_pending` jobs (running or queued) a request is a 503.

Threads, not processes: the tokenizer (Rust) lets other threads run while it works, and
Python-bound work (a template, a list of ids) gives the loop the GIL every switch interval
(5 ms). One C call that holds the GIL throughout still stalls the loop for its length (json.loads
of a 16 MB body: tens to hundreds of ms), which is why large JSON answers are rendered a slice at
a time (`json_array_in_slices`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import threading
from typing import Any, Callable, Sequence, TypeVar

from metatp.server.fields import BadRequest

__all__ = ["Offload", "json_array_in_slices", "WORKERS", "MAX_PENDING"]

T = TypeVar("T")

WORKERS = 8          # a constraint check may block its thread for its time budget: several run at once
MAX_PENDING = 64     # jobs running or queued; past this the server is busy (503), as a full waiting queue is
SLICE = 16384        # items of a JSON array rendered by one json.dumps call (about 1 ms holding the GIL)


class Offload:
    """A bounded pool of threads for a request's size-dependent work: `await offload(fn, *args)`
    runs `fn(*args)` on it and gives its result (or raises its exception) on the loop."""

    def __init__(self, workers: int = WORKERS, max_pending: int = MAX_PENDING) -> None:
        if workers < 1 or max_pending < workers:
            raise ValueError(f"need workers >= 1 and max_pending >= workers, got {workers}, {max_pending}")
        self.workers, self.max_pending = workers, max_pending
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="metatp-offload")
        self._lock = threading.Lock()
        self._pending = 0

    @property
    def pending(self) -> int:
        """Jobs running or queued now."""
        return self._pending

    def _done(self, _future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1

    async def __call__(self, fn: Callable[..., T], /, *args: Any) -> T:
        """`fn(*args)` on the pool. A job counts until it has run, even if its request goes away
        first (a thread cannot be stopped), so the bound holds for the work really in flight."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise BadRequest(f"the server is busy: {self._pending} requests are being prepared (the limit is "
                                 f"{self.max_pending}); retry later", None, "server_busy", 503, "server_error")
            self._pending += 1
        try:
            # in the caller's context: the request's tenant (a context variable the auth check
            # binds, `metatp.server.tenants`) goes with the job, as asyncio.to_thread does
            future = self._pool.submit(contextvars.copy_context().run, fn, *args)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Stop taking work; jobs not started are dropped, running ones finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def json_array_in_slices(items: Sequence[Any], size: int = SLICE) -> str:
    """The JSON text of `items` (a list), rendered `size` items per json.dumps call: the same text
    as json.dumps(items, separators=(",", ":")), but a thread rendering millions of items lets
    the event loop run between slices instead of holding the GIL for the whole list."""
    parts = [json.dumps(list(items[i:i + size]), separators=(",", ":"))[1:-1] for i in range(0, len(items), size)]
    return "[" + ",".join(parts) + "]"
