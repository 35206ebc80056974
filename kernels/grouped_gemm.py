"""Grouped GEMM for mixture-of-experts: every local expert's matmul in one launch.

Tokens arrive sorted by expert, expert e owning rows offsets[e]:offsets[e+1] of x (T, k); each
expert has one nn.Linear-style weight w[e] (n, k), so y[rows of e] = x[rows of e] @ w[e].T.

The step must not wait on the device, so the launchers never read `offsets` on the host: the
grid is sized by an upper bound and every program finds its work from `offsets` on the device.

- y = x @ w[e].T and dx = dy @ w[e] are one kernel, C = A @ B[e] with B given by strides
  (w[e].T or w[e]). Row tiles never straddle two experts, so expert e needs cdiv(count_e, BM)
  of them; their sum is at most cdiv(T, BM) + E - 1, which is the grid's row axis. A program
  computes the per-expert tile counts and their prefix sum from `offsets` (a vector of E
  entries), finds the expert its tile falls in, and exits at once when past the last tile.
- dw[e] = dy_e.T @ x_e: one program per (n-tile, k-tile, expert) loops over that expert's rows,
  whatever their number; an expert with no rows stores zeros. No atomics, so it is
  deterministic. Under skewed routing the busiest expert's programs run longest; there are
  still cdiv(n, BN) * cdiv(k, BK) of them, which keeps a GPU busy at model sizes.
"""

import torch
from megalite.kernels._triton import tl, triton, unsupported, warn_once


