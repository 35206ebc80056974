"""The fused FP8 quantise kernels (kernels/fp8_cast.py) against their torch references, bitwise:
amaxes, scales and the casts (fp32 and fp16 in, e4m3 and e5m2 out, odd sizes)."""

import pytest
import torch
from megalite.kernels.fp8 import E4M3, E5M2
from megalite.kernels.fp8_cast import (
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
def test_fp8_casts_bitwise_on_gpu():
    x = torch.randn(4096, 4096, device="cuda") * 3
    _agree(quantise_tensorwise(x, E4M3), quantise_tensorwise_ref(x, E4M3))
    _agree(quantise_mx(x, E4M3), quantise_mx_ref(x, E4M3))
