"""Adapters from URLs and S3 (asyncserve/pager/remote.py): a local HTTP server and moto's S3 serve the
tiny model's PEFT folders as folders and archives; what lands in the cache must be those files byte for
byte, served as transformers+PEFT runs them, with the limits (size, time, checksum, archive members,
allowed prefixes) refusing each hostile source alone."""
from __future__ import annotations

import hashlib
import http.server
import io
import os
import shutil
import tarfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncserve.config import Config
from asyncserve.pager import remote
from asyncserve.pager.adapters import AdapterError
from asyncserve.llm import LLM
from asyncserve.pager.remote import (ADAPTER_FILES, FetchError, FetchLimits, fetch, parse_source, template_source,
                                     under_prefix)
from asyncserve.sampling_params import SamplingParams
from reference import assert_greedy_matches, peft_references
from safetensors.torch import load_file, save_file
from server_harness import ServerThread

MiB = 2**20


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Static files of the site, counting GETs by path; /drip/... trickles a byte at a time,
    /chunked/... sends its file without a Content-Length and /slow/... after half a second."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.gets[self.path] = self.server.gets.get(self.path, 0) + 1
        self.server.auth.append(self.headers.get("Authorization"))
        if self.path.startswith("/drip/"):
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            for _ in range(1000):
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.05)
            return
        if self.path.startswith("/slow/"):
            time.sleep(0.5)
            self.path = self.path[len("/slow"):]
            return super().do_GET()
        if self.path.startswith("/chunked/"):
            data = (Path(self.directory) / self.path[len("/chunked/"):]).read_bytes()
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(data), 4096):
                piece = data[i:i + 4096]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        super().do_GET()


def _tar(path: Path, members: list[tuple[str, bytes | tarfile.TarInfo]], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as tf:
        for name, data in members:
            if isinstance(data, tarfile.TarInfo):
                tf.addfile(data)
            else:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def _zip(path: Path, members: list[tuple[str, bytes]], symlink: str | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
        if symlink is not None:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = (0o120777 << 16)
            zf.writestr(info, "/etc/passwd")
    return path


def _files(folder: Path) -> list[tuple[str, bytes]]:
    return [(name, (folder / name).read_bytes()) for name in ADAPTER_FILES]


@pytest.fixture(scope="module")
def site(tiny_model, tmp_path_factory):
    """The served files: two adapters as folders, a .tar.gz (in a folder), a .zip and a plain .tar
    (at their tops)."""
    root = tmp_path_factory.mktemp("site")
    for name in ("r2_mlp", "r8_attn_rs"):
        shutil.copytree(tiny_model.adapters[name], root / "adapters" / name)
    a = _files(root / "adapters" / "r2_mlp")
    _tar(root / "adapters" / "r2_mlp.tar.gz", [(f"r2_mlp/{n}", d) for n, d in a])
    _zip(root / "adapters" / "r2_mlp.zip", a)
    _tar(root / "adapters" / "r8_attn_rs.tar", _files(root / "adapters" / "r8_attn_rs"), mode="w")
    nan = root / "adapters" / "nan"           # a tenant's broken adapter
    shutil.copytree(tiny_model.adapters["r1_qv"], nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    next(v for k, v in tensors.items() if "lora_B" in k)[0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    return root


@pytest.fixture(scope="module")
def web(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: _Handler(*a, directory=str(site)))
    server.gets, server.auth = {}, []
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.base = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


def _limits(tmp_path, max_bytes=64 * MiB, timeout_s=30.0) -> FetchLimits:
    return FetchLimits(tmp_path / "cache", max_bytes, timeout_s)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_clean(cache: Path) -> None:
    """Nothing half-fetched is left in the cache."""
    assert not list(cache.glob(".fetching-*"))


# ---- sources and prefixes -----------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "ftp://host/a", "file:///etc/passwd", "https:///no-host/a", "https://user:pw@host/a",
    "https://host/a/../b", "https://host/a/%2e%2e/b", "https://host/a/./b", "https://host/a\\b",
    "https://host/a#md5=abc", "https://host/a#sha256=12", "https://host/a#sha256=" + "g" * 64,
    "https://host/folder?X-Amz-Signature=1", "s3://bucket", "s3://bucket/",
])
def test_malformed_sources_are_refused(text):
    with pytest.raises(FetchError) as e:
        parse_source(text)
    assert e.value.status == 400


def test_a_source_parses_into_its_url_and_pin():
    pin = "ab" * 32
    s = parse_source(f"HTTPS://Models.Example.com/a/b.tar.gz?X-Amz-Signature=1#sha256={pin.upper()}")
    assert (s.url, s.sha256, s.archive) == ("https://models.example.com/a/b.tar.gz?X-Amz-Signature=1", pin, True)
    s = parse_source("s3://bucket/adapters/x/")
    assert (s.sha256, s.archive) == (None, False)
    assert [u for u, _ in s.files()] == [f"s3://bucket/adapters/x/{f}" for f in ADAPTER_FILES]
    assert template_source("s3://b/adapters/{name}", "team a/x") == "s3://b/adapters/team%20a/x"


@pytest.mark.parametrize("url,allowed", [
    ("https://h/adapters/a", True), ("https://h/adapters/a/b.tar.gz", True), ("https://h/adapters/", False),
    ("https://h/adapters", False), ("https://h/adaptersX/a", False), ("https://h.evil/adapters/a", False),
    ("https://h:444/adapters/a", False), ("http://h/adapters/a", False), ("s3://h/adapters/a", False),
    ("https://evil/h/adapters/a", False),
])
def test_only_sources_under_an_allowed_prefix_pass(url, allowed):
    assert under_prefix(parse_source(url), "https://h/adapters") is allowed


# ---- fetching -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["adapters/r2_mlp", "adapters/r2_mlp/", "adapters/r2_mlp.tar.gz",
                                  "adapters/r2_mlp.zip"])