@triton.jit
def _find_tile(OFFS, pid, n_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row tile pid -> (expert, first row, end row); expert >= n_experts past the last tile."""
    e = tl.arange(0, BLOCK_E)
    real = e < n_experts
    lo = tl.load(OFFS + e, mask=real, other=0).to(tl.int64)  # (BLOCK_E,) first row of each
    hi = tl.load(OFFS + e + 1, mask=real, other=0).to(tl.int64)  # (BLOCK_E,) end row of each
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M  # 0 for empty experts and padding lanes
    ends = tl.cumsum(tiles, axis=0)  # tile index just past expert e's tiles
    # Padding lanes repeat the total, so past the last tile the count exceeds n_experts - 1.
    expert = tl.sum((ends <= pid).to(tl.int32), axis=0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, ends - tiles, 0), axis=0)
    start = tl.sum(tl.where(mine, lo, 0), axis=0) + (pid - first_tile) * BLOCK_M
    end = tl.sum(tl.where(mine, hi, 0), axis=0)
    return expert, start, end


@triton.jit
def _grouped_mm_kernel(
    A, B, C, OFFS, n_experts, K, N, sa_t, sa_k, sb_e, sb_k, sb_n, sc_t, sc_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    # C[rows of e] = A[rows of e] @ B[e]: A (T, K), B (E, K, N), C (T, N).
    expert, start, end = _find_tile(OFFS, tl.program_id(0), n_experts, BLOCK_M, BLOCK_E)
    if expert >= n_experts:
        return  # the grid's upper bound overshoots the real tile count
    rows = start + tl.arange(0, BLOCK_M)  # int64: row * stride may pass 2^31
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < end  # the expert's last tile is partial
    cmask = cols < N
    a_ptrs = A + rows[:, None] * sa_t + ks[None, :] * sa_k  # (BLOCK_M, BLOCK_K)
    b_ptrs = B + expert.to(tl.int64) * sb_e + ks[:, None] * sb_k + cols[None, :] * sb_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + ks < K
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BLOCK_K * sa_k
        b_ptrs += BLOCK_K * sb_k
    c_ptrs = C + rows[:, None] * sc_t + cols[None, :] * sc_n
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _grouped_dw_kernel(
    DY, X, DW, OFFS, N, K, sdy_t, sdy_n, sx_t, sx_k, sdw_e, sdw_n, sdw_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    # DW[e] = DY[rows of e].T @ X[rows of e]: DY (T, N), X (T, K), DW (E, N, K).
    expert = tl.program_id(2)
    start = tl.load(OFFS + expert).to(tl.int64)
    end = tl.load(OFFS + expert + 1).to(tl.int64)
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ms = tl.arange(0, BLOCK_M)
    nmask = ns < N
    kmask = ks < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # stays zero for an empty expert
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + ms
        rmask = rows < end
        dy_t = tl.load(  # (BLOCK_N, BLOCK_M): dy's rows read as columns
            DY + rows[None, :] * sdy_t + ns[:, None] * sdy_n,
            mask=nmask[:, None] & rmask[None, :],
            other=0.0,
        )
        x = tl.load(
            X + rows[:, None] * sx_t + ks[None, :] * sx_k,
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        acc = tl.dot(dy_t, x, acc, input_precision=PREC)
    dw_ptrs = DW + expert.to(tl.int64) * sdw_e + ns[:, None] * sdw_n + ks[None, :] * sdw_k
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


def _config(x: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the forward / dx kernel."""
    if x.device.type != "cuda":
        # The interpreter's cost is per program and per op: small tiles keep tests short and
        # still give several row tiles per expert and several k steps.
        return 16, 16, 16, 1, 1
    if x.dtype == torch.float32:  # fp32 tiles take twice the shared memory
        return 64, 64, 32, 4, 3
    # 4 stages of (128x32 + 32x128) 16-bit tiles: 64 KiB of shared memory, fine on sm80+;
    # 8 warps, since 4 hold a 128x128 fp32 accumulator in 255 registers and spill on sm_80
    # (docs/kernels.md).
    return 128, 128, 32, 8, 4


def _dw_config(x: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the weight-gradient kernel.

    Its loop runs over rows (BLOCK_M), so a stage holds a (BLOCK_N, BLOCK_M) dy tile and a
    (BLOCK_M, BLOCK_K) x tile: with the forward's 128-row tiles that is 40 KiB a stage, 160 KiB
    at 4 stages, more than sm_86/89 (99 KiB) allow. Here the row step is 32: 16 KiB a stage
    (16-bit), stages as many (2..4) as the device's shared memory per block holds."""
    if x.device.type != "cuda":
        return _config(x)  # the interpreter: the same tiles as ever (same numerics)
    smem = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin
    bm, bn, bk = (32, 64, 64) if x.dtype == torch.float32 else (32, 128, 128)
    stage = (bn * bm + bm * bk) * x.element_size()
    stages = max(2, min(4, (smem - 16 * 1024) // stage))  # room left for the epilogue
    return bm, bn, bk, 8, stages  # 4 warps spill at fp32 on sm_80 (docs/kernels.md)


def _prec(x: torch.Tensor) -> str:
    # Keep fp32 dots in fp32 (torch does by default); tf32 would be less exact than the reference.
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a (T, K), b (E, K, N) any strides -> c (T, N) in a's dtype, c[rows of e] = a[..] @ b[e]."""
    t, k = a.shape
    e, _, n = b.shape
    c = torch.empty((t, n), dtype=a.dtype, device=a.device)
    if t == 0:
        return c
    bm, bn, bk, warps, stages = _config(a)
    # Row tiles: at most cdiv(t, bm) + e - 1 (each expert wastes less than one tile).
    grid = (triton.cdiv(t, bm) + e - 1, triton.cdiv(n, bn))
    _grouped_mm_kernel[grid](
        a, b, c, offsets, e, k, n, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        b.stride(2), c.stride(0), c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_E=triton.next_power_of_2(e), PREC=_prec(a), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


def _dw(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, e: int) -> torch.Tensor:
    """dy (T, n), x (T, k) -> dw (e, n, k) in x's dtype, dw[e] = dy_e.T @ x_e (0 if empty)."""
    t, k = x.shape
    n = dy.shape[1]
    if t == 0:
        return torch.zeros((e, n, k), dtype=x.dtype, device=x.device)
    dw = torch.empty((e, n, k), dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = _dw_config(x)
    _grouped_dw_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk), e)](
        dy, x, dw, offsets, n, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PREC=_prec(x), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dw


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return _mm(x, w.transpose(1, 2), offsets)  # b[e] = w[e].T: (k, n), a strided view

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors  # (T, k), (E, n, k), (E+1,)
        dx = _mm(dy, w, offsets) if ctx.needs_input_grad[0] else None  # b[e] = w[e]: (n, k)
        dw = _dw(dy, x, offsets, w.shape[0]) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    """Shape, dtype and device checks on metadata only (nothing here waits on the device)."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or w.shape[0] == 0:
        raise ValueError(
            f"grouped_mm: x {tuple(x.shape)} and w {tuple(w.shape)} must be (T, k) and "
            "(E >= 1, n, k)"
        )
    if offsets.shape != (w.shape[0] + 1,) or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"grouped_mm: offsets must be int32/int64 of shape ({w.shape[0] + 1},) for "
            f"{w.shape[0]} experts, got {offsets.dtype} {tuple(offsets.shape)}"
        )
    if x.dtype != w.dtype or w.device != x.device or offsets.device != x.device:
        raise ValueError(
            f"grouped_mm: x ({x.dtype}, {x.device}), w ({w.dtype}, {w.device}) and offsets "
            f"({offsets.device}) must share x's dtype (offsets: an integer type) and device"
        )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """All local experts' matmuls in one launch over tokens sorted by expert.

    x (T, k): tokens, sorted so that expert e owns rows offsets[e]:offsets[e+1];
    w (E, n, k): one nn.Linear-style weight (out, in) per expert, any strides;
    offsets (E+1,) int64 (or int32) on x's device, offsets[0] = 0, offsets[E] = T, non-decreasing
    (equal consecutive offsets: an expert with no tokens).
    Returns y (T, n) with y[rows of e] = x[rows of e] @ w[e].T, in x's dtype (fp32 accumulation).
    Autograd: dx = dy @ w[e] per expert's rows, dw[e] = dy_e.T @ x_e (zero for an expert with no
    tokens). The Triton path never reads offsets on the host; offsets are trusted, not checked.
    Falls back to the torch reference (one warning) for fp64 and other unsupported inputs.
    """
    _check(x, w, offsets)
    # T = 0 (an expert-parallel rank that received no tokens) stays on the kernel path: no sync.
    reason = unsupported(w) or (unsupported(x) if x.numel() else None)
    if reason:
        warn_once("grouped_mm", reason)
        return grouped_mm_ref(x, w, offsets)
    return _GroupedMM.apply(x, w, offsets)


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The same in plain torch: one matmul per expert, in x's dtype (reads offsets on the host)."""
    _check(x, w, offsets)
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != x.shape[0] or sorted(bounds) != bounds:
        raise ValueError(
            f"grouped_mm: offsets {bounds} must rise from 0 to T={x.shape[0]} without falling"
        )
    # An empty expert contributes a (0, n) block; autograd then gives it a zero dw[e]. split and
    # unbind, not x[lo:hi] and w[e]: their backward is one cat / stack, where indexing builds a
    # zero tensor of the whole x and w per expert (E times the weights' traffic on CPU).
    sizes = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    parts = [xe @ we.T for xe, we in zip(x.split(sizes), w.unbind(0))]
    return torch.cat(parts)
