"""The chat page (llama-server's web UI, in small): static HTML, CSS and JS from `static/`,
served at `/` and `/chat`. No build step and nothing from outside the machine: the page talks
to this server's /v1/chat/completions only.

The page holds no data, so it is served without an API key; the key is typed into the page
(kept in the browser's localStorage) and sent as a Bearer token with each request, and a
refusal (401) shows in the page as the server's own error message. The Content-Security-Policy
keeps the page to this origin and to its own script file (no inline script, no eval)."""

from __future__ import annotations

from importlib import resources

#: what the page is made of: file name in `static/` -> its media type
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
              "chat.css": "text/css; charset=utf-8"}
PAGE_PATHS = ("/", "/chat")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def page_file(name: str) -> str:
    """One of the page's files, read from the installed package (the wheel ships `static/`)."""
    return resources.files("metatp.server").joinpath("static", name).read_text(encoding="utf-8")


def add_chat_page(app) -> None:
    """Route GET / and /chat to the page and /static/<file> to its script and style sheet.
    The files are read now, once: a missing one fails the server's start, not a visitor."""
    from fastapi.responses import Response

    files = {name: page_file(name) for name in PAGE_FILES}
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

    def serve_file(name: str):
        async def handler() -> Response:
            return Response(files[name], media_type=PAGE_FILES[name], headers=headers)
        handler.__name__ = "chat_page_" + name.replace(".", "_")
        return handler

    for path in PAGE_PATHS:
        app.get(path, include_in_schema=False)(serve_file("index.html"))
    for name in PAGE_FILES:
        if name != "index.html":
            app.get(f"/static/{name}", include_in_schema=False)(serve_file(name))
