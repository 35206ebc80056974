from functools import partial

import pytest
import torch
import torch.nn.functional as F
from megalite.kernels.activations import gelu, gelu_ref, swiglu, swiglu_ref
from megalite.kernels.rotary import rotary, rotary_ref

from tests.kernels.helpers import check_op, cuda_dtypes, make


def _tables(s, half, device="cpu"):
    ang = torch.arange(s, dtype=torch.float64)[:, None] * 0.3 ** torch.arange(half)
    return ang.cos().float().to(device), ang.sin().float().to(device)  # (s, d/2) fp32


@pytest.mark.parametrize("heads", [1, 5])
def test_rotary(dtype, heads):
    torch.manual_seed(0)
    b, s, d = 3, 13, 34  # d/2 = 17: no power of two anywhere
    # q as a view into a fused qkv projection: (b, s, heads, d) with non-default strides.
    qkv = make((b, s, 3 * heads * d), dtype).view(b, s, 3, heads, d)
    cos, sin = _tables(s, d // 2)
    check_op(rotary, rotary_ref, (qkv[:, :, 0], cos, sin))


@pytest.mark.parametrize("noncontig", [False, True])
def test_swiglu(dtype, noncontig):
    torch.manual_seed(1)
    if noncontig:  # gate and up as the two halves of one fused projection
        both = make((3, 37, 258), dtype, scale=3.0)
        gate, up = both[..., :129], both[..., 129:]
    else:
        gate, up = make((3, 37, 129), dtype, scale=3.0), make((3, 37, 129), dtype)
    check_op(swiglu, swiglu_ref, (gate, up))


@pytest.mark.parametrize("approximate", ["tanh", "none"])  # GPT-2's tanh GELU; the exact one
@pytest.mark.parametrize("noncontig", [False, True])
def test_gelu(dtype, noncontig, approximate):
    torch.manual_seed(2)
    x = make((3, 37, 129), dtype, noncontig=noncontig, scale=3.0)
    check_op(lambda t: gelu(t, approximate), lambda t: gelu_ref(t, approximate), (x,))
    if approximate == "none":  # the reference is torch's own exact GELU
        assert torch.equal(gelu_ref(x, "none"), F.gelu(x))


@pytest.mark.gpu
@cuda_dtypes()
def test_rotary_activations_gpu(dtype):
    torch.manual_seed(3)
    b, s, h, d = 4, 2048, 32, 128
    cos, sin = _tables(s, d // 2, "cuda")
    check_op(rotary, rotary_ref, (make((b, s, h, d), dtype, "cuda"), cos, sin))
    gate, up = make((b, s, 11008), dtype, "cuda", scale=3.0), make((b, s, 11008), dtype, "cuda")
    check_op(swiglu, swiglu_ref, (gate, up))
    for approximate in ("tanh", "none"):
        x = make((b, s, 4 * 3072), dtype, "cuda", scale=3.0)
        check_op(partial(gelu, approximate=approximate), partial(gelu_ref, approximate=approximate),
                 (x,))  # fmt: skip
