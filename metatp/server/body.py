"""Request bodies read and parsed within bounds, before any JSON parser sees them.

A body over `MAX_BODY_BYTES` is refused while it streams in (413, never buffered whole); one
nested deeper than `MAX_JSON_DEPTH` is refused before parsing (400), since Python's parser
recurses per level and a hostile body 10^5 deep would end in a RecursionError. Both limits are
far above what an OpenAI request needs (llama-server and vLLM bodies are flat JSON).
"""

from __future__ import annotations

import json
import re
from typing import Any, AsyncIterator

from metatp.server.fields import BadRequest

__all__ = ["MAX_BODY_BYTES", "MAX_JSON_DEPTH", "read_body", "too_deep", "parse_object"]

MAX_BODY_BYTES = 16 << 20
MAX_JSON_DEPTH = 64

# a JSON string (escapes included) or one bracket: strings are skipped so brackets inside them do not count
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)


async def read_body(chunks: AsyncIterator[bytes], limit: int = MAX_BODY_BYTES) -> bytes:
    """The body from its streamed chunks; a BadRequest (413) as soon as it passes `limit` bytes."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is larger than {limit} bytes", status=413)
        parts.append(chunk)
    return b"".join(parts)


def too_deep(raw: bytes, max_depth: int) -> bool:
    """Does `raw` nest arrays and objects deeper than `max_depth`? Linear in the body, and free
    for a body with fewer brackets than that; unbalanced brackets are left for the parser."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    depth = 0
    for m in _TOKENS.finditer(raw):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


def parse_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """`raw` as a JSON object, or a BadRequest naming what is wrong (not JSON, too deep, not an object)."""
    if too_deep(raw, max_depth):
        raise BadRequest(f"the request body is nested deeper than {max_depth} levels")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body
