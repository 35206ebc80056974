import pytest
import torch
from megalite.kernels.attention import (
    CAUSAL,
    _MaskedAttention,
    attention,
    attention_ref,
    block_reason,
)

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


def test_mla_head_dim_runs_in_the_kernel(dtype):
    # MLA's padded head dim (DeepSeek-V3: 128 + 64 = 192) in 256-wide tiles, 64 columns masked;
    # it used to fall back to torch, so the kernel is called directly as well.
    torch.manual_seed(0)
    q, k, v = _qkv(1, 2, 2, 70, 192, dtype)
    assert block_reason(q, k, v) is None

    for window in (0, 40):  # and with a sliding window

        def kernel(q, k, v, w=window):
            return _MaskedAttention.apply(q, k, v, 192**-0.5, *CAUSAL, w)

        def ref(q, k, v, w=window):
            return attention_ref(q, k, v, window=w or None)

        check_op(kernel, ref, (q, k, v))


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
