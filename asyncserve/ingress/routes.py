"""The HTTP ingress: an aiohttp app speaking OpenAI's API (server-sent events when streaming).

Handlers prepare a request (prepare.py) and relay its sequences' TokenEvents from the scheduler actor
to the client (relay.py); completions.py and chat.py hold what is particular to each endpoint family,
admin.py the small routes. Every error reaches the client in OpenAI's shape.
"""
from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from asyncserve.cluster.adapters import ADAPTER_FILE_PATH
from asyncserve.ingress import admin, peers
from asyncserve.ingress.chat import chat_completions
from asyncserve.ingress.completions import completions
from asyncserve.ingress.prepare import KEY_GIVEN, SERVER_KEY
from asyncserve.ingress.protocol import ApiError
from asyncserve.ingress.responses import responses
from asyncserve.pager.adapters import printable

log = logging.getLogger("asyncserve.ingress")


def error_response(request: web.Request, err: ApiError) -> web.Response:
    """The error in OpenAI's shape; each client error is logged in one line (server errors with their
    traceback where they are caught)."""
    if err.status < 500:        # the path and message may hold a client's text: escaped, one line
        log.info("%s %s -> %d %s: %s", request.method, printable(request.path), err.status, err.code,
                 printable(err.message))
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(request, e)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(request, ApiError(413, f"the request body is too large ({e.text})",
                                                code="payload_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(request, ApiError(e.status, e.reason or "error",
                                                code=e.reason.lower().replace(" ", "_")))
    except asyncio.CancelledError:
        raise
    except ConnectionResetError as e:
        if request.transport is not None and not request.transport.is_closing():
            raise
        # the client went away (mid-stream, or before its body was read): normal, not a server error.
        # Its sequences were aborted on the way out; aiohttp's write of this answer fails quietly.
        log.debug("%s %s: the client closed the connection (%s)", request.method, printable(request.path), e)
        return web.Response(status=499)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(request, ApiError(500, "internal server error", code="internal_error"))


def auth_middleware(config):
    """With an API key set, /v1/* and (unless --tokenize-public) /tokenize and /detokenize need it; every
    request is marked with whether it carried it (/metrics shows per-adapter series only then)."""

    @web.middleware
    async def check(request: web.Request, handler):
        api_key = config.api_key
        if not api_key:
            request[KEY_GIVEN] = True
            return await handler(request)
        given = request.headers.get("Authorization")
        # constant time: how long a wrong key takes must not tell how much of it was right
        request[KEY_GIVEN] = given is not None and hmac.compare_digest(given.encode(errors="surrogateescape"),
                                                                      f"Bearer {api_key}".encode())
        path = request.path
        if not request[KEY_GIVEN] and (path.startswith("/v1/")
                                       or path in ("/tokenize", "/detokenize") and not config.tokenize_public
                                       or path == "/metrics" and given is not None):
            # /metrics: a wrong key is told so, rather than answered as if none had been sent
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
        return await handler(request)
    return check


def build_app(server) -> web.Application:
    app = web.Application(middlewares=[errors_middleware, auth_middleware(server.config)],
                          client_max_size=server.config.max_body_bytes)
    app[SERVER_KEY] = server
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", admin.models)
    app.router.add_post("/v1/load_lora_adapter", admin.load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", admin.unload_lora_adapter)
    app.router.add_post("/tokenize", admin.tokenize)
    app.router.add_post("/detokenize", admin.detokenize)
    app.router.add_get("/version", admin.version)
    app.router.add_get("/health", admin.health)
    app.router.add_get("/metrics", admin.metrics)
    if server.config.peers is not None:
        app.router.add_post("/cluster/gossip", peers.gossip)
        app.router.add_post("/cluster/forward", peers.forward)
        app.router.add_get("/cluster/state", peers.state)
        app.router.add_post(ADAPTER_FILE_PATH, peers.adapter_file)
    return app
