"""Adapters from URLs and object stores, fetched into the disk tier (LoRAX's S3 source, vLLM's resolvers).

A source is ``https://…``, ``http://…`` or ``s3://bucket/key``, optionally pinned by a ``#sha256=<64 hex>``
fragment (pip's way of pinning a download):
- an archive (``.tar``, ``.tar.gz``, ``.tgz``, ``.zip``) holding adapter_config.json and
  adapter_model.safetensors, at its top or in one folder; the checksum is the archive's;
- anything else names a folder (a folder of an HTTP server, an S3 prefix): ``<url>/adapter_config.json`` and
  ``<url>/adapter_model.safetensors`` are fetched; the checksum is the weights file's.

Every fetch is bounded: at most ``max_bytes`` downloaded and unpacked (an archive's members are counted as
their headers declare them, so a decompression bomb stops before it is unpacked), all within ``timeout_s``.
The files land in ``cache_dir/<sha256 over the adapter files>/``, named by their content: a name reloaded
from a URL whose file changed gets a new folder, and the weights an older adapter reads lazily from its own
folder never change under it. A pinned source fetched before is served from the cache, with no download.

URLs of the Hugging Face Hub (or of the mirror HF_ENDPOINT names) are fetched with the Hub's token, so
private repositories' files load; no other host sees it (``_hub_token``).

The cache is bounded by ``cache_bytes``: after each fetch the folders least recently fetched go until it
fits, except the folders of registered adapters (the disk tier reads their weights from there again) and
those fetched in the last EVICT_GRACE_S (on their way to a load); pins to a removed folder go with it.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Collection, Iterator
from urllib.parse import quote, unquote, urlsplit, urlunsplit

SCHEMES = ("http", "https", "s3")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
CHUNK_BYTES = 1 << 20
MAX_READ_WAIT_S = 30.0        # one socket read waits at most this long (the whole fetch: timeout_s)
EVICT_GRACE_S = 600.0         # a folder fetched this recently is never evicted: a load may be reading it
FETCHERS = 2                  # fetches at once; more wait their turn
_SHA256 = re.compile(r"[0-9a-f]{64}")


class FetchError(ValueError):
    """A source that cannot be fetched. ``status``: the HTTP status that says why to a client (400 a bad
    or refused source, 404 none there, 502 the source failed, 504 out of time)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def is_url(path: str | None) -> bool:
    """Whether ``path`` is meant as a remote source (then it must parse) rather than a folder or Hub id."""
    return path is not None and urlsplit(path).scheme.lower() in SCHEMES and "://" in path


@dataclass(frozen=True)
class Source:
    url: str                  # scheme://host/path[?query], without the fragment
    sha256: str | None        # the pinned digest: the archive's, or the weights file's

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme

    @property
    def archive(self) -> bool:
        return urlsplit(self.url).path.lower().endswith(ARCHIVE_SUFFIXES)

    def files(self) -> list[tuple[str, str]]:
        """(URL, file name) of what a folder source fetches."""
        parts = urlsplit(self.url)
        base = parts.path.rstrip("/")
        return [(urlunsplit(parts._replace(path=f"{base}/{name}")), name) for name in ADAPTER_FILES]

    def __str__(self) -> str:
        return self.url


def parse_source(text: str) -> Source:
    """A source as given (``--adapter NAME=URL``, load_lora_adapter's lora_path); FetchError if malformed."""
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or "://" not in text:
        raise FetchError(f"adapter source {text!r}: the scheme must be one of {', '.join(SCHEMES)}")
    if not parts.hostname:
        raise FetchError(f"adapter source {text!r} names no host (or bucket)")
    if parts.username is not None or parts.password is not None:
        raise FetchError("adapter source: credentials in the URL are refused (they would be logged); "
                         "give an S3 source's in the environment, or a presigned URL")
    path = unquote(parts.path)
    if "\\" in path or any(seg in (".", "..") for seg in path.split("/")):
        raise FetchError(f"adapter source {text!r}: '.' and '..' segments are refused")
    sha256 = None
    if parts.fragment:
        key, _, value = parts.fragment.partition("=")
        if key != "sha256" or not _SHA256.fullmatch(value.lower()):
            raise FetchError(f"adapter source {text!r}: the only fragment taken is #sha256=<64 hex digits>")
        sha256 = value.lower()
    source = Source(urlunsplit((scheme, parts.netloc.lower(), parts.path, parts.query, "")), sha256)
    if not source.archive and parts.query:
        raise FetchError(f"adapter source {text!r}: a folder URL cannot carry a query (a presigned URL names one "
                         f"file: make it an archive, {', '.join(ARCHIVE_SUFFIXES)})")
    if not source.archive and not parts.path.strip("/") and scheme == "s3":
        raise FetchError(f"adapter source {text!r}: name the adapter's prefix inside the bucket")
    return source


