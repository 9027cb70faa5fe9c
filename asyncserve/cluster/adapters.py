"""Adapters between peers, by content: a request never runs on another copy of its adapter.

Every registered adapter has a digest, the sha256 over its files' sha256 (pager/remote.py's
content_key: the name of its folder in the fetch cache too), hashed in a worker thread after it is
registered (AdapterDigests). A forwarded or migrated request carries its origin's digest; the node
it reaches runs it only on an adapter of that digest. A node that lacks the adapter fetches it from
the origin (POST /cluster/adapter, signed as every peer call) into its fetch cache (PeerAdapters):
within --max-adapter-size and --adapter-fetch-timeout, checked against the digest before it lands
(atomic rename; nothing half-written stays), and registered under the same name; one fetch per name
at a time, however many requests wait on it.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Awaitable, Callable, Collection, Hashable, Iterable

import aiohttp
import msgspec

from asyncserve.cluster.messages import AdapterFileRequest
from asyncserve.pager.adapters import printable
from asyncserve.pager.remote import (ADAPTER_FILES, CHUNK_BYTES, FetchError, FetchLimits, content_key,
                                     trim_cache)

log = logging.getLogger("asyncserve.cluster")

ADAPTER_FILE_PATH = "/cluster/adapter"


def adapter_digest(folder: str | Path) -> str:
    """The content digest of the adapter in ``folder``. Blocking: run it in a worker thread."""
    digests = {}
    for name in ADAPTER_FILES:
        sha = hashlib.sha256()
        with open(Path(folder) / name, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                sha.update(chunk)
        digests[name] = sha.hexdigest()
    return content_key(digests)


class AdapterDigests:
    """Each registered adapter's digest, per registration (a name registered anew is hashed anew), on
    the event loop. ``source(name)``: (folder, registration number), None if not registered;
    ``names()``: the registered names; ``version()``: a value that changes whenever they do (refresh
    skips the walk over thousands of names while it does not)."""

    def __init__(self, source: Callable[[str], tuple[str, int] | None], names: Callable[[], Iterable[str]],
                 version: Callable[[], Hashable] | None = None):
        self.source = source
        self.names = names
        self.version = version
        self._seen: Hashable = object()                           # the version refresh last walked
        self._known: dict[str, tuple[int, str | None]] = {}     # None: its files could not be read
        self._hashing: dict[tuple[str, int], asyncio.Future] = {}
        # one thread: hashing a thousand adapters at start-up must not take every core from the steps
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="adapter-digest")

    def known(self, name: str) -> str | None:
        """The digest of ``name`` as registered now, if it has been hashed."""
        source = self.source(name)
        entry = self._known.get(name)
        return entry[1] if source is not None and entry is not None and entry[0] == source[1] else None

    async def of(self, name: str) -> str | None:
        """The digest of ``name`` as registered now, hashed first if need be; None if it is not
        registered or its files cannot be read."""
        source = self.source(name)
        if source is None:
            return None
        folder, number = source
        entry = self._known.get(name)
        if entry is not None and entry[0] == number:
            return entry[1]
        future = self._hashing.get((name, number))
        if future is None:
            future = asyncio.ensure_future(self._hash(name, folder, number))
            self._hashing[(name, number)] = future
            future.add_done_callback(lambda _: self._hashing.pop((name, number), None))
        return await asyncio.shield(future)

    async def _hash(self, name: str, folder: str, number: int) -> str | None:
        try:
            digest = await asyncio.get_running_loop().run_in_executor(self._pool, adapter_digest, folder)
        except OSError as e:         # a vanished or unreadable file: its requests stay on this node
            log.warning("adapter %s: cannot hash %s: %s", printable(name), printable(folder), e)
            digest = None
        self._known[name] = (number, digest)
        return digest

    def refresh(self) -> None:
        """Forget the adapters no longer registered; start hashing the new ones (in the background)."""
        if self.version is not None:
            version = self.version()
            if version == self._seen:
                return
            self._seen = version
        names = set(self.names())
        for name in [n for n in self._known if n not in names]:
            del self._known[name]
        for name in names:
            self.start(name)

    def start(self, name: str) -> None:
        """Hash ``name`` in the background unless it is hashed or being hashed."""
        source = self.source(name)
        entry = self._known.get(name)
        if source is not None and (entry is None or entry[0] != source[1]) and (name, source[1]) not in self._hashing:
            asyncio.ensure_future(self.of(name))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


Post = Callable[[str, str, bytes], Awaitable[aiohttp.ClientResponse]]


class _Download:
    """One file being written and hashed; its methods run in the fetcher's disk thread."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")
        self.sha = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.sha.update(chunk)
        self.file.write(chunk)

    def close(self) -> str:
        self.file.close()
        return self.sha.hexdigest()


