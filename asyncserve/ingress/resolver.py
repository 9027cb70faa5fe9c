"""--adapter-resolver: a request naming an adapter that is not loaded fetches it from a URL template
(``s3://bucket/adapters/{name}``, ``https://host/adapters/{name}.tar.gz``), loads it as
/v1/load_lora_adapter would and runs: LoRAX's dynamic adapter loading, vLLM's LoRA resolvers. Peers with
the same template find the same adapters, so a forwarded or migrated request runs wherever it lands.

The fetch runs in the fetcher's threads (pager/remote.py), the load in the pager actor; one resolve per
name at a time, however many requests wait on it. A name the template does not lead to, or leads to an
adapter that cannot be served, is remembered for MISS_TTL_S, so a client repeating it costs no fetch; at most MAX_RESOLVING names are fetched or waited on
at once (429 past that), so a flood of made-up names cannot queue fetches without end.
"""
from __future__ import annotations

import asyncio
import re
import time

from asyncserve.ingress.protocol import ApiError
from asyncserve.messages import LoadAdapter
from asyncserve.pager.adapters import AdapterError
from asyncserve.pager.remote import AdapterFetcher, FetchError, template_source

MISS_TTL_S = 60.0
MAX_MISSES = 4096
MAX_RESOLVING = 64
# a name, or org/name as the Hub spells them: what a URL's path may carry unquoted
_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,127}(/[A-Za-z0-9][\w.-]{0,127})?")


class AdapterResolver:
    def __init__(self, template: str, fetcher: AdapterFetcher):
        self.template = template
        self.fetcher = fetcher
        self._resolving: dict[str, asyncio.Future] = {}
        self._misses: dict[str, tuple[float, ApiError]] = {}   # name -> (when forgotten, its error), oldest first

    def resolvable(self, name: str) -> bool:
        return bool(_NAME.fullmatch(name)) and ".." not in name

    async def resolve(self, server, name: str) -> None:
        """Load adapter ``name`` from the template; ApiError (404 none there, 429, 502/504) if it cannot."""
        forgotten, error = self._misses.get(name, (0.0, None))
        if forgotten > time.monotonic():      # a fresh exception each time: a raised one keeps its traceback
            raise ApiError(error.status, error.message, param=error.param, code=error.code)
        future = self._resolving.get(name)
        if future is None:
            if len(self._resolving) >= MAX_RESOLVING:
                raise ApiError(429, f"{MAX_RESOLVING} adapters are being fetched; try again shortly",
                               param="model", code="overloaded", headers={"Retry-After": "1"})
            future = asyncio.ensure_future(self._load(server, name))
            self._resolving[name] = future
            future.add_done_callback(lambda f: (self._resolving.pop(name, None), f.cancelled() or f.exception()))
        await asyncio.shield(future)

    async def _load(self, server, name: str) -> None:
        source = template_source(self.template, name)
        try:
            folder = await self.fetcher.fetch(source)
        except FetchError as e:
            if e.status == 404:
                raise self._miss(name, _missing(name)) from None
            raise ApiError(e.status, f"adapter {name!r} could not be fetched: {e}", param="model",
                           code="timeout" if e.status == 504 else "adapter_fetch_failed") from None
        if server.engine.has_adapter(name):         # loaded meanwhile (load_lora_adapter)
            return
        reply = asyncio.get_running_loop().create_future()
        server.pager.mailbox.put_nowait(LoadAdapter(name, folder, reply))
        try:
            await reply
        except (AdapterError, ValueError, OSError) as e:
            if not server.engine.has_adapter(name):
                raise self._miss(name, ApiError(400, f"adapter {name!r} from {source} cannot be served: {e}",
                                                param="model", code="invalid_value")) from None

    def _miss(self, name: str, error: ApiError) -> ApiError:
        """Remember a name's lasting failure (not a timeout or an unreachable source); the error."""
        self._misses.pop(name, None)
        self._misses[name] = (time.monotonic() + MISS_TTL_S, error)
        while len(self._misses) > MAX_MISSES:
            del self._misses[next(iter(self._misses))]
        return error


def _missing(name: str) -> ApiError:
    return ApiError(404, f"the model {name!r} does not exist: it is not loaded and the adapter resolver found "
                         "no adapter of that name; see GET /v1/models", param="model", code="model_not_found")
