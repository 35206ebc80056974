"""Attention blocks for context parallelism (ring attention) and document masking.

Visibility is data: query i sees key j iff k_pos[j] <= q_pos[i] and (with doc ids)
q_doc[i] == k_doc[j]. The host turns positions and doc ids into per-tile lists (_tile_lists):
for each row tile, the column tiles that are fully visible (no mask needed) and those that are
partly visible (masked per element); every other tile is skipped, so a causal block costs about
half, as the two phases of attention.py's kernels do. Lists are tensors read by the kernels, so no
host sync happens and nothing is recompiled per mask.
"""

import math

import torch
import torch.nn.functional as F
from megalite.kernels._triton import at_least_fp32, tl, triton, unsupported, warn_once
from megalite.kernels.attention import (
    HEAD_DIMS,
    LOG2E,
    _attn_bwd_delta,
    _config,
    _prec,
    _unit_d,
)

_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _sees(qpos, kpos, qdoc, kdoc, HAS_DOC: tl.constexpr):
    # Already broadcast to the tile's shape: (BM, 1) vs (1, BN) or the transpose.
    vis = kpos <= qpos
    if HAS_DOC:
        vis = vis & (kdoc == qdoc)
    return vis


@triton.jit
def _blk_fwd_inner(
    acc, l_i, m_i, q, qpos, qdoc, K, V, KP, KD, IDX, count, sk_s, sv_s, offs_d, seqk, qk_scale,
    MASK: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    for i in range(0, count):
        offs_n = tl.load(IDX + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        kmask = offs_n < seqk
        kT = tl.load(K + offs_n[None, :] * sk_s + offs_d[:, None], mask=kmask[None, :], other=0.0)
        qk = tl.dot(q, kT, input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASK:
            kpos = tl.load(KP + offs_n, mask=kmask, other=0)
            kdoc = kpos
            if HAS_DOC:
                kdoc = tl.load(KD + offs_n, mask=kmask, other=0)
            vis = _sees(qpos[:, None], kpos[None, :], qdoc[:, None], kdoc[None, :], HAS_DOC)
            qk = tl.where(vis & kmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # the running max; -inf until a key is seen
        m_use = m_new
        if MASK:  # a row that has seen no key yet: keep exp2's argument free of -inf - -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offs_n[:, None] * sv_s + offs_d[None, :], mask=kmask[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _blk_fwd(
    Q, K, V, O, LSE, QP, KP, QD, KD, CNT, IDX,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
    sqp_b, skp_b, sqd_b, skd_b, list_b, tiles, hq, group, seqq, seqk, qk_scale,
    HAS_DOC: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    mt = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // hq, bh % hq
    hk = h // group
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rmask = offs_m < seqq
    q = tl.load(
        Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :],
        mask=rmask[:, None],
        other=0.0,
    )
    qpos = tl.load(QP + b * sqp_b + offs_m, mask=rmask, other=0)
    qdoc = qpos
    if HAS_DOC:
        qdoc = tl.load(QD + b * sqd_b + offs_m, mask=rmask, other=0)
    K += b * sk_b + hk * sk_h
    V += b * sv_b + hk * sv_h
    KP += b * skp_b
    KD += b * skd_b
    # Lists (B, 2, row tiles): [.., 0, ..] the fully visible column tiles, [.., 1, ..] the partly.
    rows = tl.num_programs(0)
    CNT += b * list_b * 2 * rows + mt
    IDX += (b * list_b * 2 * rows + mt) * tiles
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    acc, l_i, m_i = _blk_fwd_inner(
        acc, l_i, m_i, q, qpos, qdoc, K, V, KP, KD, IDX, tl.load(CNT), sk_s, sv_s, offs_d, seqk,
        qk_scale, False, HAS_DOC, BLOCK_N, PREC,
    )  # fmt: skip
    acc, l_i, m_i = _blk_fwd_inner(
        acc, l_i, m_i, q, qpos, qdoc, K, V, KP, KD, IDX + rows * tiles, tl.load(CNT + rows),
        sk_s, sv_s, offs_d, seqk, qk_scale, True, HAS_DOC, BLOCK_N, PREC,
    )  # fmt: skip
    empty = l_i == 0.0  # no visible key: out 0, lse -inf
    l_i = tl.where(empty, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(
        O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :],
        o.to(O.dtype.element_ty),
        mask=rmask[:, None],
    )
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_i)) * _LN2)  # natural log
    tl.store(LSE + bh * seqq + offs_m, lse, mask=rmask)


