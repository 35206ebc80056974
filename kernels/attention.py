"""Causal self-attention with grouped-query heads: a FlashAttention-2 style Triton kernel.

Forward: one program per (query block, batch * query head) streams key/value blocks with an
online softmax, so the (s, s) score matrix never exists; it saves only the per-row log-sum-exp
(in log2 units, fp32). Key blocks strictly below the diagonal need no causal mask, so each loop
runs in two phases: unmasked blocks, then the masked diagonal block(s).

Backward (no atomics): one kernel per key/value block accumulates dK and dV over every query head
of its group (GQA: the group's gradients are summed in registers, never expanded), and a second
kernel per query block accumulates dQ. Both recompute the probabilities from the saved LSE.
Tensors keep their strides (any layout with unit stride along d), and the output takes q's layout,
so q = x.view(b, s, h, d).transpose(1, 2) gives an output whose transpose back is free.

Blocks for context parallelism (ring attention) and document masking, in the second half:
visibility comes from integer positions and optional doc ids (key j visible to query i iff
k_pos[j] <= q_pos[i] and q_doc[i] == k_doc[j]), so the query and key blocks may be any slices of
the sequence, in any order. A ring step on query rows Q and one key/value block runs

    out_b, lse_b = attention_block_fwd(q, k, v, q_pos, k_pos)   # fp32, this block's keys only
    out, lse = merge_attention(out, lse, out_b, lse_b)          # exact, over all blocks so far
    # backward, with the final (merged) out and lse of the rows:
    dq_b, dk_b, dv_b = attention_block_bwd(q, k, v, out, lse, dout, q_pos, k_pos)  # fp32

and summing the block results over all key blocks gives the full attention and its gradients.
attention_masked is the same on one device, as an autograd op. Each has a plain-torch `_ref`.
"""

import math

import torch
import torch.nn.functional as F
from megalite.kernels._triton import tl, triton, unsupported, warn_once

HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K, V, sk_s, sv_s, offs_m, offs_d, lo, hi, seq, qk_scale,
    MASK: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kmask = offs_n < seq
        kT = tl.load(K + offs_n[None, :] * sk_s + offs_d[:, None], mask=kmask[None, :], other=0.0)
        qk = tl.dot(q, kT, input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASK:
            causal = (offs_m[:, None] >= offs_n[None, :]) & kmask[None, :]
            qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: key 0 is visible to every row
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offs_n[:, None] * sv_s + offs_d[None, :], mask=kmask[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
    hq, group, seq, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // hq, bh % hq
    hk = h // group  # the key/value head this query head shares
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    qmask = offs_m[:, None] < seq
    q = tl.load(
        Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], mask=qmask, other=0.0
    )
    K += b * sk_b + hk * sk_h
    V += b * sv_b + hk * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K, V, sk_s, sv_s, offs_m, offs_d, 0, start_m, seq, qk_scale,
        False, BLOCK_N, PREC,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K, V, sk_s, sv_s, offs_m, offs_d, start_m,
        tl.minimum(start_m + BLOCK_M, seq), seq, qk_scale, True, BLOCK_N, PREC,
    )  # fmt: skip
    o = acc / l_i[:, None]
    tl.store(
        O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :],
        o.to(O.dtype.element_ty),
        mask=qmask,
    )
    tl.store(LSE + bh * seq + offs_m, m_i + tl.log2(l_i), mask=offs_m < seq)


