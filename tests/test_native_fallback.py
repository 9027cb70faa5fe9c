"""kernels/cpu without a working compiler: the eager path runs and the log says so once (this runs
everywhere, also where the library cannot be built); and the sources compile for CPUs other than
this one."""
import shutil
import subprocess

import pytest
import torch

import kernels.cpu as cpu_kernels
from asyncserve.lora.backend import TorchLoraBackend
from asyncserve.model.config import ModelConfig
from asyncserve.pager.pool import PagedPool


def test_failed_build_falls_back_to_eager_and_logs_once(monkeypatch, caplog):
    """No compiler (the build raises): library() is None, the warning is logged once however often
    the model asks, and the model and the LoRA backend stay on their eager ops."""
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    for name, value in (("_library", None), ("_error", None), ("_tried", False)):
        monkeypatch.setattr(cpu_kernels, name, value)
    monkeypatch.setenv("ASYNCSERVE_NATIVE", "1")
    with caplog.at_level("WARNING", logger="kernels.cpu"):
        assert not any(cpu_kernels.enabled_for(torch.zeros(1)) for _ in range(3))
    assert cpu_kernels.library() is None and "command not found" in cpu_kernels.error()
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "eager" in warnings[0].getMessage()
    pool = PagedPool(4, num_layers=1, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=2, head_dim=16)
    assert not TorchLoraBackend(pool, config).native, "the LoRA backend must stay on its eager plans"
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_kernels.add_rms_norm(torch.zeros(1, 4), None, torch.ones(4), 1e-5)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_library_compiles_for_a_cpu_without_avx512():
    """The build uses -march=native, so this machine's tests cannot see code that only compiles with
    AVX-512 BF16 (a bf16 branch once broke every AVX2-only build, which then fell back to eager ops):
    the sources must also pass the compiler's checks for an AVX2-only CPU (x86-64-v3)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    flags = [f for f in cpu_kernels.CFLAGS if not f.startswith("-march")]
    cmd = ["c++", "-std=c++20", "-fsyntax-only", "-march=x86-64-v3", *flags,
           *(f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]),
           str(cpu_kernels.SOURCE_DIR / cpu_kernels.SOURCES[0])]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0, "\n".join(errors[:10])


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm (binutils)")
def test_library_exports_no_unique_symbols():
    """Two builds loaded in one process (kernel_builds.other_build, bench_quant.py --against) keep their own
    inline variables and statics: gcc makes those unique symbols by default, which the loader merges across
    libraries, so the two builds shared settings and thread-local buffers, and a build whose structs differed
    crashed. -fno-gnu-unique keeps them per library."""
    from reference import require_native_kernels

    require_native_kernels()
    symbols = subprocess.run(["nm", "-D", "--defined-only", cpu_kernels.library().__file__], capture_output=True,
                             text=True, timeout=60, check=True).stdout.splitlines()
    assert any(" T " in line for line in symbols), "nm listed no functions: the check would be empty"
    unique = [line for line in symbols if line.split()[-2:-1] == ["u"]]
    assert not unique, f"{len(unique)} unique symbols, e.g. {unique[:3]}"


def test_a_killed_builds_lock_is_removed_once_stale(tmp_path, monkeypatch, caplog):
    """A build killed mid-way leaves cpp_extension's lock, on which torch waits forever: library() waits
    while a lock is fresh (a live build) and removes one older than STALE_BUILD_LOCK_S, then builds."""
    import os
    import threading
    import time

    from torch.utils import cpp_extension

    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - cpu_kernels.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    seen = []

    def load(**kwargs):
        seen.append(lock.exists())
        raise RuntimeError("stop here")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpu_kernels, "build_dir", lambda: tmp_path)
    for name, value in (("_library", None), ("_error", None), ("_tried", False)):
        monkeypatch.setattr(cpu_kernels, name, value)
    with caplog.at_level("WARNING", logger="kernels.cpu"):
        assert cpu_kernels.library() is None
    assert seen == [False], "the build must start only after the stale lock is gone"
    assert any("did not finish" in r.getMessage() for r in caplog.records)

    # a fresh lock: waited for while its build runs (here: until it is released) ...
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()
    t0 = time.perf_counter()
    cpu_kernels.wait_for_build_lock(tmp_path, poll_s=0.05)
    assert time.perf_counter() - t0 >= 0.25
    # ... and removed once it has grown stale with nobody releasing it
    lock.touch()
    t0 = time.perf_counter()
    cpu_kernels.wait_for_build_lock(tmp_path, stale_s=0.5, poll_s=0.05)
    assert not lock.exists() and 0.45 <= time.perf_counter() - t0 < 5


def test_the_build_runs_the_environments_ninja_whatever_path_finds_first(tmp_path, monkeypatch):
    """A ninja earlier on PATH (a system one, here a fake) is not the one the build runs: two ninja
    versions distrust each other's logs, and a venv activated or not rebuilt the library each time
    (~50 s). The build sees the ninja package's binary first; PATH is restored after, also on errors."""
    import os

    import ninja
    from torch.utils import cpp_extension

    fake = tmp_path / "ninja"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    path = os.environ["PATH"]
    seen = []

    def load(**kwargs):
        seen.append(shutil.which("ninja"))
        raise RuntimeError("stop here")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpu_kernels, "build_dir", lambda: tmp_path / "build")
    for name, value in (("_library", None), ("_error", None), ("_tried", False)):
        monkeypatch.setattr(cpu_kernels, name, value)
    assert shutil.which("ninja") == str(fake)
    assert cpu_kernels.library() is None
    assert seen == [os.path.join(ninja.BIN_DIR, "ninja")]
    assert os.environ["PATH"] == path