@triton.jit
def _load_lse(LSE, offs_m, qmask):
    # Natural-log lse -> log2 units. Rows past the end, and rows that see no key at all
    # (lse = -inf), get +inf so that p = exp2(s - lse) = 0 and they contribute nothing.
    lse = tl.load(LSE + offs_m, mask=qmask, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)


@triton.jit
def _blk_dkdv_inner(
    dk, dv, k, v, kpos, kdoc, Q, DO, LSE, DELTA, QP, QD, IDX, count, sq_s, sd_s, offs_d, seqq,
    qk_scale, MASK: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_M: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    for i in range(0, count):
        offs_m = tl.load(IDX + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        qmask = offs_m < seqq
        qT = tl.load(Q + offs_m[None, :] * sq_s + offs_d[:, None], mask=qmask[None, :], other=0.0)
        lse = _load_lse(LSE, offs_m, qmask)
        pT = tl.exp2(tl.dot(k, qT, input_precision=PREC) * qk_scale - lse[None, :])  # (BN, BM)
        if MASK:
            qpos = tl.load(QP + offs_m, mask=qmask, other=0)
            qdoc = qpos
            if HAS_DOC:
                qdoc = tl.load(QD + offs_m, mask=qmask, other=0)
            vis = _sees(qpos[None, :], kpos[:, None], qdoc[None, :], kdoc[:, None], HAS_DOC)
            pT = tl.where(vis, pT, 0.0)
        do = tl.load(DO + offs_m[:, None] * sd_s + offs_d[None, :], mask=qmask[:, None], other=0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        delta = tl.load(DELTA + offs_m, mask=qmask, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)  # (BN, BM)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _blk_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, QP, KP, QD, KD, CNT, IDX,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s,
    sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s, sqp_b, skp_b, sqd_b, skd_b, list_b, tiles,
    hq, hkv, group, seqq, seqk, qk_scale, sm_scale,
    HAS_DOC: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    nt = tl.program_id(0)
    bhk = tl.program_id(1)
    b, hk = bhk // hkv, bhk % hkv
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kmask = offs_n < seqk
    k = tl.load(
        K + b * sk_b + hk * sk_h + offs_n[:, None] * sk_s + offs_d[None, :],
        mask=kmask[:, None],
        other=0.0,
    )
    v = tl.load(
        V + b * sv_b + hk * sv_h + offs_n[:, None] * sv_s + offs_d[None, :],
        mask=kmask[:, None],
        other=0.0,
    )
    # Keys past the end are never stored, so they need no mask of their own.
    kpos = tl.load(KP + b * skp_b + offs_n, mask=kmask, other=0)
    kdoc = kpos
    if HAS_DOC:
        kdoc = tl.load(KD + b * skd_b + offs_n, mask=kmask, other=0)
    QP += b * sqp_b
    QD += b * sqd_b
    rows = tl.num_programs(0)
    CNT += b * list_b * 2 * rows + nt
    IDX += (b * list_b * 2 * rows + nt) * tiles
    n_full = tl.load(CNT)
    n_part = tl.load(CNT + rows)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for g in range(group):  # GQA: the group's query heads summed in registers
        h = hk * group + g
        Qh = Q + b * sq_b + h * sq_h
        DOh = DO + b * sd_b + h * sd_h
        LSEh = LSE + (b * hq + h) * seqq
        DELTAh = DELTA + (b * hq + h) * seqq
        dk, dv = _blk_dkdv_inner(
            dk, dv, k, v, kpos, kdoc, Qh, DOh, LSEh, DELTAh, QP, QD, IDX, n_full, sq_s, sd_s,
            offs_d, seqq, qk_scale, False, HAS_DOC, BLOCK_M, PREC,
        )  # fmt: skip
        dk, dv = _blk_dkdv_inner(
            dk, dv, k, v, kpos, kdoc, Qh, DOh, LSEh, DELTAh, QP, QD, IDX + rows * tiles, n_part,
            sq_s, sd_s, offs_d, seqq, qk_scale, True, HAS_DOC, BLOCK_M, PREC,
        )  # fmt: skip
    dk *= sm_scale
    tl.store(
        DK + b * sdk_b + hk * sdk_h + offs_n[:, None] * sdk_s + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kmask[:, None],
    )
    tl.store(
        DV + b * sdv_b + hk * sdv_h + offs_n[:, None] * sdv_s + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kmask[:, None],
    )


@triton.jit
def _blk_dq_inner(
    dq, q, do, lse, delta, qpos, qdoc, K, V, KP, KD, IDX, count, sk_s, sv_s, offs_d, seqk,
    qk_scale, MASK: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    for i in range(0, count):
        offs_n = tl.load(IDX + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        kmask = offs_n < seqk
        kT = tl.load(K + offs_n[None, :] * sk_s + offs_d[:, None], mask=kmask[None, :], other=0.0)
        vT = tl.load(V + offs_n[None, :] * sv_s + offs_d[:, None], mask=kmask[None, :], other=0.0)
        p = tl.exp2(tl.dot(q, kT, input_precision=PREC) * qk_scale - lse[:, None])  # (BM, BN)
        if MASK:  # keys past the end are zero (k = 0 adds nothing to dq) and masked here too
            kpos = tl.load(KP + offs_n, mask=kmask, other=0)
            kdoc = kpos
            if HAS_DOC:
                kdoc = tl.load(KD + offs_n, mask=kmask, other=0)
            vis = _sees(qpos[:, None], kpos[None, :], qdoc[:, None], kdoc[None, :], HAS_DOC)
            p = tl.where(vis & kmask[None, :], p, 0.0)
        dp = tl.dot(do, vT, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PREC)
    return dq


@triton.jit
def _blk_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, QP, KP, QD, KD, CNT, IDX,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s,
    sdq_b, sdq_h, sdq_s, sqp_b, skp_b, sqd_b, skd_b, list_b, tiles,
    hq, group, seqq, seqk, qk_scale, sm_scale,
    HAS_DOC: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    mt = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // hq, bh % hq
    hk = h // group
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rmask = offs_m < seqq
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
    lse = _load_lse(LSE + bh * seqq, offs_m, rmask)
    delta = tl.load(DELTA + bh * seqq + offs_m, mask=rmask, other=0.0)
    qpos = tl.load(QP + b * sqp_b + offs_m, mask=rmask, other=0)
    qdoc = qpos
    if HAS_DOC:
        qdoc = tl.load(QD + b * sqd_b + offs_m, mask=rmask, other=0)
    K += b * sk_b + hk * sk_h
    V += b * sv_b + hk * sv_h
    KP += b * skp_b
    KD += b * skd_b
    rows = tl.num_programs(0)
    CNT += b * list_b * 2 * rows + mt
    IDX += (b * list_b * 2 * rows + mt) * tiles
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    dq = _blk_dq_inner(
        dq, q, do, lse, delta, qpos, qdoc, K, V, KP, KD, IDX, tl.load(CNT), sk_s, sv_s, offs_d,
        seqk, qk_scale, False, HAS_DOC, BLOCK_N, PREC,
    )  # fmt: skip
    dq = _blk_dq_inner(
        dq, q, do, lse, delta, qpos, qdoc, K, V, KP, KD, IDX + rows * tiles,
        tl.load(CNT + rows), sk_s, sv_s, offs_d, seqk, qk_scale, True, HAS_DOC, BLOCK_N, PREC,
    )  # fmt: skip
    dq *= sm_scale
    tl.store(
        DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=rmask[:, None],
    )


def _ids(x: torch.Tensor | None, b: int, s: int, what: str, device) -> torch.Tensor | None:
    """(s,) or (b, s) ints -> (1 or b, s) int64 with unit stride along s (None stays None)."""
    if x is None:
        return None
    if x.dtype.is_floating_point or x.dtype.is_complex:
        raise ValueError(f"{what} must be an integer tensor, got {x.dtype}")
    x = x.reshape(1, -1) if x.dim() == 1 else x
    if x.dim() != 2 or x.shape[1] != s or x.shape[0] not in (1, b):
        raise ValueError(f"{what} has shape {tuple(x.shape)}; expected ({s},) or ({b}, {s})")
    return x.to(device=device, dtype=torch.int64).contiguous()


def _check_ids(q, k, q_pos, k_pos, q_doc, k_doc):
    """Validated (1|b, s) int64 positions and doc ids on q's device."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("give both q_doc and k_doc, or neither")
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    return (
        _ids(q_pos, b, sq, "q_pos", q.device),
        _ids(k_pos, b, sk, "k_pos", q.device),
        _ids(q_doc, b, sq, "q_doc", q.device),
        _ids(k_doc, b, sk, "k_doc", q.device),
    )


def _tile_range(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, s) -> per-tile (min, max), each (B, cdiv(s, block)). The last tile is padded with its
    last element, which leaves its range unchanged."""
    pad = -x.shape[1] % block
    if pad:
        x = torch.cat([x, x[:, -1:].expand(-1, pad)], 1)
    x = x.view(x.shape[0], -1, block)
    return x.amin(-1), x.amax(-1)


def _tile_lists(qp, kp, qd, kd, bm, bn, sk, by_key):
    """Which (query tile, key tile) pairs the kernels visit, as lists the kernels read.

    Returns cnt (B, 2, rows) int32 and idx (B, 2, rows, cols) int32, B = 1 or b (per-row ids):
    [:, 0] lists the fully visible column tiles of each row tile, [:, 1] the partly visible
    ones (those need the element mask), in increasing order, idx[.., :cnt] valid. Rows are
    query tiles (cols key tiles) or, with by_key, the transpose. Tiles are judged by the range
    of their positions and doc ids, so the lists are exact for sorted doc ids and conservative
    (never wrong) otherwise.
    """
    qlo, qhi = _tile_range(qp, bm)  # (B, mt)
    klo, khi = _tile_range(kp, bn)  # (B, nt)
    some = klo[:, None, :] <= qhi[:, :, None]  # (B, mt, nt): some key may be visible
    full = khi[:, None, :] <= qlo[:, :, None]
    if qd is not None:
        dqlo, dqhi = _tile_range(qd, bm)
        dklo, dkhi = _tile_range(kd, bn)
        some = (
            some & (dklo[:, None, :] <= dqhi[:, :, None]) & (dkhi[:, None, :] >= dqlo[:, :, None])
        )
        one_doc = (dqlo == dqhi)[:, :, None] & (dklo == dkhi)[:, None, :]
        full = full & one_doc & (dklo[:, None, :] == dqlo[:, :, None])
    if sk % bn:
        full[:, :, -1] = False  # keys past the end need the bounds mask
    part = some & ~full
    lists = torch.stack([full, part], 1)  # (B, 2, mt, nt)
    if by_key:
        lists = lists.transpose(2, 3)
    cnt = lists.sum(-1, dtype=torch.int32)
    # A stable sort of "not listed" puts the listed tiles first, in increasing order.
    idx = torch.sort((~lists).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return cnt.contiguous(), idx.contiguous()


def _id_args(qp, kp, qd, kd):
    """Kernel arguments for the ids: tensors (docs replaced by positions when absent, unread)
    and their batch strides (0 when shared by every row)."""
    has_doc = qd is not None
    qd, kd = (qd, kd) if has_doc else (qp, kp)
    strides = [t.stride(0) if t.shape[0] > 1 else 0 for t in (qp, kp, qd, kd)]
    per_row = int(any(t.shape[0] > 1 for t in (qp, kp, qd, kd)))
    return (qp, kp, qd, kd), strides, per_row, has_doc


def _block_fwd(q, k, v, ids, scale, out_dtype):
    """Launch the forward kernel: out (q's layout, out_dtype), lse (b, hq, sq) fp32 natural log."""
    q, k, v = _unit_d(q, k, v)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    o = torch.empty_like(q, dtype=out_dtype)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    (qp, kp, qd, kd), id_strides, per_row, has_doc = _id_args(*ids)
    bm, bn, warps, stages = _config(q)["fwd"]
    cnt, idx = _tile_lists(*ids, bm, bn, sk, by_key=False)
    _blk_fwd[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, o, lse, qp, kp, qd, kd, cnt, idx, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2), *id_strides, per_row, idx.shape[-1], hq,
        hq // hkv, sq, sk, scale * LOG2E, HAS_DOC=has_doc, D=d, BLOCK_M=bm, BLOCK_N=bn,
        PREC=_prec(q), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return o, lse


def _block_bwd(q, k, v, o, lse, do, ids, scale, grad_dtype):
    """Launch the backward kernels: dq, dk, dv in grad_dtype (q's, k's, v's layout if dense)."""
    q, k, v, o = _unit_d(q, k, v, o)
    (do,) = _unit_d(do.to(q.dtype))  # the dots pair do with v and p, in q's dtype
    lse = lse.to(torch.float32).contiguous()  # (b, hq, sq)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    (qp, kp, qd, kd), id_strides, per_row, has_doc = _id_args(*ids)
    cfg = _config(q)
    delta = torch.empty_like(lse)  # (b, hq, sq): rowsum(do * o) of the final output
    _attn_bwd_delta[(triton.cdiv(sq, 64), b * hq)](
        o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1),
        do.stride(2), hq, sq, D=d, BLOCK_M=64,
    )  # fmt: skip
    dq = torch.empty_like(q, dtype=grad_dtype)
    dk = torch.empty_like(k, dtype=grad_dtype)
    dv = torch.empty_like(v, dtype=grad_dtype)
    strides = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
    )  # fmt: skip
    bm, bn, warps, stages = cfg["dkdv"]
    cnt, idx = _tile_lists(*ids, bm, bn, sk, by_key=True)
    _blk_bwd_dkdv[(triton.cdiv(sk, bn), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, qp, kp, qd, kd, cnt, idx, *strides, dk.stride(0),
        dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), *id_strides,
        per_row, idx.shape[-1], hq, hkv, group, sq, sk, scale * LOG2E, scale,
        HAS_DOC=has_doc, D=d, BLOCK_M=bm, BLOCK_N=bn, PREC=_prec(q), num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    bm, bn, warps, stages = cfg["dq"]
    cnt, idx = _tile_lists(*ids, bm, bn, sk, by_key=False)
    _blk_bwd_dq[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, do, lse, delta, dq, qp, kp, qd, kd, cnt, idx, *strides, dq.stride(0),
        dq.stride(1), dq.stride(2), *id_strides, per_row, idx.shape[-1], hq, group, sq, sk,
        scale * LOG2E, scale, HAS_DOC=has_doc, D=d, BLOCK_M=bm, BLOCK_N=bn, PREC=_prec(q),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv


def _block_reason(q, k, v, *more) -> str | None:
    """Why the block kernels cannot take these inputs, or None."""
    reason = unsupported(q, k, v, *more)
    if reason is None:
        if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
            reason = f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}"
        elif q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
            reason = f"shapes q {tuple(q.shape)} k {tuple(k.shape)} do not pair (b, hq, s, d)"
        elif not (q.dtype == k.dtype == v.dtype):
            reason = "q, k and v have mixed dtypes"
        elif q.shape[-1] not in HEAD_DIMS:
            reason = f"head dim {q.shape[-1]} not in {HEAD_DIMS}"
    return reason


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def attention_block_fwd(q, k, v, q_pos, k_pos, q_doc=None, k_doc=None, scale=None):
    """Attention of a query block against one key/value block (one step of ring attention).

    q (b, hq, s_q, d); k, v (b, hkv, s_k, d) with hq a multiple of hkv. q_pos (s_q,) and k_pos
    (s_k,) are integer global positions, or (b, s_q) / (b, s_k) per batch row; query i sees key j
    iff k_pos[j] <= q_pos[i] and, with doc ids (same shapes, both or neither), q_doc[i] ==
    k_doc[j]. scale defaults to 1/sqrt(d).

    Returns (out, lse): out (b, hq, s_q, d), the softmax over the visible keys of this block only,
    in fp32 (fp64 for fp64 inputs), in q's layout when q is dense; lse (b, hq, s_q) fp32 (fp64),
    the natural-log log-sum-exp of the scaled scores over those keys. A row that sees no key
    here gets out = 0 and lse = -inf. Combine blocks with merge_attention. No autograd.
    """
    ids = _check_ids(q, k, q_pos, k_pos, q_doc, k_doc)
    reason = _block_reason(q, k, v)
    if reason:
        warn_once("attention_block_fwd", reason)
        return attention_block_fwd_ref(q, k, v, *ids, scale=scale)
    return _block_fwd(q, k, v, ids, _scale(q, scale), torch.float32)


def attention_block_bwd(q, k, v, out, lse, dout, q_pos, k_pos, q_doc=None, k_doc=None, scale=None):
    """Gradient contribution of one (query block, key/value block) pair.

    q, k, v, ids and scale as in attention_block_fwd; out (b, hq, s_q, d), lse (b, hq, s_q) are
    the FINAL results of these query rows over all key blocks (merged), dout (b, hq, s_q, d) the
    gradient of out. Returns (dq, dk, dv) in fp32 (fp64 for fp64 q): dq (b, hq, s_q, d) and dk,
    dv (b, hkv, s_k, d) summed over each GQA group. Summed over all key blocks they are the full
    attention's gradients. Rows with lse = -inf (no visible key anywhere) contribute nothing.
    """
    ids = _check_ids(q, k, q_pos, k_pos, q_doc, k_doc)
    reason = _block_reason(q, k, v, out, dout)
    if reason:
        warn_once("attention_block_bwd", reason)
        return attention_block_bwd_ref(q, k, v, out, lse, dout, *ids, scale=scale)
    return _block_bwd(q, k, v, out, lse, dout, ids, _scale(q, scale), torch.float32)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine partial attention over two disjoint key sets: (out (b, hq, s, d), lse (b, hq, s)).

    lse = log(e^lse_a + e^lse_b) and out is the average of out_a and out_b weighted by
    e^(lse_a - lse), e^(lse_b - lse): both weights are at most 1, so nothing overflows. A row
    that is -inf on one side takes the other side as is; -inf on both stays (0, -inf).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    # Where both sides are empty lse is -inf; a finite stand-in keeps the weights 0, not NaN.
    ref = torch.where(lse == float("-inf"), 0.0, lse)
    w_a = torch.exp(lse_a - ref).unsqueeze(-1)
    w_b = torch.exp(lse_b - ref).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, *ids):
        o, lse = _block_fwd(q, k, v, ids, scale, q.dtype)  # (b, hq, s_q, d) in q's layout
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, o, lse, *(t if t is not None else q for t in ids))
        ctx.has_doc = ids[2] is not None
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *ids = ctx.saved_tensors
        if not ctx.has_doc:
            ids[2:] = [None, None]
        dq, dk, dv = _block_bwd(q, k, v, o, lse, do, ids, ctx.scale, q.dtype)
        return dq, dk, dv, None, None, None, None, None


def attention_masked(q, k, v, q_pos, k_pos, q_doc=None, k_doc=None):
    """Causal-by-position attention with optional document masking, with autograd.

    q (b, hq, s_q, d), k and v (b, hkv, s_k, d); positions and doc ids as in attention_block_fwd
    (any order: a load-balanced permutation of the sequence works). Returns (b, hq, s_q, d) in
    q's dtype and layout; rows that see no key are 0.
    """
    ids = _check_ids(q, k, q_pos, k_pos, q_doc, k_doc)
    reason = _block_reason(q, k, v)
    if reason:
        warn_once("attention_masked", reason)
        return attention_masked_ref(q, k, v, *ids)
    return _MaskedAttention.apply(q, k, v, _scale(q, None), *ids)


def _visible_ref(q_pos, k_pos, q_doc, k_doc) -> torch.Tensor:
    """(1|b, s_q, s_k) bool: key j visible to query i."""
    q_pos, k_pos = q_pos.reshape(-1, 1, q_pos.shape[-1]), k_pos.reshape(-1, 1, k_pos.shape[-1])
    vis = k_pos <= q_pos.transpose(1, 2)
    if q_doc is not None:
        q_doc, k_doc = q_doc.reshape(-1, q_doc.shape[-1], 1), k_doc.reshape(-1, 1, k_doc.shape[-1])
        vis = vis & (k_doc == q_doc)
    return vis


def _grouped(q, k, v, *ids, scale):
    """Upcast to at least fp32 and group query heads: q (b, hkv, g, s_q, d), k and v
    (b, hkv, 1, s_k, d), visibility (1|b, 1, 1, s_q, s_k), and the scale."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    q = at_least_fp32(q).reshape(b, hkv, hq // hkv, sq, d)  # head h = hk * g + i, as the kernels
    k, v = (at_least_fp32(t).to(q.dtype).unsqueeze(2) for t in (k, v))
    vis = _visible_ref(*ids).to(q.device)[:, None, None]
    return q, k, v, vis, _scale(q, scale)


def attention_block_fwd_ref(q, k, v, q_pos, k_pos, q_doc=None, k_doc=None, scale=None):
    """Plain-torch attention_block_fwd, computed in fp32 (fp64 for fp64 inputs)."""
    b, hq, sq, d = q.shape
    q, k, v, vis, scale = _grouped(q, k, v, q_pos, k_pos, q_doc, k_doc, scale=scale)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~vis, float("-inf"))  # (b, hkv, g, sq, sk)
    lse = torch.logsumexp(s, -1, keepdim=True)  # -inf where no key is visible
    p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse))  # 0 on those rows
    return (p @ v).reshape(b, hq, sq, d), lse.reshape(b, hq, sq)


def attention_block_bwd_ref(
    q, k, v, out, lse, dout, q_pos, k_pos, q_doc=None, k_doc=None, scale=None
):
    """Plain-torch attention_block_bwd, computed in fp32 (fp64 for fp64 inputs)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    q, k, v, vis, scale = _grouped(q, k, v, q_pos, k_pos, q_doc, k_doc, scale=scale)
    out, dout = (t.to(q.dtype).reshape(q.shape) for t in (out, dout))
    lse = lse.to(q.dtype).reshape(*q.shape[:-1], 1)
    lse = torch.where(lse == float("-inf"), float("inf"), lse)  # rows that see nothing: p = 0
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~vis, float("-inf"))
    p = torch.exp(s - lse)  # (b, hkv, g, sq, sk), normalised over all key blocks
    delta = (dout * out).sum(-1, keepdim=True)
    ds = p * (dout @ v.transpose(-1, -2) - delta)
    dq = (ds @ k * scale).reshape(b, hq, sq, d)
    dk = (ds.transpose(-1, -2) @ q).sum(2) * scale  # (b, hkv, sk, d)
    dv = (p.transpose(-1, -2) @ dout).sum(2)
    return dq, dk.reshape(b, hkv, sk, d), dv.reshape(b, hkv, sk, d)


def attention_masked_ref(q, k, v, q_pos, k_pos, q_doc=None, k_doc=None):
    """Plain-torch attention_masked: scaled_dot_product_attention with the visibility mask."""
    vis = _visible_ref(q_pos, k_pos, q_doc, k_doc).to(q.device)  # (1|b, sq, sk)
    # Rows that see no key attend to every key (a finite softmax on every backend, hence finite
    # gradients), then are zeroed: their output and gradients are 0.
    empty = ~vis.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=(vis | empty)[:, None], enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.masked_fill(empty[:, None], 0.0)
