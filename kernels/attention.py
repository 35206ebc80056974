"""Causal and document-masked attention with grouped-query heads, as autograd ops.

Both run the one set of kernels in attention_core.py. Causal attention is the case
q_pos = k_pos = 0..s-1 (no doc ids), whose tile lists are cached per shape; attention_masked
takes any integer positions and optional doc ids (key j visible to query i iff
k_pos[j] <= q_pos[i] and q_doc[i] == k_doc[j]), so query and key rows may be any slices of the
sequence in any order. Both take a sliding window W (Mistral's: also k_pos[j] > q_pos[i] - W). The output takes q's layout, so q = x.view(b, s, h, d).transpose(1, 2)
gives an output whose transpose back is free. The launchers here also serve the ring-attention
blocks of attention_blocks.py. Each op has a plain-torch `_ref`.
"""

import functools
import math

import torch
import torch.nn.functional as F
from megalite.kernels._triton import triton, unsupported, warn_once
from megalite.kernels.attention_core import (
    HEAD_DIMS,
    LOG2E,
    attn_bwd_delta,
    attn_bwd_dkdv,
    attn_bwd_dq,
    attn_fwd,
    config,
    dims,
    precision,
)
from torch.utils.weak import WeakIdKeyDictionary

CAUSAL = (None, None, None, None)  # ids meaning q_pos = k_pos = 0..s-1, no doc ids


