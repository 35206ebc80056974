"""One transformer layer (pre-norm) built from the tensor-parallel layers.

Shapes: h hidden, t TP size, s sequence; hidden states enter and leave a layer as (b, s, h),
or (b, s/t, h) with sequence parallelism. Heads are split over TP: this rank computes nh/t
query heads and the key/value heads they need.

Inference with a KV cache passes `kv`, one layer's view of a `megalite.generation.KVCache`:
x then holds only the new tokens (never sequence-parallel), their keys and values are appended
to the cache, and attention runs over every cached slot with explicit positions.

What the flavour decides is read from `cfg.features` (model_config.ModelFeatures: biases, Qwen3's
per-head q/k norms, gpt-oss's attention sinks: `ops.attention_sinks`); the model flags any flavour may set are read from `cfg` (the head dim, RoPE
scaling in model/rope.py, a sliding window handed to the attention ops). Every matmul and the
attention core go through `ops` (megalite.kernels: `ops.linear`, `ops.attention`). Every layer
is built from `(cfg, env)` (model/env.py `LayerEnv`: the groups, the chunk's `SequenceParallel`
switch, ops, dropout stream, recompute, dtype and device) and a few arguments of its own.
"""

import dataclasses
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.mla import LatentAttention
from megalite.model.moe import MoELayer
from megalite.model.rope import RotaryTable
from megalite.parallel.context_parallel import context_attention
from megalite.parallel.specs import mark
from megalite.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    fused_column_linear,
    shard_spec,
)


class Norm(nn.Module):
    """LayerNorm (with a bias unless `features.norm_bias` is off) or RMSNorm (`features.norm`).
    Replicated over TP; with sequence parallelism each rank sees only its rows, so the weight
    gradient is summed over TP."""

    def __init__(self, cfg: ModelConfig, env: LayerEnv):
        super().__init__()
        self.ops, self.eps, self.rms = env.ops, cfg.norm_epsilon, cfg.features.rms_norm
        kw = env.tensor_kw
        spec = shard_spec(env.tp, None, partial_grad=env.sequence_parallel, no_weight_decay=True)
        self.weight = mark(nn.Parameter(torch.ones(cfg.hidden_size, **kw)), **spec)
        self.bias = None
        if cfg.features.layer_norm_bias:
            self.bias = mark(nn.Parameter(torch.zeros(cfg.hidden_size, **kw)), **spec)

    def forward(self, x):
        if self.rms:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


