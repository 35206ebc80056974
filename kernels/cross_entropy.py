"""Cross entropy of logits against labels, one fp32 loss per token.

The forward pass streams each row's logits in vocabulary blocks with an online log-sum-exp
(running max m and sum of exp(x - m)), so no fp32 copy of the (tokens, V) logits ever exists;
it keeps only the fp32 log-sum-exp per row. The backward pass streams the blocks again and writes
softmax - onehot, scaled by the incoming per-token gradient, in the logits' dtype. A program
takes one row on a GPU, ROWS rows at once under the interpreter (_triton.rows_per_program).

Vocab-parallel use (the logits' last dim is sharded over a tensor-parallel group, rank r holding
vocab ids [vocab_start, vocab_start + V/tp)):

    m, s, t = cross_entropy_shard_stats(shard, labels, vocab_start)  # each (...) fp32
    M = all_reduce(m, MAX)                        # global row max
    S = all_reduce(s * exp(m - M), SUM)           # rescale each shard's sum to the global max
    T = all_reduce(t, SUM)                        # exactly one shard holds the target logit
    lse = M + log(S)
    loss = where(labels == ignore_index, 0, lse - T)
    # backward, given d(loss) (...):
    d_shard = cross_entropy_shard_grad(shard, labels, vocab_start, lse, d_loss, ignore_index)

A single device is the case tp = 1, vocab_start = 0, which is what `cross_entropy` does.
"""

import torch
import torch.nn.functional as F
from megalite.kernels._triton import (
    at_least_fp32,
    program_rows,
    rows,
    rows_per_program,
    tl,
    triton,
    unsupported,
    warn_once,
)


@triton.jit
def _ce_stats_kernel(
    LOGITS, LABELS, MAX, SUMEXP, TARGET, stride, n_rows, n_cols, vocab_start,
    BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    row, live = program_rows(n_rows, ROWS)
    local = tl.load(LABELS + row) - vocab_start  # target's column in this shard (may be outside)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    t = tl.zeros([ROWS], tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = (cols < n_cols)[None, :]
        x = tl.load(
            LOGITS + row[:, None] * stride + cols[None, :], mask=mask, other=float("-inf")
        ).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))  # finite from the first block on
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
        t += tl.sum(tl.where((cols[None, :] == local[:, None]) & mask, x, 0.0), axis=1)
    tl.store(MAX + row, m, mask=live)
    tl.store(SUMEXP + row, s, mask=live)
    tl.store(TARGET + row, t, mask=live)


@triton.jit
def _ce_grad_kernel(
    LOGITS, LABELS, LSE, DLOSS, DLOGITS, stride, stride_d, n_rows, n_cols, vocab_start,
    ignore_index, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    row, live = program_rows(n_rows, ROWS)
    label = tl.load(LABELS + row)
    local = (label - vocab_start)[:, None]
    scale = tl.where(label == ignore_index, 0.0, tl.load(DLOSS + row))[:, None]
    lse = tl.load(LSE + row)[:, None]
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        mask = cols < n_cols
        x = tl.load(LOGITS + row[:, None] * stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)) * scale
        tl.store(
            DLOGITS + row[:, None] * stride_d + cols,
            g.to(DLOGITS.dtype.element_ty),
            mask=mask & live[:, None],
        )


