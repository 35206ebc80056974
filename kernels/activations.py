"""MLP activations: SwiGLU (llama) and GELU, tanh-approximated (gpt2) or exact (erf; nanogpt).

Elementwise kernels over (rows, n) views with a runtime row stride, so gate/up halves of a fused
projection are read in place; a program takes ROWS rows (1 on a GPU, more under the interpreter).
The backward passes recompute the activation from the saved inputs instead of saving it, trading
a few flops for an activation-sized buffer.
"""

import torch
import torch.nn.functional as F
from megalite.kernels._triton import (
    program_rows,
    rows,
    rows_per_program,
    tl,
    triton,
    unsupported,
    warn_once,
)

# A constexpr: compiled kernels may read no other global (the interpreter does not check);
# written right of the tensor it scales, as the interpreter wraps constexpr * tensor wrongly.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
SQRT_1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2): erf's argument
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi): the normal density's factor


@triton.jit
def _tanh(z):
    # tanh from exp(-2|z|) <= 1: no overflow, and portable to the CPU interpreter.
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -t, t)


@triton.jit
def _tile(n_rows, n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # This program's (ROWS, BLOCK) tile (ROWS = 1 on a GPU): row indices (clamped for loads,
    # (ROWS, 1)), column indices (1, BLOCK), and the store mask.
    row, live = program_rows(n_rows, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    return row[:, None], cols, live[:, None] & (cols < n)


@triton.jit
def _swiglu_fwd(G, U, Y, sg, su, sy, n_rows, n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    row, cols, mask = _tile(n_rows, n, BLOCK, ROWS)
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + cols, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    G, U, DY, DG, DU, sg, su, sdy, sdg, sdu, n_rows, n, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    row, cols, mask = _tile(n_rows, n, BLOCK, ROWS)
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dsilu = sig * (1.0 + g * (1.0 - sig))  # d/dg of g * sigmoid(g)
    tl.store(DG + row * sdg + cols, (dy * u * dsilu).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * sdu + cols, (dy * silu).to(DU.dtype.element_ty), mask=mask)


# EXACT (a constexpr: two compiled variants, no branch per element): GELU x Phi(x) with
# Phi(x) = (1 + erf(x / sqrt 2)) / 2, else GPT-2's 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
@triton.jit
def _gelu_fwd(X, Y, sx, sy, n_rows, n, BLOCK: tl.constexpr, ROWS: tl.constexpr,
              EXACT: tl.constexpr):  # fmt: skip
    row, cols, mask = _tile(n_rows, n, BLOCK, ROWS)
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if EXACT:
        t = tl.math.erf(x * SQRT_1_2)
    else:
        t = _tanh((x + 0.044715 * x * x * x) * SQRT_2_OVER_PI)
    tl.store(Y + row * sy + cols, (0.5 * x * (1.0 + t)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd(X, DY, DX, sx, sdy, sdx, n_rows, n, BLOCK: tl.constexpr, ROWS: tl.constexpr,
              EXACT: tl.constexpr):  # fmt: skip
    row, cols, mask = _tile(n_rows, n, BLOCK, ROWS)
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
    if EXACT:  # d/dx x Phi(x) = Phi(x) + x phi(x), phi the normal density
        t = tl.math.erf(x * SQRT_1_2)
        dt = 2.0 * tl.exp(-0.5 * x * x) * INV_SQRT_2PI  # 2 phi(x): 0.5 x dt = x phi(x)
    else:
        t = _tanh((x + 0.044715 * x * x * x) * SQRT_2_OVER_PI)
        dt = (1.0 + 3.0 * 0.044715 * x * x) * SQRT_2_OVER_PI * (1.0 - t * t)
    tl.store(
        DX + row * sdx + cols, (dy * 0.5 * (1.0 + t + x * dt)).to(DX.dtype.element_ty), mask=mask
    )


def _grid(x2: torch.Tensor) -> tuple[tuple[int, int], int, int]:
    """Grid, column block and rows per program (1 on a GPU) for a (rows, n) view."""
    n_rows, n = x2.shape
    block = min(triton.next_power_of_2(n), 1024)
    per = rows_per_program(n_rows, block)
    return (triton.cdiv(n_rows, per), triton.cdiv(n, block)), block, per


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g2, u2 = rows(gate), rows(up)  # (rows, n)
        y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
        grid, block, per = _grid(g2)
        _swiglu_fwd[grid](
            g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), *g2.shape, BLOCK=block, ROWS=per
        )
        ctx.save_for_backward(g2, u2)
        ctx.shape = gate.shape
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        dy2 = rows(dy)
        dg = torch.empty(g2.shape, dtype=g2.dtype, device=g2.device)
        du = torch.empty(u2.shape, dtype=u2.dtype, device=u2.device)
        grid, block, per = _grid(g2)
        _swiglu_bwd[grid](
            g2, u2, dy2, dg, du, g2.stride(0), u2.stride(0), dy2.stride(0), dg.stride(0),
            du.stride(0), *g2.shape, BLOCK=block, ROWS=per,
        )  # fmt: skip
        return dg.view(ctx.shape), du.view(ctx.shape)


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, exact: bool):
        x2 = rows(x)  # (rows, n)
        y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        grid, block, per = _grid(x2)
        _gelu_fwd[grid](x2, y, x2.stride(0), y.stride(0), *x2.shape, BLOCK=block, ROWS=per,
                        EXACT=exact)  # fmt: skip
        ctx.save_for_backward(x2)
        ctx.shape, ctx.exact = x.shape, exact
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        dy2 = rows(dy)
        dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
        grid, block, per = _grid(x2)
        _gelu_bwd[grid](
            x2, dy2, dx, x2.stride(0), dy2.stride(0), dx.stride(0), *x2.shape, BLOCK=block,
            ROWS=per, EXACT=ctx.exact,
        )  # fmt: skip
        return dx.view(ctx.shape), None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, both (..., n) of one dtype -> (..., n)."""
    reason = unsupported(gate, up)
    if reason is None and (gate.shape != up.shape or gate.dtype != up.dtype):
        reason = "gate and up differ in shape or dtype"
    if reason:
        warn_once("swiglu", reason)
        return swiglu_ref(gate, up)
    return _SwiGLU.apply(gate, up)


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU, (...) -> (...): `approximate` as F.gelu's, "tanh" (GPT-2's, the default) or "none"
    (the exact erf form)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu: approximate={approximate!r} is neither 'tanh' nor 'none'")
    reason = unsupported(x)
    if reason:
        warn_once("gelu", reason)
        return gelu_ref(x, approximate)
    return _GELU.apply(x, approximate == "none")


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_ref(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)
