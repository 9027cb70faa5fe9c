"""kernels/cpu without a working compiler: the eager path runs and the log says so once (this runs
everywhere, also where the library cannot be built)."""
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
