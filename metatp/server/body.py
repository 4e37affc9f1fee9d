"""Request bodies read and parsed within bounds, before any JSON parser sees them.

A body over `MAX_BODY_BYTES` is refused while it streams in (413, never buffered whole); one
nested deeper than `MAX_JSON_DEPTH` is refused before parsing (400), since Python's parser
recurses per level and a hostile body 10^5 deep would end in a RecursionError. Both limits are
far above what an OpenAI request needs (llama-server and vLLM bodies are flat JSON). The depth
check and the parse are `metatp.request_fields.parse_json`, the one parse of client JSON: a
schema sent as a JSON string inside the body goes through it too (naming its field).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from metatp.request_fields import MAX_JSON_DEPTH, FieldError, parse_json, too_deep
from metatp.server.fields import BadRequest

__all__ = ["MAX_BODY_BYTES", "MAX_JSON_DEPTH", "read_body", "too_deep", "parse_object"]

MAX_BODY_BYTES = 16 << 20


async def read_body(chunks: AsyncIterator[bytes], limit: int = MAX_BODY_BYTES) -> bytes:
    """The body from its streamed chunks; a BadRequest (413) as soon as it passes `limit` bytes."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is larger than {limit} bytes", status=413)
        parts.append(chunk)
    return b"".join(parts)


def parse_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """`raw` as a JSON object, or a BadRequest naming what is wrong (not JSON, too deep, not an object)."""
    try:
        body = parse_json(raw, "body", "the request body", max_depth)
    except FieldError as e:
        raise BadRequest(str(e)) from None        # the body itself: no field to name
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body
