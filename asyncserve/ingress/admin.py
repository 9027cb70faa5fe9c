"""The small routes: models, runtime adapters, (de)tokenize, version, health, metrics."""
from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from aiohttp import web

from asyncserve import __version__
from asyncserve.ingress.prepare import KEY_GIVEN, SERVER_KEY, adapter_for, ready_server
from asyncserve.ingress.protocol import (ApiError, DetokenizeRequest, LoadLoraRequest, TokenizeRequest,
                                         UnloadLoraRequest, decode_body)
from asyncserve.ingress.tokenizing import chat_prompt, decode, encode
from asyncserve.messages import LoadAdapter, UnloadAdapter
from asyncserve.pager.adapters import AdapterError
from asyncserve.pager.remote import FetchError, is_url, parse_source, under_prefix

MAX_PATH_CHARS = 4096         # PATH_MAX

_json = msgspec.json.Encoder()


async def models(request: web.Request) -> web.Response:
    server = ready_server(request)
    engine = server.engine
    base = engine.model_name
    data = [{"id": base, "object": "model", "created": server.started, "owned_by": "asyncserve", "root": base,
             "parent": None, "max_model_len": engine.max_model_len}]
    tiers = engine.adapter_tiers()
    for name, path in engine.adapter_paths().items():
        tier, pinned = tiers[name]
        data.append({"id": name, "object": "model", "created": server.started, "owned_by": "asyncserve",
                     "root": path, "parent": base, "max_model_len": engine.max_model_len,
                     "tier": tier, "pinned": pinned})
    return web.json_response({"object": "list", "data": data})


def _inside_root(server, path: str) -> str:
    root = server.config.adapter_root
    if root is None:
        raise ApiError(403, "runtime adapter loading is disabled; start the server with --adapter-root DIR",
                       param="lora_path", code="forbidden")
    if not path or len(path) > MAX_PATH_CHARS or not path.isprintable():
        raise ApiError(400, f"lora_path must be a non-empty path of at most {MAX_PATH_CHARS} printable characters",
                       param="lora_path", code="invalid_value")
    root_real = Path(root).resolve()
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root_real / candidate
    try:
        real = candidate.resolve()      # follows symlinks and '..': what would actually be read
        found = real.is_dir() or real.suffix == ".gguf" and real.is_file()     # a llama.cpp adapter file too
    except (OSError, RuntimeError) as e:      # a name too long, a symlink loop
        raise ApiError(400, f"lora_path cannot be resolved: {e.strerror if isinstance(e, OSError) else e}",
                       param="lora_path", code="invalid_value") from None
    if not str(real).isprintable():          # a link to a name that would break the log lines naming it
        raise ApiError(400, "lora_path leads to a folder whose name has non-printable characters",
                       param="lora_path", code="invalid_value")
    if not real.is_relative_to(root_real):
        raise ApiError(400, f"lora_path must be inside the adapter root {root_real}", param="lora_path",
                       code="invalid_value")
    if not found:
        raise ApiError(404, f"no adapter folder or .gguf file at {path!r}", param="lora_path", code="not_found")
    return str(real)


def _allowed_source(server, text: str):
    """A URL lora_path, parsed, if it lies under one of --adapter-url-prefix's prefixes (a tenant must not
    make the server fetch from anywhere: an internal address, a cloud's metadata service)."""
    prefixes = server.config.adapter_url_prefixes
    if not prefixes:
        raise ApiError(403, "runtime adapter loading from URLs is disabled; start the server with "
                            "--adapter-url-prefix URL", param="lora_path", code="forbidden")
    if len(text) > MAX_PATH_CHARS or not text.isprintable():
        raise ApiError(400, f"lora_path must be at most {MAX_PATH_CHARS} printable characters", param="lora_path",
                       code="invalid_value")
    try:
        source = parse_source(text)
    except FetchError as e:
        raise ApiError(400, str(e), param="lora_path", code="invalid_value") from None
    if not any(under_prefix(source, prefix) for prefix in prefixes):
        raise ApiError(403, f"lora_path {source} is not under an allowed adapter URL prefix", param="lora_path",
                       code="forbidden")
    return source


