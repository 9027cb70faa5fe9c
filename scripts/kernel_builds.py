"""Another checkout's native kernels loaded beside this process's own, for benchmarks that compare two
versions of kernels/cpu in one process (bench_quant.py --against, bench_offline.py --build-steps): on a
box whose speed drifts between processes by more than a kernel change gains, only runs interleaved in one
process compare."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import kernels.cpu as cpu_kernels


def other_build(checkout: Path) -> ModuleType:
    """CHECKOUT's kernels (its kernels/cpu/ops.cpp with its own CFLAGS), built under another extension name
    into their own folder, once per checkout (~1.5 min): a second library of the same name would not load
    beside this one (Python hands back the module it already has)."""
    child = subprocess.run([sys.executable, "-c", "import json, kernels.cpu as k; print(json.dumps([k.CFLAGS, k.LDFLAGS]))"],
                           env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True, text=True)
    if child.returncode:
        raise SystemExit(f"{checkout}: kernels.cpu does not import there:\n{child.stderr}")
    cflags, ldflags = json.loads(child.stdout.splitlines()[-1])
    source = (checkout / "kernels" / "cpu" / "ops.cpp").resolve()
    folder = cpu_kernels.build_dir().parent / "against" / hashlib.sha256(str(source).encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension
    with cpu_kernels.environment_ninja():
        other = cpp_extension.load(name="asyncserve_cpu_kernels_against", sources=[str(source)], extra_cflags=cflags,
                                   extra_ldflags=ldflags, build_directory=str(folder), verbose=False)
    own = cpu_kernels.library()
    assert own is not None and other is not own and other.__file__ != own.__file__
    return other
