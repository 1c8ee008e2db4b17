"""The packed oneDNN CPU product (dspark_core.models.cpu_linear) against F.linear."""

from __future__ import annotations

import gc

import pytest
import torch

from dspark_core.models import cpu_linear
from dspark_core.models.layers import linear

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this torch build has no oneDNN")


@pytest.fixture(autouse=True)
def packed_path_on():
    cpu_linear.set_enabled(True)
    yield
    cpu_linear.set_enabled(None)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 33])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("features", [48, 320])  # 1-3 rows of 320 features are padded to 4
def test_packed_product_matches_f_linear(rows, with_bias, features):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, features, generator=gen), torch.randn(72, features, generator=gen)
    b = torch.randn(72, generator=gen) if with_bias else None
    assert cpu_linear.takes_packed_path(x, w)
    out = linear(x, w, b)
    assert out.shape == (rows, 72)
    # sums of up to 320 products in another order: a few 1e-5 apart
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_packed_product_takes_any_leading_shape_and_bfloat16():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 7, 32, generator=gen), torch.randn(40, 32, generator=gen)
    torch.testing.assert_close(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    # packed only where oneDNN has bfloat16 products (AVX512 or AVX-NE-CONVERT); elsewhere F.linear, same result
    assert cpu_linear.takes_packed_path(xb, wb) == cpu_linear.bfloat16_packed_supported()
    torch.testing.assert_close(linear(xb, wb).float(), (xb.float() @ wb.float().T), rtol=2e-2, atol=5e-2)


def test_bfloat16_without_onednn_support_takes_f_linear(monkeypatch):
    # on a CPU without oneDNN bfloat16 the packed operator raises; the product must not reach it
    monkeypatch.setattr(cpu_linear, "bfloat16_packed_supported", lambda: False)
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 16, generator=gen).bfloat16(), torch.randn(8, 16, generator=gen).bfloat16()
    assert not cpu_linear.takes_packed_path(x, w)
    assert cpu_linear.takes_packed_path(x.float(), w.float())  # float32 keeps the packed path
    torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w))


def test_in_place_update_repacks_the_weight():
    # a stale packed copy after an optimizer step would silently keep the old weights
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 16, generator=gen), torch.randn(24, 16, generator=gen)
    first = linear(x, w)
    with torch.no_grad():
        w.mul_(-2.0)
    torch.testing.assert_close(linear(x, w), -2.0 * first, rtol=1e-5, atol=1e-5)


def test_freed_weight_drops_its_packed_copy():
    w = torch.randn(8, 8)
    linear(torch.randn(1, 8), w)
    key = id(w)
    assert key in cpu_linear._packed
    del w
    gc.collect()
    assert key not in cpu_linear._packed


def test_training_products_stay_on_autograd():
    w = torch.randn(12, 6, requires_grad=True)
    x = torch.randn(4, 6)
    assert not cpu_linear.takes_packed_path(x, w)
    linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(12, 6))
    with torch.no_grad():
        assert cpu_linear.takes_packed_path(x, w)


def test_switch_off_and_unsupported_inputs_fall_back():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    cpu_linear.set_enabled(False)
    assert not cpu_linear.takes_packed_path(x, w)
    cpu_linear.set_enabled(True)
    assert not cpu_linear.takes_packed_path(x.double(), w.double())
    assert not cpu_linear.takes_packed_path(x, w.bfloat16())  # mixed dtypes
    assert not cpu_linear.takes_packed_path(x, w, torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(linear(x.double(), w.double()), x.double() @ w.double().T)


def test_environment_variable_turns_the_path_off(monkeypatch):
    cpu_linear.set_enabled(None)
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    monkeypatch.setenv("DSPARK_CPU_LINEAR", "aten")
    assert not cpu_linear.takes_packed_path(x, w)
    monkeypatch.setenv("DSPARK_CPU_LINEAR", "onednn")
    assert cpu_linear.takes_packed_path(x, w)