def under_prefix(source: Source, prefix: str) -> bool:
    """Whether ``source`` lies under the allowed ``prefix`` (a URL naming a folder): same scheme, host and
    port, and a path below the prefix's path, segment by segment (``https://h/a`` does not allow
    ``https://h/ab`` nor ``https://h.evil/``)."""
    s, p = urlsplit(source.url), urlsplit(prefix)
    if (s.scheme, s.hostname, s.port) != (p.scheme.lower(), (p.hostname or "").lower(), p.port):
        return False
    folder = p.path.rstrip("/") + "/"
    return s.path.startswith(folder) and len(s.path) > len(folder)


def check_prefix(prefix: str) -> None:
    """ValueError unless ``prefix`` is an allowed-sources prefix: a URL of a folder, nothing else."""
    parts = urlsplit(prefix)
    if parts.scheme.lower() not in SCHEMES or not parts.hostname or parts.query or parts.fragment \
            or parts.username is not None:
        raise ValueError(f"adapter URL prefix {prefix!r} must be a plain URL of a folder, e.g. "
                         "https://models.example.com/adapters/ or s3://bucket/adapters/")


@dataclass(frozen=True)
class FetchLimits:
    cache_dir: Path
    max_bytes: int
    timeout_s: float
    cache_bytes: int = 0          # the cache's bound (trim_cache); 0: none


class _Budget:
    """What is left of a fetch's bytes and time."""

    def __init__(self, limits: FetchLimits, source: Source):
        self.bytes_left, self.deadline, self.source = limits.max_bytes, time.monotonic() + limits.timeout_s, source
        self.limits = limits

    def take(self, n: int) -> None:
        self.bytes_left -= n
        if self.bytes_left < 0:
            raise FetchError(f"adapter source {self.source} is larger than the limit of {self.limits.max_bytes} "
                             "bytes (--max-adapter-size)")
        self.tick()

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise FetchError(f"adapter source {self.source} took longer than {self.limits.timeout_s:g} s "
                             "(--adapter-fetch-timeout)", status=504)

    def read_wait_s(self) -> float:
        return max(0.1, min(MAX_READ_WAIT_S, self.deadline - time.monotonic()))


HF_HOSTS = ("huggingface.co", "hf.co")


def _hub_token(url: str) -> str | None:
    """The Hugging Face token (HF_TOKEN, or `hf auth login`'s) for a URL of the Hub over https, or of the
    Hub mirror HF_ENDPOINT names: a private repository's files, `https://huggingface.co/ORG/NAME/resolve/main`.
    No other host is ever sent it."""
    parts = urlsplit(url)
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", ""))
    hub = parts.scheme == "https" and parts.hostname in HF_HOSTS
    mirror = bool(endpoint.hostname) and (parts.scheme, parts.netloc) == (endpoint.scheme, endpoint.netloc)
    if not (hub or mirror):
        return None
    from huggingface_hub import get_token

    return get_token()


def _http_chunks(url: str, budget: _Budget) -> Iterator[bytes]:
    request = urllib.request.Request(url, headers={"User-Agent": "asyncserve"})
    if token := _hub_token(url):
        # unredirected: the Hub redirects large files to a CDN with signed URLs, which must not see it
        request.add_unredirected_header("Authorization", f"Bearer {token}")
    try:
        response = urllib.request.urlopen(request, timeout=budget.read_wait_s())
    except urllib.error.HTTPError as e:
        e.close()
        raise FetchError(f"{url}: {e.code} {e.reason}", status=404 if e.code in (401, 403, 404, 410) else 502) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        status = 504 if isinstance(reason, TimeoutError) else 502
        raise FetchError(f"{url}: {reason}", status=status) from None
    with response:
        size = response.headers.get("Content-Length")
        if size is not None and size.isdigit() and int(size) > budget.bytes_left:
            budget.take(int(size))          # refused before a byte of it is read
        while True:
            try:
                # read1: at most one socket read, so a server dripping bytes cannot outlast the deadline
                chunk = response.read1(CHUNK_BYTES)
            except (OSError, ValueError) as e:
                raise FetchError(f"{url}: {e}", status=504 if isinstance(e, TimeoutError) else 502) from None
            if not chunk:
                return
            yield chunk


