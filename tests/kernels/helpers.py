"""The kernel tests' one accuracy rule and input makers.

Rule: against an fp64 reference computed from the same (rounded) inputs, a kernel's max abs error
may be at most twice the error of torch's own op in the same dtype, plus a small atol scaled by
the result's magnitude. So a kernel is as exact as torch in the dtype, whatever the dtype.
"""

import pytest
import torch

ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def make(shape, dtype, device="cpu", noncontig=False, scale=1.0, offset=0.0):
    """Random tensor requiring grad; noncontig gives a view whose rows have a larger stride."""
    *lead, n = shape
    base = torch.randn(*lead, 2 * n if noncontig else n, dtype=torch.float64) * scale + offset
    base = base.to(device=device, dtype=dtype).requires_grad_()
    return base[..., :n] if noncontig else base


def _run(fn, args, grad_out):
    """fn(*args) -> (out, grads of out·grad_out w.r.t. the tensor args that require grad)."""
    out = fn(*args)
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(out, wrt, grad_out) if wrt and grad_out is not None else ()
    return out, grads


def _exact(args):
    """The same inputs in fp64, as new leaves (labels and other integer tensors unchanged)."""
    return [
        a.detach().double().requires_grad_(a.requires_grad)
        if isinstance(a, torch.Tensor) and a.is_floating_point()
        else a
        for a in args
    ]


def assert_within(name, actual, torch_out, exact, atol):
    err = (actual.double() - exact).abs().max().item()
    base = (torch_out.double() - exact).abs().max().item()
    bound = 2 * base + atol * max(1.0, exact.abs().max().item())
    assert err <= bound, f"{name}: kernel error {err:.3g} > 2 x torch's {base:.3g} + atol"


def check_op(op, ref, args, grad=True, atol=None, seed=0):
    """Compare op with ref in the same dtype and in fp64: output and every input gradient."""
    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
    atol = ATOL[dtype] if atol is None else atol
    out_t = ref(*args)
    torch.manual_seed(seed)
    g = torch.randn(out_t.shape, dtype=torch.float64).to(out_t) if grad else None
    out, grads = _run(op, args, g)
    out_t, grads_t = _run(ref, args, g)
    out_x, grads_x = _run(ref, _exact(args), None if g is None else g.double())
    assert out.dtype == out_t.dtype and out.shape == out_t.shape
    assert_within("output", out, out_t, out_x, atol)
    for i, (a, b, c) in enumerate(zip(grads, grads_t, grads_x)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_within(f"grad {i}", a, b, c, atol)


def cuda_dtypes():
    """GPU tests cover bf16 too (the interpreter cannot)."""
    return pytest.mark.parametrize(
        "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
    )