class HeadNorm(nn.Module):
    """RMSNorm over each head's features (`features.qk_norm`: Qwen3's q_norm and k_norm, before
    RoPE): one weight (head_dim,) shared by every head. The heads are split over TP, so the
    forward needs no communication and each rank's weight gradient is its heads' part, summed
    over TP."""

    def __init__(self, cfg: ModelConfig, env: LayerEnv):
        super().__init__()
        self.ops, self.eps = env.ops, cfg.norm_epsilon
        spec = shard_spec(env.tp, None, partial_grad=True, no_weight_decay=True)
        w = torch.ones(cfg.head_dim, **env.tensor_kw)
        self.weight = mark(nn.Parameter(w), **spec)

    def forward(self, x):  # (b, s, heads, hd)
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, env: LayerEnv, rope=None):
        """With context parallelism (`env.cp`) this rank holds s/cp tokens of each sequence and
        attention spans all of them (`env.cp_attention`). `rope`: the chunk's `RotaryTables`
        (default: a table of this layer's own)."""
        super().__init__()
        tp, ops, kw = env.tp, env.ops, env.tensor_kw
        self.tp, self.ops, self.rng = tp, ops, env.rng
        self.sequence_parallel = env.sequence_parallel  # the chunk's switch (model/env.py)
        self.cp, self.cp_comm_type = env.cp, env.cp_attention
        self.cfg, self.recompute_core = cfg, env.recompute == "selective"
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.heads_kv, cfg.head_dim
        self.heads = nh // tp.size
        # Fewer query groups than TP ranks: every rank keeps all k/v heads and uses its group's.
        self.split_kv = nkv % tp.size == 0
        self.kv_heads = nkv // tp.size if self.split_kv else 1
        self.kv_group = None if self.split_kv else tp.rank * nkv // tp.size
        self.rotary = cfg.features.rotary
        # sliding window: passed to the attention ops only when set (a custom op need not know it)
        self.window = {} if cfg.sliding_window is None else {"window": cfg.sliding_window}
        col = {"group": tp, "bias": cfg.features.qkv_bias, "enter": False, **kw, "ops": ops,
               "sequence_parallel": self.sequence_parallel,
               "overlap": env.tp_comm_overlap}  # fmt: skip
        self.q = ColumnParallelLinear(h, nh * hd, **col)
        self.k = ColumnParallelLinear(h, nkv * hd, split=self.split_kv, **col)
        self.v = ColumnParallelLinear(h, nkv * hd, split=self.split_kv, **col)
        self.out = RowParallelLinear(nh * hd, h, tp, bias=cfg.features.linear_bias,
                                     sequence_parallel=self.sequence_parallel, **kw, ops=ops,
                                     overlap=env.tp_comm_overlap)  # fmt: skip
        if cfg.features.qk_norm:
            self.q_norm = HeadNorm(cfg, env)
            self.k_norm = HeadNorm(cfg, env)
        if cfg.features.attention_sinks:  # gpt-oss: one logit per head, split with the heads
            spec = shard_spec(tp, 0, no_weight_decay=True)
            self.sinks = mark(nn.Parameter(torch.zeros(self.heads, **kw)), **spec)
        if self.rotary:  # shared by the chunk's layers
            device = kw["device"]
            self.rope = RotaryTable(cfg, cfg.seq_length, device) if rope is None else rope.get(cfg)

    def _core(self, q, k, v, shard=None):
        """q (b, nh/t, s, hd), k and v (b, kv heads, s, hd) -> (b, nh/t, s, hd): `ops.attention`,
        the seam for an attention variant (or the masked/context-parallel blocks of `shard`)."""
        # gpt-oss's sinks (kernels/attention_sinks.py): ops.attention_sinks, or the cp blocks'
        sinks = {"sinks": self.sinks} if hasattr(self, "sinks") else {}
        if shard is not None and shard.attention_masked:  # cp > 1 or documents (no dropout)
            return context_attention(q, k, v, self.cp, shard, self.cp_comm_type, self.ops,
                                     **sinks, **self.window)  # fmt: skip
        p = self.cfg.attention_dropout if self.training else 0.0
        if sinks:
            with self.rng.fork() if p > 0 else nullcontext():
                return self.ops.attention_sinks(q, k, v, self.sinks, dropout_p=p, **self.window)
        if p > 0:
            with self.rng.fork():  # heads are sharded: each rank drops its own
                return self.ops.attention(q, k, v, p, **self.window)
        return self.ops.attention(q, k, v, **self.window)

    # --compile: eager, a graph break (torch.compile cannot replay the sharded RNG's context_fn);
    # torch.compiler.disable at the first call, as in parallel/comm.py
    @torch._disable_dynamo
    def _recomputed_core(self, q, k, v, shard=None):
        """`_core`, its activations recomputed in backward (selective recompute)."""
        return checkpoint(self._core, q, k, v, shard, use_reentrant=False,
                          context_fn=self.rng.recompute_contexts)  # fmt: skip

    def _rotate_at(self, q, k, positions, rows: int):
        """RoPE of q and k (b, s, heads, hd) at per-row positions (b, s), in one call: the rows
        as one long sequence, so the op's (s, d/2) tables are the rows of each position.
        `rows`: a host bound on the positions (the table grows to it; no device read)."""
        b, s = positions.shape
        pos = positions.reshape(-1)
        cos, sin = self.rope.tables(rows)
        qk = torch.cat([q, k], 2).reshape(1, b * s, -1, q.shape[3])  # (1, b*s, heads, hd)
        qk = self.ops.rotary(qk, cos[pos], sin[pos]).view(b, s, -1, q.shape[3])
        return qk.split([q.shape[2], k.shape[2]], 2)

    def _heads(self, x, fused: bool):
        """q, k, v (b, s, heads, hd) of the layer's input x ((b, s/t, h) with sequence
        parallelism): this rank's heads (its query group's k/v when every rank keeps them all),
        normed with qk-norm. `fused`: one matmul and one saved input for backward (training);
        decoding skips the weight copy."""
        qkv = fused_column_linear(x, (self.q, self.k, self.v), fused)
        q, k, v = (t.unflatten(-1, (-1, self.cfg.head_dim)) for t in qkv)
        if self.kv_group is not None:
            k = k[:, :, self.kv_group : self.kv_group + 1]
            v = v[:, :, self.kv_group : self.kv_group + 1]
        if hasattr(self, "q_norm"):  # per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x, shard=None):
        """Training (and evaluation) over whole sequences. `shard` (context_parallel.Shard):
        the positions and documents of this rank's tokens when they are not simply 0..s-1 of
        one document (context parallelism, packed samples)."""
        q, k, v = self._heads(x, fused=True)  # (b, s, heads, hd); s/cp tokens with cp
        b, s = q.shape[:2]
        if self.rotary and shard is not None:  # true (or in-document) positions
            q, k = self._rotate_at(q, k, shard.positions, self.cfg.seq_length)
        elif self.rotary:
            cos, sin = self.rope.tables(s)
            q = self.ops.rotary(q, cos[:s], sin[:s])
            k = self.ops.rotary(k, cos[:s], sin[:s])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, hd)
        if self.recompute_core and self.training:
            o = self._recomputed_core(q, k, v, shard)
        else:
            o = self._core(q, k, v, shard)
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.cfg.head_dim)  # (b, s, nh/t * hd)
        return self.out(o)

    def decode(self, x, kv):
        """Generation: x's new tokens attend to themselves and to what `kv`
        (generation.LayerKV, or CPKVCache split over cp) holds, which they join."""
        q, k, v = self._heads(x, fused=False)
        b, s = q.shape[:2]
        if self.rotary:
            q, k = self._rotate_at(q, k, kv.positions, kv.span)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, hd)
        if kv.cp is not None:  # the cache is split over cp (CPKVCache)
            o = kv.attend(q, k, v, self.ops, getattr(self, "sinks", None), **self.window)
        else:
            k, v = kv.append(k, v)  # (b, kv heads, every cached slot, hd)
            if hasattr(self, "sinks"):  # the same visibility as attention_masked's below
                o = self.ops.attention_sinks(q, k, v, self.sinks, kv.q_slot, kv.k_slot, kv.q_doc,
                                             kv.k_doc, **self.window)  # fmt: skip
            elif s == 1 and kv.k_doc is None and not self.window:  # one token sees every slot
                o = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
            else:  # a query sees the slots up to its own (in its window), padding excluded
                o = self.ops.attention_masked(q, k, v, kv.q_slot, kv.k_slot, kv.q_doc, kv.k_doc,
                                              **self.window)  # fmt: skip
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.cfg.head_dim)  # (b, s, nh/t * hd)
        return self.out(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, env: LayerEnv):
        super().__init__()
        tp, ops, kw = env.tp, env.ops, env.tensor_kw
        self.tp, self.sequence_parallel, self.ops = tp, env.sequence_parallel, ops
        self.gated = cfg.features.gated_mlp
        self.gelu_kw = cfg.features.gelu_kwargs  # {} (tanh) or approximate="none" (exact)
        h, f, bias = cfg.hidden_size, cfg.ffn, cfg.features.linear_bias
        col = {"group": tp, "bias": bias, "sequence_parallel": self.sequence_parallel,
               "enter": False, **kw, "ops": ops, "overlap": env.tp_comm_overlap}  # fmt: skip
        if self.gated:
            self.gate = ColumnParallelLinear(h, f, **col)
        self.up = ColumnParallelLinear(h, f, **col)
        self.down = RowParallelLinear(f, h, tp, bias=bias, sequence_parallel=self.sequence_parallel,
                                      **kw, ops=ops, overlap=env.tp_comm_overlap)  # fmt: skip

    def forward(self, x, fused=True):
        if self.gated:
            y = self.ops.swiglu(*fused_column_linear(x, (self.gate, self.up), fused))  # (b, s, f/t)
        else:
            (up,) = fused_column_linear(x, (self.up,), fused)
            y = self.ops.gelu(up, **self.gelu_kw)
        return self.down(y)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, env: LayerEnv, moe: bool = False, rope=None):
        """`moe`: the layer holds experts (over `env.experts`) instead of an MLP. `rope`: the
        chunk's RotaryTables."""
        super().__init__()
        self.sequence_parallel, self.rng, self.dropout, self.recompute = (
            env.sequence_parallel,
            env.rng,
            cfg.hidden_dropout,
            env.recompute,
        )
        self.input_norm = Norm(cfg, env)
        attention = LatentAttention if cfg.features.latent_attention else Attention
        self.attention = attention(cfg, env, rope)
        self.post_attention_norm = Norm(cfg, env)
        if not moe:
            self.mlp = MLP(cfg, env)
        else:
            size = cfg.moe_shared_expert_intermediate_size
            shared_cfg = dataclasses.replace(cfg, ffn_hidden_size=size)
            self.mlp = MoELayer(cfg, env, MLP(shared_cfg, env) if size else None)

    def _drop(self, x):
        if not self.training or self.dropout == 0:
            return x
        if self.sequence_parallel:  # rows sharded over TP: different masks per rank
            with self.rng.fork():
                return F.dropout(x, self.dropout)
        return F.dropout(x, self.dropout)

    def _forward(self, x, kv=None, shard=None):
        h = self.input_norm(x)
        x = x + self._drop(self.attention(h, shard) if kv is None else self.attention.decode(h, kv))
        return x + self._drop(self.mlp(self.post_attention_norm(x), fused=kv is None))

    def forward(self, x, kv=None, shard=None):
        if kv is not None:  # inference: nothing to recompute
            return self._forward(x, kv)
        if self.recompute == "full" and self.training:
            return checkpoint(self._forward, x, None, shard, use_reentrant=False,
                              context_fn=self.rng.recompute_contexts)  # fmt: skip
        return self._forward(x, shard=shard)
