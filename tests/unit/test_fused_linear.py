"""tensor_parallel.fused_column_linear in one process: what its backward keeps, and its
gradients against F.linear per layer (the TP + SP layer against one process:
tests/distributed/test_tensor_parallel.py)."""

import pytest
import torch
import torch.nn.functional as F

from megalite.parallel.comm import Group
from megalite.parallel.tensor_parallel import (
    ColumnParallelLinear,
    _JoinedLinear,
    fused_column_linear,
)
from megalite.pipeline.split_backward import input_grad


def _layers(bias: bool):
    g = Group("tp", [0], 0)
    torch.manual_seed(0)
    layers = [ColumnParallelLinear(8, n, g, bias=bias, enter=False, dtype=torch.float64)
              for n in (4, 2, 2)]  # fmt: skip
    for layer in layers:
        torch.nn.init.normal_(layer.weight)
        if bias:
            torch.nn.init.normal_(layer.bias)
    return layers


def _loss(ys):
    return sum(((i + 1) * y).square().sum() for i, y in enumerate(ys))


@pytest.mark.parametrize("bias", [False, True])
def test_gradients_are_f_linears_and_no_joined_weight_is_kept(bias):
    layers = _layers(bias)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        ys = fused_column_linear(x * 1, layers)
    params = {p.untyped_storage().data_ptr() for layer in layers for p in layer.parameters()}
    assert [tuple(t.shape) for t in kept if t.untyped_storage().data_ptr() not in params] == [
        (2, 5, 8)]  # x only: the weights themselves, no (8, 8) concatenation  # fmt: skip
    _loss(ys).backward()
    got = [x.grad.clone()] + [p.grad.clone() for layer in layers for p in layer.parameters()]
    x.grad = None
    for layer in layers:
        layer.zero_grad()
    _loss([F.linear(x, layer.weight, layer.bias) for layer in layers]).backward()
    want = [x.grad] + [p.grad for layer in layers for p in layer.parameters()]
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-12


def test_a_split_backward_makes_each_gradient_once():
    """Zero-bubble's I computes the input's gradient alone, W the weights' alone."""
    layers = _layers(True)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    calls = []
    backward = _JoinedLinear.backward

    def spy(ctx, g):
        out = backward(ctx, g)
        calls.append([o is not None for o in out[3:]])  # x, the weights, the bias
        return out

    _JoinedLinear.backward = staticmethod(spy)
    try:
        h = x * 1
        out = torch.cat(fused_column_linear(h, layers), -1)
        w = input_grad(out, torch.ones_like(out), h, [p for la in layers for p in la.parameters()])
        w()
    finally:
        _JoinedLinear.backward = staticmethod(backward)
    assert calls == [[True, False, False, False, False], [False, True, True, True, True]]