def _block_v(logits: torch.Tensor) -> tuple[int, int]:
    # Under the interpreter: about 4 blocks a row (its cost is per op, not per element), at
    # least 64 wide, so the tests' short rows still exercise the multi-block online path.
    n = logits.shape[-1]
    cap = 4096 if logits.device.type == "cuda" else max(64, triton.next_power_of_2(n) // 4)
    return min(triton.next_power_of_2(n), cap), 8


# Rows per slice of the torch references: their fp32 temporaries stay near 2**24 elements, so
# no fp32 copy of the whole (tokens, V) logits exists on this path either.
_REF_ELEMENTS = 2**24


def _row_slices(n_rows: int, n_cols: int):
    step = max(1, _REF_ELEMENTS // max(n_cols, 1))
    return (slice(i, i + step) for i in range(0, n_rows, step))


def cross_entropy_shard_stats_ref(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cross_entropy_shard_stats` in plain torch (fp64 stays fp64), a slice of rows at a time."""
    x2 = logits.reshape(labels.numel(), logits.shape[-1])  # (N, Vs); Vs may be 0
    lab = labels.reshape(-1)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    n, vs = x2.shape
    m, s, t = (torch.empty(n, dtype=dtype, device=logits.device) for _ in range(3))
    if vs == 0:  # a shard that is all vocabulary padding
        return (m.fill_(float("-inf")).view(labels.shape), s.zero_().view(labels.shape),
                t.zero_().view(labels.shape))  # fmt: skip
    for sl in _row_slices(n, vs):
        xf = at_least_fp32(x2[sl])
        m[sl] = xf.amax(-1)
        s[sl] = (xf - m[sl, None]).exp().sum(-1)
        local = lab[sl] - vocab_start
        inside = (local >= 0) & (local < vs)
        t[sl] = torch.where(inside, xf.gather(1, local.clamp(0, vs - 1)[:, None])[:, 0], 0)
    return m.view(labels.shape), s.view(labels.shape), t.view(labels.shape)


def cross_entropy_shard_grad_ref(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    ignore_index: int = -100,
) -> torch.Tensor:
    """`cross_entropy_shard_grad` in plain torch, a slice of rows at a time, without reading
    anything on the host (no nonzero: the one-hot is a scatter)."""
    x2 = logits.reshape(labels.numel(), logits.shape[-1])
    lab, lse1, dl = labels.reshape(-1), lse.reshape(-1), grad_loss.reshape(-1)
    out = torch.empty_like(x2)
    vs = x2.shape[1]
    if vs == 0:
        return out.view(logits.shape)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    for sl in _row_slices(x2.shape[0], vs):
        g = (at_least_fp32(x2[sl]) - lse1[sl, None].to(dtype)).exp()
        local = lab[sl] - vocab_start
        inside = ((local >= 0) & (local < vs)).to(g.dtype)[:, None]
        g.scatter_add_(1, local.clamp(0, vs - 1)[:, None], -inside)
        scale = torch.where(lab[sl] == ignore_index, 0, dl[sl]).to(g.dtype)
        out[sl] = (g * scale[:, None]).to(out.dtype)
    return out.view(logits.shape)


def cross_entropy_shard_stats(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (max, sum of exp(logit - max), target logit or 0 if not in this shard), fp32
    (fp64 for fp64 logits, through the reference).

    logits (..., Vs) is the shard holding vocab ids [vocab_start, vocab_start + Vs); labels (...)
    are global ids. No autograd: see the module docstring for combining and the backward pass.
    """
    if unsupported(logits):
        return cross_entropy_shard_stats_ref(logits, labels, vocab_start)
    x2 = rows(logits)  # (N, Vs)
    lab = labels.reshape(-1).contiguous()  # (N,)
    n = x2.shape[0]
    m, s, t = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    block, warps = _block_v(x2)
    per = rows_per_program(n, block)
    _ce_stats_kernel[(triton.cdiv(n, per),)](
        x2, lab, m, s, t, x2.stride(0), n, x2.shape[1], vocab_start, BLOCK_V=block, ROWS=per,
        num_warps=warps,
    )  # fmt: skip
    return m.view(labels.shape), s.view(labels.shape), t.view(labels.shape)


def cross_entropy_shard_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    ignore_index: int = -100,
) -> torch.Tensor:
    """d loss / d logits for a shard: (softmax - onehot) * grad_loss, in the logits' dtype.

    lse (...) is the global log-sum-exp per row, grad_loss (...) the gradient of the per-token
    loss; rows whose label is ignore_index get zero gradient.
    """
    if unsupported(logits):
        return cross_entropy_shard_grad_ref(logits, labels, vocab_start, lse, grad_loss,
                                            ignore_index)  # fmt: skip
    x2 = rows(logits)  # (N, Vs)
    lab = labels.reshape(-1).contiguous()
    lse1, dl = lse.reshape(-1).float().contiguous(), grad_loss.reshape(-1).float().contiguous()
    d = torch.empty(x2.shape, dtype=logits.dtype, device=logits.device)
    block, warps = _block_v(x2)
    n = x2.shape[0]
    per = rows_per_program(n, block)
    _ce_grad_kernel[(triton.cdiv(n, per),)](
        x2, lab, lse1, dl, d, x2.stride(0), d.stride(0), n, x2.shape[1], vocab_start,
        ignore_index, BLOCK_V=block, ROWS=per, num_warps=warps,
    )  # fmt: skip
    return d.view(logits.shape)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        m, s, t = cross_entropy_shard_stats(logits, labels, 0)
        lse = m + torch.log(s)
        ctx.save_for_backward(logits, labels, lse)
        ctx.ignore_index = ignore_index
        return torch.where(labels == ignore_index, 0.0, lse - t)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse = ctx.saved_tensors
        d = cross_entropy_shard_grad(logits, labels, 0, lse, grad_loss, ctx.ignore_index)
        return d, None, None


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """logits (..., V), labels (...) -> per-token loss (...) in fp32 (0 where ignored)."""
    reason = unsupported(logits)
    if reason is None and logits.shape[:-1] != labels.shape:
        reason = f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}"
    if reason:
        warn_once("cross_entropy", reason)
        return cross_entropy_ref(logits, labels, ignore_index)
    return _CrossEntropy.apply(logits, labels, ignore_index)


def cross_entropy_ref(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """logits (..., V), labels (...) -> per-token loss (...) in fp32 (0 where ignored)."""
    flat = F.cross_entropy(
        at_least_fp32(logits).flatten(0, -2),
        labels.flatten(),
        ignore_index=ignore_index,
        reduction="none",
    )
    return flat.view(labels.shape)
