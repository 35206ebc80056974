import pytest
import torch
from megalite.kernels.attention import attention, attention_ref

from tests.kernels.helpers import check_op, cuda_dtypes, make


def _qkv(b, hq, hkv, s, d, dtype, device="cpu"):
    # q laid out as the model makes it: (b, s, hq, d) viewed as (b, hq, s, d).
    q = make((b, s, hq * d), dtype, device).view(b, s, hq, d).transpose(1, 2)
    k = make((b, hkv, s, d), dtype, device)
    # v as a strided slice (rows of 2d elements): non-contiguous in a second way.
    v = make((b, hkv, s, d), dtype, device, noncontig=True)
    return q, k, v


@pytest.mark.parametrize(
    "b,hq,hkv,s,d",
    [
        (2, 4, 2, 37, 32),  # GQA, seq not a multiple of any block
        (1, 3, 3, 50, 16),  # MHA, several diagonal and off-diagonal blocks
        (2, 2, 1, 16, 16),  # MQA, exactly one block
        (1, 2, 1, 19, 64),
        (1, 2, 1, 150, 16),  # past 64: several tiles under the interpreter too (its are 64)
    ],
)
def test_attention(dtype, b, hq, hkv, s, d):
    torch.manual_seed(0)
    check_op(attention, attention_ref, _qkv(b, hq, hkv, s, d, dtype))


def test_attention_output_keeps_q_layout():
    q, k, v = _qkv(1, 2, 1, 5, 16, torch.float32)
    o = attention(q, k, v)
    assert o.stride() == q.stride()  # so o.transpose(1, 2).reshape(b, s, h * d) is free


@pytest.mark.gpu
@cuda_dtypes()
@pytest.mark.parametrize("d", [64, 128])
def test_attention_gpu(dtype, d):
    torch.manual_seed(1)
    check_op(attention, attention_ref, _qkv(2, 16, 4, 2047, d, dtype, "cuda"))
