"""Context parallelism: the sequence split over the ranks of `cp`, attention over all of it.

Load balance. The sequence is cut into 2·cp chunks; rank i holds chunks i and 2·cp-1-i, so
every rank has as much causal work as any other (an early chunk sees few keys, a late one many).
Tokens keep their true global positions (`chunk_positions`), which rotary and learned position
embeddings, the causal mask and document masking all use.

Ring attention (`ring_attention`, Megatron's cp_comm_type "p2p"). The K/V block of every rank
travels around the ring: at step j a rank computes its queries against the block that started
j ranks back while the next block is already on its way (asynchronous send/receive, waited for
only after the computation), and merges the partial results with their log-sum-exps. Nothing
but this rank's q, k, v, output and log-sum-exp is kept for backward: backward sends the K/V
blocks around again, each with the gradient of its keys and values accumulating as it goes, and
a last hop takes that gradient home. So cp-1 K/V transfers per direction, and attention's saved
bytes per rank are 1/cp of the whole sequence's.

The blocks are the kernels' `attention_block_fwd` / `attention_block_bwd` / `merge_attention`
(Triton, or their plain-torch references: exact in fp64).
"""

import torch

from megalite.parallel.comm import Group
from megalite.pipeline import p2p


def chunk_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions of the tokens rank `rank` holds: chunks rank and 2cp-1-rank of
    2cp equal chunks, in that order. (seq/cp,) int64."""
    n = seq // (2 * cp)
    first = torch.arange(rank * n, (rank + 1) * n, device=device)
    second = torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n, device=device)
    return torch.cat([first, second])


def _ring_step(group: Group, send: torch.Tensor, recv: torch.Tensor):
    """Post: `send` to the next rank of the ring, `recv` from the previous one."""
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    return p2p.post([(True, send, nxt), (False, recv, prev)], group)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, positions, docs, ops):
        # q (b, hq, s, d), k, v (b, hkv, s, d): this rank's tokens; positions/docs: (cp, s) of
        # every rank's tokens (known everywhere: every cp rank holds the same samples)
        cp, me = group.size, group.rank
        kv = torch.stack([k, v])  # (2, b, hkv, s, d): one message per hop
        out = lse = None
        for step in range(cp):
            src = (me - step) % cp  # whose K/V this is
            nxt = torch.empty_like(kv) if step < cp - 1 else None
            batch = _ring_step(group, kv, nxt) if nxt is not None else None
            o, l = ops.attention_block_fwd(
                q, kv[0], kv[1], positions[me], positions[src],
                None if docs is None else docs[me], None if docs is None else docs[src],
            )  # fmt: skip
            out, lse = (o, l) if out is None else ops.merge_attention(out, lse, o, l)
            if batch is not None:
                batch.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse, positions, *(() if docs is None else (docs,)))
        ctx.group, ctx.ops = group, ops
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, positions, *docs = ctx.saved_tensors
        docs = docs[0] if docs else None
        group, ops = ctx.group, ctx.ops
        cp, me = group.size, group.rank
        dq = torch.zeros_like(out)
        # (K, V, dK, dV) of one rank travel together; the last hop takes dK, dV home
        state = torch.cat([torch.stack([k, v]).to(out.dtype), torch.zeros(2, *k.shape,
                          dtype=out.dtype, device=k.device)])  # fmt: skip
        for step in range(cp):
            src = (me - step) % cp
            kk, vv = state[0].to(q.dtype), state[1].to(q.dtype)
            g_q, g_k, g_v = ops.attention_block_bwd(
                q, kk, vv, out, lse, dout, positions[me], positions[src],
                None if docs is None else docs[me], None if docs is None else docs[src],
            )  # fmt: skip
            dq += g_q
            state[2] += g_k
            state[3] += g_v
            if cp > 1:  # cp-1 hops with K/V, the last one with dK, dV only
                last = step == cp - 1
                send = state[2:] if last else state
                nxt = torch.empty_like(send)
                _ring_step(group, send, nxt).wait()
                state = nxt if not last else torch.cat([state[:2], nxt])
        # after cp hops the gradients that arrived are this rank's own keys' and values'
        dk, dv = state[2].to(k.dtype), state[3].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None


def ring_attention(q, k, v, group: Group, positions, docs=None, ops=None):
    """Causal (and, with `docs`, document-masked) attention of this rank's queries against the
    keys of every rank of `group`. q (b, hq, s/cp, d), k and v (b, hkv, s/cp, d); positions
    (cp, s/cp): the global positions of every rank's tokens; docs (cp, s/cp) their document
    ids, or None. Returns (b, hq, s/cp, d) in q's dtype."""
    if ops is None:
        from megalite.kernels import TORCH_OPS as ops
    return _RingAttention.apply(q, k, v, group, positions, docs, ops)
