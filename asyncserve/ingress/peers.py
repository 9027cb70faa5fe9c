"""Routes between peers (cluster mode), under /cluster/: every call must carry a valid HMAC signature
for this node's incarnation (cluster/auth.py) or gets a 401 and changes nothing. The client API key
does not apply here.

    POST /cluster/gossip    a peer's Digest                                  -> 204
    POST /cluster/forward   a ForwardedRequest: run it here                  -> newline-delimited ForwardLines
    GET  /cluster/state     this node's digest and its peer table            -> JSON
    POST /cluster/adapter   an AdapterFileRequest: one file of an adapter    -> its bytes
                            registered here (cluster/adapters.py)
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgspec
from aiohttp import web

from asyncserve.cluster.auth import AuthError, WrongDestination
from asyncserve.cluster.messages import AdapterFileRequest, Digest, ForwardedRequest, ForwardLine, Moved
from asyncserve.engine import RequestError
from asyncserve.ingress.prepare import SERVER_KEY, ready_server, served_adapter
from asyncserve.ingress.protocol import ApiError
from asyncserve.messages import Abort, Submit
from asyncserve.pager.remote import CHUNK_BYTES
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
    if fwd.adapter is not None:
        await adapter_as_sent(server, fwd)
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


async def adapter_as_sent(server, fwd: ForwardedRequest) -> None:
    """Return once this node holds the forwarded request's adapter with the content its origin ran it
    with (the envelope's digest): registered here already, found by --adapter-resolver, or fetched
    from the origin. Another content under its name is a 409 (adapter_mismatch), an adapter that
    cannot be had a 503 (adapter_unavailable): either way the origin runs it elsewhere."""
    if fwd.adapter_digest is None:
        raise ApiError(400, "a forwarded request for an adapter must carry its digest", param="adapter_digest",
                       code="invalid_value")
    try:
        await _adapter_with_digest(server, fwd)
    except ApiError as e:
        if e.code in ("adapter_mismatch", "adapter_unavailable"):
            server.metrics.peer_adapters.labels(e.code).inc()
        raise


async def _adapter_with_digest(server, fwd: ForwardedRequest) -> None:
    name, want = fwd.adapter, fwd.adapter_digest
    if not server.engine.has_adapter(name):
        await _fetch_adapter(server, fwd)
    held = await server.cluster.adapter_digests.of(name)
    if held is None:
        raise ApiError(503, f"adapter {name!r} cannot be read here", code="adapter_unavailable")
    if held != want:
        raise ApiError(409, f"adapter {name!r} here has other content than at {fwd.origin} (digest {held[:16]}…, "
                            f"not {want[:16]}…): its tokens would differ", param="model", code="adapter_mismatch")


async def _fetch_adapter(server, fwd: ForwardedRequest) -> None:
    """The adapter from --adapter-resolver if it applies and finds it, else from the origin."""
    try:
        await served_adapter(server, fwd.adapter)
        return
    except ApiError as e:
        if e.status != 404:
            raise
    cluster = server.cluster
    origin = cluster.membership.by_node_id(fwd.origin)
    if origin is None:
        raise ApiError(503, f"adapter {fwd.adapter!r} is not here and its origin {fwd.origin} is not a known peer",
                       code="adapter_unavailable")
    try:
        await cluster.peer_adapters.adopt(origin.url, fwd.adapter, fwd.adapter_digest)
    except (ValueError, OSError) as e:       # FetchError, AdapterError: the fetch or the load failed
        raise ApiError(503, f"adapter {fwd.adapter!r} could not be fetched from {fwd.origin}: {e}",
                       code="adapter_unavailable") from None


async def adapter_file(request: web.Request) -> web.StreamResponse:
    """One file of an adapter registered here, for a peer to run a request of ours: looked up by the
    adapter's registered name (never a path), read in a worker thread as it is sent."""
    server, body = await signed_body(request)
    ready_server(request)
    ask = decode(body, AdapterFileRequest)
    folder = server.engine.adapter_paths().get(ask.name)
    if folder is None:
        raise ApiError(404, f"no adapter {ask.name!r} is registered here", code="model_not_found")
    loop = asyncio.get_running_loop()
    try:
        file, size = await loop.run_in_executor(None, _open_sized, Path(folder) / ask.file)
    except OSError:
        raise ApiError(404, f"adapter {ask.name!r} has no readable {ask.file}", code="not_found") from None
    try:
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = size
        await resp.prepare(request)
        left = size
        while left > 0 and (chunk := await loop.run_in_executor(None, file.read, min(CHUNK_BYTES, left))):
            await resp.write(chunk)
            left -= len(chunk)
        await resp.write_eof()
        return resp
    finally:
        file.close()


def _open_sized(path: Path):
    file = open(path, "rb")
    return file, os.fstat(file.fileno()).st_size
