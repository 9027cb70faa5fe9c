"""Base projections: the device's fastest form must compute exactly what F.linear computes."""
import pytest
import torch
import torch.nn.functional as F

from asyncserve.model.linear import Linear, OneDnnLinear, make_linear, onednn_packs


@pytest.mark.skipif(not onednn_packs(torch.device("cpu"), torch.float32), reason="torch built without oneDNN")
def test_cpu_float32_linear_choice_and_exact_weights(monkeypatch):
    """float32 on CPU: the native packed GEMM on AVX2 CPUs without AVX-512, else oneDNN's reorder;
    both give W back bit for bit (merged mode needs it), and an odd in_features packs too."""
    import kernels.cpu as cpu_kernels
    from asyncserve.model.linear import NativeLinear, native_packs

    g = torch.Generator().manual_seed(4)
    for out_features, in_features in [(48, 32), (50, 63)]:
        w = torch.randn(out_features, in_features, generator=g)
        x = torch.randn(16, in_features, generator=g)
        lin = make_linear(w)
        assert type(lin) is (NativeLinear if cpu_kernels.fp32_gemm_available() else OneDnnLinear)
        assert native_packs(w) == cpu_kernels.fp32_gemm_available()
        torch.testing.assert_close(lin(x).double(), F.linear(x.double(), w.double()), rtol=1e-5, atol=1e-5)
        assert torch.equal(lin.dense_weight(), w) and lin.shape == (out_features, in_features)
    monkeypatch.setattr(cpu_kernels, "fp32_gemm_available", lambda: False)    # an AVX-512 CPU
    assert isinstance(make_linear(w), OneDnnLinear)


@pytest.mark.parametrize("rows", [0, 1, 16, 77])
def test_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    x = torch.randn(rows, 80, generator=g)[:, ::2]              # strided input, as slices of a step are
    ref = F.linear(x.double(), w.double())
    for lin in (make_linear(w), Linear(w)):
        y = lin(x)
        assert y.shape == (rows, 96) and lin.shape == (96, 40)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_cpu_bfloat16_linear_choice_and_exact_weights(monkeypatch):
    """bf16 on CPU: the native packed GEMM where this CPU has it (else oneDNN's reorder), both
    F.linear's function to bf16 rounding, both giving W back bit for bit (merged mode needs it);
    an odd in_features, which the kernel's pairs cannot hold, stays on oneDNN."""
    import kernels.cpu as cpu_kernels
    from asyncserve.model.linear import NativeLinear, native_packs

    g = torch.Generator().manual_seed(3)
    w = torch.randn(50, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    ref = F.linear(x.double(), w.double())
    lin = make_linear(w)
    assert isinstance(lin, NativeLinear) == native_packs(w) == cpu_kernels.bf16_gemm_available()
    torch.testing.assert_close(lin(x).double(), ref, rtol=2 ** -7, atol=1e-3)
    assert torch.equal(lin.dense_weight(), w) and lin.shape == (50, 64)
    assert not isinstance(make_linear(torch.randn(50, 63).to(torch.bfloat16)), NativeLinear)
    monkeypatch.setattr(cpu_kernels, "bf16_gemm_available", lambda: False)    # an AVX2-only CPU
    fallback = make_linear(w)
    assert type(fallback) is (OneDnnLinear if onednn_packs(w.device, w.dtype) else Linear)
    torch.testing.assert_close(fallback(x).double(), ref, rtol=2 ** -7, atol=1e-3)
