"""Cross entropy on vocabulary-sharded logits, without ever gathering the full vocabulary.

Each rank holds logits (..., V/tp) for its slice of the padded vocabulary. The loss needs three
numbers per token, each combined over TP: the max (for stability), the sum of exp(logit - max)
and the target's logit (held by one rank). The shard statistics and the shard gradient are the
ops' `ce_shard_stats` / `ce_shard_grad` (kernels/cross_entropy.py: Triton kernels that stream
the vocabulary, or their torch references that work a slice of rows at a time), so no fp32
softmax of the logits is ever materialised or saved: backward keeps the logits (in their dtype)
and the fp32 log-sum-exp per token. Columns past the real vocabulary (padding) are excluded, so
the loss equals an unpadded model's.
"""

import torch

from megalite.kernels import TORCH_OPS
from megalite.parallel import comm
from megalite.parallel.comm import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, ignore_index, ops):
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        real = logits[..., : max(0, min(per_rank, vocab_size - start))]  # (..., n_real)
        m, s, t = ops.ce_shard_stats(real, labels, start)  # (...) each, fp32 (fp64 for fp64)
        top = m.clone()
        comm.all_reduce(top, group, op=torch.distributed.ReduceOp.MAX)
        # each shard's sum rescaled to the global max; exactly one shard holds the target
        both = torch.stack([s * torch.exp(m - top), t])
        comm.all_reduce(both, group)  # one all-reduce for the two sums
        lse = top + both[0].log()
        ignored = labels == ignore_index
        loss = torch.where(ignored, 0.0, lse - both[1])
        ctx.save_for_backward(logits, labels, lse)
        ctx.start, ctx.n_real, ctx.ignore_index, ctx.ops = start, real.shape[-1], ignore_index, ops
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse = ctx.saved_tensors
        real = logits[..., : ctx.n_real]
        d = ctx.ops.ce_shard_grad(real, labels, ctx.start, lse, grad_loss, ctx.ignore_index)
        if ctx.n_real < logits.shape[-1]:  # padding columns get no gradient
            d = torch.cat([d, d.new_zeros((*d.shape[:-1], logits.shape[-1] - ctx.n_real))], -1)
        return d, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits, labels, group: Group, vocab_size: int, ignore_index: int = -100, ops=TORCH_OPS
):
    """logits (..., V_padded/tp) of this rank's vocabulary slice, labels (...) -> per-token loss
    (...) in fp32 (fp64 for fp64 logits); vocab_size is the real (unpadded) vocabulary. `ops`:
    the kernels' namespace (`megalite.kernels.select`), Triton or torch."""
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_size, ignore_index, ops)