def test_every_form_of_a_source_lands_as_the_same_files(web, site, tmp_path, path):
    folder = Path(fetch(f"{web.base}/{path}", _limits(tmp_path)))
    for name in ADAPTER_FILES:
        assert (folder / name).read_bytes() == (site / "adapters" / "r2_mlp" / name).read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == sorted(ADAPTER_FILES)
    expected = hashlib.sha256("".join(f"{n}:{_sha(site / 'adapters' / 'r2_mlp' / n)}\n"
                                      for n in ADAPTER_FILES).encode()).hexdigest()
    assert folder.name == expected         # named by content: every form of one adapter shares a folder
    _assert_clean(tmp_path / "cache")


def test_a_pinned_source_is_checked_and_then_served_from_the_cache(web, site, tmp_path):
    limits = _limits(tmp_path)
    archive = site / "adapters" / "r2_mlp.tar.gz"
    url = f"{web.base}/adapters/r2_mlp.tar.gz"
    with pytest.raises(FetchError, match="not the pinned"):
        fetch(f"{url}#sha256={'0' * 64}", limits)
    assert not [p for p in limits.cache_dir.iterdir() if p.name != "pins"]
    first = fetch(f"{url}#sha256={_sha(archive)}", limits)
    gets = web.gets.get("/adapters/r2_mlp.tar.gz")
    assert fetch(f"{url}#sha256={_sha(archive)}", limits) == first
    assert web.gets.get("/adapters/r2_mlp.tar.gz") == gets          # no second download
    weights = site / "adapters" / "r2_mlp" / "adapter_model.safetensors"
    assert fetch(f"{web.base}/adapters/r2_mlp#sha256={_sha(weights)}", limits) == first   # a folder pins its weights
    with pytest.raises(FetchError, match="not the pinned"):
        fetch(f"{web.base}/adapters/r8_attn_rs#sha256={_sha(weights)}", limits)
    _assert_clean(limits.cache_dir)


