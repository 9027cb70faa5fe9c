"""`pip install .` (not editable) from a clean copy of the repository gives a working server: every
package and data file ships, the entry point runs, and it answers a request as the checkout does.

Slow (a build and a server start, about a minute), run in CI. torch and the other dependencies are
not downloaded again: the fresh venv sees the running environment's site-packages through a .pth
file (which adds the folder, not the .pth files in it, so the checkout's editable install stays out)
and the package is installed with --no-deps --no-build-isolation."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import asyncserve
from asyncserve import LLM, SamplingParams

REPO = Path(asyncserve.__file__).resolve().parents[1]
KERNEL_SOURCES = sorted(p.name for p in (REPO / "kernels/cpu").iterdir() if p.suffix in (".cpp", ".h"))


def _clean_copy(dest: Path) -> Path:
    """The files a clean clone would hold (tracked, or new and not ignored): no .venv, build or caches."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def _fresh_venv(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "running_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def _get(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def test_a_non_editable_install_serves_a_request(tmp_path, tiny_model, monkeypatch):
    python = _fresh_venv(tmp_path / "venv")
    source = _clean_copy(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", str(source)], check=True, timeout=300)
    shutil.rmtree(source)                     # nothing may come from the copy: only the installed files

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    # the installed package: its own files, the kernels' sources beside it, their build in the user's cache
    probe = ("import asyncserve, kernels.cpu as k, json; print(json.dumps([asyncserve.__file__, "
             "asyncserve.__version__, sorted(p.name for p in k.SOURCE_DIR.iterdir() if p.suffix in ('.cpp', '.h')), "
             "str(k.build_dir())]))")
    where, version, sources, build_dir = json.loads(subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, check=True, env=env, cwd=tmp_path).stdout)
    assert Path(where).is_relative_to(tmp_path / "venv") and version == "0.1.0"
    assert sources == KERNEL_SOURCES
    assert Path(build_dir).is_relative_to(tmp_path / "cache" / "asyncserve" / "kernels")

    log = tmp_path / "server.log"
    # ASYNCSERVE_NATIVE=0: building the kernels takes minutes here; what the build needs is checked above
    server = subprocess.Popen([str(tmp_path / "venv/bin/asyncserve"), "serve", "--model", str(tiny_model.root),
                               "--port", "0", "--threads", "1", "--device", "cpu", "--dtype", "float32",
                               "--step-profile", "off", "--cpu-assist", "off"],
                              stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=tmp_path,
                              env={**env, "ASYNCSERVE_NATIVE": "0"})
    try:
        deadline = time.monotonic() + 180
        while "ready: model" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        port = int(log.read_text().split("listening on http://127.0.0.1:")[1].split()[0])
        base = f"http://127.0.0.1:{port}"
        model = _get(f"{base}/v1/models")["data"][0]["id"]
        prompt = "The quick brown fox"
        answer = _get(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert server.returncode == 0, log.read_text()
    monkeypatch.setenv("ASYNCSERVE_NATIVE", "0")      # the same eager ops as the server
    offline = LLM(model=str(tiny_model.root), device="cpu", dtype="float32", pool_mem="64MiB")
    expected = offline.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    assert answer["choices"][0]["text"] == expected.text
    assert answer["usage"]["completion_tokens"] == len(expected.token_ids) > 0
