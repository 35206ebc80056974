"""How an MoE router turns its logits into k experts per token and their weights.

One `Routing` (built from the MoE fields of ModelConfig) answers every routing question, so the
layer (model/moe.py) never asks which model it is. Shapes: T tokens, E experts, k per token,
G expert groups. Everything here is per token: no communication, the same in every layout.

- scores (T, E): softmax over the experts (Mixtral, Qwen3-MoE, gpt-oss), or the sigmoid of each
  logit (DeepSeek-V3, --moe-router-score-function sigmoid);
- choice: the top k of the scores plus the auxiliary-loss-free expert bias (when enabled);
  with node-limited routing (--moe-router-num-groups G, --moe-router-group-topk g) only the
  g groups with the best sum of their two best biased scores take part (DeepSeek-V3);
- weights (T, k): the chosen experts' unbiased scores, renormalised over the k chosen unless
  --moe-router-pre-softmax (sigmoid: a 1e-20 guard on the sum, as DeepSeek-V3), times
  --moe-router-topk-scaling-factor. gpt-oss's "softmax over the top-k logits" is this
  renormalised softmax exactly.
- aux_probs: the per-expert probabilities the load-balancing loss uses (sigmoid scores are
  first normalised over the experts, as Megatron does).
"""

from dataclasses import dataclass

import torch

from megalite.config import ModelConfig

GROUP_SCORE_TOP = 2  # a group is ranked by the sum of its best two scores (DeepSeek-V3)


@dataclass(frozen=True)
class Routing:
    k: int
    sigmoid: bool = False
    normalise: bool = True  # renormalise the weights over the k chosen
    groups: int | None = None  # node-limited routing: experts in G groups ...
    group_topk: int | None = None  # ... of which a token may use g
    scale: float = 1.0

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Routing":
        return cls(
            k=cfg.moe_router_topk,
            sigmoid=cfg.moe_router_score_function == "sigmoid",
            normalise=not cfg.moe_router_pre_softmax,
            groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk,
            scale=cfg.moe_router_topk_scaling_factor or 1.0,
        )

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """(T, E) fp32 logits -> (T, E) scores."""
        return logits.sigmoid() if self.sigmoid else logits.softmax(-1)

    def choose(self, scores: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """(T, E) scores and the expert bias (E,) or None -> expert indices (T, k)."""
        choice = scores if bias is None else scores + bias
        if self.groups:
            t, e = choice.shape
            grouped = choice.view(t, self.groups, e // self.groups)
            best = grouped.topk(min(GROUP_SCORE_TOP, e // self.groups), dim=-1).values.sum(-1)
            keep = torch.zeros_like(best, dtype=torch.bool)  # (T, G)
            keep.scatter_(1, best.topk(self.group_topk, dim=-1).indices, True)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(t, e)
            choice = choice.masked_fill(~keep, float("-inf"))
        return choice.topk(self.k, dim=-1).indices

    def weights(self, scores: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """(T, E) scores, (T, k) chosen experts -> (T, k) weights."""
        w = scores.gather(1, top)
        if self.normalise:
            total = w.sum(-1, keepdim=True)
            w = w / (total + 1e-20 if self.sigmoid else total)
        return w * self.scale if self.scale != 1.0 else w

    def aux_probs(self, scores: torch.Tensor) -> torch.Tensor:
        """(T, E): the probabilities P_e of the load-balancing loss are made of."""
        return scores / scores.sum(-1, keepdim=True) if self.sigmoid else scores