def _unit_d(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


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


def check_ids(q, k, q_pos, k_pos, q_doc, k_doc):
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


def _tile_lists(qp, kp, qd, kd, bm, bn, sk, by_key, window=0):
    """Which (query tile, key tile) pairs the kernels visit, as lists the kernels read.

    Returns cnt (B, 2, rows) int32 and idx (B, 2, rows, cols) int32, B = 1 or b (per-row ids):
    [:, 0] lists the fully visible column tiles of each row tile, [:, 1] the partly visible
    ones (those need the element mask), in increasing order, idx[.., :cnt] valid. Rows are
    query tiles (cols key tiles) or, with by_key, the transpose. Tiles are judged by the range
    of their positions and doc ids, so the lists are exact for sorted doc ids and conservative
    (never wrong) otherwise. `window` W > 0: keys also need k_pos > q_pos - W.
    """
    qlo, qhi = _tile_range(qp, bm)  # (B, mt)
    klo, khi = _tile_range(kp, bn)  # (B, nt)
    some = klo[:, None, :] <= qhi[:, :, None]  # (B, mt, nt): some key may be visible
    full = khi[:, None, :] <= qlo[:, :, None]
    if window > 0:
        some = some & (khi[:, None, :] > qlo[:, :, None] - window)
        full = full & (klo[:, None, :] > qhi[:, :, None] - window)
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


@functools.lru_cache(maxsize=64)
def _causal_pos(s: int, device: torch.device) -> torch.Tensor:
    return torch.arange(s, device=device)[None]  # (1, s) int64


@functools.lru_cache(maxsize=64)
def _causal_lists(s: int, bm: int, bn: int, by_key: bool, device: torch.device, window=0):
    # Cached: every layer and step of a causal model asks for the same few lists.
    pos = _causal_pos(s, device)
    return _tile_lists(pos, pos, None, None, bm, bn, s, by_key, window)


# Lists of explicit ids, kept while their tensors live: every layer of a micro-batch (and the
# ring's steps, forward and backward) passes views of the same position and doc tensors (the
# micro-batch's Shard), so each (query block, key block, tiling) is built once, not per layer.
# Keyed weakly on the storage owner ("root") of the query positions; views are told apart by
# offset, shape and strides, and an in-place write (a new _version) empties the entry.
_ID_LISTS = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _view_key(t: torch.Tensor | None):
    if t is None:
        return None
    return id(_root(t)), t.storage_offset(), tuple(t.shape), tuple(t.stride())


def _lists(ids, bm, bn, sk, by_key, device, window=0):
    if ids is CAUSAL:
        return _causal_lists(sk, bm, bn, by_key, device, window)
    try:
        versions = tuple(None if t is None else t._version for t in ids)
    except RuntimeError:  # inference-mode tensors keep no version: build every time
        return _tile_lists(*ids, bm, bn, sk, by_key, window)
    owner = _root(ids[0])
    entry = _ID_LISTS.get(owner)
    if entry is None or entry["versions"] != versions:
        entry = _ID_LISTS[owner] = {"versions": versions, "others": [], "lists": {}}
    key = (tuple(_view_key(t) for t in ids), bm, bn, sk, by_key, window)
    if key not in entry["lists"]:
        # The entry holds the other ids' roots (so their id() in the key stays theirs), never
        # its owner (which would then never be freed).
        for t in ids[1:]:
            if t is not None and _root(t) is not owner and all(_root(t) is not o for o in
                                                               entry["others"]):  # fmt: skip
                entry["others"].append(_root(t))
        entry["lists"][key] = _tile_lists(*ids, bm, bn, sk, by_key, window)
    return entry["lists"][key]


def _id_args(ids, s, device):
    """Kernel arguments for the ids: tensors (docs replaced by positions when absent, unread),
    their batch strides (0 when shared by every row), whether lists are per row, has_doc."""
    qp, kp, qd, kd = (_causal_pos(s, device),) * 2 + (None, None) if ids is CAUSAL else ids
    has_doc = qd is not None
    qd, kd = (qd, kd) if has_doc else (qp, kp)
    strides = [t.stride(0) if t.shape[0] > 1 else 0 for t in (qp, kp, qd, kd)]
    per_row = int(any(t.shape[0] > 1 for t in (qp, kp, qd, kd)))
    return (qp, kp, qd, kd), strides, per_row, has_doc


def block_fwd(q, k, v, ids, scale, out_dtype, window=0):
    """Launch the forward kernel: out (q's layout, out_dtype), lse (b, hq, sq) fp32 natural log;
    `window` W > 0: a sliding window of W keys (0: none)."""
    q, k, v = _unit_d(q, k, v)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    o = torch.empty_like(q, dtype=out_dtype)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    (qp, kp, qd, kd), id_strides, per_row, has_doc = _id_args(ids, sk, q.device)
    bm, bn, warps, stages = config(q)["fwd"]
    cnt, idx = _lists(ids, bm, bn, sk, False, q.device, window)
    attn_fwd[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, o, lse, qp, kp, qd, kd, cnt, idx, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2), *id_strides, per_row, idx.shape[-1], hq,
        hq // hkv, sq, sk, scale * LOG2E, window, HAS_DOC=has_doc, **dims(d), BLOCK_M=bm, BLOCK_N=bn,
        PREC=precision(q), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return o, lse


def block_bwd(q, k, v, o, lse, do, ids, scale, grad_dtype, window=0):
    """Launch the backward kernels: dq, dk, dv in grad_dtype (q's, k's, v's layout if dense)."""
    q, k, v, o = _unit_d(q, k, v, o)
    (do,) = _unit_d(do.to(q.dtype))  # the dots pair do with v and p, in q's dtype
    lse = lse.to(torch.float32).contiguous()  # (b, hq, sq)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    (qp, kp, qd, kd), id_strides, per_row, has_doc = _id_args(ids, sk, q.device)
    cfg = config(q)
    delta = torch.empty_like(lse)  # (b, hq, sq): rowsum(do * o) of the final output
    attn_bwd_delta[(triton.cdiv(sq, 64), b * hq)](
        o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1),
        do.stride(2), hq, sq, **dims(d), BLOCK_M=64,
    )  # fmt: skip
    dq = torch.empty_like(q, dtype=grad_dtype)
    dk = torch.empty_like(k, dtype=grad_dtype)
    dv = torch.empty_like(v, dtype=grad_dtype)
    strides = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
    )  # fmt: skip
    bm, bn, warps, stages = cfg["dkdv"]
    cnt, idx = _lists(ids, bm, bn, sk, True, q.device, window)
    attn_bwd_dkdv[(triton.cdiv(sk, bn), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, qp, kp, qd, kd, cnt, idx, *strides, dk.stride(0),
        dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), *id_strides,
        per_row, idx.shape[-1], hq, hkv, group, sq, sk, scale * LOG2E, scale, window,
        HAS_DOC=has_doc, **dims(d), BLOCK_M=bm, BLOCK_N=bn, PREC=precision(q), num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    bm, bn, warps, stages = cfg["dq"]
    cnt, idx = _lists(ids, bm, bn, sk, False, q.device, window)
    attn_bwd_dq[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, do, lse, delta, dq, qp, kp, qd, kd, cnt, idx, *strides, dq.stride(0),
        dq.stride(1), dq.stride(2), *id_strides, per_row, idx.shape[-1], hq, group, sq, sk,
        scale * LOG2E, scale, window, HAS_DOC=has_doc, **dims(d), BLOCK_M=bm, BLOCK_N=bn, PREC=precision(q),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv


def block_reason(q, k, v, *more) -> str | None:
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
        elif max(t.shape[2] * t.stride(2) for t in (q, k, v, *more)) >= 2**31:
            # The kernels' batch and head bases are int64, offsets within a head's rows int32.
            reason = "a head's rows span 2^31 elements or more (int32 in-tile offsets)"
    return reason


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, q_pos, k_pos, q_doc, k_doc, window=0):
        ids = (q_pos, k_pos, q_doc, k_doc)
        ids = CAUSAL if ids[0] is None else ids
        o, lse = block_fwd(q, k, v, ids, scale, q.dtype, window)  # (b, hq, s_q, d), q's layout
        ctx.scale, ctx.causal, ctx.has_doc = scale, ids is CAUSAL, ids[2] is not None
        ctx.window = window
        ctx.save_for_backward(q, k, v, o, lse, *(t if t is not None else q for t in ids))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *ids = ctx.saved_tensors
        if ctx.causal:
            ids = CAUSAL
        elif not ctx.has_doc:
            ids[2:] = [None, None]
        dq, dk, dv = block_bwd(q, k, v, o, lse, do, tuple(ids), ctx.scale, q.dtype, ctx.window)
        return dq, dk, dv, *(None,) * (len(ctx.needs_input_grad) - 3)  # the window is optional


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, window=None
) -> torch.Tensor:
    """Causal attention, q (b, hq, s, d), k and v (b, hkv, s, d), hq a multiple of hkv; with
    `window` W each query sees the last W keys, itself included (a sliding window).

    Returns (b, hq, s, d) in q's layout. Falls back to the torch reference (with one warning)
    for dropout, head dims outside HEAD_DIMS, or unsupported dtypes and devices.
    """
    reason = block_reason(q, k, v)
    if reason is None:
        if dropout_p > 0.0:
            reason = "attention dropout is not implemented in the Triton kernel"
        elif q.shape[2] != k.shape[2]:
            reason = f"shapes q {tuple(q.shape)} k {tuple(k.shape)}: causal needs one length"
    if reason:
        warn_once("attention", reason)
        return attention_ref(q, k, v, dropout_p, window)
    return _MaskedAttention.apply(q, k, v, default_scale(q, None), *CAUSAL, window or 0)


