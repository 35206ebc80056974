import pytest
import torch
from megalite.kernels.layer_norm import layer_norm, layer_norm_ref
from megalite.kernels.rms_norm import rms_norm, rms_norm_ref

from tests.kernels.helpers import check_op, cuda_dtypes, make


@pytest.mark.parametrize("noncontig", [False, True])
def test_rms_norm(dtype, noncontig):
    torch.manual_seed(1)
    x = make((3, 37, 129), dtype, noncontig=noncontig)
    w = make((129,), dtype, scale=0.5, offset=1.0)
    check_op(rms_norm, rms_norm_ref, (x, w, 1e-5))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("noncontig", [False, True])
def test_layer_norm(dtype, bias, noncontig):
    torch.manual_seed(2)
    x = make((3, 37, 129), dtype, noncontig=noncontig, offset=2.0)  # offset: mean matters
    w = make((129,), dtype, scale=0.5, offset=1.0)
    b = make((129,), dtype) if bias else None
    check_op(layer_norm, layer_norm_ref, (x, w, b, 1e-5))


def test_norms_fp32_weight_with_fp16_input():
    # Mixed precision: fp32 parameters, fp16 activations; gradients keep each one's dtype.
    torch.manual_seed(3)
    x = make((5, 64), torch.float16)
    w = make((64,), torch.float32, offset=1.0)
    check_op(rms_norm, rms_norm_ref, (x, w, 1e-6), atol=1e-3)


@pytest.mark.gpu
@cuda_dtypes()
def test_norms_gpu(dtype):
    torch.manual_seed(4)
    x = make((4, 2048, 4096), dtype, "cuda")
    w = make((4096,), dtype, "cuda", scale=0.5, offset=1.0)
    b = make((4096,), dtype, "cuda")
    check_op(rms_norm, rms_norm_ref, (x, w, 1e-5))
    check_op(layer_norm, layer_norm_ref, (x, w, b, 1e-5))