def test_a_changed_source_gets_a_new_folder_and_the_old_one_stays(web, site, tmp_path):
    limits = _limits(tmp_path)
    folder = site / "adapters" / "changing"
    shutil.copytree(site / "adapters" / "r2_mlp", folder)
    try:
        old = Path(fetch(f"{web.base}/adapters/changing", limits))
        shutil.copy(site / "adapters" / "r8_attn_rs" / "adapter_model.safetensors", folder)
        new = Path(fetch(f"{web.base}/adapters/changing", limits))
    finally:
        shutil.rmtree(folder)
    assert new != old
    assert (old / "adapter_model.safetensors").read_bytes() == \
        (site / "adapters" / "r2_mlp" / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize("path", ["adapters/r2_mlp", "chunked/adapters/r2_mlp.zip", "adapters/r2_mlp.tar.gz"])
def test_a_source_over_the_size_limit_is_refused(web, site, tmp_path, path):
    weights = (site / "adapters" / "r2_mlp" / "adapter_model.safetensors").stat().st_size
    with pytest.raises(FetchError, match="larger than the limit") as e:
        fetch(f"{web.base}/{path}", _limits(tmp_path, max_bytes=weights // 2))
    assert e.value.status == 400
    _assert_clean(tmp_path / "cache")


def test_a_dripping_source_runs_out_of_time(web, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(FetchError, match="longer than") as e:
        fetch(f"{web.base}/drip/adapters/x.tar", _limits(tmp_path, timeout_s=1.0))
    assert e.value.status == 504 and time.monotonic() - t0 < 5
    _assert_clean(tmp_path / "cache")


def test_missing_and_unreachable_sources_say_so(web, tmp_path):
    with pytest.raises(FetchError, match="404") as e:
        fetch(f"{web.base}/adapters/nothing-here", _limits(tmp_path))
    assert e.value.status == 404
    closed = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    port = closed.server_address[1]
    closed.server_close()
    with pytest.raises(FetchError) as e:
        fetch(f"http://127.0.0.1:{port}/a.tar", _limits(tmp_path))
    assert e.value.status == 502
    _assert_clean(tmp_path / "cache")


def _hostile_archives(site: Path, out: Path) -> dict[str, tuple[Path, str]]:
    """name -> (archive, what the refusal says)."""
    config, weights = _files(site / "adapters" / "r2_mlp")
    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    hard = tarfile.TarInfo("adapter_model.safetensors")
    hard.type, hard.linkname = tarfile.LNKTYPE, "adapter_config.json"
    bomb = out / "bomb.tar.gz"
    with tarfile.open(bomb, "w:gz") as tf:      # 48 MiB of zeros: a few KiB downloaded
        info = tarfile.TarInfo("padding.bin")
        info.size = 48 * MiB
        tf.addfile(info, io.BytesIO(bytes(info.size)))
        for name, data in (config, weights):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    zip_bomb = out / "bomb.zip"
    with zipfile.ZipFile(zip_bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(*config)
        zf.writestr("adapter_model.safetensors", bytes(48 * MiB))
    return {
        "traversal": (_tar(out / "t1.tar.gz", [("../adapter_config.json", config[1]), weights]), "plain file"),
        "absolute": (_tar(out / "t2.tar.gz", [("/adapter_config.json", config[1]), weights]), "plain file"),
        "deep": (_tar(out / "t3.tar.gz", [("a/b/adapter_config.json", config[1]), ("a/b/" + weights[0], weights[1])]),
                 "plain file"),
        "symlink": (_tar(out / "t4.tar.gz", [config, ("adapter_model.safetensors", link)]), "plain file"),
        "hardlink": (_tar(out / "t5.tar.gz", [config, ("adapter_model.safetensors", hard)]), "plain file"),
        "twice": (_tar(out / "t6.tar.gz", [config, weights, weights]), "twice"),
        "two folders": (_tar(out / "t7.tar.gz", [("a/" + config[0], config[1]), ("b/" + weights[0], weights[1])]),
                        "two folders"),
        "no weights": (_tar(out / "t8.tar.gz", [config]), "has no adapter_model.safetensors"),
        "not an archive": (_write(out / "t9.tar.gz", b"<html>login page</html>"), "cannot be unpacked"),
        "tar bomb": (bomb, "larger than the limit"),
        "zip bomb": (zip_bomb, "larger than the limit"),
        "zip traversal": (_zip(out / "z1.zip", [("../" + config[0], config[1]), weights]), "plain file"),
        "zip symlink": (_zip(out / "z2.zip", [config], symlink="adapter_model.safetensors"), "plain file"),
        "zip truncated": (_write(out / "z3.zip", _zip(out / "z3full.zip", [config, weights]).read_bytes()[:-200]),
                          "cannot be unpacked"),
    }


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_hostile_archives_are_refused_each_alone(web, site, tmp_path):
    hostile = site / "hostile"
    hostile.mkdir(exist_ok=True)
    cases = _hostile_archives(site, hostile)
    limits = _limits(tmp_path, max_bytes=16 * MiB)
    for label, (archive, message) in cases.items():
        t0 = time.monotonic()
        with pytest.raises(FetchError, match=message):
            fetch(f"{web.base}/hostile/{archive.name}", limits)
        assert time.monotonic() - t0 < 5, label       # a bomb stops at its header, not after unpacking
    assert not [p for p in limits.cache_dir.iterdir()]
    assert Path(fetch(f"{web.base}/adapters/r2_mlp.tar.gz", limits)).is_dir()    # and the next one is fine


# ---- serving ----------------------------------------------------------------------------------------

def test_url_adapters_generate_as_transformers_and_peft(web, tiny_model, tmp_path):
    adapters = {"tarred": f"{web.base}/adapters/r2_mlp.tar.gz", "folder": f"{web.base}/adapters/r8_attn_rs/",
                "plain tar": f"{web.base}/adapters/r8_attn_rs.tar"}
    llm = LLM(model=str(tiny_model.root), adapters=adapters, dtype="float32", device="cpu",
              adapter_cache_dir=str(tmp_path / "cache"), speculative_tokens=0)
    llm.load_adapter("later", f"{web.base}/adapters/r2_mlp.zip")
    prompt = tiny_model.tokenizer.encode("serving many adapters")
    names = ["tarred", "folder", "plain tar", "later"]
    outs = llm.generate([prompt] * len(names), SamplingParams(max_tokens=8, temperature=0.0), adapters=names)
    local = {"tarred": "r2_mlp", "folder": "r8_attn_rs", "plain tar": "r8_attn_rs", "later": "r2_mlp"}
    refs = peft_references(tiny_model.base, tiny_model.adapters, [(prompt, local[n]) for n in names], 8)
    for name, out, ref in zip(names, outs, refs):
        assert_greedy_matches(out.token_ids, ref, 1e-3, name)
    with pytest.raises(ValueError, match="404"):
        llm.load_adapter("gone", f"{web.base}/adapters/gone.tar")
    assert "gone" not in llm.engine.adapter_names


def test_config_refuses_bad_sources_and_prefixes(tiny_model):
    for kwargs in ({"adapters": {"x": "https://user:pw@h/a"}}, {"adapters": {"x": "s3://bucket"}},
                   {"adapter_url_prefixes": ["https://h/a?x=1"]}, {"adapter_url_prefixes": ["ftp://h/"]},
                   {"adapter_url_prefixes": ["/local/folder"]}, {"max_adapter_size": 0},
                   {"adapter_fetch_timeout_s": 0}):
        with pytest.raises(ValueError):
            Config(model=str(tiny_model.root), **kwargs).validate()


@pytest.fixture(scope="module")
def srv(tiny_model, web, tmp_path_factory):
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_url_prefixes=[f"{web.base}/adapters/", f"{web.base}/drip/", f"{web.base}/slow/"],
                             adapter_cache_dir=str(tmp_path_factory.mktemp("cache")), adapter_fetch_timeout_s=2,
                             speculative_tokens=0))
    yield st
    st.stop()


def _complete(srv, model, prompt="serving many adapters"):
    status, body, _ = srv.request("POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 6,
                                                             "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_runtime_loads_from_urls_fetch_once_and_serve(srv, web, tiny_model):
    before = dict(web.gets)
    url = f"{web.base}/slow/adapters/r8_attn_rs.tar"
    with ThreadPoolExecutor(3) as pool:      # three names, one source at once: one download
        replies = list(pool.map(lambda n: srv.request("POST", "/v1/load_lora_adapter",
                                                      {"lora_name": n, "lora_path": url}), ["u1", "u2", "u3"]))
    assert [r[0] for r in replies] == [200, 200, 200], replies
    assert web.gets["/slow/adapters/r8_attn_rs.tar"] - before.get("/slow/adapters/r8_attn_rs.tar", 0) == 1
    texts = {_complete(srv, n) for n in ("u1", "u2", "u3")}
    assert len(texts) == 1
    llm = LLM(model=str(tiny_model.root), adapters={"local": str(tiny_model.adapters["r8_attn_rs"])},
              dtype="float32", device="cpu", speculative_tokens=0)
    out = llm.generate(["serving many adapters"], SamplingParams(max_tokens=6, temperature=0.0), adapters=["local"])
    assert texts == {out[0].text}


@pytest.mark.parametrize("path,status", [
    ("{base}/hostile/t1.tar.gz", 403), ("{base}/adaptersX/r2_mlp", 403), ("{base}/adapters", 403),
    ("http://127.0.0.1:1/adapters/r2_mlp", 403), ("http://169.254.169.254/latest/meta-data/", 403),
    ("{base}/adapters/../hostile/t1.tar.gz", 400), ("{base}/adapters/r2_mlp#sha256=1", 400),
    ("s3://bucket/adapters/x", 403), ("{base}/adapters/nothing", 404),
    ("{base}/adapters/r2_mlp.zip#sha256=" + "0" * 64, 400),
])
def test_runtime_loads_refuse_sources_outside_the_prefixes(srv, web, path, status):
    reply = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path.format(base=web.base)})
    assert reply[0] == status, reply
    assert reply[1]["error"]["param"] == "lora_path"
    assert _complete(srv, "tiny")          # the server goes on


def test_a_slow_fetch_never_stalls_the_server(srv, web):
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(srv.request, "POST", "/v1/load_lora_adapter",
                           {"lora_name": "slow", "lora_path": f"{web.base}/drip/x.tar"})
        time.sleep(0.3)
        t0 = time.monotonic()
        assert srv.request("GET", "/health")[0] == 200
        assert _complete(srv, "tiny")
        assert time.monotonic() - t0 < 1.5
        status, body, _ = slow.result(30)
    assert status == 504 and "longer than" in body["error"]["message"]


def test_runtime_url_loads_need_a_prefix(tiny_model, web, tmp_path):
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu",
                             adapter_cache_dir=str(tmp_path / "cache")))
    try:
        for url in (f"{web.base}/adapters/r2_mlp", "s3://bucket/a", "https://example.com/a.tar.gz"):
            status, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": url})
            assert status == 403 and "--adapter-url-prefix" in body["error"]["message"]
        assert not (tmp_path / "cache").exists()
    finally:
        st.stop()