async def _fetched(server, text: str) -> str:
    """The local folder of an allowed URL's adapter, fetched in a worker thread (or found in the cache)."""
    _allowed_source(server, text)
    try:
        return await server.adapter_fetcher.fetch(text)
    except FetchError as e:
        raise ApiError(e.status, str(e), param="lora_path",
                       code={404: "not_found", 504: "timeout"}.get(e.status, "invalid_value")) from None


async def load_lora_adapter(request: web.Request) -> web.Response:
    server = ready_server(request)
    req = decode_body(await request.read(), LoadLoraRequest)
    try:                # before the name is logged anywhere: a newline in it would forge a log line
        server.engine.check_adapter_name(req.lora_name)
    except AdapterError as e:
        raise ApiError(400, str(e), param="lora_name", code="invalid_value") from None
    path = await _fetched(server, req.lora_path) if is_url(req.lora_path) else _inside_root(server, req.lora_path)
    reply = asyncio.get_running_loop().create_future()
    server.pager.mailbox.put_nowait(LoadAdapter(req.lora_name, path, reply, pinned=req.pinned))
    try:
        await reply
    except (ValueError, OSError) as e:      # AdapterError and friends, an unreadable file: this adapter only
        raise ApiError(400, str(e), param="lora_path", code="invalid_value") from None
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    server = ready_server(request)
    req = decode_body(await request.read(), UnloadLoraRequest)
    reply = asyncio.get_running_loop().create_future()
    server.pager.mailbox.put_nowait(UnloadAdapter(req.lora_name, reply))
    try:
        await reply
    except KeyError:
        raise ApiError(404, f"adapter {req.lora_name!r} is not loaded", param="lora_name",
                       code="model_not_found") from None
    server.metrics.retire_adapter(req.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def _tokenizer_request(request: web.Request, kind):
    """A /tokenize or /detokenize body; its optional model must be one that is served."""
    server = ready_server(request)
    req = decode_body(await request.read(), kind)
    if req.model is not None:
        adapter_for(server, req.model)
    return server, req


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens"}."""
    server, req = await _tokenizer_request(request, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "send either prompt or messages", param="prompt", code="invalid_value")
    if req.prompt is not None:
        tokens = await encode(server, req.prompt, req.add_special_tokens is not False)
    else:
        _, tokens = await chat_prompt(server, req, bool(req.add_special_tokens))
    answer = {"count": len(tokens), "max_model_len": server.engine.max_model_len, "tokens": tokens}
    # msgspec: a million ids in milliseconds, where json.dumps held the event loop a few hundred
    return web.Response(body=_json.encode(answer), content_type="application/json")


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {"tokens"} -> {"prompt"}."""
    server, req = await _tokenizer_request(request, DetokenizeRequest)
    vocab = server.engine.vocab_size
    if req.tokens and not (0 <= min(req.tokens) and max(req.tokens) < vocab):       # C loops: a million in ms
        bad = next(t for t in req.tokens if not 0 <= t < vocab)
        raise ApiError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens", code="invalid_value")
    prompt = await decode(server, req.tokens)
    return web.Response(body=_json.encode({"prompt": prompt}), content_type="application/json")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def health(request: web.Request) -> web.Response:
    server = request.app[SERVER_KEY]
    if server.failed:
        return web.json_response({"status": "failed", "error": server.failed}, status=503)
    if not server.ready:
        return web.json_response({"status": "loading"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    server = request.app[SERVER_KEY]
    if server.ready:
        server.metrics.observe_engine(server.engine)
    # per-adapter series name tenants' adapters and their traffic: only for the API key's holders
    per_adapter = request[KEY_GIVEN] or server.config.metrics_public
    return web.Response(body=server.metrics.render(per_adapter), content_type="text/plain", charset="utf-8")
