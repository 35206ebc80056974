"""Fused FP8 quantisation kernels beside their torch references (kernels/fp8.py's numerics).

- `quantise_tensorwise(x, dtype)`: amax (one partial max per program, then the max of the
  partials), the scale (kernels/fp8.py `amax_to_scale`, on the device) and the saturating
  cast, in two passes over x instead of torch's four (abs, amax, multiply, cast).
- `quantise_mx(x, dtype)`: MXFP8 along the last dim: each program reads one block of 32,
  computes its power-of-two (e8m0) scale 2^(floor(log2 amax) - emax) and writes the cast block
  and its scale, in one pass.

Each returns `Quantised(data, scale)` like the references `quantise_tensorwise_ref` /
`quantise_mx_ref`. The interpreter's float -> fp8 conversion loses the carry into the exponent
(127.9 becomes 64 in e4m3), so the kernels round onto the FP8 grid in fp32 themselves
(`_round_fp8`) and the cast only stores an exact value: bitwise torch's result under
TRITON_INTERPRET=1 (tests/kernels/test_fp8_cast.py); compiled, the `gpu` test checks the same.

The recipes quantise through `TRITON_CASTS` (amax, cast, MX blocks: the steps of
kernels/fp8.py `TorchCasts`, with the amax reduced over the shards between the first two)
wherever the ops namespace is Triton's (`ops.fp8_casts`: CUDA, or --kernels triton); inputs a
kernel cannot take (bf16 under the interpreter, a CPU tensor without it) take the torch steps.
The ahead-of-time check compiles the three kernels (kernels/aot_cases.py `_fp8_casts`).
"""

import torch
from megalite.kernels._triton import tl, triton, unsupported, warn_once
from megalite.kernels.fp8 import (
    _EMAX,
    MX_BLOCK,
    TORCH_CASTS,
    Quantised,
    TorchCasts,
    amax_to_scale,
    cast,
    quantise_mx_torch,
)

BLOCK = 1024


_GRID = {torch.float8_e4m3fn: (3.0, -6.0), torch.float8_e5m2: (2.0, -14.0)}  # mantissa, emin


@triton.jit
def _round_fp8(y, mbits, emin):
    """y (already within the format's range) rounded to nearest-even on the FP8 grid, in fp32:
    adding and taking away 2^23 ulp rounds at the ulp. The cast that follows is then exact,
    which the interpreter's conversion (it loses a carry into the exponent) needs."""
    a = tl.abs(y)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), emin)
    c = tl.exp2(e - mbits) * 8388608.0
    r = (a + c) - c
    return tl.where(y < 0, -r, r)


@triton.jit
def _amax_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.max(tl.abs(x), axis=0))


@triton.jit
def _cast_kernel(x_ptr, y_ptr, scale_ptr, n, fmax, mbits, emin, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round_fp8(tl.clamp(x * tl.load(scale_ptr), -fmax, fmax), mbits, emin)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mx_kernel(x_ptr, y_ptr, s_ptr, k, blocks, emax, fmax, mbits, emin, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # one block of BLOCK along a row: row pid // blocks
    row, blk = pid // blocks, pid % blocks
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < k
    x = tl.load(x_ptr + row * k + cols, mask=mask, other=0.0).to(tl.float32)
    # 2^-127 typed fp32 explicitly: as a bare literal (below fp32's normal range) triton 3.8
    # types it fp64 and promotes the whole block to fp64 (tests/kernels/test_literals.py).
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), tl.full([], 5.877471754111438e-39, tl.float32))
    e = tl.minimum(tl.maximum(tl.floor(tl.log2(amax)) - emax, -127.0), 127.0)
    scale = tl.exp2(e)
    y = _round_fp8(tl.clamp(x / scale, -fmax, fmax), mbits, emin)
    tl.store(y_ptr + row * k + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + pid, scale)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor: one partial max per program, then their max."""
    x = x.contiguous()
    n = x.numel()
    grid = (triton.cdiv(n, BLOCK),)
    partial = torch.empty(grid[0], dtype=torch.float32, device=x.device)
    _amax_kernel[grid](x, partial, n, BLOCK=BLOCK)
    return partial.amax()


def cast_to(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """x * scale saturated and rounded into `dtype` (kernels/fp8.py `cast`), scale a 1-element
    fp32 tensor (read on the device: no host sync)."""
    x = x.contiguous()
    n = x.numel()
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    s = scale.reshape(1).float()
    _cast_kernel[(triton.cdiv(n, BLOCK),)](x, y, s, n, torch.finfo(dtype).max, *_GRID[dtype],
                                           BLOCK=BLOCK)  # fmt: skip
    return y


def quantise_tensorwise(x: torch.Tensor, dtype) -> Quantised:
    scale = amax_to_scale(amax(x), dtype)
    return Quantised(cast_to(x, scale, dtype), scale.reciprocal())


def quantise_tensorwise_ref(x: torch.Tensor, dtype) -> Quantised:
    scale = amax_to_scale(x.detach().abs().amax().float(), dtype)
    return Quantised(cast(x, scale, dtype), scale.reciprocal())


def quantise_mx(x: torch.Tensor, dtype) -> Quantised:
    """x (rows, k) -> FP8 data (rows, k) and scales (rows, ceil(k/32))."""
    x = x.contiguous()
    rows, k = x.shape
    blocks = triton.cdiv(k, MX_BLOCK)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    s = torch.empty(rows, blocks, dtype=torch.float32, device=x.device)
    # one warp per block of 32: a thread per element (4 warps left 3 of them idle)
    _mx_kernel[(rows * blocks,)](x, y, s, k, blocks, float(_EMAX[dtype]), torch.finfo(dtype).max,
                                 *_GRID[dtype], BLOCK=MX_BLOCK, num_warps=1)  # fmt: skip
    return Quantised(y, s)


def quantise_mx_ref(x: torch.Tensor, dtype) -> Quantised:
    return quantise_mx_torch(x, dtype)


class TritonCasts(TorchCasts):
    """The recipes' quantise steps through the kernels above; the torch steps (TorchCasts) for
    inputs the kernels cannot take here (warned once)."""

    def _torch(self, t: torch.Tensor) -> bool:
        reason = unsupported(t)
        if reason:
            warn_once("fp8_cast", reason)
        return reason is not None

    def amax(self, t):
        return TORCH_CASTS.amax(t) if self._torch(t) else amax(t.detach())

    def cast(self, t, scale, dtype):
        return TORCH_CASTS.cast(t, scale, dtype) if self._torch(t) else cast_to(t, scale, dtype)

    def mx(self, t, dtype):
        return TORCH_CASTS.mx(t, dtype) if self._torch(t) else quantise_mx(t, dtype)


TRITON_CASTS = TritonCasts()
