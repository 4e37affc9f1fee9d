"""`serve()`: uvicorn over the app on rank 0 (or the one process), the followers on the other
ranks, and a clean stop on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Sequence

from metatp.ir.errors import ConfigError
from metatp.server.app import create_app
from metatp.server.ranks import follow_steps, served_world

if TYPE_CHECKING:
    from metatp.api import LLM
    from metatp.server.tenants import Tenants


def serve(llm: "LLM", host: str = "127.0.0.1", port: int = 8080, model_name: str | None = None,
          api_key: "str | Sequence[str] | Tenants | None" = None, log_level: str = "warning",
          max_model_len: int | None = None, allowed_origins: Sequence[str] = (), webui: bool = True,
          tool_call_parser: str | None = None) -> None:
    """Run the server until interrupted. Under MPI every rank calls this: rank 0 serves HTTP and
    leads the steps, the other ranks follow them (`follow_steps`); an interrupt or the server
    exiting ends every rank cleanly (returns normally; SystemExit from uvicorn still propagates).
    `api_key`: one key, several, or `Tenants` (`metatp.server.tenants`: each key a tenant);
    `allowed_origins`: browser origins answered with CORS headers (`create_app`); `webui`: the chat
    page at / (`metatp.server.chat_page`); `tool_call_parser`: the tool-call format, default detected
    from the chat template (`create_app`)."""
    world = served_world(llm)
    if world is not None and not world.is_root:
        follow_steps(llm)
        return
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("metatp serve needs FastAPI and uvicorn: pip install 'metatp[serve]'") from None
    app = create_app(llm, model_name, api_key, max_model_len, allowed_origins, webui, tool_call_parser)
    if world is None:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
        return
    # uvicorn re-raises the SIGINT/SIGTERM it shut down on; as KeyboardInterrupt here, it ends
    # rank 0 as cleanly as the followers (which the launcher gave the same signal)
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    except KeyboardInterrupt:
        pass
    finally:
        srv = app.state.server
        srv.sched.stop()
        srv.sched.stop_leading()            # once: the lifespan may have posted STOP already
        for s, h in previous.items():
            signal.signal(s, h)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
