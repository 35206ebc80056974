"""The fused FP8 quantise kernels (kernels/fp8_cast.py) against their torch references, bitwise:
amaxes, scales and the casts (fp32 and fp16 in, e4m3 and e5m2 out, odd sizes)."""

import pytest
import torch
from megalite.kernels.fp8 import E4M3, E5M2
from megalite.kernels.fp8_cast import (
    TRITON_CASTS,
    quantise_mx,
    quantise_mx_ref,
    quantise_tensorwise,
    quantise_tensorwise_ref,
)


def _agree(a, b):
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
    assert torch.equal(a.scale.float(), b.scale.float())
    assert torch.equal(a.data.float(), b.data.float())


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(37, 129), (3000,)])
def test_tensorwise_cast(fp8, shape, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 7).to(dtype)
    _agree(quantise_tensorwise(x, fp8), quantise_tensorwise_ref(x, fp8))


@pytest.mark.parametrize("k", [96, 100])
def test_mx_block_scales(k, dtype):
    torch.manual_seed(1)
    x = (torch.randn(5, k) * torch.logspace(-3, 3, k)).to(dtype)
    _agree(quantise_mx(x, E4M3), quantise_mx_ref(x, E4M3))


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_casts_bitwise_on_gpu(dt):
    """Compiled, and bf16 inputs (the training dtype, which the interpreter cannot check)."""
    x = (torch.randn(4096, 4096, device="cuda") * 3).to(dt)
    for fp8 in (E4M3, E5M2):
        _agree(quantise_tensorwise(x, fp8), quantise_tensorwise_ref(x, fp8))
    _agree(quantise_mx(x, E4M3), quantise_mx_ref(x, E4M3))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "mxfp8"])
def test_recipes_quantise_through_the_kernels(recipe):
    """An Fp8Linear given TRITON_CASTS (what TRITON_OPS hands the maker) quantises through the
    kernels, not their torch fallback, and computes forward and backward bit for bit what the
    torch steps compute."""
    from megalite.kernels import TORCH_OPS, TRITON_OPS, _triton
    from megalite.kernels.fp8 import TORCH_CASTS, make_recipe
    from megalite.kernels.fp8_linear import Fp8Linear

    assert TRITON_OPS.fp8_casts is TRITON_CASTS and TORCH_OPS.fp8_casts is TORCH_CASTS
    torch.manual_seed(2)
    x0, w0 = torch.randn(4, 16, 64), torch.randn(32, 64) * 0.1
    g = torch.randn(4, 16, 32)
    out = []
    for casts in (TRITON_CASTS, TORCH_CASTS):
        lin = Fp8Linear(make_recipe(recipe), casts=casts)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = lin(x, w)
        y.backward(g)
        out.append((y, x.grad, w.grad))
    assert not _triton._warned  # no fallback: the kernels ran
    for a, b in zip(*out):
        assert torch.equal(a, b)
