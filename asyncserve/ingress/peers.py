"""Routes between peers (cluster mode), under /cluster/: every call must carry a valid HMAC signature
for this node's incarnation (cluster/auth.py) or gets a 401 and changes nothing. The client API key
does not apply here.

    POST /cluster/gossip    a peer's Digest                                  -> 204
    POST /cluster/forward   a ForwardedRequest: run it here                  -> newline-delimited ForwardLines
    GET  /cluster/state     this node's digest and its peer table            -> JSON
"""
from __future__ import annotations

import asyncio
import time

import msgspec
from aiohttp import web

from asyncserve.cluster.auth import AuthError, WrongDestination
from asyncserve.cluster.messages import Digest, ForwardedRequest, ForwardLine, Moved
from asyncserve.engine import RequestError
from asyncserve.ingress.prepare import SERVER_KEY, ready_server, served_adapter
from asyncserve.ingress.protocol import ApiError
from asyncserve.messages import Abort, Submit
from asyncserve.structured import StructuredOutputError

_encoder = msgspec.json.Encoder()


async def signed_body(request: web.Request):
    """(the server, the call's body) once its signature, timestamp and nonce check out."""
    server = request.app[SERVER_KEY]
    body = await request.read()
    try:
        server.cluster.verifier.verify(request.method, request.raw_path, request.headers, body)
    except WrongDestination as e:     # a peer's: it learns this incarnation from the answer and retries
        raise ApiError(401, f"peer call refused: {e}", code="invalid_peer_signature", headers=e.headers) from None
    except AuthError as e:
        raise ApiError(401, f"peer call refused: {e}", code="invalid_peer_signature") from None
    return server, body


def decode(body: bytes, type_):
    try:
        return msgspec.json.decode(body, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed {type_.__name__}: {e}", code="invalid_value") from None
    except RecursionError:
        raise ApiError(400, f"malformed {type_.__name__}: nested too deeply", code="invalid_value") from None


async def gossip(request: web.Request) -> web.Response:
    server, body = await signed_body(request)
    server.cluster.heard(decode(body, Digest))
    return web.Response(status=204)


async def state(request: web.Request) -> web.Response:
    server, _ = await signed_body(request)
    cluster = server.cluster
    now = time.monotonic()
    peers = [{"url": p.url, "node_id": p.digest.node_id if p.digest else None, "state": p.state.value,
              "silent_s": round(now - p.last_heard, 3), "digest": p.digest}
             for p in cluster.membership.peers.values()]
    own = cluster.digest() if server.ready else None
    return web.Response(body=_encoder.encode({"node_id": cluster.node_id, "url": cluster.url, "self": own,
                                              "peers": peers, "forwarding": len(cluster.forwards),
                                              "serving_for_peers": len(cluster.served)}),
                        content_type="application/json")


async def forward(request: web.Request) -> web.StreamResponse:
    """Run a request another node sends (fresh, moved or resubmitted) and stream its TokenEvents back,
    or, if it moves on from here, where it went."""
    server, body = await signed_body(request)
    ready_server(request)
    fwd = decode(body, ForwardedRequest)
    engine = server.engine
    if fwd.model != engine.model_name:
        raise ApiError(409, f"this server serves {engine.model_name!r}, not {fwd.model!r}", param="model",
                       code="model_mismatch")
    rid = fwd.request_id
    if rid in server.cluster.served or rid in server.scheduler.streams:
        raise ApiError(409, f"request {rid} is already running here", code="duplicate_request")
    if not fwd.output_ids:       # a request already under way is always taken: it must finish
        waiting = engine.load_snapshot().waiting + server.scheduler.mailbox.qsize()
        if waiting >= server.config.max_waiting:
            raise ApiError(429, f"the server is overloaded ({waiting} requests waiting)", code="overloaded")
    if fwd.params.structured_outputs is not None:      # built off the event loop, as for a client's request
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.compile_constraint,
                                                             fwd.params.structured_outputs)
        except StructuredOutputError as e:
            raise ApiError(400, str(e), param="structured_outputs", code="invalid_value") from None
    if fwd.adapter is not None:      # with --adapter-resolver, fetched here as for a client's request
        await served_adapter(server, fwd.adapter)
    try:
        seq = engine.adopt(fwd.prompt_ids, fwd.output_ids, fwd.params, fwd.adapter, rid, fwd.seed,
                           arrival=time.monotonic())
    except RequestError as e:
        raise ApiError(e.status, str(e), param=e.param, code="invalid_value") from None
    seq.migrations = fwd.migrations
    stream: asyncio.Queue = asyncio.Queue()
    server.cluster.served.add(rid)
    server.scheduler.mailbox.put_nowait(Submit(seq, stream))
    done = False
    try:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        while not done:
            item = await stream.get()
            if isinstance(item, Moved):
                line, done = ForwardLine(moved=item), True
            else:
                line, done = ForwardLine(event=item), item.finished
            await resp.write(_encoder.encode(line) + b"\n")
        return resp
    finally:
        server.cluster.served.discard(rid)
        if not done:             # the origin went away (or a write failed): nobody reads it now
            server.scheduler.mailbox.put_nowait(Abort(rid))
