"""Cross entropy on vocabulary-sharded logits, without ever gathering the full vocabulary.

Each rank holds logits (..., V/tp) for its slice of the padded vocabulary. The loss needs three
numbers per token, each combined over TP: the max (for stability), the sum of exp(logit - max)
and the target's logit (held by one rank). Columns past the real vocabulary (padding) are
excluded, so the loss equals an unpadded model's.
"""

import torch

from megalite.kernels._triton import at_least_fp32
from megalite.parallel import comm
from megalite.parallel.comm import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, ignore_index):
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        x = at_least_fp32(logits)  # (..., V/tp)
        n_real = max(0, min(per_rank, vocab_size - start))
        if n_real < per_rank:
            x = x.clone()
            x[..., n_real:] = float("-inf")
        m = x.max(dim=-1).values  # (...)
        comm.all_reduce(m, group, op=torch.distributed.ReduceOp.MAX)
        x = x - m.unsqueeze(-1)
        local = labels - start
        mine = (local >= 0) & (local < per_rank)
        target = torch.where(
            mine, x.gather(-1, local.clamp(0, per_rank - 1).unsqueeze(-1)).squeeze(-1), 0.0
        )
        exp = x.exp_()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([target, sum_exp])  # one all-reduce for the two sums
        comm.all_reduce(both, group)
        target, sum_exp = both
        loss = sum_exp.log() - target
        ignored = labels == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine & ~ignored, ignored)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine, ignored = ctx.saved_tensors
        grad = softmax  # d loss / d logit = softmax - onehot(target)
        rows = mine.nonzero(as_tuple=True)
        grad[rows + (local[rows],)] -= 1.0
        grad = grad * grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits, labels, group: Group, vocab_size: int, ignore_index: int = -100
):
    """logits (..., V_padded/tp) of this rank's vocabulary slice, labels (...) -> per-token loss
    (...) in fp32 (fp64 for fp64 logits); vocab_size is the real (unpadded) vocabulary."""
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_size, ignore_index)
