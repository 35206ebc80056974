"""Multi-token prediction (DeepSeek-V3's MTP, `--mtp-num-layers D`): D modules after the head.

Module k (1..D) predicts token t+1+k at position t from the previous depth's hidden states
h^{k-1} (h^0: the last layer's output, before the final norm) and the embedding of token t+k:

    h^k = Layer_k(eh_proj([enorm(emb(t+k)); hnorm(h^{k-1})]))      eh_proj: (2h -> h)
    loss_k = cross_entropy(output(final_norm_k(h^k)), t+1+k)

sharing the word embedding and the output layer with the model. The chunk with the head holds
the modules (the last pipeline stage, its last virtual chunk): the tokens t+k are its labels
moved left by k-1, the targets its labels moved left by k, and the last k positions of each row
have no target. The training loss is the model's plus `mtp_loss_scaling_factor` times the mean
of the D losses (Megatron's --mtp-loss-scaling-factor).

Tensor parallelism: the norms and eh_proj are whole on every rank (with sequence parallelism
each rank projects its own rows, and their gradients are summed over TP); the layer is an
ordinary `TransformerLayer`. A head stage without the embedding holds a copy of it, tied to the
first stage's as a tied output layer is (`tied_to`, gradients summed over the `embed` group).
"""

import torch
import torch.nn as nn

from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.layers import Norm, TransformerLayer
from megalite.parallel.specs import mark
from megalite.parallel.tensor_parallel import shard_spec


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, env: LayerEnv, moe: bool = False, rope=None):
        """`moe`: the module's layer holds experts (DeepSeek-V3's MTP layer is an MoE layer
        when the model's last layers are); `rope`: the chunk's RotaryTables."""
        super().__init__()
        self.ops = env.ops
        self.enorm = Norm(cfg, env)
        self.hnorm = Norm(cfg, env)
        h = cfg.hidden_size
        w = torch.empty(h, 2 * h, **env.tensor_kw)  # [embedding; hidden] -> hidden, whole
        spec = shard_spec(env.tp, None, partial_grad=env.sequence_parallel)  # rows split over TP
        self.eh_proj = nn.Module()
        self.eh_proj.weight = mark(nn.Parameter(w), **spec)
        self.layer = TransformerLayer(cfg, env, moe, rope)
        self.final_norm = Norm(cfg, env)

    def forward(self, emb, hidden, shard=None):
        """emb, hidden (b, s[/t], h) -> this depth's hidden states (b, s[/t], h)."""
        x = torch.cat([self.enorm(emb), self.hnorm(hidden)], -1)
        return self.layer(self.ops.linear(x, self.eh_proj.weight), shard=shard)


def shifted(labels: torch.Tensor, k: int) -> torch.Tensor:
    """labels (b, s) moved left by k (the last k positions wrap: they have no target)."""
    return torch.roll(labels, -k, -1) if k else labels


def mtp_loss(chunk, hidden, labels, shard, token_loss) -> torch.Tensor:
    """The scaled mean of the MTP modules' losses. `chunk`: the GPTChunk holding them (its
    `mtp`, `mtp_embed` and `logits`); `token_loss(logits, labels)`: per-token losses (b, s)."""
    depth = len(chunk.mtp)
    s = labels.shape[-1]
    total = 0.0
    for k, module in enumerate(chunk.mtp.values(), 1):
        hidden = module(chunk.mtp_embed(shifted(labels, k - 1)), hidden, shard)
        loss = token_loss(chunk.logits(hidden, module.final_norm), shifted(labels, k))
        valid = (torch.arange(s, device=labels.device) < s - k).to(loss.dtype)  # (s,)
        if shard is not None and shard.loss_mask is not None:
            total = total + (loss * valid * shifted(shard.loss_mask, k)).sum() * shard.loss_weight
        else:
            total = total + (loss * valid).sum() / (valid.sum() * labels.shape[0])
    return total * (chunk.cfg.mtp_loss_scaling_factor / depth)
