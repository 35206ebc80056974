"""The peer of bench_tp.py: a plain-module GPT of megalite's llama shape and parameter names
(nn.Embedding, nn.RMSNorm, nn.Linear; attention, rotary and SwiGLU through megalite's plain-torch
reference functions), parallelised with torch's DTensor TP (`parallelize`), and a global-norm
clip for a mix of DTensor and plain parameters (`clip`)."""

import torch
import torch.nn as nn
from megalite.kernels import TORCH_OPS

from megalite.config import ModelConfig
from megalite.model.rope import rotary_tables


class Attention(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        h, hd = m.hidden_size, m.head_dim
        self.hd = hd
        self.q = nn.Linear(h, m.num_attention_heads * hd, bias=False)
        self.k = nn.Linear(h, m.heads_kv * hd, bias=False)
        self.v = nn.Linear(h, m.heads_kv * hd, bias=False)
        self.out = nn.Linear(m.num_attention_heads * hd, h, bias=False)
        cos, sin = rotary_tables(m)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):  # (b, s, h) -> (b, s, h); under TP q/k/v hold this rank's heads
        b, s = x.shape[:2]
        q = self.q(x).view(b, s, -1, self.hd)
        k = self.k(x).view(b, s, -1, self.hd)
        v = self.v(x).view(b, s, -1, self.hd)
        q = TORCH_OPS.rotary(q, self.cos[:s], self.sin[:s])
        k = TORCH_OPS.rotary(k, self.cos[:s], self.sin[:s])
        o = TORCH_OPS.attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(m.hidden_size, m.ffn, bias=False)
        self.up = nn.Linear(m.hidden_size, m.ffn, bias=False)
        self.down = nn.Linear(m.ffn, m.hidden_size, bias=False)

    def forward(self, x):
        return self.down(TORCH_OPS.swiglu(self.gate(x), self.up(x)))


class Layer(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.input_norm = nn.RMSNorm(m.hidden_size, eps=m.norm_epsilon)
        self.attention = Attention(m)
        self.post_attention_norm = nn.RMSNorm(m.hidden_size, eps=m.norm_epsilon)
        self.mlp = MLP(m)

    def forward(self, x):
        x = x + self.attention(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class TorchGPT(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        V = m.padded_vocab_size(1)
        self.embedding = nn.Module()
        self.embedding.word = nn.Embedding(V, m.hidden_size)
        self.layers = nn.ModuleList(Layer(m) for _ in range(m.num_layers))
        self.final_norm = nn.RMSNorm(m.hidden_size, eps=m.norm_epsilon)
        self.output = nn.Linear(m.hidden_size, V, bias=False)

    def forward(self, ids):  # -> logits (b, s, V): a DTensor sharded on the vocabulary under TP
        x = self.embedding.word(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.final_norm(x))


def parallelize(model: TorchGPT, mesh, sequence_parallel: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if sequence_parallel:  # torchtitan's plan
        top = {
            "embedding.word": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "final_norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        }
        enter = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        layer = {
            "input_norm": SequenceParallel(),
            "attention": enter,
            "attention.out": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_norm": SequenceParallel(),
            "mlp": enter,
            "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        top = {
            "embedding.word": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        layer = {"attention.out": RowwiseParallel(), "mlp.down": RowwiseParallel()}
    for name in ("attention.q", "attention.k", "attention.v", "mlp.gate", "mlp.up"):
        layer[name] = ColwiseParallel()
    parallelize_module(model, mesh, top)
    for blk in model.layers:
        parallelize_module(blk, mesh, layer)
    return model


def clip(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ for a mix of DTensor and plain (replicated) parameters:
    without SP the norms stay plain tensors, and torch's clip cannot stack the two kinds."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    dts = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sq = 0.0
    if dts:
        sq += torch.nn.utils.get_total_norm(dts).full_tensor().item() ** 2
    if plain:
        sq += torch.nn.utils.get_total_norm(plain).item() ** 2
    coef = min(1.0, max_norm / (sq**0.5 + 1e-6))
    if coef < 1.0:
        for group in (dts, plain):
            if group:
                torch._foreach_mul_(group, coef)
    return sq**0.5
