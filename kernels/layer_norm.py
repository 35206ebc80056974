"""LayerNorm over the last dimension, statistics in fp32.

Same layout as rms_norm.py: one program per row in the forward pass (saving mean and 1/std in
fp32), and in the backward pass each program walks a run of rows, accumulating its dw/db partial
sums in fp32 registers; the few partial rows are summed in torch (no atomics, deterministic).
"""

import torch
import torch.nn.functional as F
from megalite.kernels._triton import (
    at_least_fp32,
    row_block,
    rows,
    tl,
    triton,
    unsupported,
    warn_once,
)
from megalite.kernels.rms_norm import MAX_N, _programs


@triton.jit
def _layer_norm_fwd(
    X, W, B, Y, MEAN, RSTD, stride_x, stride_y, n, eps,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n
    xc = tl.where(mask, x - mean, 0.0)  # padding must not enter the variance
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd(
    X, W, DY, DX, MEAN, RSTD, DW, DB, stride_x, stride_dy, stride_dx, n_rows, n, rows_per_prog,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid * rows_per_prog, tl.minimum((pid + 1) * rows_per_prog, n_rows)):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        wdy = w * dy
        # The two means are the mean's and the std's own dependence on x.
        c1 = tl.sum(wdy * x_hat, axis=0) / n
        c2 = tl.sum(wdy, axis=0) / n
        dx = rstd * (wdy - x_hat * c1 - c2)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
    tl.store(DW + pid * n + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB + pid * n + cols, db, mask=mask)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2 = rows(x)  # (rows, n)
        n_rows, n = x2.shape
        y = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        block, warps = row_block(n)
        w = weight.contiguous()
        b = w if bias is None else bias.contiguous()  # any pointer will do when HAS_BIAS is off
        _layer_norm_fwd[(n_rows,)](
            x2, w, b, y, mean, rstd, x2.stride(0), n, n, eps,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.x_shape, ctx.bias_dtype = x.shape, None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, mean, rstd = ctx.saved_tensors
        n_rows, n = x2.shape
        dy2 = rows(dy)
        dx = torch.empty((n_rows, n), dtype=x2.dtype, device=x2.device)
        progs = _programs(x2, n_rows)
        dw_part = torch.empty((progs, n), dtype=torch.float32, device=x2.device)
        has_bias = ctx.bias_dtype is not None
        db_part = torch.empty_like(dw_part) if has_bias else dw_part
        block, warps = row_block(n)
        _layer_norm_bwd[(progs,)](
            x2, w, dy2, dx, mean, rstd, dw_part, db_part, x2.stride(0), dy2.stride(0), n,
            n_rows, n, triton.cdiv(n_rows, progs), HAS_BIAS=has_bias, BLOCK=block,
            num_warps=warps,
        )  # fmt: skip
        db = db_part.sum(0).to(ctx.bias_dtype) if has_bias else None
        return dx.view(ctx.x_shape), dw_part.sum(0).to(w.dtype), db, None


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """x (..., n), weight and bias (n,) (bias may be None) -> (..., n) in x's dtype."""
    params = (weight,) if bias is None else (weight, bias)
    reason = unsupported(x, *params) or (
        f"n={x.shape[-1]} > {MAX_N}" if x.shape[-1] > MAX_N else None
    )
    if reason:
        warn_once("layer_norm", reason)
        return layer_norm_ref(x, weight, bias, eps)
    return _LayerNorm.apply(x, weight, bias, eps)


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    b = None if bias is None else at_least_fp32(bias)
    xf = at_least_fp32(x)
    return F.layer_norm(xf, x.shape[-1:], at_least_fp32(weight), b, eps).to(x.dtype)
