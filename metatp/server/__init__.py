"""`metatp serve`: an OpenAI-compatible HTTP server over one LLM (FastAPI + uvicorn + SSE).

Every HTTP request becomes one scheduler request per sample (`n`); a driver thread steps the
continuous batch, and each request's outputs come back to its handler through a callback onto
the event loop. A streaming client that goes away has its requests cancelled, so their KV
cells are freed at the next step. Bad requests get OpenAI-shaped error JSON with status 400
(never a traceback); a full waiting queue answers 503.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics (Prometheus
text), /tokenize and /detokenize (llama-server's shapes).

Under MPI (`mpiexec -n N metatp serve -m MODEL -sm tensor [-ts ...]`, one process per device),
rank 0 alone runs the HTTP server, tokenizes, schedules and samples; its scheduler *leads*
(`Scheduler.lead`): before every step it posts the step's batch -- KV cells taken and freed,
each sequence's tokens and logits mode (`metatp.lockstep.StepBatch`) -- and the other ranks,
which never open a port, run the same forward pass in lock step (`metatp.lockstep.follow`),
sleeping between probes while the server idles. The server stopping (SIGINT/SIGTERM to
mpiexec, which passes them to every rank, or uvicorn exiting) posts STOP and every rank exits
0; a failing step on any rank aborts every rank with the error printed once.

The event loop only routes: what grows with a request's size (parsing the body, SamplingParams
and its constraint, tokenizing, the chat template, submitting, a whole answer) runs on a bounded
pool of threads, and a prompt text too long for a request is refused before it is tokenized.

Modules: `app` (routes), `fields` (request fields checked once), `frontend` (the LLM side of a
request), `offload` (the pool the routes' size-dependent work runs on), `sse` (streams and
collection), `metrics` (Prometheus text), `launch` (`serve`), `ranks` (MPI: what is refused, the
follower ranks), `tenants` (API keys, each a tenant with a prefix-cache namespace of its own),
`chat_page` (the chat page at /, its files in `static/`).
"""

from metatp.server.app import create_app
from metatp.server.fields import BadRequest
from metatp.server.launch import serve
from metatp.server.ranks import follow_steps, refuse_mpi

__all__ = ["create_app", "serve", "follow_steps", "BadRequest", "refuse_mpi"]