def _s3_chunks(url: str, budget: _Budget) -> Iterator[bytes]:
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError:
        raise FetchError("s3:// adapter sources need boto3: pip install 'asyncserve[s3]'") from None
    parts = urlsplit(url)
    wait = budget.read_wait_s()
    # credentials, region and endpoint (AWS_ENDPOINT_URL for MinIO and the like) come as boto3 finds them
    client = boto3.client("s3", config=botocore.config.Config(connect_timeout=wait, read_timeout=wait,
                                                              retries={"max_attempts": 2}))
    try:
        reply = client.get_object(Bucket=parts.hostname, Key=unquote(parts.path.lstrip("/")))
    except botocore.exceptions.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        raise FetchError(f"{url}: {code or e}", status=404 if code in ("NoSuchKey", "NoSuchBucket", "404",
                                                                      "AccessDenied", "403") else 502) from None
    except botocore.exceptions.BotoCoreError as e:
        raise FetchError(f"{url}: {e}", status=502) from None
    body = reply["Body"]
    try:
        if reply.get("ContentLength", 0) > budget.bytes_left:
            budget.take(reply["ContentLength"])
        while chunk := body.read(CHUNK_BYTES):
            yield chunk
    except botocore.exceptions.BotoCoreError as e:
        raise FetchError(f"{url}: {e}", status=502) from None
    finally:
        body.close()


def _download(url: str, scheme: str, dest: Path, budget: _Budget) -> str:
    """``url`` into ``dest`` within the budget; its sha256."""
    digest = hashlib.sha256()
    chunks = _s3_chunks(url, budget) if scheme == "s3" else _http_chunks(url, budget)
    with open(dest, "wb") as out:
        for chunk in chunks:
            budget.take(len(chunk))
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _wanted(name: str, kind_ok: bool, found: dict[str, str], source: Source) -> str | None:
    """The adapter file an archive member is (None: not one), refusing odd ones: a link or device of
    that name, one deeper than one folder, a second copy, a second folder."""
    parts = PurePosixPath(name).parts
    if not parts or parts[-1] not in ADAPTER_FILES:
        return None
    if not kind_ok or len(parts) > 2 or parts[0] in ("/", "..", ".") or ".." in parts:
        raise FetchError(f"adapter archive {source}: member {name!r} must be a plain file at its top or in "
                         "one folder")
    if parts[-1] in found:
        raise FetchError(f"adapter archive {source} holds {parts[-1]} twice")
    folder = "/".join(parts[:-1])
    if any(f != folder for f in found.values()):
        raise FetchError(f"adapter archive {source} holds adapter files in two folders")
    found[parts[-1]] = folder
    return parts[-1]


def _copy(reader, dest: Path, budget: _Budget) -> str:
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        while chunk := reader.read(CHUNK_BYTES):
            budget.tick()
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _unpack(archive: Path, work: Path, source: Source, budget: _Budget) -> dict[str, str]:
    """The adapter files of ``archive`` into ``work`` by their bare names (member paths never become
    paths here); {file name: sha256}. Every member's declared size counts against the byte budget
    before it is read or skipped."""
    found: dict[str, str] = {}
    digests: dict[str, str] = {}
    try:
        if urlsplit(source.url).path.lower().endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    budget.take(info.file_size)
                for info in zf.infolist():
                    regular = not info.is_dir() and (info.external_attr >> 16) & 0o170000 in (0, 0o100000)
                    name = _wanted(info.filename, regular, found, source)
                    if name is None:
                        continue
                    if info.flag_bits & 0x1:
                        raise FetchError(f"adapter archive {source}: {info.filename} is encrypted")
                    with zf.open(info) as reader:
                        digests[name] = _copy(reader, work / name, budget)
        else:
            with tarfile.open(archive, mode="r|*") as tf:      # a stream: members in order, none read twice
                for member in tf:
                    budget.take(member.size)
                    name = _wanted(member.name, member.isreg(), found, source)
                    if name is not None:
                        digests[name] = _copy(tf.extractfile(member), work / name, budget)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, RuntimeError) as e:
        raise FetchError(f"adapter archive {source} cannot be unpacked: {e}") from None
    missing = [name for name in ADAPTER_FILES if name not in digests]
    if missing:
        raise FetchError(f"adapter archive {source} has no {' or '.join(missing)}")
    return digests


def _pin_path(cache_dir: Path, source: Source) -> Path:
    # by URL and pin: a folder's pin covers its weights, not the config beside them
    return cache_dir / "pins" / hashlib.sha256(f"{source.url}#{source.sha256}".encode()).hexdigest()


def _pinned(cache_dir: Path, source: Source) -> str | None:
    """The folder this pinned source was fetched into before, if it is still whole."""
    try:
        key = _pin_path(cache_dir, source).read_text().strip()
    except OSError:
        return None
    folder = cache_dir / key
    return str(folder) if _SHA256.fullmatch(key) and all((folder / f).is_file() for f in ADAPTER_FILES) else None


