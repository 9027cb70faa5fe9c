"""Where scripts/setup.sh installs torch from: prints pip's index arguments, one a line (none: pip's
configured index), and the reason on stderr. Standard library only: it runs before anything is installed.

    ASYNCSERVE_TORCH_INDEX=URL          that index (a mirror, or a CUDA build of your choice)
    a CUDA GPU (nvidia-smi lists one)   pip's configured index: PyPI's Linux torch is the CUDA build
    no GPU, the CPU index reachable     PyTorch's CPU index: the CPU build (~200 MB), not CUDA's (~3 GB)
    no GPU, the CPU index unreachable   pip's configured index (a mirror, or a --find-links folder
                                        holding the CPU wheel), with a warning
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from typing import Callable

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
REACH_TIMEOUT_S = 3.0        # a mirror-only network answers at once (no DNS) or never: do not wait long


def has_cuda_gpu() -> bool:
    """Whether nvidia-smi (found on PATH) works and lists a GPU."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return False
    try:
        listed = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def reachable(index: str, timeout_s: float = REACH_TIMEOUT_S) -> bool:
    """Whether the index answers for torch's page within timeout_s."""
    try:
        request = urllib.request.Request(index.rstrip("/") + "/torch/", method="HEAD")
        with urllib.request.urlopen(request, timeout=timeout_s):
            return True
    except (OSError, ValueError):    # no route, no DNS, a timeout, an HTTP error: all mean not here
        return False


def choose(override: str | None, gpu: Callable[[], bool], cpu_index_reachable: Callable[[], bool]
           ) -> tuple[list[str], str]:
    """pip's index arguments for torch, and why. The probes are called only when needed."""
    if override:
        return ["--index-url", override], f"ASYNCSERVE_TORCH_INDEX: torch from {override}"
    if gpu():
        return [], "a CUDA GPU: the CUDA build of torch from pip's configured index"
    if cpu_index_reachable():
        return ["--index-url", CPU_INDEX], f"no CUDA GPU: the CPU build of torch from {CPU_INDEX}"
    return [], (f"no CUDA GPU, but {CPU_INDEX} cannot be reached: torch from pip's configured index; on a "
                "plain PyPI mirror that is the CUDA build (~3 GB): set ASYNCSERVE_TORCH_INDEX to a CPU index "
                "or point PIP_FIND_LINKS at a folder holding the CPU wheel")


def main() -> None:
    args, reason = choose(os.environ.get("ASYNCSERVE_TORCH_INDEX"), has_cuda_gpu, lambda: reachable(CPU_INDEX))
    print(f"setup: {reason}", file=sys.stderr)
    for arg in args:
        print(arg)


if __name__ == "__main__":
    main()