# ---- S3 ---------------------------------------------------------------------------------------------

@pytest.fixture
def s3(monkeypatch, site):
    moto = pytest.importorskip("moto")
    import boto3

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with moto.mock_aws():
        client = boto3.client("s3")
        client.create_bucket(Bucket="models")
        for path in (site / "adapters").rglob("*"):
            if path.is_file():
                client.upload_file(str(path), "models", f"adapters/{path.relative_to(site / 'adapters')}")
        yield client


def test_s3_sources_land_as_the_same_files(s3, site, tmp_path):
    limits = _limits(tmp_path)
    folders = {fetch(url, limits) for url in ("s3://models/adapters/r2_mlp", "s3://models/adapters/r2_mlp.tar.gz",
                                              "s3://models/adapters/r2_mlp.zip")}
    assert len(folders) == 1
    folder = Path(folders.pop())
    for name in ADAPTER_FILES:
        assert (folder / name).read_bytes() == (site / "adapters" / "r2_mlp" / name).read_bytes()
    for url in ("s3://models/adapters/nothing", "s3://no-such-bucket/adapters/r2_mlp.tar"):
        with pytest.raises(FetchError) as e:
            fetch(url, limits)
        assert e.value.status == 404
    with pytest.raises(FetchError, match="larger than the limit"):
        fetch("s3://models/adapters/r2_mlp", _limits(tmp_path, max_bytes=1000))
    _assert_clean(limits.cache_dir)


