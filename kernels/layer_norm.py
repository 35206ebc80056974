"""LayerNorm over the last dimension, statistics in fp32.

Same layout as rms_norm.py: one program per row in the forward pass (saving mean and 1/std in
fp32), and in the backward pass each program walks a run of rows, accumulating its dw/db partial
sums in fp32 registers; the few partial rows are summed in torch (no atomics, deterministic).
Under the interpreter a program takes ROWS rows at once (_triton.rows_per_program); on a GPU
ROWS is 1.
"""

import torch
import torch.nn.functional as F
from megalite.kernels._triton import (
    at_least_fp32,
    program_rows,
    row_block,
    rows,
    rows_per_program,
    tl,
    triton,
    unsupported,
    warn_once,
)
from megalite.kernels.rms_norm import MAX_N, _programs


@triton.jit
def _layer_norm_fwd(
    X, W, B, Y, MEAN, RSTD, stride_x, stride_y, n_rows, n, eps,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    row1, live = program_rows(n_rows, ROWS)  # (ROWS,): clamped int64 indices, real rows
    row = row1[:, None]
    cols = tl.arange(0, BLOCK)
    mask = (cols < n)[None, :]
    x = tl.load(X + row * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n
    xc = tl.where(mask, x - mean[:, None], 0.0)  # padding must not enter the variance
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n + eps)
    w = tl.load(W + cols, mask=cols < n, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    tl.store(MEAN + row1, mean, mask=live)
    tl.store(RSTD + row1, rstd, mask=live)
    tl.store(
        Y + row * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask & live[:, None]
    )


@triton.jit
def _layer_norm_bwd(
    X, W, DY, DX, MEAN, RSTD, DW, DB, stride_x, stride_dy, stride_dx, n_rows, n, rows_per_prog,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = (cols < n)[None, :]
    w = tl.load(W + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    end = tl.minimum((pid + 1) * rows_per_prog, n_rows)
    for start in range(pid * rows_per_prog, end, ROWS):  # ROWS rows at a time (1 on a GPU)
        r = start + tl.arange(0, ROWS)
        row = tl.minimum(r, n_rows - 1).to(tl.int64)[:, None]  # (ROWS, 1), int64 as above
        live = (r < end)[:, None]
        x = tl.load(X + row * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols[None, :], mask=mask & live, other=0.0)
        dy = dy.to(tl.float32)  # 0 on rows past the end: they add nothing to dw, db
        rstd = tl.load(RSTD + row)
        x_hat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        wdy = w * dy
        # The two means are the mean's and the std's own dependence on x.
        c1 = tl.sum(wdy * x_hat, axis=1)[:, None] / n
        c2 = tl.sum(wdy, axis=1)[:, None] / n
        dx = rstd * (wdy - x_hat * c1 - c2)
        tl.store(DX + row * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask & live)
        dw += tl.sum(dy * x_hat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW + pid * n + cols, dw, mask=cols < n)
    if HAS_BIAS:
        tl.store(DB + pid * n + cols, db, mask=cols < n)


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
        per = rows_per_program(n_rows, block)
        _layer_norm_fwd[(triton.cdiv(n_rows, per),)](
            x2, w, b, y, mean, rstd, x2.stride(0), n, n_rows, n, eps,
            HAS_BIAS=bias is not None, BLOCK=block, ROWS=per, num_warps=warps,
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
        progs = _programs(x2, n_rows, row_block(n)[0])
        dw_part = torch.empty((progs, n), dtype=torch.float32, device=x2.device)
        has_bias = ctx.bias_dtype is not None
        db_part = torch.empty_like(dw_part) if has_bias else dw_part
        block, warps = row_block(n)
        _layer_norm_bwd[(progs,)](
            x2, w, dy2, dx, mean, rstd, dw_part, db_part, x2.stride(0), dy2.stride(0), n,
            n_rows, n, triton.cdiv(n_rows, progs), HAS_BIAS=has_bias, BLOCK=block,
            ROWS=rows_per_program(triton.cdiv(n_rows, progs), block), num_warps=warps,
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
