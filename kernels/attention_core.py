"""The attention kernels: one FlashAttention-2 style set for causal, document-masked and
ring-block attention (the ops are in attention.py and attention_blocks.py).

Visibility is data: query i sees key j iff k_pos[j] <= q_pos[i] and (with doc ids)
q_doc[i] == k_doc[j] and (with a sliding window W > 0, a runtime int: 0 is none)
k_pos[j] > q_pos[i] - W; causal attention is q_pos = k_pos = 0..s-1. The host lists, per row tile,
the column tiles that are fully visible (no mask) and those that are partly visible (masked per
element); every other tile is skipped, so a causal pass costs about half the square. Lists are
tensors read by the kernels, so nothing syncs with the host or recompiles per mask.

Forward: one program per (query tile, batch * query head) streams its listed key/value tiles
with an online softmax, so the (s_q, s_k) scores never exist, and saves the per-row natural-log
log-sum-exp (fp32; -inf, with output 0, for a row that sees no key). Backward (no atomics): one
kernel per key/value tile accumulates dK and dV over every query head of its GQA group in
registers, a second per query tile accumulates dQ; both recompute the probabilities from the
lse. Tensors keep their strides (any layout with unit stride along d).
"""

import torch
from megalite.kernels._triton import tl, triton

HEAD_DIMS = (16, 32, 64, 128, 192, 256)  # 192: MLA's padded q/k/v (DeepSeek-V3: 128 + 64)
LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(LOG2E)


def dims(d: int) -> dict:
    """The head-dim constexprs: D, the tile width (a power of 2, as tl.arange needs), and
    HEAD_D, the real head dim (< D only for 192, which runs in 256-wide tiles, masked)."""
    return dict(D=triton.next_power_of_2(d), HEAD_D=d)


@triton.jit
def _dmask(offs_d, HEAD_D: tl.constexpr, D: tl.constexpr):
    # The columns past the real head dim: an all-true constant (folded away) unless padded.
    if HEAD_D == D:
        return tl.full([D], 1, tl.int1)
    else:
        return offs_d < HEAD_D