def fetch(text: str, limits: FetchLimits, keep: Collection[str] = ()) -> str:
    """The adapter ``text`` names, fetched and checked into the cache; its folder there. Blocking: run it
    in a worker thread. FetchError says what went wrong; nothing partial is left behind. Then the cache
    is trimmed to ``limits.cache_bytes``, never removing the folders in ``keep`` (registered adapters')."""
    source = parse_source(text)
    cache = limits.cache_dir
    if source.sha256 and (hit := _pinned(cache, source)):
        _touch(Path(hit))
        trim_cache(cache, limits.cache_bytes, {*keep, hit})
        return hit
    budget = _Budget(limits, source)
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetching-", dir=cache))
    try:
        if source.archive:
            archive = work / ".archive"
            pinned = _download(source.url, source.scheme, archive, budget)
            _check_pin(source, pinned, "archive")
            budget.bytes_left = limits.max_bytes       # as much again unpacked
            digests = _unpack(archive, work, source, budget)
            archive.unlink()
        else:
            digests = {name: _download(url, source.scheme, work / name, budget) for url, name in source.files()}
            _check_pin(source, digests[WEIGHTS_FILE], WEIGHTS_FILE)
        key = content_key(digests)
        folder = cache / key
        try:
            work.rename(folder)           # atomic; a folder of the same content already there stays
        except OSError:
            _touch(folder)
            if not all((folder / f).is_file() for f in ADAPTER_FILES):
                raise
        _touch(folder)
        if source.sha256:
            pin = _pin_path(cache, source)
            pin.parent.mkdir(exist_ok=True)
            tmp = pin.with_name(f".{pin.name}.{os.getpid()}")
            tmp.write_text(key)
            tmp.replace(pin)
        trim_cache(cache, limits.cache_bytes, {*keep, str(folder)})
        return str(folder)
    except OSError as e:
        raise FetchError(f"adapter source {source}: cannot write the cache {cache}: {e}", status=500) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def content_key(digests: dict[str, str]) -> str:
    """An adapter's identity by content, from its files' sha256 ({file name: hex}): its cache folder's
    name, and what peers compare before running each other's requests (cluster/adapters.py)."""
    return hashlib.sha256("".join(f"{n}:{digests[n]}\n" for n in ADAPTER_FILES).encode()).hexdigest()


def _touch(folder: Path) -> None:
    """Mark a cache folder used now: the cache keeps the most recently used (trim_cache)."""
    try:
        os.utime(folder)
    except OSError:
        pass


def trim_cache(cache_dir: Path, max_bytes: int, keep: Collection[str] = ()) -> list[Path]:
    """Remove the least recently used adapter folders until the cache holds at most ``max_bytes`` (0: no
    bound), never one in ``keep`` nor one used in the last EVICT_GRACE_S; pins to removed folders go too.
    Returns the folders removed. (If what must stay is larger, the cache stays over its bound.)"""
    if max_bytes <= 0:
        return []
    folders, total = [], 0
    try:
        for entry in cache_dir.iterdir():
            if _SHA256.fullmatch(entry.name) and entry.is_dir():
                size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
                folders.append((entry.stat().st_mtime, size, entry))
                total += size
    except OSError:               # another fetch removed one meanwhile: trim next time
        return []
    kept = {os.path.realpath(p) for p in keep}
    now, removed = time.time(), []
    for mtime, size, folder in sorted(folders):
        if total <= max_bytes:
            break
        if os.path.realpath(folder) in kept or now - mtime < EVICT_GRACE_S:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        total -= size
        removed.append(folder)
    if removed:
        gone = {folder.name for folder in removed}
        for pin in (cache_dir / "pins").glob("*"):
            try:
                if pin.read_text().strip() in gone:
                    pin.unlink()
            except OSError:
                pass
    return removed


def _check_pin(source: Source, digest: str, what: str) -> None:
    if source.sha256 and digest != source.sha256:
        raise FetchError(f"adapter source {source}: the {what}'s sha256 is {digest}, not the pinned {source.sha256}")


def template_source(template: str, name: str) -> str:
    """A resolver template with ``{name}`` filled in, quoted as one path of URL segments."""
    return template.replace("{name}", quote(name, safe="/"))


class AdapterFetcher:
    """Fetches on the event loop's behalf: each in one of FETCHERS worker threads, one fetch per source
    at a time however many ask for it (they all get its result). ``in_use()`` (on the event loop): the
    folders of registered adapters, which trimming the cache leaves."""

    def __init__(self, limits: FetchLimits, in_use: Callable[[], Collection[str]] = tuple):
        self.limits = limits
        self.in_use = in_use
        self._pool = ThreadPoolExecutor(FETCHERS, thread_name_prefix="adapter-fetch")
        self._running: dict[str, asyncio.Future] = {}

    async def fetch(self, text: str) -> str:
        future = self._running.get(text)
        if future is None:
            future = asyncio.get_running_loop().run_in_executor(self._pool, fetch, text, self.limits,
                                                                frozenset(self.in_use()))
            self._running[text] = future
            future.add_done_callback(lambda _: self._running.pop(text, None))
        return await asyncio.shield(future)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