@triton.jit
def _attn_bwd_delta(
    O, DO, DELTA, so_b, so_h, so_s, sd_b, sd_h, sd_s, hq, seq,
    D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # delta_i = sum_d o_id * do_id = sum_j p_ij dp_ij: the softmax backward's row term.
    bh = tl.program_id(1)
    b, h = bh // hq, bh % hq
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask = offs_m[:, None] < seq
    o = tl.load(
        O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], mask=mask, other=0.0
    )
    do = tl.load(
        DO + b * sd_b + h * sd_h + offs_m[:, None] * sd_s + offs_d[None, :], mask=mask, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * seq + offs_m, delta, mask=offs_m < seq)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, Q, DO, LSE, DELTA, sq_s, sd_s, offs_n, offs_d, lo, hi, seq, qk_scale,
    MASK: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qmask = offs_m < seq
        qT = tl.load(Q + offs_m[None, :] * sq_s + offs_d[:, None], mask=qmask[None, :], other=0.0)
        # Rows past the end get lse = +inf, hence p = 0: they contribute nothing.
        lse = tl.load(LSE + offs_m, mask=qmask, other=float("inf"))
        pT = tl.exp2(tl.dot(k, qT, input_precision=PREC) * qk_scale - lse[None, :])  # (BN, BM)
        if MASK:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        do = tl.load(DO + offs_m[:, None] * sd_s + offs_d[None, :], mask=qmask[:, None], other=0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        delta = tl.load(DELTA + offs_m, mask=qmask, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)  # (BN, BM)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s,
    sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s, hq, hkv, group, seq, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b, hk = bhk // hkv, bhk % hkv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kmask = offs_n[:, None] < seq
    k = tl.load(
        K + b * sk_b + hk * sk_h + offs_n[:, None] * sk_s + offs_d[None, :], mask=kmask, other=0.0
    )
    v = tl.load(
        V + b * sv_b + hk * sv_h + offs_n[:, None] * sv_s + offs_d[None, :], mask=kmask, other=0.0
    )
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for g in range(group):
        h = hk * group + g
        Qh = Q + b * sq_b + h * sq_h
        DOh = DO + b * sd_b + h * sd_h
        LSEh = LSE + (b * hq + h) * seq
        DELTAh = DELTA + (b * hq + h) * seq
        # Query blocks on the diagonal need the causal mask; those below it see every key here.
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sq_s, sd_s, offs_n, offs_d, start_n,
            tl.minimum(start_n + BLOCK_N, seq), seq, qk_scale, True, BLOCK_M, PREC,
        )  # fmt: skip
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sq_s, sd_s, offs_n, offs_d, start_n + BLOCK_N,
            seq, seq, qk_scale, False, BLOCK_M, PREC,
        )  # fmt: skip
    dk *= sm_scale
    tl.store(
        DK + b * sdk_b + hk * sdk_h + offs_n[:, None] * sdk_s + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kmask,
    )
    tl.store(
        DV + b * sdv_b + hk * sdv_h + offs_n[:, None] * sdv_s + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kmask,
    )


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, K, V, sk_s, sv_s, offs_m, offs_d, lo, hi, seq, qk_scale,
    MASK: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kmask = offs_n[None, :] < seq
        kT = tl.load(K + offs_n[None, :] * sk_s + offs_d[:, None], mask=kmask, other=0.0)
        vT = tl.load(V + offs_n[None, :] * sv_s + offs_d[:, None], mask=kmask, other=0.0)
        p = tl.exp2(tl.dot(q, kT, input_precision=PREC) * qk_scale - lse[:, None])  # (BM, BN)
        if MASK:
            # Keys past the end lie above the diagonal of every real row, so this hides them too.
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = tl.dot(do, vT, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s,
    sdq_b, sdq_h, sdq_s, hq, group, seq, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // hq, bh % hq
    hk = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rmask = offs_m < seq
    q = tl.load(
        Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :],
        mask=rmask[:, None],
        other=0.0,
    )
    do = tl.load(
        DO + b * sd_b + h * sd_h + offs_m[:, None] * sd_s + offs_d[None, :],
        mask=rmask[:, None],
        other=0.0,
    )
    lse = tl.load(LSE + bh * seq + offs_m, mask=rmask, other=float("inf"))
    delta = tl.load(DELTA + bh * seq + offs_m, mask=rmask, other=0.0)
    K += b * sk_b + hk * sk_h
    V += b * sv_b + hk * sv_h
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    dq = _dq_inner(
        dq, q, do, lse, delta, K, V, sk_s, sv_s, offs_m, offs_d, 0, start_m, seq, qk_scale,
        False, BLOCK_N, PREC,
    )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse, delta, K, V, sk_s, sv_s, offs_m, offs_d, start_m,
        tl.minimum(start_m + BLOCK_M, seq), seq, qk_scale, True, BLOCK_N, PREC,
    )  # fmt: skip
    dq *= sm_scale
    tl.store(
        DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=rmask[:, None],
    )


