"""Attention with learned sinks (gpt-oss, `features.attention_sinks`).

Each head h has a learned logit s_h that joins every query's softmax as one more column and
takes no value: p_ij = exp(l_ij) / (exp(s_h) + sum_j' exp(l_ij')), out_i = sum_j p_ij v_j. A
query may so give little weight to every key. The sinks are split over TP with the heads
(`attention.sinks` (nh,), split along dim 0), so each rank's gradient is its heads' whole
gradient: nothing is reduced over TP and the norm counts each element once.

This is plain torch (the (s_q, s_k) scores are materialised, as in attention_ref), used for
every `--kernels` choice: the Triton attention kernels have no sink column yet. Shapes: q
(b, hq, s_q, d), k and v (b, hkv, s_k, d), hq a multiple of hkv.
"""

import torch
import torch.nn.functional as F


def visible(q_pos, k_pos, q_doc=None, k_doc=None, window=None) -> torch.Tensor:
    """(1|b, s_q, s_k) bool: key j visible to query i (causal by position, within the
    window, in the same document)."""
    q_pos, k_pos = q_pos.reshape(-1, q_pos.shape[-1], 1), k_pos.reshape(-1, 1, k_pos.shape[-1])
    vis = k_pos <= q_pos
    if window is not None:
        vis = vis & (k_pos > q_pos - window)
    if q_doc is not None:
        vis = vis & (k_doc.reshape(-1, 1, k_doc.shape[-1]) == q_doc.reshape(-1, q_doc.shape[-1], 1))
    return vis


def sink_attention(q, k, v, sinks, vis, dropout_p: float = 0.0) -> torch.Tensor:
    """Softmax attention over the visible keys (`vis` (1|b, s_q, s_k)) and a sink column per
    head (`sinks` (hq,)) -> (b, hq, s_q, d) in q's dtype; a row that sees no key gives 0."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(dtype) @ k.to(dtype).transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~vis[:, None], float("-inf"))  # (b, hq, s_q, s_k)
    sink = sinks.to(dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return (probs @ v.to(dtype)).to(q.dtype)
