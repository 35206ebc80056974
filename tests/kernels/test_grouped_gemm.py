import warnings

import pytest
import torch
from megalite.kernels.grouped_gemm import grouped_mm, grouped_mm_ref

from tests.kernels.helpers import check_op, cuda_dtypes, make


def _inputs(counts, k, n, dtype, layout="contig", device="cpu"):
    """x (T, k), w (E, n, k), offsets (E+1,) for experts owning counts[e] consecutive rows."""
    t, e = sum(counts), len(counts)
    if layout == "transposed":
        # Neither x nor w has unit stride along k: x as (k, T).t(), w stored (E, k, n) as a
        # model keeping weights input-major would.
        x = make((k, t), dtype, device).t()
        w = make((e, k, n), dtype, device, scale=k**-0.5).transpose(1, 2)
    else:
        x = make((t, k), dtype, device, noncontig=layout == "noncontig")  # row stride 2k
        w = make((e, n, k), dtype, device, scale=k**-0.5)
    offsets = torch.tensor([0, *counts], device=device).cumsum(0)
    return x, w, offsets


@pytest.mark.parametrize(
    "counts,k,n,layout",
    [
        ([37], 24, 40, "contig"),  # one expert, T not a multiple of the 16-row tile
        ([2, 45, 3], 40, 24, "noncontig"),  # 90% of the tokens on one expert
        ([10, 0, 0, 23], 24, 40, "noncontig"),  # empty experts in the middle
        ([0, 17, 16, 0], 40, 24, "transposed"),  # empty at both ends; a tile exactly full
    ],
)
def test_grouped_mm(dtype, counts, k, n, layout):
    torch.manual_seed(0)
    check_op(grouped_mm, grouped_mm_ref, _inputs(counts, k, n, dtype, layout))


def test_grouped_mm_reads_no_offsets_on_host(monkeypatch):
    # The training step must not wait on the device: forward and both gradients launch without
    # ever turning a tensor into a Python value (the interpreter reads memory, not these).
    x, w, offsets = _inputs([5, 0, 30], 24, 40, torch.float32)
    for name in ("item", "tolist", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a: pytest.fail("host read"), raising=False)
    y = grouped_mm(x, w, offsets)
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    monkeypatch.undo()
    y_ref = grouped_mm_ref(x, w, offsets)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), torch.ones_like(y_ref))
    for a, b in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        torch.testing.assert_close(a, b)


def test_grouped_mm_no_tokens():
    # An expert-parallel rank may receive no tokens at all: the kernel path, zero dw, no warning.
    x, w, offsets = _inputs([0, 0, 0], 24, 40, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = grouped_mm(x, w, offsets)
        (dw,) = torch.autograd.grad(y, (w,), torch.ones_like(y))
    assert y.shape == (0, 40) and dw.shape == w.shape and not dw.any()


def test_grouped_mm_weight_grad_only():
    # x without grad (frozen input): only the dw kernel runs.
    torch.manual_seed(0)
    x, w, offsets = _inputs([3, 20, 0], 24, 40, torch.float32)
    x = x.detach()
    g = torch.randn(x.shape[0], 40)
    (dw,) = torch.autograd.grad(grouped_mm(x, w, offsets), (w,), g)
    (dw_ref,) = torch.autograd.grad(grouped_mm_ref(x, w, offsets), (w,), g)
    torch.testing.assert_close(dw, dw_ref)


def test_grouped_mm_fp64_takes_the_reference():
    x, w, offsets = _inputs([4, 0, 5], 24, 40, torch.float64)
    with pytest.warns(UserWarning, match="megalite.kernels.grouped_mm: .*torch reference"):
        y = grouped_mm(x, w, offsets)
    torch.testing.assert_close(y, grouped_mm_ref(x, w, offsets), rtol=0, atol=0)


def test_grouped_mm_rejects_bad_inputs():
    x, w, offsets = _inputs([4, 5], 24, 40, torch.float32)
    with pytest.raises(ValueError, match="must be \\(T, k\\)"):
        grouped_mm(x[:, :20], w, offsets)
    with pytest.raises(ValueError, match="offsets must be"):
        grouped_mm(x, w, offsets[:2])
    with pytest.raises(ValueError, match="must share"):
        grouped_mm(x, w.half(), offsets)
    with pytest.raises(ValueError, match="rise from 0 to T"):
        grouped_mm_ref(x, w, torch.tensor([0, 6, 5]))


@pytest.mark.gpu
@cuda_dtypes()
@pytest.mark.parametrize(
    "counts,layout",
    [
        ([1800, 3, 0, 97, 50, 0, 1, 49], "contig"),  # skewed, empties, partial tiles
        ([300, 0, 211, 513], "noncontig"),
        ([0, 1000, 0, 0], "transposed"),
    ],
)
def test_grouped_mm_gpu(dtype, counts, layout):
    torch.manual_seed(1)
    check_op(grouped_mm, grouped_mm_ref, _inputs(counts, 520, 328, dtype, layout, "cuda"))


@pytest.mark.gpu
def test_grouped_mm_gpu_never_syncs():
    x, w, offsets = _inputs([700, 0, 300, 24], 256, 512, torch.bfloat16, device="cuda")
    g = torch.randn(x.shape[0], 512, device="cuda", dtype=torch.bfloat16)
    torch.autograd.grad(grouped_mm(x, w, offsets), (x, w), g)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(grouped_mm(x, w, offsets), (x, w), g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
