"""The native bf16 GEMV of the CPU decode step against F.linear: fp32 accumulation, so within one bf16
rounding of the fp32 product; F.linear itself wherever the kernel does not take the inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.runtime.models.kernels.cpu_linear import (
    Linear,
    cpu_linear,
    linear,
    native_linear_takes,
)
from freetoken.runtime.moe.kernels.loader import bf16_dot_units, load_library

pytestmark = pytest.mark.skipif(load_library() is None, reason="needs the compiled CPU kernels")


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("shape", [(96, 64), (37, 33), (300, 128)])
def test_native_gemv_is_the_fp32_product_rounded_once(rows: int, shape: tuple[int, int]) -> None:
    n, h = shape
    g = torch.Generator().manual_seed(rows * n + h)
    w = (torch.randn(n, h, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(rows, h, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    assert native_linear_takes(x, w)
    want = F.linear(x.float(), w.float(), bias.float())
    got = cpu_linear(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # one rounding to bf16 (8 bits of mantissa) of a sum whose order differs from torch's
    assert torch.allclose(got.float(), want, rtol=2**-7, atol=1e-3 * want.abs().max().item())
    assert not torch.equal(got, torch.zeros_like(got))


def test_float32_input_rows_come_back_in_float32() -> None:
    w = torch.randn(64, 32).to(torch.bfloat16)
    x = torch.randn(2, 32)
    got = cpu_linear(x, w)
    assert got.dtype == torch.float32
    assert torch.allclose(got, F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


def test_what_the_kernel_does_not_take_is_f_linear() -> None:
    w32 = torch.randn(64, 32)
    x = torch.randn(2, 32)
    assert not native_linear_takes(x, w32)
    assert torch.equal(cpu_linear(x, w32), F.linear(x, w32))
    w = w32.to(torch.bfloat16)
    many = torch.randn(17, 32).to(torch.bfloat16)
    assert not native_linear_takes(many, w)
    assert torch.equal(cpu_linear(many, w), F.linear(many, w))
    assert not native_linear_takes(x.to(torch.bfloat16), w.t().contiguous().t())  # not contiguous


def test_many_rows_are_one_rounding_of_the_product_and_linear_is_an_nn_linear() -> None:
    """More rows than the GEMV takes: torch's bf16 product where the CPU has bf16 units, else the widened
    fp32 product rounded back — exactly one of them, by the CPU's flags."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(48, 40, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(2, 33, 40, generator=g).to(torch.bfloat16)  # 66 rows: more than the GEMV takes
    got = linear(x, w)
    assert got.shape == (2, 33, 48) and got.dtype == torch.bfloat16
    want = F.linear(x, w) if bf16_dot_units() else F.linear(x.float(), w.float()).to(torch.bfloat16)
    assert torch.equal(got, want)
    wide = F.linear(x.float(), w.float())
    assert torch.allclose(got.float(), wide, rtol=2**-7, atol=1e-3 * wide.abs().max().item())
    one = linear(x[:1, :3], w)  # 3 rows: the native GEMV, same shape rules
    assert one.shape == (1, 3, 48)
    layer = Linear(40, 48, bias=False).to(torch.bfloat16)
    assert isinstance(layer, torch.nn.Linear) and list(layer.state_dict()) == ["weight"]
    assert torch.equal(layer(x), linear(x, layer.weight))
