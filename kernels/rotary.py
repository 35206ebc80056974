"""Rotary position embedding, rotate-half convention (as Hugging Face Llama stores q/k).

One program rotates all heads of one (batch, position) pair, so cos/sin are read once per token.
The rotation is orthogonal, so the backward pass is the same kernel with sin negated.
"""

import torch
from megalite.kernels._triton import at_least_fp32, tl, triton, unsupported, warn_once


@triton.jit
def _rotary_kernel(
    X, COS, SIN, Y, seq, heads, half,
    sx_b, sx_s, sx_h, sy_b, sy_s, sy_h, sc_s, sign,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # b * sx_b is an offset into the whole tensor
    b, s = pid // seq, pid % seq
    h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)  # (BLOCK_H, 1); int64 as pid
    d = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
    mask = (h < heads) & (d < half)
    c = tl.load(COS + s * sc_s + d, mask=d < half, other=0.0).to(tl.float32)  # (1, BLOCK_D)
    sn = tl.load(SIN + s * sc_s + d, mask=d < half, other=0.0).to(tl.float32) * sign
    x_ptr = X + b * sx_b + s * sx_s + h * sx_h + d
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)  # first half of each head
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)  # second half
    y_ptr = Y + b * sy_b + s * sy_s + h * sy_h + d
    tl.store(y_ptr, (x1 * c - x2 * sn).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + half, (x2 * c + x1 * sn).to(Y.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    b, s, h, d = x.shape
    y = torch.empty((b, s, h, d), dtype=x.dtype, device=x.device)
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d // 2)
    _rotary_kernel[(b * s,)](
        x, cos, sin, y, s, h, d // 2, *x.stride()[:3], *y.stride()[:3], cos.stride(0), sign,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d >= 2048 else 1,
    )  # fmt: skip
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, -1.0), None, None  # cos/sin are fixed tables


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, s, heads, d), cos and sin (s, d/2) -> (b, s, heads, d) in x's dtype."""
    reason = unsupported(x, cos, sin)
    if reason is None and (
        x.dim() != 4 or x.shape[-1] % 2 or cos.shape != (x.shape[1], x.shape[-1] // 2)
    ):
        reason = f"x {tuple(x.shape)} with cos {tuple(cos.shape)} is not (b, s, h, d) with (s, d/2)"
    if reason:
        warn_once("rotary", reason)
        return rotary_ref(x, cos, sin)
    return _Rotary.apply(x, cos, sin)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, s, heads, d); cos, sin: (s, d/2). Rotates pairs (i, i + d/2)."""
    x1, x2 = at_least_fp32(x).chunk(2, dim=-1)
    c, s = at_least_fp32(cos[None, :, None, :]), at_least_fp32(sin[None, :, None, :])
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
