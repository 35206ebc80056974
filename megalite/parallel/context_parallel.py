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
blocks around again (overlapped the same way) and, on a second ring, the gradient of each
block's keys and values, accumulating as it goes and waited for only after the next block's
computation; its last hop takes the gradient home. So cp-1 K/V transfers per direction (plus
cp of dK/dV backward), and attention's saved bytes per rank are 1/cp of the whole sequence's.

The blocks are the kernels' `attention_block_fwd` / `attention_block_bwd` / `merge_attention`
(Triton, or their plain-torch references: exact in fp64).

All-to-all attention (`a2a_attention`, "a2a", DeepSpeed-Ulysses): one all-to-all trades this
rank's tokens of every head for every token of 1/cp of the heads, ordinary attention runs over
the whole sequence (in natural order), and a second all-to-all trades back. Three exchanges
forward (q, k+v, out), their reverses backward; it needs the heads divisible by cp.

Hierarchical attention (`hierarchical_attention`, "a2a+p2p", Megatron's
--hierarchical-context-parallel-sizes A P, cp = A·P): all-to-all among A adjacent cp ranks (a
node's), then the ring over the P groups of them (across nodes), each ring member holding its
A ranks' 2A chunks for 1/A of the heads; the blocks mask by true positions, so the
load-balanced split stays the data's. The ring's hops carry A times the tokens for 1/A of the
heads (the same bytes) but P-1 hops instead of cp-1; the heads must be divisible by A.

Attention sinks (gpt-oss, kernels/attention_sinks.py): a sink is one more softmax block with
value 0. The ring adds it once to each rank's merged result (`add_sink`), so every block's
backward sees the final probabilities, and its gradient comes from that result (`sink_grad`);
all-to-all hands each member its heads' sinks with the heads.

Batches (`shard_batch`): every cp rank loads the same samples and keeps its tokens, labels and
loss mask; what attention and the loss need to know of the whole (every rank's positions and
document ids, the step's count of tokens with a loss) is computed from the whole samples on
each rank, so it costs no communication. The document flags (--reset-position-ids,
--reset-attention-mask, --eod-mask-loss) go through the same `Shard`, with or without cp.
"""

from dataclasses import dataclass, fields

import torch

from megalite.kernels.attention_sinks import add_sink, sink_grad
from megalite.parallel import comm, p2p
from megalite.parallel.comm import Group


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


def _wait(batch, group: Group):
    """Wait for a ring hop; during a profiled schedule the wait is a "cp" span of the timeline
    (what the hop left exposed after the block computed meanwhile)."""
    with group.ledger.span("cp"):
        batch.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, positions, docs, ops, window):
        # q (b, hq, s, d), k, v (b, hkv, s, d): this rank's tokens; positions/docs: (cp, s) of
        # every rank's tokens (known everywhere: every cp rank holds the same samples); sinks
        # (hq,) or None: gpt-oss's sink logits, one more block merged once, after the ring
        cp, me = group.size, group.rank
        kv = torch.stack([k, v])  # (2, b, hkv, s, d): one message per hop
        out = lse = None
        for step in range(cp):
            src = (me - step) % cp  # whose K/V this is
            nxt = torch.empty_like(kv) if step < cp - 1 else None
            batch = _ring_step(group, kv, nxt) if nxt is not None else None
            o, l = ops.attention_block_fwd(
                q, kv[0], kv[1], positions[me], positions[src],
                None if docs is None else docs[me], None if docs is None else docs[src], **window,
            )  # fmt: skip
            out, lse = (o, l) if out is None else ops.merge_attention(out, lse, o, l)
            if batch is not None:
                _wait(batch, group)
                kv = nxt
        if sinks is not None:  # backward sees the final (out, lse): the sink's included
            out, lse = add_sink(out, lse, sinks)
        extra = (() if docs is None else (docs,)) + (() if sinks is None else (sinks,))
        ctx.has_docs, ctx.has_sinks = docs is not None, sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, positions, *extra)
        ctx.group, ctx.ops, ctx.window = group, ops, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, positions, *extra = ctx.saved_tensors
        docs = extra.pop(0) if ctx.has_docs else None
        dsinks = sink_grad(out, lse, dout, extra[0]) if ctx.has_sinks else None
        group, ops = ctx.group, ctx.ops
        cp, me = group.size, group.rank
        dq = torch.zeros_like(out)
        # Two rings: the K/V blocks, as forward (posted before the block that uses the current
        # one, so the hop overlaps it), and their gradients dK/dV in the accumulation dtype,
        # each rank adding its share and passing them on (waited for only after the next
        # block's computation). After cp hops the gradients of this rank's own keys come home.
        kv = torch.stack([k, v])
        dkv = torch.zeros(2, *k.shape, dtype=out.dtype, device=k.device)
        arriving = None  # (batch, tensor) bringing the gradients of the next block's keys
        for step in range(cp):
            src = (me - step) % cp
            nxt = torch.empty_like(kv) if step < cp - 1 else None
            batch = _ring_step(group, kv, nxt) if nxt is not None else None
            g_q, g_k, g_v = ops.attention_block_bwd(
                q, kv[0], kv[1], out, lse, dout, positions[me], positions[src],
                None if docs is None else docs[me], None if docs is None else docs[src],
                **ctx.window,
            )  # fmt: skip
            dq += g_q
            if arriving is not None:
                _wait(arriving[0], group)
                dkv = arriving[1]
            dkv[0] += g_k
            dkv[1] += g_v
            if cp > 1:
                home = torch.empty_like(dkv)
                arriving = (_ring_step(group, dkv, home), home)
            if batch is not None:
                _wait(batch, group)
                kv = nxt
        if arriving is not None:
            _wait(arriving[0], group)
            dkv = arriving[1]
        dq, dk, dv = dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq, dk, dv, dsinks, *(None,) * 5


def ring_attention(q, k, v, group: Group, positions, docs=None, ops=None, sinks=None, **window):
    """Causal (and, with `docs`, document-masked) attention of this rank's queries against the
    keys of every rank of `group`. q (b, hq, s/cp, d), k and v (b, hkv, s/cp, d); positions
    (cp, s/cp): the global positions of every rank's tokens; docs (cp, s/cp) their document
    ids, or None; `sinks` (hq,): a learned sink logit per query head (gpt-oss), or None;
    `window=W`: a sliding window over the positions. Returns (b, hq, s/cp, d) in q's dtype."""
    if ops is None:
        from megalite.kernels import TORCH_OPS as ops
    return _RingAttention.apply(q, k, v, sinks, group, positions, docs, ops, window)


def _exchange(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """(b, heads, s_loc, d) -> (b, heads/cp, cp*s_loc, d) (dim=1: scatter heads, gather the
    sequence in group order), or back (dim=2)."""
    cp = group.size
    b, h, s, d = x.shape
    if dim == 1:
        rows = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # (cp, b, h/cp, s, d): to member j
        got = comm.all_to_all(rows.reshape(cp, -1), group, [1] * cp, [1] * cp)
        got = got.reshape(cp, b, h // cp, s, d).permute(1, 2, 0, 3, 4)  # (b, h/cp, cp, s, d)
        return got.reshape(b, h // cp, cp * s, d)
    rows = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # (cp, b, h, s/cp, d)
    got = comm.all_to_all(rows.reshape(cp, -1), group, [1] * cp, [1] * cp)
    return got.reshape(cp, b, h, s // cp, d).transpose(0, 1).reshape(b, cp * h, s // cp, d)


def _scatter_heads(q, k, v, sinks, group: Group):
    """q (b, hq, s, d), k, v (b, hkv, s, d) of this rank's tokens -> every token of the group's
    members (in group order) for 1/size of the heads: q (b, hq/n, n*s, d), k and v (b, hkv/n,
    n*s, d), and this member's heads' sinks (so only their gradient reaches it)."""
    b, hkv, _, d = k.shape
    if sinks is not None:
        n = q.shape[1] // group.size
        sinks = sinks[group.rank * n : (group.rank + 1) * n]
    q = _exchange(q, group, 1)
    # one exchange for k and v: interleaved per head, so each member gets both of its heads
    kv = _exchange(torch.stack([k, v], 2).reshape(b, 2 * hkv, -1, d), group, 1)
    k, v = kv.unflatten(1, (hkv // group.size, 2)).unbind(2)
    return q, k, v, sinks


def a2a_attention(q, k, v, group: Group, positions, docs=None, ops=None, sinks=None, **window):
    """ring_attention's result by all-to-all (Ulysses): same arguments and result; the heads of
    q and of k, v must be divisible by the group's size."""
    if ops is None:
        from megalite.kernels import TORCH_OPS as ops
    q, k, v, sinks = _scatter_heads(q, k, v, sinks, group)  # (b, h/cp, s, d), rank order
    # rank order -> natural order: the causal mask needs no positions, the plain kernel runs
    order = positions.reshape(-1).argsort()
    back = order.argsort()
    q, k, v = (t[:, :, order] for t in (q, k, v))
    ids = ()  # causal in natural order; with documents, positions and doc ids
    if docs is not None:
        d = docs.permute(1, 0, 2).reshape(docs.shape[1], -1)[:, order]  # (b, s)
        every = positions.reshape(-1)[order]
        ids = (every, every, d, d)
    if sinks is not None:
        o = ops.attention_sinks(q, k, v, sinks, *ids, **window)
    elif ids:
        o = ops.attention_masked(q, k, v, *ids, **window)
    else:
        o = ops.attention(q, k, v, **window)
    return _exchange(o[:, :, back], group, 2)  # (b, hq, s/cp, d)


def hierarchical_attention(q, k, v, groups: tuple, positions, docs=None, ops=None, sinks=None,
                           **window):  # fmt: skip
    """ring_attention's result in two levels (Megatron's a2a+p2p): `groups` (inner, outer),
    the cp group cut into inner groups of A adjacent cp ranks and outer groups of the P ranks at
    one place of every inner group (cp rank a + A·p: inner rank a, outer rank p). An all-to-all
    over the inner group gathers its A ranks' tokens for 1/A of the heads, the ring runs over
    the outer group on those A·s/cp tokens, and a second all-to-all trades back. Each ring
    member's tokens are its inner group's chunks, in cp rank order, with their true positions
    (the blocks mask by positions, so any set of chunks is exact). Same arguments (positions
    and docs over all cp ranks) and result as ring_attention; the heads of q and of k, v must
    be divisible by A."""
    inner, outer = groups
    a, p = inner.size, outer.size
    q, k, v, sinks = _scatter_heads(q, k, v, sinks, inner)  # (b, h/A, A*s/cp, d)
    pos = positions.reshape(p, a * positions.shape[1])  # (P, A*s/cp): cp ranks A*p .. A*p+A-1
    if docs is not None:  # (cp, b, s/cp) -> (P, b, A*s/cp), the same tokens
        b, n = docs.shape[1:]
        docs = docs.reshape(p, a, b, n).transpose(1, 2).reshape(p, b, a * n)
    o = ring_attention(q, k, v, outer, pos, docs, ops, sinks, **window)
    return _exchange(o, inner, 2)  # (b, hq, s/cp, d)


def context_attention(q, k, v, group: Group, shard: "Shard", comm_type="p2p", ops=None,
                      sinks=None, **window):  # fmt: skip
    """Causal attention of this rank's tokens over the whole sequence of every rank of `group`,
    document-masked when the shard has document ids: q (b, hq, s/cp, d), k, v (b, hkv, s/cp, d).
    `comm_type`: "p2p" (ring), "a2a", or a2a+p2p's (inner, outer) groups of `group`
    (ProcessGroups.cp_levels; hierarchical_attention). At cp = 1 that is masked attention over this rank's sequences. `sinks` (hq,): gpt-oss's
    sink logits, or None. `window=W`: a sliding window by sequence index."""
    if ops is None:
        from megalite.kernels import TORCH_OPS as ops
    if group.size == 1:
        pos, doc = shard.index[0], None if shard.docs is None else shard.docs[0]
        if sinks is not None:
            return ops.attention_sinks(q, k, v, sinks, pos, pos, doc, doc, **window)
        return ops.attention_masked(q, k, v, pos, pos, doc, doc, **window)
    if isinstance(comm_type, tuple):  # a2a+p2p: its (inner, outer) groups
        group, attend = comm_type, hierarchical_attention
    else:
        attend = a2a_attention if comm_type == "a2a" else ring_attention
    return attend(q, k, v, group, shard.index, shard.docs, ops, sinks, **window)


@dataclass
class Shard:
    """This rank's share of one micro-batch's sequences: what the layers and the loss need
    beside the token ids and labels (s_loc = s/cp tokens of each sequence)."""

    positions: torch.Tensor  # (b, s_loc) int64: each token's position for the embeddings
    index: torch.Tensor  # (cp, s_loc) int64: the sequence index of every cp rank's tokens
    docs: torch.Tensor | None = None  # (cp, b, s_loc) document ids of every cp rank's tokens
    loss_mask: torch.Tensor | None = None  # (b, s_loc) 1.0 where a token's loss counts
    # With a loss mask: multiplies this rank's masked loss sum, m·cp / (the unmasked tokens of
    # the step's m micro-batches, whole sequences), so that averaging over micro-batches and cp
    # (as the executor and the gradient reduction do) gives sum(losses) / unmasked tokens.
    loss_weight: torch.Tensor | float = 1.0  # a 0-d float64 tensor with a mask: never read

    @property
    def attention_masked(self) -> bool:
        """Attention needs positions or documents (cp > 1, or document masking)."""
        return self.index.shape[0] > 1 or self.docs is not None

    def to(self, device, non_blocking=False) -> "Shard":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, t in moved.items():
            if isinstance(t, torch.Tensor):
                # a non-blocking copy from pageable memory is a blocking one: pin it first
                pin = (
                    non_blocking and t.device.type == "cpu" and torch.device(device).type == "cuda"
                )
                moved[name] = (t.pin_memory() if pin else t).to(device, non_blocking=non_blocking)
        return Shard(**moved)


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(b, s) -> (b, s) int64: 0 for the first document of each row, +1 after each end-of-document
    token (which belongs to the document it ends)."""
    starts = torch.zeros_like(tokens, dtype=torch.int64)
    starts[:, 1:] = (tokens[:, :-1] == eod).long()
    return starts.cumsum(1)


def shard_batch(batch, cp: int, rank: int, eod: int | None = None, reset_position_ids=False,
                reset_attention_mask=False, eod_mask_loss=False) -> list:  # fmt: skip
    """The micro-batches [(tokens, labels)] of a step, whole samples (b, s) on the host, as this
    cp rank trains on them: [(tokens, labels)] unchanged when cp = 1 and no document flag is
    set, else [(tokens, labels, Shard)] with this rank's s/cp tokens of each sample (chunks
    `rank` and 2cp-1-rank of 2cp). The loss count spans every micro-batch (and every cp rank)."""
    documents = reset_position_ids or reset_attention_mask or eod_mask_loss
    if cp == 1 and not documents:
        return batch
    if documents and eod is None:
        raise ValueError("document masking needs the end-of-document token (a tokenizer)")
    s = batch[0][0].shape[1]
    index = torch.stack([chunk_positions(s, cp, r) for r in range(cp)])  # (cp, s/cp)
    mine = index[rank]
    masks = [(tokens != eod).float() if eod_mask_loss else None for tokens, _ in batch]
    weight = 1.0
    if eod_mask_loss:  # a tensor, never read on the host: it travels with the shard
        counted = sum((tokens != eod).sum() for tokens, _ in batch)
        weight = len(batch) * cp / counted.clamp(min=1).double()
    out = []
    for (tokens, labels), mask in zip(batch, masks):
        b = tokens.shape[0]
        positions = torch.arange(s).expand(b, s)
        docs = None
        if reset_position_ids or reset_attention_mask:
            d = document_ids(tokens, eod)
            if reset_position_ids:  # position within the document: index minus its start
                first = torch.where(torch.diff(d, dim=1, prepend=d[:, :1] - 1) > 0, positions, 0)
                positions = positions - first.cummax(1).values
            docs = torch.stack([d[:, i] for i in index]) if reset_attention_mask else None
        shard = Shard(positions[:, mine].contiguous(), index, docs,
                      None if mask is None else mask[:, mine].contiguous(), weight)  # fmt: skip
        out.append((tokens[:, mine].contiguous(), labels[:, mine].contiguous(), shard))
    return out
