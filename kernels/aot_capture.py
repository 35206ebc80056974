"""Capture the launches the kernel launchers really make on a GPU, on a CPU-only machine.

The launchers choose block sizes, warps and stages from the device (its type, compute
capability, shared memory), and the kernels' signatures follow from the tensors and ints they
pass. `capture(arch)` runs launchers on fake CUDA tensors (torch's FakeTensorMode: shapes,
dtypes and strides, no data) with the device properties of `arch`, and records every
`kernel[grid](...)` call instead of launching it: the JIT function, its bound arguments
(tensors as triton's MockTensor of the same dtype), the options and the grid. aot.py compiles
exactly those, through the binder the JIT itself uses, so nothing is re-typed by hand.

Needs a process where TRITON_INTERPRET is unset: there `@triton.jit` makes JITFunctions.
"""

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Arch:
    """A target: compute capability, shared memory one block may use (bytes), SMs."""

    name: str
    capability: int
    smem: int
    sms: int

    @property
    def major_minor(self) -> tuple[int, int]:
        return divmod(self.capability, 10)


# Shared memory per block (opt-in maximum): CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability": 8.0 163 KB, 8.6/8.9 99 KB, 9.0 227 KB, 10.0 227 KB.
ARCHS = {
    "sm_80": Arch("sm_80", 80, 163 * 1024, 108),
    "sm_86": Arch("sm_86", 86, 99 * 1024, 84),
    "sm_89": Arch("sm_89", 89, 99 * 1024, 128),
    "sm_90a": Arch("sm_90a", 90, 227 * 1024, 132),
    "sm_100a": Arch("sm_100a", 100, 227 * 1024, 148),
}


@dataclass
class Launch:
    """One recorded `kernel[grid](*args, **kwargs)`; tensors replaced by MockTensors."""

    fn: object  # triton JITFunction
    args: tuple
    kwargs: dict
    grid: tuple
    case: str  # the scenario that made it
    shapes: list = field(default_factory=list)  # the tensor arguments' shapes, for the table


def _index(t: torch.Tensor, idx) -> torch.Tensor:
    """Basic indexing (None, ints, slices, ...) through aten view ops."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(x is Ellipsis for x in idx):
        i = next(j for j, x in enumerate(idx) if x is Ellipsis)
        named = sum(x is not None for x in idx) - 1
        idx = idx[:i] + (slice(None),) * (t.dim() - named) + idx[i + 1 :]
    dim = 0
    for x in idx:
        if x is None:
            t, dim = t.unsqueeze(dim), dim + 1
        elif isinstance(x, int):
            t = t.select(dim, x)
        elif isinstance(x, slice):
            start, stop, step = x.indices(t.shape[dim])
            t, dim = torch.ops.aten.slice(t, dim, start, stop, step), dim + 1
        else:
            raise TypeError(f"fake-CUDA capture supports basic indexing only, not {x!r}")
    return t


class _BasicIndexing(TorchFunctionMode):
    # Python indexing (also `~` and copying `.contiguous()`) of a fake CUDA tensor takes a CUDA device guard, which a
    # CPU-only torch lacks; the same through aten ops does not.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            return _index(*args)
        if func is torch.Tensor.__setitem__:
            t, idx, val = args
            view = _index(t, idx)
            view.copy_(val) if isinstance(val, torch.Tensor) else view.fill_(val)
            return None
        if func is torch.Tensor.__invert__:
            return torch.bitwise_not(*args)
        if func is torch.Tensor.contiguous and not args[0].is_contiguous():
            return torch.clone(args[0], memory_format=torch.contiguous_format)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def capture(arch: Arch):
    """Within: tensors made on "cuda" are fake, the device looks like `arch`, and kernel
    launches are recorded. Yields a recorder: call `rec.case = "..."` before each scenario;
    `rec.launches` holds the launches."""
    from triton.runtime.jit import JITFunction, MockTensor

    rec = SimpleNamespace(case="", launches=[])

    def run(self, *args, grid, warmup, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        mock = tuple(MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        grid = grid(dict(zip(self.arg_names, args))) if callable(grid) else tuple(grid)
        rec.launches.append(
            Launch(self, mock, dict(kwargs), grid, rec.case, [tuple(t.shape) for t in tensors])
        )

    major, minor = arch.major_minor
    props = SimpleNamespace(
        name=f"fake {arch.name}", major=major, minor=minor, multi_processor_count=arch.sms,
        shared_memory_per_block_optin=arch.smem,
    )  # fmt: skip
    saved = (JITFunction.run, torch.cuda.get_device_properties, torch.cuda.get_device_capability)
    JITFunction.run = run
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.get_device_capability = lambda device=None: (major, minor)
    try:
        with FakeTensorMode(), _BasicIndexing(), torch.no_grad():
            yield rec
    finally:
        JITFunction.run, torch.cuda.get_device_properties, torch.cuda.get_device_capability = saved


class _Ctx:
    """Stands in for autograd's ctx: autograd cannot run on fake CUDA tensors in a CPU-only
    torch, so scenarios call an autograd.Function's forward and backward themselves."""

    needs_input_grad = (True,) * 16

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def forward_backward(fn_cls, *args):
    """Run fn_cls.forward then fn_cls.backward (with output-shaped gradients), as autograd
    would, so the launches of both passes are recorded."""
    ctx = _Ctx()
    out = fn_cls.forward(ctx, *args)
    outs = out if isinstance(out, tuple) else (out,)
    fn_cls.backward(ctx, *(torch.empty_like(o) for o in outs))
    return out
