"""Attention with learned sinks (gpt-oss) on the flash kernels of attention_core.py.

A sink is a logit s_h per query head that joins every softmax as one more column with value 0:
p_ij = exp(l_ij) / (exp(s_h) + sum_j' exp(l_ij')). It is so one more softmax "block", with
out = 0 and lse = s_h, and merges with the kernels' (out, lse) over the keys by log-sum-exp
(`add_sink`): lse_f = logaddexp(lse, s_h), out_f = out * exp(lse - lse_f). The kernels need no
sink of their own:

- the flash backward fed with (out_f, lse_f, dout) gives the true dq, dk, dv: its
  p = exp(s - lse_f) are the true probabilities and its delta = rowsum(dout * out_f) the true
  one (d out_i / d l_ij = p_ij (v_j - out_i), the sink taking no value);
- d s_h = -sum_i p_sink,i * rowsum(dout_i * out_f,i), p_sink = exp(s_h - lse_f) (`sink_grad`).

What runs where: a `gpt_oss` model's attention (Attention._core, and its KV cache) calls
`ops.attention_sinks`: with `--kernels triton` (or auto on CUDA) this file's autograd op on the
flash kernels (causal, GQA, sliding windows, positions and documents), falling back to the
reference with one warning for attention dropout or inputs the kernels do not take; with
`--kernels torch` `attention_sinks_ref`, the plain-torch reference (the (s_q, s_k) scores
materialised with the sink column, `sink_attention`). Context parallelism uses the same two
functions with either op set: ring attention merges its key blocks, adds the sink once at the
end and hands (out_f, lse_f) to every block's backward; all-to-all attention holds whole
sequences of its heads and calls `ops.attention_sinks` with their sinks. The sinks are split
over TP with the heads (`attention.sinks` (nh,), split along dim 0), so each rank's gradient is
its heads' whole gradient: nothing is reduced over TP and the norm counts each element once.
"""

import torch
import torch.nn.functional as F
from megalite.kernels._triton import warn_once
from megalite.kernels.attention import (
    CAUSAL,
    _causal_pos,
    _visible_ref,
    block_bwd,
    block_fwd,
    block_reason,
    check_ids,
    default_scale,
)


def add_sink(out, lse, sinks):
    """The sink as one more block: out (b, hq, s, d), lse (b, hq, s) over the keys, sinks (hq,)
    -> (out_f, lse_f) in out's dtype (at least fp32 math). A row that sees no key gets out 0 and
    lse s_h; with s_h = -inf too it stays (0, -inf)."""
    s = sinks.to(lse.dtype).view(1, -1, 1)
    lse_f = torch.logaddexp(lse, s)
    ref = torch.where(lse_f == float("-inf"), 0.0, lse_f)  # no NaN from -inf - -inf
    return out * torch.exp(lse - ref).unsqueeze(-1).to(out.dtype), lse_f


def sink_grad(out_f, lse_f, dout, sinks):
    """d loss / d sinks (hq,) in sinks' dtype, from the final (out_f, lse_f) of add_sink and
    dout, all (b, hq, s[, d]): -sum over rows of p_sink * rowsum(dout * out_f)."""
    ref = torch.where(lse_f == float("-inf"), float("inf"), lse_f)  # p_sink 0 there
    p_sink = torch.exp(sinks.to(lse_f.dtype).view(1, -1, 1) - ref)
    delta = (dout.to(lse_f.dtype) * out_f.to(lse_f.dtype)).sum(-1)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, q_pos, k_pos, q_doc, k_doc, window):
        ids = (q_pos, k_pos, q_doc, k_doc)
        ids = CAUSAL if ids[0] is None else ids
        o, lse = block_fwd(q, k, v, ids, default_scale(q, None), torch.float32, window)
        o, lse = add_sink(o, lse, sinks)
        o = o.to(q.dtype)  # (b, hq, s_q, d), q's layout
        ctx.causal, ctx.has_doc, ctx.window = ids is CAUSAL, ids[2] is not None, window
        ctx.save_for_backward(q, k, v, sinks, o, lse, *(t if t is not None else q for t in ids))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, sinks, o, lse, *ids = ctx.saved_tensors
        if ctx.causal:
            ids = CAUSAL
        elif not ctx.has_doc:
            ids[2:] = [None, None]
        scale = default_scale(q, None)
        dq, dk, dv = block_bwd(q, k, v, o, lse, do, tuple(ids), scale, q.dtype, ctx.window)
        return dq, dk, dv, sink_grad(o, lse, do, sinks), None, None, None, None, None


def attention_sinks(q, k, v, sinks, q_pos=None, k_pos=None, q_doc=None, k_doc=None,
                    dropout_p: float = 0.0, window=None):  # fmt: skip
    """Attention with a sink logit per query head, with autograd: q (b, hq, s_q, d), k and v
    (b, hkv, s_k, d), sinks (hq,). Causal when no positions are given (s_q = s_k), else key j
    is visible to query i as in attention_masked (positions, optional doc ids, `window` W).
    Returns (b, hq, s_q, d) in q's dtype and layout; a row that sees no key gives 0.

    Falls back to attention_sinks_ref (with one warning) for dropout and for inputs the kernels
    do not take."""
    if q_pos is not None:
        q_pos, k_pos, q_doc, k_doc = check_ids(q, k, q_pos, k_pos, q_doc, k_doc)
    reason = block_reason(q, k, v)
    if reason is None:
        if dropout_p > 0.0:
            reason = "attention dropout is not implemented in the Triton kernel"
        elif q_pos is None and q.shape[2] != k.shape[2]:
            reason = f"shapes q {tuple(q.shape)} k {tuple(k.shape)}: causal needs one length"
        elif sinks.shape != (q.shape[1],):
            reason = f"sinks {tuple(sinks.shape)}: expected one per query head ({q.shape[1]},)"
    if reason:
        warn_once("attention_sinks", reason)
        return attention_sinks_ref(q, k, v, sinks, q_pos, k_pos, q_doc, k_doc, dropout_p, window)
    return _SinkAttention.apply(q, k, v, sinks, q_pos, k_pos, q_doc, k_doc, window or 0)


def attention_sinks_ref(q, k, v, sinks, q_pos=None, k_pos=None, q_doc=None, k_doc=None,
                        dropout_p: float = 0.0, window=None):  # fmt: skip
    """Plain-torch attention_sinks: sink_attention with the visibility of the positions."""
    if q_pos is None:
        q_pos = k_pos = _causal_pos(q.shape[2], q.device)
    vis = _visible_ref(q_pos, k_pos, q_doc, k_doc, window).to(q.device)
    return sink_attention(q, k, v, sinks, vis, dropout_p)


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