# ---- the resolver: a request's unknown adapter fetched by name -------------------------------------

@pytest.fixture(scope="module")
def resolving(tiny_model, web, tmp_path_factory):
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_resolver=f"{web.base}/slow/adapters/{{name}}",
                             adapter_cache_dir=str(tmp_path_factory.mktemp("cache")), speculative_tokens=0))
    yield st
    st.stop()


def _local_text(tiny_model, adapter: str) -> str:
    llm = LLM(model=str(tiny_model.root), adapters={"local": str(tiny_model.adapters[adapter])}, dtype="float32",
              device="cpu", speculative_tokens=0)
    return llm.generate(["serving many adapters"], SamplingParams(max_tokens=6, temperature=0.0),
                        adapters=["local"])[0].text


def test_the_resolver_loads_a_requested_adapter_once(resolving, web, tiny_model):
    path = "/slow/adapters/r2_mlp/adapter_model.safetensors"
    before = web.gets.get(path, 0)
    with ThreadPoolExecutor(4) as pool:         # four requests at once for a name not loaded: one fetch
        texts = list(pool.map(lambda _: _complete(resolving, "r2_mlp"), range(4)))
    assert web.gets[path] - before == 1
    assert set(texts) == {_local_text(tiny_model, "r2_mlp")}
    status, body, _ = resolving.request("GET", "/v1/models")
    assert "r2_mlp" in {m["id"] for m in body["data"]}
    status, body, _ = resolving.request("POST", "/v1/chat/completions", {
        "model": "r2_mlp", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert status == 200 and web.gets[path] - before == 1      # loaded now: no second fetch


@pytest.mark.parametrize("name", ["no-such-adapter", "org/no-such-adapter"])
def test_names_the_resolver_cannot_find_get_404_and_are_remembered(resolving, web, name):
    for _ in range(3):
        status, body, _ = resolving.request("POST", "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 2})
        assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert web.gets[f"/slow/adapters/{name}/adapter_config.json"] == 1
    assert _complete(resolving, "tiny")


@pytest.mark.parametrize("name", ["../adapters/r2_mlp", "a/b/c", "x y", ".hidden", "a/../r2_mlp", "%2e%2e", "é",
                                  "x" * 300])
def test_names_no_url_may_carry_are_never_fetched(resolving, web, name):
    before = sum(web.gets.values())
    status, body, _ = resolving.request("POST", "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert sum(web.gets.values()) == before


def test_a_broken_adapter_the_resolver_finds_fails_alone(resolving, web):
    for _ in range(2):
        status, body, _ = resolving.request("POST", "/v1/completions", {"model": "nan", "prompt": "x",
                                                                         "max_tokens": 2})
        assert status == 400 and "NaN or infinite" in body["error"]["message"], body
    assert web.gets["/slow/adapters/nan/adapter_model.safetensors"] == 1     # remembered: not fetched again
    assert "nan" not in {m["id"] for m in resolving.request("GET", "/v1/models")[1]["data"]}
    assert _complete(resolving, "tiny")


def test_past_the_resolves_at_once_requests_get_429(resolving, monkeypatch):
    monkeypatch.setattr("asyncserve.ingress.resolver.MAX_RESOLVING", 1)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_complete, resolving, "r8_attn_rs")        # a fetch of half a second per file
        time.sleep(0.2)
        status, body, headers = resolving.request("POST", "/v1/completions",
                                                  {"model": "another", "prompt": "x", "max_tokens": 2})
        assert status == 429 and headers["Retry-After"] == "1", body
        assert first.result(30)
    status, body, _ = resolving.request("POST", "/v1/completions", {"model": "another", "prompt": "x", "max_tokens": 2})
    assert status == 404


# ---- the cache's bound --------------------------------------------------------------------------------

def _cached(cache: Path, size: int, age_s: float, pinned: bool = False) -> Path:
    """A cache folder of ``size`` bytes last used ``age_s`` ago, with a pin naming it if ``pinned``."""
    folder = cache / hashlib.sha256(f"{size}:{age_s}".encode()).hexdigest()
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(b"x" * (size - 2))
    when = time.time() - age_s
    os.utime(folder, (when, when))
    if pinned:
        (cache / "pins").mkdir(exist_ok=True)
        (cache / "pins" / hashlib.sha256(folder.name.encode()).hexdigest()).write_text(folder.name)
    return folder


@pytest.mark.parametrize("bound, keep, gone", [    # 12 kB in all: d 1, c 2, b 3, a 4 and the recent one 2
    (0, [], []),                               # no bound
    (20_000, [], []),                          # under it
    (9_500, [], ["d", "c"]),                   # least recently used first, until it fits
    (3_000, [], ["d", "c", "b", "a"]),         # never the one just used
    (3_000, ["d"], ["c", "b", "a"]),           # nor a registered adapter's
    (3_000, ["d", "c", "b", "a"], []),         # over the bound with nothing it may remove
    (9_500, ["c"], ["d", "b"]),
])
def test_trimming_removes_the_least_recently_used_folders_but_no_kept_or_recent_one(tmp_path, bound, keep, gone):
    cache = tmp_path / "cache"
    folders = {name: _cached(cache, 1_000 * (i + 1), age_s=3_600 * (4 - i), pinned=True)
               for i, name in enumerate("dcba")}           # d: 1 kB, used 4 h ago ... a: 4 kB, 1 h ago
    recent = _cached(cache, 2_000, age_s=1.0)                # fetched a moment ago: on its way to a load
    (cache / ".fetching-x").mkdir()                          # a fetch under way: not the trim's
    removed = remote.trim_cache(cache, bound, [str(folders[n]) for n in keep])
    assert sorted(removed) == sorted(folders[n] for n in gone)
    assert all(folders[n].is_dir() != (n in gone) for n in folders) and recent.is_dir()
    assert (cache / ".fetching-x").is_dir()
    pins = {p.read_text() for p in (cache / "pins").iterdir()}
    assert pins == {folders[n].name for n in folders if n not in gone}


def test_fetches_keep_the_cache_bounded_but_never_drop_what_is_registered(web, site, tmp_path, monkeypatch):
    """The folder just fetched and the registered adapters' (keep) stay; the least recently used other ones
    go; a pinned source whose folder went is downloaded again."""
    monkeypatch.setattr(remote, "EVICT_GRACE_S", 0.0)
    size = sum((site / "adapters" / "r2_mlp" / name).stat().st_size for name in ADAPTER_FILES)
    limits = FetchLimits(tmp_path / "cache", 64 * MiB, 30.0, cache_bytes=size + 1)
    weights = site / "adapters" / "r2_mlp" / "adapter_model.safetensors"
    pinned = f"{web.base}/adapters/r2_mlp#sha256={_sha(weights)}"
    first = fetch(pinned, limits)
    second = fetch(f"{web.base}/adapters/r8_attn_rs", limits, keep=[first])
    assert Path(first).is_dir() and Path(second).is_dir()          # over the bound: both kept
    third = fetch(f"{web.base}/adapters/nan", limits, keep=[second])
    assert not Path(first).exists() and Path(second).is_dir() and Path(third).is_dir()
    gets = web.gets.get("/adapters/r2_mlp/adapter_model.safetensors", 0)
    assert fetch(pinned, limits) == first and Path(first).is_dir()
    assert web.gets["/adapters/r2_mlp/adapter_model.safetensors"] == gets + 1   # its pin went with it
    assert not Path(second).exists() and not Path(third).exists()


def test_the_server_keeps_its_adapters_folders_and_trims_the_others(tiny_model, web, site, tmp_path, monkeypatch):
    """--adapter-cache-size 1: runtime loads from URLs keep every registered adapter's folder (the disk
    tier reads them again); an unloaded one's folder goes at the next fetch."""
    monkeypatch.setattr(remote, "EVICT_GRACE_S", 0.0)
    st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                             adapter_url_prefixes=[f"{web.base}/adapters/"], adapter_cache_dir=str(tmp_path),
                             adapter_cache_size=1, speculative_tokens=0))
    try:
        for name in ("r2_mlp", "r8_attn_rs"):
            status, body, _ = st.request("POST", "/v1/load_lora_adapter",
                                         {"lora_name": name, "lora_path": f"{web.base}/adapters/{name}"})
            assert status == 200, body
        assert _cached_names(tmp_path, site) == {"r2_mlp", "r8_attn_rs"}      # over the bound: both stay
        assert st.request("POST", "/v1/unload_lora_adapter", {"lora_name": "r2_mlp"})[0] == 200
        status, body, _ = st.request("POST", "/v1/load_lora_adapter",       # fetched, then refused (a NaN)
                                     {"lora_name": "nan", "lora_path": f"{web.base}/adapters/nan"})
        assert status == 400, body
        assert _cached_names(tmp_path, site) == {"r8_attn_rs", "nan"}          # r2_mlp's went
        status, out, _ = st.request("POST", "/v1/completions", {"model": "r8_attn_rs", "prompt": "the fox",
                                                                "max_tokens": 3, "temperature": 0})
        assert status == 200, out
    finally:
        st.stop()


def _cached_names(cache: Path, site: Path) -> set[str]:
    """The site's adapters whose files are in the cache's folders."""
    by_weights = {_sha(f / "adapter_model.safetensors"): f.name for f in (site / "adapters").iterdir() if f.is_dir()}
    return {by_weights[_sha(folder / "adapter_model.safetensors")] for folder in cache.glob("[0-9a-f]" * 64)}


def test_offline_loads_from_urls_keep_the_adapters_already_registered(tiny_model, web, site, tmp_path, monkeypatch):
    """LLM(adapters=URLs) with a one-byte cache: each fetch keeps the folders of the adapters loaded before
    it, so both adapters stay servable from disk (an unload then frees its folder for the next trim)."""
    monkeypatch.setattr(remote, "EVICT_GRACE_S", 0.0)
    llm = LLM(model=str(tiny_model.root), dtype="float32", device="cpu", adapter_cache_dir=str(tmp_path),
              adapter_cache_size=1, adapters={name: f"{web.base}/adapters/{name}" for name in ("r2_mlp", "r8_attn_rs")})
    assert _cached_names(tmp_path, site) == {"r2_mlp", "r8_attn_rs"}
    llm.unload_adapter("r2_mlp")
    with pytest.raises(AdapterError, match="NaN"):
        llm.load_adapter("nan", f"{web.base}/adapters/nan")
    assert _cached_names(tmp_path, site) == {"r8_attn_rs", "nan"}


# ---- private Hub repositories -------------------------------------------------------------------------

class _PrivateHub(http.server.BaseHTTPRequestHandler):
    """A Hub that serves /private/NAME/resolve/main/FILE to the bearer of TOKEN only, redirecting the
    weights to ``cdn`` (another host: the web fixture) as the Hub sends large files to its CDN."""
    token, cdn = "hf_secret", ""

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self.send_response(401)
            self.end_headers()
            return
        name, file = self.path.split("/")[2], self.path.rsplit("/", 1)[1]
        self.send_response(302)
        self.send_header("Location", f"{self.cdn}/adapters/{name}/{file}")
        self.end_headers()


@pytest.fixture
def private_hub(web, monkeypatch, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PrivateHub)
    server.daemon_threads = True
    _PrivateHub.cdn = web.base
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", base)              # a Hub mirror: the one non-Hub host given the token
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))   # no stored token from `hf auth login`
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield base
    server.shutdown()
    server.server_close()