@triton.jit
def _sees(qpos, kpos, qdoc, kdoc, window, HAS_DOC: tl.constexpr):
    # Already broadcast to the tile's shape: (BM, 1) vs (1, BN) or the transpose.
    vis = (kpos <= qpos) & ((kpos > qpos - window) | (window <= 0))
    if HAS_DOC:
        vis = vis & (kdoc == qdoc)
    return vis


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, qpos, qdoc, K, V, KP, KD, IDX, count, sk_s, sv_s, offs_d, dmask, seqk,
    qk_scale, window, MASK: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    for i in range(0, count):
        offs_n = tl.load(IDX + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        kmask = offs_n < seqk
        kT = tl.load(K + offs_n[None, :] * sk_s + offs_d[:, None], mask=kmask[None, :] & dmask[:, None],
                     other=0.0)  # fmt: skip
        qk = tl.dot(q, kT, input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASK:
            kpos = tl.load(KP + offs_n, mask=kmask, other=0)
            kdoc = kpos
            if HAS_DOC:
                kdoc = tl.load(KD + offs_n, mask=kmask, other=0)
            vis = _sees(qpos[:, None], kpos[None, :], qdoc[:, None], kdoc[None, :], window,
                        HAS_DOC)  # fmt: skip
            qk = tl.where(vis & kmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # the running max; -inf until a key is seen
        m_use = m_new
        if MASK:  # a row that has seen no key yet: keep exp2's argument free of -inf - -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offs_n[:, None] * sv_s + offs_d[None, :], mask=kmask[:, None] & dmask[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V, O, LSE, QP, KP, QD, KD, CNT, IDX,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
    sqp_b, skp_b, sqd_b, skd_b, list_b, tiles, hq, group, seqq, seqk, qk_scale, window,
    HAS_DOC: tl.constexpr, D: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    mt = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: b * sq_b, bh * seqq may pass 2^31
    b, h = bh // hq, bh % hq
    hk = h // group
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    dmask = _dmask(offs_d, HEAD_D, D)
    rmask = offs_m < seqq
    q = tl.load(
        Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :],
        mask=rmask[:, None] & dmask[None, :],
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
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, qpos, qdoc, K, V, KP, KD, IDX, tl.load(CNT), sk_s, sv_s, offs_d, dmask, seqk,
        qk_scale, window, False, HAS_DOC, BLOCK_N, PREC,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, qpos, qdoc, K, V, KP, KD, IDX + rows * tiles, tl.load(CNT + rows),
        sk_s, sv_s, offs_d, dmask, seqk, qk_scale, window, True, HAS_DOC, BLOCK_N, PREC,
    )  # fmt: skip
    empty = l_i == 0.0  # no visible key: out 0, lse -inf
    l_i = tl.where(empty, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(
        O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :],
        o.to(O.dtype.element_ty),
        mask=rmask[:, None] & dmask[None, :],
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
def _dkdv_inner(
    dk, dv, k, v, kpos, kdoc, Q, DO, LSE, DELTA, QP, QD, IDX, count, sq_s, sd_s, offs_d, dmask,
    seqq, qk_scale, window, MASK: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_M: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    for i in range(0, count):
        offs_m = tl.load(IDX + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        qmask = offs_m < seqq
        qT = tl.load(Q + offs_m[None, :] * sq_s + offs_d[:, None], mask=qmask[None, :] & dmask[:, None],
                     other=0.0)  # fmt: skip
        lse = _load_lse(LSE, offs_m, qmask)
        pT = tl.exp2(tl.dot(k, qT, input_precision=PREC) * qk_scale - lse[None, :])  # (BN, BM)
        if MASK:
            qpos = tl.load(QP + offs_m, mask=qmask, other=0)
            qdoc = qpos
            if HAS_DOC:
                qdoc = tl.load(QD + offs_m, mask=qmask, other=0)
            vis = _sees(qpos[None, :], kpos[:, None], qdoc[None, :], kdoc[:, None], window,
                        HAS_DOC)  # fmt: skip
            pT = tl.where(vis, pT, 0.0)
        do = tl.load(DO + offs_m[:, None] * sd_s + offs_d[None, :], mask=qmask[:, None] & dmask[None, :],
                     other=0.0)  # fmt: skip
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        delta = tl.load(DELTA + offs_m, mask=qmask, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)  # (BN, BM)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PREC)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, QP, KP, QD, KD, CNT, IDX,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s,
    sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s, sqp_b, skp_b, sqd_b, skd_b, list_b, tiles,
    hq, hkv, group, seqq, seqk, qk_scale, sm_scale, window,
    HAS_DOC: tl.constexpr, D: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    nt = tl.program_id(0)
    bhk = tl.program_id(1).to(tl.int64)  # int64 bases, as in attn_fwd
    b, hk = bhk // hkv, bhk % hkv
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    dmask = _dmask(offs_d, HEAD_D, D)
    kmask = offs_n < seqk
    k = tl.load(
        K + b * sk_b + hk * sk_h + offs_n[:, None] * sk_s + offs_d[None, :],
        mask=kmask[:, None] & dmask[None, :],
        other=0.0,
    )
    v = tl.load(
        V + b * sv_b + hk * sv_h + offs_n[:, None] * sv_s + offs_d[None, :],
        mask=kmask[:, None] & dmask[None, :],
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
        dk, dv = _dkdv_inner(
            dk, dv, k, v, kpos, kdoc, Qh, DOh, LSEh, DELTAh, QP, QD, IDX, n_full, sq_s, sd_s,
            offs_d, dmask, seqq, qk_scale, window, False, HAS_DOC, BLOCK_M, PREC,
        )  # fmt: skip
        dk, dv = _dkdv_inner(
            dk, dv, k, v, kpos, kdoc, Qh, DOh, LSEh, DELTAh, QP, QD, IDX + rows * tiles, n_part,
            sq_s, sd_s, offs_d, dmask, seqq, qk_scale, window, True, HAS_DOC, BLOCK_M, PREC,
        )  # fmt: skip
    dk *= sm_scale
    tl.store(
        DK + b * sdk_b + hk * sdk_h + offs_n[:, None] * sdk_s + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kmask[:, None] & dmask[None, :],
    )
    tl.store(
        DV + b * sdv_b + hk * sdv_h + offs_n[:, None] * sdv_s + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kmask[:, None] & dmask[None, :],
    )


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, qpos, qdoc, K, V, KP, KD, IDX, count, sk_s, sv_s, offs_d, dmask, seqk,
    qk_scale, window, MASK: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    for i in range(0, count):
        offs_n = tl.load(IDX + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        kmask = offs_n < seqk
        kT = tl.load(K + offs_n[None, :] * sk_s + offs_d[:, None], mask=kmask[None, :] & dmask[:, None],
                     other=0.0)  # fmt: skip
        vT = tl.load(V + offs_n[None, :] * sv_s + offs_d[:, None], mask=kmask[None, :] & dmask[:, None],
                     other=0.0)  # fmt: skip
        p = tl.exp2(tl.dot(q, kT, input_precision=PREC) * qk_scale - lse[:, None])  # (BM, BN)
        if MASK:  # keys past the end are zero (k = 0 adds nothing to dq) and masked here too
            kpos = tl.load(KP + offs_n, mask=kmask, other=0)
            kdoc = kpos
            if HAS_DOC:
                kdoc = tl.load(KD + offs_n, mask=kmask, other=0)
            vis = _sees(qpos[:, None], kpos[None, :], qdoc[:, None], kdoc[None, :], window,
                        HAS_DOC)  # fmt: skip
            p = tl.where(vis & kmask[None, :], p, 0.0)
        dp = tl.dot(do, vT, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PREC)
    return dq


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, QP, KP, QD, KD, CNT, IDX,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s,
    sdq_b, sdq_h, sdq_s, sqp_b, skp_b, sqd_b, skd_b, list_b, tiles,
    hq, group, seqq, seqk, qk_scale, sm_scale, window,
    HAS_DOC: tl.constexpr, D: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    mt = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: b * sq_b, bh * seqq may pass 2^31
    b, h = bh // hq, bh % hq
    hk = h // group
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    dmask = _dmask(offs_d, HEAD_D, D)
    rmask = offs_m < seqq
    q = tl.load(
        Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )
    do = tl.load(
        DO + b * sd_b + h * sd_h + offs_m[:, None] * sd_s + offs_d[None, :],
        mask=rmask[:, None] & dmask[None, :],
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
    dq = _dq_inner(
        dq, q, do, lse, delta, qpos, qdoc, K, V, KP, KD, IDX, tl.load(CNT), sk_s, sv_s, offs_d,
        dmask, seqk, qk_scale, window, False, HAS_DOC, BLOCK_N, PREC,
    )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse, delta, qpos, qdoc, K, V, KP, KD, IDX + rows * tiles,
        tl.load(CNT + rows), sk_s, sv_s, offs_d, dmask, seqk, qk_scale, window, True, HAS_DOC, BLOCK_N,
        PREC,
    )  # fmt: skip
    dq *= sm_scale
    tl.store(
        DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=rmask[:, None] & dmask[None, :],
    )


@triton.jit
def attn_bwd_delta(
    O, DO, DELTA, so_b, so_h, so_s, sd_b, sd_h, sd_s, hq, seq,
    D: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # delta_i = sum_d o_id * do_id = sum_j p_ij dp_ij: the softmax backward's row term.
    bh = tl.program_id(1).to(tl.int64)  # int64: b * sq_b, bh * seqq may pass 2^31
    b, h = bh // hq, bh % hq
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    dmask = _dmask(offs_d, HEAD_D, D)
    mask = (offs_m[:, None] < seq) & dmask[None, :]
    o = tl.load(
        O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], mask=mask, other=0.0
    )
    do = tl.load(
        DO + b * sd_b + h * sd_h + offs_m[:, None] * sd_s + offs_d[None, :], mask=mask, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * seq + offs_m, delta, mask=offs_m < seq)


def config(q: torch.Tensor) -> dict:
    """Block sizes (BLOCK_M, BLOCK_N, warps, stages) of each kernel, for q (b, hq, s, d).

    GPU: FlashAttention-2 tutorial-like tiles. Interpreter: 64 x 64, since its cost is per
    program and per op, not per element (16-row tiles made the tiny preset's attention several
    times slower); the tests use sequences longer than 64 to cover the multi-tile paths."""
    d = q.shape[-1]
    if q.device.type != "cuda":
        return dict(fwd=(64, 64, 1, 1), dkdv=(64, 64, 1, 1), dq=(64, 64, 1, 1))
    if d > 128:  # 256-wide tiles (192 padded): fewer rows, more warps, or the accumulators spill
        if q.dtype == torch.float32:
            return dict(fwd=(32, 32, 8, 1), dkdv=(16, 32, 8, 1), dq=(32, 16, 8, 1))
        return dict(fwd=(64, 32, 8, 2), dkdv=(32, 32, 8, 1), dq=(32, 32, 8, 1))
    if q.dtype == torch.float32:  # fp32 tiles take twice the shared memory
        return dict(fwd=(64, 32, 4, 2), dkdv=(32, 64, 4, 2), dq=(64, 32, 4, 2))
    if d <= 64:
        return dict(fwd=(128, 64, 4, 3), dkdv=(32, 128, 8, 2), dq=(128, 32, 8, 3))
    return dict(fwd=(128, 64, 8, 3), dkdv=(32, 64, 8, 2), dq=(64, 32, 4, 2))


def precision(q: torch.Tensor) -> str:
    # Keep fp32 dots in fp32 (torch does); tf32 would be less exact than the reference.
    return "ieee" if q.dtype == torch.float32 else "tf32"
