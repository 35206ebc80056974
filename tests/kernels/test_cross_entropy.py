import importlib

import pytest
import torch
from megalite.kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_ref,
    cross_entropy_shard_grad,
    cross_entropy_shard_grad_ref,
    cross_entropy_shard_stats,
    cross_entropy_shard_stats_ref,
)

from tests.kernels.helpers import assert_within, check_op, cuda_dtypes, make


def _labels(shape, vocab, device="cpu"):
    labels = torch.randint(0, vocab, shape, device=device)
    labels.view(-1)[::7] = -100  # some ignored tokens
    return labels


@pytest.mark.parametrize("noncontig", [False, True])
def test_cross_entropy(dtype, noncontig):
    torch.manual_seed(0)
    logits = make((3, 11, 129), dtype, noncontig=noncontig, scale=4.0)  # 3 vocab blocks of 64
    labels = _labels((3, 11), 129)
    check_op(cross_entropy, cross_entropy_ref, (logits, labels))
    loss = cross_entropy(logits, labels)
    assert loss.dtype == torch.float32 and (loss[labels == -100] == 0).all()


def test_cross_entropy_large_logits():
    # A max far from zero: the online log-sum-exp must not overflow.
    torch.manual_seed(1)
    logits = make((4, 200), torch.float16, scale=2.0, offset=60000.0 / 2**4)
    check_op(cross_entropy, cross_entropy_ref, (logits, torch.randint(0, 200, (4,))))


@pytest.mark.parametrize("torch_path", [False, True])
def test_vocab_parallel_combination(torch_path):
    """Three uneven vocab shards combined as the module docstring says give the full loss."""
    torch.manual_seed(2)
    dtype = torch.float64 if torch_path else torch.float32  # fp64 takes the torch fallback
    logits = (torch.randn(5, 7, 150, dtype=torch.float64) * 4).to(dtype)
    labels = _labels((5, 7), 150)
    bounds = [(0, 40), (40, 111), (111, 150)]
    stats = [cross_entropy_shard_stats(logits[..., a:b], labels, a) for a, b in bounds]
    m = torch.stack([st[0] for st in stats]).amax(0)  # all_reduce MAX
    s = sum(st[1] * torch.exp(st[0] - m) for st in stats)  # all_reduce SUM
    t = sum(st[2] for st in stats)  # all_reduce SUM
    lse = m + torch.log(s)
    loss = torch.where(labels == -100, 0.0, lse - t)
    x = logits.double().requires_grad_()
    exact = cross_entropy_ref(x, labels)
    assert loss.dtype == torch.promote_types(dtype, torch.float32) and loss.shape == labels.shape
    assert_within("loss", loss, exact.float(), exact, 1e-5)
    g = torch.randn(5, 7, dtype=torch.float64)
    (d_exact,) = torch.autograd.grad(exact, x, g)
    d = torch.cat(
        [cross_entropy_shard_grad(logits[..., a:b], labels, a, lse, g) for a, b in bounds], -1
    )
    assert d.dtype == dtype
    assert_within("grad", d, d_exact.to(dtype), d_exact, 1e-5)


def test_shard_references_work_in_row_slices(monkeypatch):
    """The torch references never hold an fp32 copy of all the logits: with slices of a few
    rows they give what one slice gives."""
    torch.manual_seed(4)
    logits = torch.randn(6, 9, 70, dtype=torch.float16) * 3
    labels = _labels((6, 9), 100)
    whole = cross_entropy_shard_stats_ref(logits, labels, 30)
    lse = whole[0] + whole[1].log()
    g = torch.randn(6, 9)
    grad = cross_entropy_shard_grad_ref(logits, labels, 30, lse, g)
    module = importlib.import_module("megalite.kernels.cross_entropy")  # (the package exports
    monkeypatch.setattr(module, "_REF_ELEMENTS", 70 * 4)  # a function of the same name)
    for a, b in zip(cross_entropy_shard_stats_ref(logits, labels, 30), whole):
        assert torch.equal(a, b)
    assert torch.equal(cross_entropy_shard_grad_ref(logits, labels, 30, lse, g), grad)
    # a shard that is all vocabulary padding: no column, max -inf, nothing to add
    m, s, t = cross_entropy_shard_stats_ref(logits[..., :0], labels, 100)
    assert (m == float("-inf")).all() and (s == 0).all() and (t == 0).all()
    assert cross_entropy_shard_grad_ref(logits[..., :0], labels, 100, lse, g).shape == (6, 9, 0)


def _vocab_parallel(rank, world, dtype):
    """The vocab-parallel loss with the Triton shard kernels (interpreter) against one process,
    and what it keeps for backward: the logits in their dtype, no fp32 softmax."""
    from megalite.kernels import TORCH_OPS, TRITON_OPS

    from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    tp = build_groups(Topology(tp=world), torch.device("cpu")).tp
    torch.manual_seed(5)
    vocab, padded = 150, 160  # the last shard holds 10 padding columns
    full = torch.randn(4, 7, vocab, dtype=torch.float64) * 4
    labels = _labels((4, 7), vocab)
    g = torch.randn(4, 7, dtype=torch.float64)
    padded_full = torch.nn.functional.pad(full, (0, padded - vocab))
    mine = padded_full.chunk(world, -1)[rank].to(dtype).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(mine, labels, tp, vocab, ops=TRITON_OPS)
    (d,) = torch.autograd.grad(loss, mine, g.float())
    x = full.to(dtype).double().requires_grad_()
    exact = cross_entropy_ref(x, labels)
    (d_exact,) = torch.autograd.grad(exact, x, g)
    ref_loss = vocab_parallel_cross_entropy(mine.detach().requires_grad_(), labels, tp, vocab,
                                            ops=TORCH_OPS)  # fmt: skip
    assert_within("loss", loss, ref_loss, exact, 1e-5 if dtype == torch.float32 else 1e-3)
    d_exact = torch.nn.functional.pad(d_exact, (0, padded - vocab)).chunk(world, -1)[rank]
    assert_within("grad", d, d_exact.to(dtype), d_exact, 1e-5 if dtype == torch.float32 else 1e-3)
    big = [t for t in saved if t.dim() and t.shape[-1] == mine.shape[-1]]
    assert [t.dtype for t in big] == [dtype]  # the logits themselves; no fp32 (tokens, V) copy
    return True


@pytest.mark.distributed
def test_vocab_parallel_with_triton_kernels_at_tp2(dtype):
    from megalite.testing import spawn

    assert spawn(_vocab_parallel, 2, dtype) == [True, True]


@pytest.mark.gpu
@cuda_dtypes()
def test_cross_entropy_gpu(dtype):
    torch.manual_seed(3)
    logits = make((4096, 128256), dtype, "cuda", scale=4.0)
    check_op(cross_entropy, cross_entropy_ref, (logits, _labels((4096,), 128256, "cuda")))
