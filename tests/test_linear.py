"""Base projections: the device's fastest form must compute exactly what F.linear computes."""
import pytest
import torch
import torch.nn.functional as F

from asyncserve.model.linear import Linear, OneDnnLinear, make_linear, onednn_packs


@pytest.mark.skipif(not onednn_packs(torch.device("cpu"), torch.float32), reason="torch built without oneDNN")
def test_cpu_float32_uses_reordered_onednn_weights():
    assert isinstance(make_linear(torch.randn(48, 32)), OneDnnLinear)


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