class PeerAdapters:
    """Adapters fetched from the peers whose requests need them, and registered here.

    ``post(url, path, body)``: a signed call to a peer; ``load(name, folder)``: register a fetched
    folder; ``in_use()``: the registered adapters' folders (trimming the cache leaves them)."""

    def __init__(self, limits: FetchLimits, post: Post, load: Callable[[str, str], Awaitable[None]],
                 in_use: Callable[[], Collection[str]] = tuple):
        self.limits = limits
        self.post = post
        self.load = load
        self.in_use = in_use
        self._adopting: dict[str, asyncio.Future] = {}
        # one thread for the files: writes, hashing, the rename and clean-up happen in the order asked,
        # so a clean-up after a timeout never races a write still under way
        self._disk = ThreadPoolExecutor(1, thread_name_prefix="peer-adapter-disk")

    async def adopt(self, url: str, name: str, digest: str) -> None:
        """Fetch adapter ``name`` of ``digest`` from the peer at ``url`` and register it; FetchError
        (or the load's AdapterError) if it cannot be. Callers for the same name share one."""
        future = self._adopting.get(name)
        if future is None:
            future = asyncio.ensure_future(self._adopt(url, name, digest))
            self._adopting[name] = future
            future.add_done_callback(lambda f: (self._adopting.pop(name, None), f.cancelled() or f.exception()))
        await asyncio.shield(future)

    async def _adopt(self, url: str, name: str, digest: str) -> None:
        folder = await self.fetch(url, name, digest)
        log.info("adapter %s: fetched from %s into %s", printable(name), url, folder)
        await self.load(name, folder)

    async def fetch(self, url: str, name: str, digest: str) -> str:
        """The adapter's folder in the cache (cache_dir/<digest>), downloaded from the peer unless a
        whole copy is there already."""
        loop = asyncio.get_running_loop()
        cache = self.limits.cache_dir
        folder = cache / digest
        if await loop.run_in_executor(self._disk, _whole, folder):
            return str(folder)
        try:
            work = await loop.run_in_executor(self._disk, _work_folder, cache)
        except OSError as e:
            raise FetchError(f"cannot write the adapter cache {cache}: {e}", status=500) from None
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                got = await self._download_all(url, name, work)
            if got != digest:
                raise FetchError(f"adapter {name!r} from {url} has digest {got}, not {digest} as its request "
                                 "said: refused", status=502)
            keep = {*self.in_use(), str(folder)}       # read here, on the event loop that changes it
            await loop.run_in_executor(self._disk, self._install, work, folder, keep)
        except TimeoutError:
            raise FetchError(f"adapter {name!r} from {url} took longer than {self.limits.timeout_s:g} s "
                             "(--adapter-fetch-timeout)", status=504) from None
        except (aiohttp.ClientError, OSError) as e:
            raise FetchError(f"adapter {name!r} from {url}: {type(e).__name__}: {e}", status=502) from None
        finally:
            await loop.run_in_executor(self._disk, shutil.rmtree, work, True)
        return str(folder)

    async def _download_all(self, url: str, name: str, work: Path) -> str:
        """Both files into ``work``, together within the byte limit; their content digest."""
        digests, left = {}, self.limits.max_bytes
        for file in ADAPTER_FILES:
            digests[file], size = await self._download(url, name, file, work / file, left)
            left -= size
        return content_key(digests)

    async def _download(self, url: str, name: str, file: str, dest: Path, limit: int) -> tuple[str, int]:
        """One file into ``dest``, refused past ``limit`` bytes; (its sha256, its size)."""
        loop = asyncio.get_running_loop()
        body = msgspec.json.encode(AdapterFileRequest(name, file))
        async with await self.post(url, ADAPTER_FILE_PATH, body) as resp:
            if resp.status != 200:
                text = (await resp.content.read(1024)).decode(errors="replace")
                raise FetchError(f"adapter {name!r} from {url}: HTTP {resp.status}: {text}",
                                 status=404 if resp.status == 404 else 502)
            size = resp.content_length or 0          # refused before a byte is read
            self._check_size(size, limit, name, url)
            sink = await loop.run_in_executor(self._disk, _Download, dest)
            try:
                size = 0
                async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
                    size += len(chunk)
                    self._check_size(size, limit, name, url)
                    await loop.run_in_executor(self._disk, sink.write, chunk)
            finally:
                sha = await loop.run_in_executor(self._disk, sink.close)
        return sha, size

    def _check_size(self, size: int, limit: int, name: str, url: str) -> None:
        if size > limit:
            raise FetchError(f"adapter {name!r} from {url} is larger than the limit of {self.limits.max_bytes} "
                             "bytes (--max-adapter-size)")

    def _install(self, work: Path, folder: Path, keep: Collection[str]) -> None:
        """The checked files under their digest's name (atomic; a whole copy there already stays),
        then the cache trimmed to its bound, never removing the folders in ``keep``."""
        try:
            work.rename(folder)
        except OSError:
            if not _whole(folder):
                raise
        os.utime(folder)
        trim_cache(self.limits.cache_dir, self.limits.cache_bytes, keep)

    def close(self) -> None:
        self._disk.shutdown(wait=False, cancel_futures=True)


def _whole(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ADAPTER_FILES)


def _work_folder(cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".fetching-", dir=cache))