def attention_masked(q, k, v, q_pos, k_pos, q_doc=None, k_doc=None, window=None):
    """Causal-by-position attention with optional document masking, with autograd.

    q (b, hq, s_q, d), k and v (b, hkv, s_k, d); positions and doc ids as in attention_block_fwd
    (any order: a load-balanced permutation of the sequence works); `window` W: also
    k_pos > q_pos - W. Returns (b, hq, s_q, d) in q's dtype and layout;
    rows that see no key are 0.
    """
    ids = check_ids(q, k, q_pos, k_pos, q_doc, k_doc)
    reason = block_reason(q, k, v)
    if reason:
        warn_once("attention_masked", reason)
        return attention_masked_ref(q, k, v, *ids, window=window)
    return _MaskedAttention.apply(q, k, v, default_scale(q, None), *ids, window or 0)


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, window=None
) -> torch.Tensor:
    """q (b, hq, s, d), k and v (b, hkv, s, d) with hq a multiple of hkv -> (b, hq, s, d);
    `window` W: query i sees keys i-W+1..i."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    i = torch.arange(q.shape[2], device=q.device)
    band = (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)  # (s, s) key j for query i
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=dropout_p)


def _visible_ref(q_pos, k_pos, q_doc, k_doc, window=None) -> torch.Tensor:
    """(1|b, s_q, s_k) bool: key j visible to query i."""
    q_pos, k_pos = q_pos.reshape(-1, 1, q_pos.shape[-1]), k_pos.reshape(-1, 1, k_pos.shape[-1])
    vis = k_pos <= q_pos.transpose(1, 2)
    if window is not None:
        vis = vis & (k_pos > q_pos.transpose(1, 2) - window)
    if q_doc is not None:
        q_doc, k_doc = q_doc.reshape(-1, q_doc.shape[-1], 1), k_doc.reshape(-1, 1, k_doc.shape[-1])
        vis = vis & (k_doc == q_doc)
    return vis


def attention_masked_ref(q, k, v, q_pos, k_pos, q_doc=None, k_doc=None, window=None):
    """Plain-torch attention_masked: scaled_dot_product_attention with the visibility mask."""
    vis = _visible_ref(q_pos, k_pos, q_doc, k_doc, window).to(q.device)  # (1|b, sq, sk)
    # Rows that see no key attend to every key (a finite softmax on every backend, hence finite
    # gradients), then are zeroed: their output and gradients are 0.
    empty = ~vis.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=(vis | empty)[:, None], enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.masked_fill(empty[:, None], 0.0)
