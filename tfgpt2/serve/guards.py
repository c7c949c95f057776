"""What stands between a client and a route: the API key (`RequireKey`), a body read up to a
bound and parsed off the event loop (`read_json`), and OpenAI's error object for a route or
method that does not exist (`no_route`)."""
import asyncio
import hashlib
import hmac
import json

from fastapi.responses import JSONResponse

from .protocol import RequestError

MAX_BODY = 4 << 20  # bytes: 272 prompts of 1024 token ids (--max_batch 16 + --max_queue 256) take under 2 MiB


class RequireKey:
    """ASGI middleware: a request without `Authorization: Bearer <key>` gets 401 and OpenAI's
    error object, except on `open_paths`. The keys are compared as SHA-256 digests with
    `hmac.compare_digest`, in a time that depends on neither key."""

    def __init__(self, app, *, key, open_paths):
        self.app, self.digest, self.open_paths = app, _digest(key.encode()), frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._allowed(scope["headers"]):
            return await self.app(scope, receive, send)
        error = RequestError("Incorrect API key provided: send the server's key as Authorization: Bearer <key>",
                             status=401, code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _allowed(self, headers):
        scheme, _, token = dict(headers).get(b"authorization", b"").partition(b" ")
        return hmac.compare_digest(_digest(token.strip()), self.digest) & (scheme.lower() == b"bearer")


def _digest(key):
    return hashlib.sha256(key).digest()


async def read_json(request, limit, parse):
    """`parse(the body's JSON)`, read and parsed in a worker thread, so that a large body never
    holds the event loop. A body over `limit` bytes is refused (413) by its Content-Length or as
    soon as that many bytes are in, never parsed; JSON that is no JSON, or nests deeper than
    Python's parser goes (about 1000 levels), is a 400. Starlette's ClientDisconnect where the
    client leaves first."""
    body = await read_body(request, limit)
    return await asyncio.to_thread(_parse, body, parse)


async def read_body(request, limit):
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size, limit):
    return RequestError(f"the request body has {size} bytes; this server takes at most {limit} (--max_body_bytes)",
                        status=413, code="request_too_large")


def _parse(body, parse):
    try:
        value = json.loads(body)
    except RecursionError:
        raise RequestError("the request body nests JSON arrays or objects too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    return parse(value)


async def no_route(request, error):
    """OpenAI's error object for Starlette's 404 (no such route) and 405 (no such method)."""
    where = f"{request.method} {request.url.path[:80]}"
    message = (f"no route {where}: this server serves /v1/completions, /v1/models, /tokenize, /detokenize, "
               f"/tokenizer_info, /version, /health and /metrics" if error.status_code == 404 else
               f"{where}: method not allowed" if error.status_code == 405 else str(error.detail))
    body = RequestError(message, status=error.status_code, code="not_found" if error.status_code == 404 else None)
    return JSONResponse(body.body(), status_code=error.status_code, headers=error.headers)
