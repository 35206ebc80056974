"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the attention of `features.latent_attention`.

Shapes: h hidden, nh heads (nh/t on this TP rank), r_q `q_lora_rank`, r `kv_lora_rank`, dn
`qk_nope_head_dim`, dr `qk_rope_head_dim`, dv `v_head_dim`; q and k have dn + dr dims per head.

    q      = q_b(RMSNorm(q_a(x)))               (or q(x) without q_lora_rank)  -> (nh, dn + dr)
    c, k_r = split(kv_a(x), [r, dr])            the latent c and the RoPE key k_r shared by heads
    k_n, v = split(kv_b(RMSNorm(c)), [dn, dv])  per head
    k      = [k_n; RoPE(k_r)],  q = [q_n; RoPE(q_r)]

Tensor parallelism is over heads: q_b (or q), kv_b are column-parallel by heads, `out` is
row-parallel; the a-projections and their norms are whole on every rank (each rank's heads give
part of their gradient, summed over TP, as k/v heads replicated in `layers.Attention`).

The attention ops take one head dim for q, k and v and the scale 1/sqrt(d): v (or q and k) is
zero-padded to the larger dim, which adds nothing to a score or an output, and q is multiplied by
softmax_scale * sqrt(d) when the scale differs (yarn's mscale, as DeepSeek-V3 sets it). So every
attention path (torch, Triton, masked, context-parallel ring and all-to-all) runs MLA unchanged.

A KV cache keeps the compressed latent RMSNorm(c) (b, 1, slots, r) and the rotated RoPE key
(b, 1, slots, dr) per layer, not the per-head keys and values: `LayerKV.append(c, k_r)`.
"""

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.rope import RotaryTable
from megalite.parallel.context_parallel import context_attention
from megalite.parallel.specs import mark
from megalite.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    enter_tp_region,
    shard_spec,
)


def mla_mscale(scale: float, mscale: float) -> float:
    """yarn's magnitude correction 0.1 m ln(scale) + 1 (1 when the context is not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(dn + dr), times mscale(factor, mscale_all_dim)^2 under yarn (DeepSeek-V3)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling != "none" and cfg.yarn_mscale_all_dim:
        scale *= mla_mscale(cfg.rope_scaling_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale


class LatentNorm(nn.Module):
    """RMSNorm over a latent (r_q or r features), whole on every rank; its gradient is the sum
    of every rank's heads' parts (summed over TP). eps 1e-6: DeepSeek-V3 does not pass its
    rms_norm_eps to these two norms."""

    def __init__(self, dim: int, env: LayerEnv, eps: float = 1e-6):
        super().__init__()
        self.ops, self.eps = env.ops, eps
        w = torch.ones(dim, **env.tensor_kw)
        spec = shard_spec(env.tp, None, partial_grad=True, no_weight_decay=True)
        self.weight = mark(nn.Parameter(w), **spec)

    def forward(self, x):
        return self.ops.rms_norm(x, self.weight, self.eps)


class LatentAttention(nn.Module):
    """MLA with `layers.Attention`'s interface: forward(x, shard=None), decode(x, kv)."""

    def __init__(self, cfg: ModelConfig, env: LayerEnv, rope=None):
        super().__init__()
        tp, ops, kw = env.tp, env.ops, env.tensor_kw
        self.tp, self.ops, self.rng = tp, ops, env.rng
        self.sequence_parallel = env.sequence_parallel  # the chunk's switch (model/env.py)
        self.cp, self.cp_comm_type = env.cp, env.cp_attention
        self.cfg, self.recompute_core = cfg, env.recompute == "selective"
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.heads = nh // tp.size
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.r = cfg.kv_lora_rank
        self.d = max(self.dn + self.dr, self.dv)  # the one head dim handed to the attention ops
        # q multiplier making the ops' 1/sqrt(d) the model's scale (None: already equal)
        q_mul = softmax_scale(cfg) * math.sqrt(self.d)
        self.q_mul = None if abs(q_mul - 1.0) < 1e-12 else q_mul
        self.window = {} if cfg.sliding_window is None else {"window": cfg.sliding_window}
        col = {"group": tp, "bias": False, "sequence_parallel": self.sequence_parallel,
               "enter": False, **kw, "ops": ops}  # fmt: skip
        dqk = self.dn + self.dr
        if cfg.q_lora_rank:
            self.q_a = ColumnParallelLinear(h, cfg.q_lora_rank, split=False, **col)
            self.q_a_norm = LatentNorm(cfg.q_lora_rank, env)
            self.q_b = ColumnParallelLinear(cfg.q_lora_rank, nh * dqk, **col)
        else:
            self.q = ColumnParallelLinear(h, nh * dqk, **col)
        self.kv_a = ColumnParallelLinear(h, self.r + self.dr, split=False, **col)
        self.kv_a_norm = LatentNorm(self.r, env)
        self.kv_b = ColumnParallelLinear(self.r, nh * (self.dn + self.dv), **col)
        self.out = RowParallelLinear(nh * self.dv, h, tp, bias=False, **kw, ops=ops,
                                     sequence_parallel=self.sequence_parallel)  # fmt: skip
        # RoPE over the dr dims only: the tables of a model whose head dim is dr
        rope_cfg = dataclasses.replace(cfg, kv_channels=self.dr)
        self.rope = (
            RotaryTable(rope_cfg, cfg.seq_length, kw["device"])
            if rope is None
            else rope.get(rope_cfg)
        )  # the chunk's (RotaryTables), shared by its layers

    def _rotate(self, x, positions, rows: int):
        """RoPE of x (b, s, heads, dr) at positions (b, s), or 0..s-1 when None; `rows`: a
        host bound on the positions."""
        cos, sin = self.rope.tables(rows)
        if positions is None:
            s = x.shape[1]
            return self.ops.rotary(x, cos[:s], sin[:s])
        b, s = positions.shape
        pos = positions.reshape(-1)
        y = self.ops.rotary(x.reshape(1, b * s, -1, self.dr), cos[pos], sin[pos])
        return y.view(b, s, -1, self.dr)

    def _expand(self, latent, k_rope):
        """latent (b, t, r) and rotated k_rope (b, t, 1, dr) -> k (b, nh/t, t, dn + dr) and
        v (b, nh/t, t, dv)."""
        kv = self.kv_b(latent).unflatten(-1, (-1, self.dn + self.dv))  # (b, t, nh/t, dn + dv)
        k_nope, v = kv.split([self.dn, self.dv], -1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], -1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _padded(self, q, k, v):
        """q, k (b, heads, s, dn + dr), v (b, heads, s, dv) -> all (.., d), q scaled: the ops'
        1/sqrt(d) is then the model's softmax scale and zero dims add nothing."""
        dqk = q.shape[-1]
        if self.q_mul is not None:
            q = q * self.q_mul
        if dqk < self.d:
            q, k = F.pad(q, (0, self.d - dqk)), F.pad(k, (0, self.d - dqk))
        if self.dv < self.d:
            v = F.pad(v, (0, self.d - self.dv))
        return q, k, v

    def _core(self, q, k, v, shard=None):
        """q, k (b, heads, s, dn + dr), v (b, heads, s, dv) -> (b, heads, s, dv)."""
        q, k, v = self._padded(q, k, v)
        if shard is not None and shard.attention_masked:  # cp > 1 or documents (no dropout)
            o = context_attention(q, k, v, self.cp, shard, self.cp_comm_type, self.ops,
                                  **self.window)  # fmt: skip
        elif self.cfg.attention_dropout > 0 and self.training:
            with self.rng.fork():  # heads are sharded: each rank drops its own
                o = self.ops.attention(q, k, v, self.cfg.attention_dropout, **self.window)
        else:
            o = self.ops.attention(q, k, v, **self.window)
        return o[..., : self.dv]

    def _cached(self, q, latent, k_rope, kv):
        """Attention over every cached slot: the cache holds latents and RoPE keys only, the
        heads' keys and values are expanded from them (b, nh/t, slots, .)."""
        latent, k_rope = kv.append(latent[:, None], k_rope.transpose(1, 2))  # (b, 1, slots, .)
        q, k, v = self._padded(q, *self._expand(latent[:, 0], k_rope.transpose(1, 2)))
        if q.shape[2] == 1 and kv.k_doc is None and not self.window:  # one token sees every slot
            o = F.scaled_dot_product_attention(q, k, v)
        else:  # a query sees the slots up to its own (in its window), padding excluded
            o = self.ops.attention_masked(q, k, v, kv.q_slot, kv.k_slot, kv.q_doc, kv.k_doc,
                                          **self.window)  # fmt: skip
        return o[..., : self.dv]

    def decode(self, x, kv):
        """As `layers.Attention.decode`; `kv` (generation.LayerKV) caches latents."""
        return self.forward(x, kv=kv)

    def forward(self, x, shard=None, kv=None):
        """As `layers.Attention.forward`; with `kv` (from `decode`) the cached path."""
        x = enter_tp_region(x, self.tp, self.sequence_parallel)  # (b, s, h); s/cp tokens with cp
        b, s, _ = x.shape
        q = self.q_b(self.q_a_norm(self.q_a(x))) if hasattr(self, "q_a") else self.q(x)
        q_nope, q_rope = q.unflatten(-1, (-1, self.dn + self.dr)).split([self.dn, self.dr], -1)
        latent, k_rope = self.kv_a(x).split([self.r, self.dr], -1)  # (b, s, r), (b, s, dr)
        latent = self.kv_a_norm(latent)
        positions = kv.positions if kv is not None else getattr(shard, "positions", None)
        rows = kv.span if kv is not None else s if positions is None else self.cfg.seq_length
        q_rope = self._rotate(q_rope, positions, rows)  # (b, s, nh/t, dr)
        k_rope = self._rotate(k_rope[:, :, None], positions, rows)  # (b, s, 1, dr)
        q = torch.cat([q_nope, q_rope], -1).transpose(1, 2)  # (b, nh/t, s, dn + dr)
        if kv is not None:
            o = self._cached(q, latent, k_rope, kv)
        else:
            k, v = self._expand(latent, k_rope)
            if self.recompute_core and self.training:
                o = checkpoint(self._core, q, k, v, shard, use_reentrant=False,
                               context_fn=self.rng.recompute_contexts)  # fmt: skip
            else:
                o = self._core(q, k, v, shard)
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.dv)  # (b, s, nh/t * dv)
        return self.out(o)