def _config(q: torch.Tensor) -> dict:
    """Block sizes (BLOCK_M, BLOCK_N, warps, stages) per kernel. The loops need fwd
    BLOCK_M % BLOCK_N == 0, dkdv BLOCK_N % BLOCK_M == 0 and dq BLOCK_M % BLOCK_N == 0.

    GPU: FlashAttention-2 tutorial-like tiles. Interpreter: 64 x 64, since its cost is per
    program and per op, not per element (16-row tiles made the tiny preset's attention several
    times slower); the tests use sequences longer than 64 to cover the multi-tile paths."""
    d = q.shape[-1]
    if q.device.type != "cuda":
        return dict(fwd=(64, 64, 1, 1), dkdv=(64, 64, 1, 1), dq=(64, 64, 1, 1))
    if q.dtype == torch.float32:  # fp32 tiles take twice the shared memory
        return dict(fwd=(64, 32, 4, 2), dkdv=(32, 64, 4, 2), dq=(64, 32, 4, 2))
    if d <= 64:
        return dict(fwd=(128, 64, 4, 3), dkdv=(32, 128, 4, 3), dq=(128, 32, 4, 3))
    return dict(fwd=(128, 64, 8, 3), dkdv=(32, 64, 4, 2), dq=(64, 32, 4, 2))


def _prec(q: torch.Tensor) -> str:
    # Keep fp32 dots in fp32 (torch does); tf32 would be less exact than the reference.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _unit_d(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        q, k, v = _unit_d(q, k, v)  # (b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d)
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        o = torch.empty_like(q)  # q's layout (empty_like keeps the strides of a dense tensor)
        lse = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)  # log2 units
        sm_scale = 1.0 / math.sqrt(d)
        bm, bn, warps, stages = _config(q)["fwd"]
        _attn_fwd[(triton.cdiv(s, bm), b * hq)](
            q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1),
            o.stride(2), hq, hq // hkv, s, sm_scale * LOG2E,
            D=d, BLOCK_M=bm, BLOCK_N=bn, PREC=_prec(q), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        (do,) = _unit_d(do)
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        group = hq // hkv
        sm_scale = 1.0 / math.sqrt(d)
        cfg = _config(q)
        delta = torch.empty_like(lse)  # (b, hq, s) fp32
        _attn_bwd_delta[(triton.cdiv(s, 64), b * hq)](
            o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1),
            do.stride(2), hq, s, D=d, BLOCK_M=64,
        )  # fmt: skip
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        strides = (
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        )  # fmt: skip
        bm, bn, warps, stages = cfg["dkdv"]
        _attn_bwd_dkdv[(triton.cdiv(s, bn), b * hkv)](
            q, k, v, do, lse, delta, dk, dv, *strides, dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2), hq, hkv, group, s, sm_scale * LOG2E,
            sm_scale, D=d, BLOCK_M=bm, BLOCK_N=bn, PREC=_prec(q), num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
        bm, bn, warps, stages = cfg["dq"]
        _attn_bwd_dq[(triton.cdiv(s, bm), b * hq)](
            q, k, v, do, lse, delta, dq, *strides, dq.stride(0), dq.stride(1), dq.stride(2), hq,
            group, s, sm_scale * LOG2E, sm_scale, D=d, BLOCK_M=bm, BLOCK_N=bn, PREC=_prec(q),
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return dq, dk, dv


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention, q (b, hq, s, d), k and v (b, hkv, s, d), hq a multiple of hkv.

    Returns (b, hq, s, d) in q's layout. Falls back to the torch reference (with one warning)
    for dropout, head dims outside HEAD_DIMS, or unsupported dtypes and devices.
    """
    reason = unsupported(q, k, v)
    if reason is None:
        if dropout_p > 0.0:
            reason = "attention dropout is not implemented in the Triton kernel"
        elif q.dim() != 4 or k.shape != v.shape or q[:, :1].shape != k[:, :1].shape:
            reason = f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}"
        elif q.shape[1] % k.shape[1] or not (q.dtype == k.dtype == v.dtype):
            reason = "query heads not a multiple of key/value heads, or mixed dtypes"
        elif q.shape[-1] not in HEAD_DIMS:
            reason = f"head dim {q.shape[-1]} not in {HEAD_DIMS}"
    if reason:
        warn_once("attention", reason)
        return attention_ref(q, k, v, dropout_p)
    return _FlashAttention.apply(q, k, v)


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """q (b, hq, s, d), k and v (b, hkv, s, d) with hq a multiple of hkv -> (b, hq, s, d)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
