"""Attention blocks for context parallelism (ring attention), on the kernels of attention_core.

A query block sees a key/value block by position and optional doc ids (key j visible to query i
iff k_pos[j] <= q_pos[i] and q_doc[i] == k_doc[j]), so the blocks may be any slices of the
sequence, in any order. A ring step on query rows Q and one key/value block runs

    out_b, lse_b = attention_block_fwd(q, k, v, q_pos, k_pos)   # fp32, this block's keys only
    out, lse = merge_attention(out, lse, out_b, lse_b)          # exact, over all blocks so far
    # backward, with the final (merged) out and lse of the rows:
    dq_b, dk_b, dv_b = attention_block_bwd(q, k, v, out, lse, dout, q_pos, k_pos)  # fp32

and summing the block results over all key blocks gives the full attention and its gradients.
attention.attention_masked is the same on one device, as an autograd op. Each has a `_ref`.
"""

import torch
from megalite.kernels._triton import at_least_fp32, warn_once
from megalite.kernels.attention import (
    _visible_ref,
    block_bwd,
    block_fwd,
    block_reason,
    check_ids,
    default_scale,
)


def attention_block_fwd(q, k, v, q_pos, k_pos, q_doc=None, k_doc=None, scale=None, window=None):
    """Attention of a query block against one key/value block (one step of ring attention).

    q (b, hq, s_q, d); k, v (b, hkv, s_k, d) with hq a multiple of hkv. q_pos (s_q,) and k_pos
    (s_k,) are integer global positions, or (b, s_q) / (b, s_k) per batch row; query i sees key j
    iff k_pos[j] <= q_pos[i] and, with doc ids (same shapes, both or neither), q_doc[i] ==
    k_doc[j] (and, with a sliding window W, k_pos[j] > q_pos[i] - W). scale defaults to
    1/sqrt(d).

    Returns (out, lse): out (b, hq, s_q, d), the softmax over the visible keys of this block only,
    in fp32 (fp64 for fp64 inputs), in q's layout when q is dense; lse (b, hq, s_q) fp32 (fp64),
    the natural-log log-sum-exp of the scaled scores over those keys. A row that sees no key
    here gets out = 0 and lse = -inf. Combine blocks with merge_attention. No autograd.
    """
    ids = check_ids(q, k, q_pos, k_pos, q_doc, k_doc)
    reason = block_reason(q, k, v)
    if reason:
        warn_once("attention_block_fwd", reason)
        return attention_block_fwd_ref(q, k, v, *ids, scale=scale, window=window)
    return block_fwd(q, k, v, ids, default_scale(q, scale), torch.float32, window or 0)


def attention_block_bwd(
    q, k, v, out, lse, dout, q_pos, k_pos, q_doc=None, k_doc=None, scale=None, window=None
):
    """Gradient contribution of one (query block, key/value block) pair.

    q, k, v, ids and scale as in attention_block_fwd; out (b, hq, s_q, d), lse (b, hq, s_q) are
    the FINAL results of these query rows over all key blocks (merged), dout (b, hq, s_q, d) the
    gradient of out. Returns (dq, dk, dv) in fp32 (fp64 for fp64 q): dq (b, hq, s_q, d) and dk,
    dv (b, hkv, s_k, d) summed over each GQA group. Summed over all key blocks they are the full
    attention's gradients. Rows with lse = -inf (no visible key anywhere) contribute nothing.
    """
    ids = check_ids(q, k, q_pos, k_pos, q_doc, k_doc)
    reason = block_reason(q, k, v, out, dout)
    if reason:
        warn_once("attention_block_bwd", reason)
        return attention_block_bwd_ref(q, k, v, out, lse, dout, *ids, scale=scale, window=window)
    scale = default_scale(q, scale)
    return block_bwd(q, k, v, out, lse, dout, ids, scale, torch.float32, window or 0)


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


def _grouped(q, k, v, *ids, scale, window=None):
    """Upcast to at least fp32 and group query heads: q (b, hkv, g, s_q, d), k and v
    (b, hkv, 1, s_k, d), visibility (1|b, 1, 1, s_q, s_k), and the scale."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    q = at_least_fp32(q).reshape(b, hkv, hq // hkv, sq, d)  # head h = hk * g + i, as the kernels
    k, v = (at_least_fp32(t).to(q.dtype).unsqueeze(2) for t in (k, v))
    vis = _visible_ref(*ids, window).to(q.device)[:, None, None]
    return q, k, v, vis, default_scale(q, scale)


def attention_block_fwd_ref(q, k, v, q_pos, k_pos, q_doc=None, k_doc=None, scale=None, window=None):
    """Plain-torch attention_block_fwd, computed in fp32 (fp64 for fp64 inputs)."""
    b, hq, sq, d = q.shape
    q, k, v, vis, scale = _grouped(q, k, v, q_pos, k_pos, q_doc, k_doc, scale=scale,
                                   window=window)  # fmt: skip
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~vis, float("-inf"))  # (b, hkv, g, sq, sk)
    lse = torch.logsumexp(s, -1, keepdim=True)  # -inf where no key is visible
    p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse))  # 0 on those rows
    return (p @ v).reshape(b, hq, sq, d), lse.reshape(b, hq, sq)


def attention_block_bwd_ref(
    q, k, v, out, lse, dout, q_pos, k_pos, q_doc=None, k_doc=None, scale=None, window=None
):
    """Plain-torch attention_block_bwd, computed in fp32 (fp64 for fp64 inputs)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    q, k, v, vis, scale = _grouped(q, k, v, q_pos, k_pos, q_doc, k_doc, scale=scale,
                                   window=window)  # fmt: skip
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
