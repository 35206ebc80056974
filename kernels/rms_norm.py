"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, statistics in fp32.

One program normalises one row held whole in registers (hidden sizes up to 64K). The backward
pass recomputes x_hat from x and the saved 1/rms; each program sums its rows' dw in fp32 and the
few per-program partial sums are added in torch, which avoids atomics and stays deterministic.
Under the interpreter a program takes ROWS rows at once (_triton.rows_per_program); on a GPU
ROWS is 1.
"""

import torch
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

MAX_N = 65536


@triton.jit
def _rms_norm_fwd(
    X, W, Y, RSTD, stride_x, stride_y, n_rows, n, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    row1, live = program_rows(n_rows, ROWS)  # (ROWS,): clamped int64 indices, real rows
    row = row1[:, None]
    cols = tl.arange(0, BLOCK)
    mask = (cols < n)[None, :]
    x = tl.load(X + row * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n + eps)
    tl.store(RSTD + row1, rstd, mask=live)
    y = x * rstd[:, None] * w
    tl.store(
        Y + row * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask & live[:, None]
    )


@triton.jit
def _rms_norm_bwd(
    X, W, DY, DX, RSTD, DW, stride_x, stride_dy, stride_dx, n_rows, n, rows_per_prog,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = (cols < n)[None, :]
    w = tl.load(W + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    end = tl.minimum((pid + 1) * rows_per_prog, n_rows)
    for start in range(pid * rows_per_prog, end, ROWS):  # ROWS rows at a time (1 on a GPU)
        r = start + tl.arange(0, ROWS)
        row = tl.minimum(r, n_rows - 1).to(tl.int64)[:, None]  # (ROWS, 1), int64 as above
        live = (r < end)[:, None]
        x = tl.load(X + row * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols[None, :], mask=mask & live, other=0.0)
        dy = dy.to(tl.float32)  # 0 on rows past the end: they add nothing to dw
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        wdy = w * dy
        # d/dx of x * rstd(x): the second term is the rstd's own dependence on x.
        dx = rstd * (wdy - x_hat * (tl.sum(wdy * x_hat, axis=1)[:, None] / n))
        tl.store(DX + row * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask & live)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(DW + pid * n + cols, dw, mask=cols < n)


def _programs(x: torch.Tensor, n_rows: int, block: int) -> int:
    """Programs for a row-reduction backward: a few per SM on a GPU; under the interpreter one
    per tile of rows_per_program rows (its cost is per program, not per row)."""
    if x.device.type == "cuda":
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return max(1, min(n_rows, 4 * sms))
    return triton.cdiv(n_rows, rows_per_program(n_rows, block))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = rows(x)  # (rows, n)
        n_rows, n = x2.shape
        y = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block, warps = row_block(n)
        w = weight.contiguous()
        per = rows_per_program(n_rows, block)
        _rms_norm_fwd[(triton.cdiv(n_rows, per),)](
            x2, w, y, rstd, x2.stride(0), n, n_rows, n, eps, BLOCK=block, ROWS=per,
            num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(x2, w, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        n_rows, n = x2.shape
        dy2 = rows(dy)
        dx = torch.empty((n_rows, n), dtype=x2.dtype, device=x2.device)
        progs = _programs(x2, n_rows, row_block(n)[0])
        dw_part = torch.empty((progs, n), dtype=torch.float32, device=x2.device)
        block, warps = row_block(n)
        _rms_norm_bwd[(progs,)](
            x2, w, dy2, dx, rstd, dw_part, x2.stride(0), dy2.stride(0), n, n_rows, n,
            triton.cdiv(n_rows, progs), BLOCK=block,
            ROWS=rows_per_program(triton.cdiv(n_rows, progs), block), num_warps=warps,
        )  # fmt: skip
        return dx.view(ctx.x_shape), dw_part.sum(0).to(w.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., n), weight (n,) -> (..., n) in x's dtype; Triton kernel, torch fallback."""
    reason = unsupported(x, weight) or (
        f"n={x.shape[-1]} > {MAX_N}" if x.shape[-1] > MAX_N else None
    )
    if reason:
        warn_once("rms_norm", reason)
        return rms_norm_ref(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = at_least_fp32(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * at_least_fp32(weight)).to(x.dtype)
