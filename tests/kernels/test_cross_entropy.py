import pytest
import torch
from megalite.kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_ref,
    cross_entropy_shard_grad,
    cross_entropy_shard_stats,
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
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    assert_within("loss", loss, exact.float(), exact, 1e-5)
    g = torch.randn(5, 7, dtype=torch.float64)
    (d_exact,) = torch.autograd.grad(exact, x, g)
    d = torch.cat(
        [cross_entropy_shard_grad(logits[..., a:b], labels, a, lse, g) for a, b in bounds], -1
    )
    assert d.dtype == dtype
    assert_within("grad", d, d_exact.to(dtype), d_exact, 1e-5)


@pytest.mark.gpu
@cuda_dtypes()
def test_cross_entropy_gpu(dtype):
    torch.manual_seed(3)
    logits = make((4096, 128256), dtype, "cuda", scale=4.0)
    check_op(cross_entropy, cross_entropy_ref, (logits, _labels((4096,), 128256, "cuda")))