def test_private_hub_repositories_take_the_hf_token_which_no_other_host_sees(private_hub, web, site, tmp_path,
                                                                            monkeypatch):
    url = f"{private_hub}/private/r2_mlp/resolve/main"
    with pytest.raises(FetchError) as refused:               # no token: 401, a missing adapter to the client
        fetch(url, _limits(tmp_path))
    assert refused.value.status == 404
    monkeypatch.setenv("HF_TOKEN", _PrivateHub.token)
    seen = len(web.auth)
    folder = Path(fetch(url, _limits(tmp_path)))
    assert (folder / "adapter_model.safetensors").read_bytes() == \
        (site / "adapters" / "r2_mlp" / "adapter_model.safetensors").read_bytes()
    fetch(f"{web.base}/adapters/r8_attn_rs", _limits(tmp_path))     # another host, asked directly
    assert len(web.auth) - seen == 4 and set(web.auth[seen:]) == {None}   # the CDN's two and the host's two
    _assert_clean(tmp_path / "cache")


@pytest.mark.parametrize("url, sent", [
    ("https://huggingface.co/org/private/resolve/main", True),
    ("https://hf.co/org/private/resolve/main", True),
    ("http://huggingface.co/org/private/resolve/main", False),          # never in clear text
    ("https://huggingface.co.example.com/org/a", False),
    ("https://example.com/huggingface.co/org/a", False),
    ("https://cdn-lfs.huggingface.co/repos/x", False),                   # the CDN: signed URLs, no token
    ("https://models.example.com/adapters/a", False),
])
def test_the_hub_token_goes_to_the_hub_alone(url, sent, monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert remote._hub_token(url) == ("hf_secret" if sent else None)
