"""Ring attention at cp 2 and 4 against attention over the whole sequence in one process (fp64,
1e-10): outputs and the gradients of q, k and v, causal and with document masking; the ring
moves cp-1 K/V blocks per direction and keeps only this rank's tensors for backward."""

import pytest
import torch
from megalite.kernels import attention_masked_ref

from megalite.parallel.context_parallel import chunk_positions, ring_attention
from megalite.parallel.groups import build_groups
from megalite.parallel.topology import Topology
from tests.spawn import spawn

pytestmark = pytest.mark.distributed
B, HQ, HKV, S, D = 2, 4, 2, 16, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    # packed documents: each row cut at its own places
    ends = torch.rand(B, S, generator=g) < 0.2
    docs = torch.cumsum(ends.long(), 1)
    return q, k, v, torch.randn(B, HQ, S, D, generator=g, dtype=torch.float64), docs


def _ring(rank, world):
    cp = build_groups(Topology(dp=world), torch.device("cpu")).dp  # any group of the ranks
    positions = torch.stack([chunk_positions(S, world, r) for r in range(world)])  # (cp, s/cp)
    mine = positions[rank]
    q, k, v, dout, docs = _inputs()
    out, saved = [], []
    for with_docs in (False, True):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        every = torch.arange(S)
        doc_args = (docs, docs) if with_docs else (None, None)
        ref = attention_masked_ref(*full, every, every, *doc_args)
        ref.backward(dout)
        local = [t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v)]
        rank_docs = torch.stack([docs[:, p] for p in positions]) if with_docs else None
        cp.ledger.reset()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            got = ring_attention(*local, cp, positions, rank_docs)
        sends_forward = cp.ledger.calls["dp"]
        got.backward(dout[:, :, mine])
        err = (got - ref[:, :, mine]).abs().max().item()
        grads = [(a.grad - b.grad[:, :, mine]).abs().max().item() for a, b in zip(local, full)]
        out.append((err, max(grads), sends_forward, cp.ledger.calls["dp"] - sends_forward))
    return out, sum(t.numel() * t.element_size() for t in saved[: len(saved) // 2])


def _saved_bytes_one_rank() -> int:
    """What attention over the whole sequence keeps, through the same function at cp = 1."""
    from megalite.parallel.comm import Group

    q, k, v, _, _ = _inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ring_attention(*(t.requires_grad_() for t in (q, k, v)), Group("cp", [0], 0),
                       torch.arange(S)[None])  # fmt: skip
    return sum(t.numel() * t.element_size() for t in saved)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_whole_sequence(cp):
    whole = _saved_bytes_one_rank()
    for rank_out, saved in spawn(_ring, cp):
        # q, k, v, out and lse of this rank's tokens (positions: a few bytes more)
        assert saved <= whole / cp * 1.1, (saved, whole)
        for err, grad_err, forward_hops, backward_hops in rank_out:
            assert err <= 1e-10 and grad_err <= 1e-10, (err, grad_err)
            assert forward_hops == cp - 1  # K/V blocks sent on by each rank, forward
            assert backward_hops == cp  # cp-1 with K/V (and dK/dV), one taking dK/dV home


def test_load_balanced_positions():
    for cp in (1, 2, 4):
        got = sorted(torch.cat([chunk_positions(16, cp, r) for r in range(cp)]).tolist())
        assert got == list(range(16))
    # rank 0 holds the first and the last chunk: as much causal work as rank 1
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
