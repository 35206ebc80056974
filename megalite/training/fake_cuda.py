"""Fake devices on a CPU-only torch, and what a rank's code asks of the device counted: host
syncs and blocking host-to-device copies.

`FakeTensorMode` computes shapes, dtypes and devices without data. Around it `fake_cuda()`:
- routes the Python entry points that a CPU-only build refuses for "cuda" before any mode sees
  them (`Tensor.to`, `copy_`, `cuda`, `pin_memory`, indexing) to the aten ops they run, and
  stands in for the CUDA generator state and events. Forward and optimizer code runs on fake
  "cuda" tensors this way; autograd's backward does not (its engine needs the device guard
  and hooks of a CUDA build), so the fake world uses fake CPU tensors, the CPU playing the GPU
  (`gpu="cpu"`; docs/fake_world.md);
- answers host reads (`tolist`, `item`, `bool(...)`) of a fake tensor with a fill value, since
  there are no values: 0.0 for floating tensors (the step's norm and flags: no skip, no stop),
  `int_fill` for integer ones (the expert router's counts: balanced routing), and counts each as
  a host sync, with blocking host-to-device copies (a tensor made on the device from a host
  value; a copy from unpinned memory), which wait for the device's queue on CUDA.

`where` says which line asked.
"""

import traceback
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"}
FACTORIES = {"tensor", "as_tensor"}  # from host values: on "cuda" a blocking copy


GPU = ["cuda"]  # the device type that plays the GPU (fake_cuda(gpu=...))


def _cuda(device) -> bool:
    return device is not None and torch.device(device).type == GPU[0]


class FakeCuda:
    """What `fake_cuda()` yields: the host syncs since `reset()`, and where each was asked."""

    def __init__(self, int_fill: int = 1):
        self.int_fill = int_fill
        self.syncs, self.where = 0, []

    def reset(self):
        self.syncs, self.where = 0, []

    def hit(self, what: str):
        self.syncs += 1
        self.where.append((what, "".join(traceback.format_stack(limit=10)[:-3])))

    def _fill(self, t: torch.Tensor):
        v = (
            0.0
            if t.dtype.is_floating_point
            else (False if t.dtype == torch.bool else self.int_fill)
        )
        for n in reversed(t.shape):
            v = [v] * n if not isinstance(v, list) else [list(v) for _ in range(n)]
        return v


def _pinned(t) -> bool:
    return getattr(t, "_fake_pinned", False)


def _on_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _basic(t, index):
    """Apply the ints, slices, None and ... of `index` to t with aten views; the tensor
    indices left, one per dimension of the result (None where there is none)."""
    aten = torch.ops.aten
    index = index if isinstance(index, tuple) else (index,)
    used = sum(1 for i in index if i is not None and i is not Ellipsis)
    dim, advanced = 0, []
    for i in index:
        if i is Ellipsis:
            skip = t.dim() - dim - (used - _count_before(index, i))
            advanced += [None] * skip
            dim += skip
        elif i is None:
            t = aten.unsqueeze(t, dim)
            advanced.append(None)
            dim += 1
        elif isinstance(i, bool) or isinstance(i, torch.Tensor) or isinstance(i, list):
            advanced.append(i if isinstance(i, torch.Tensor) else torch.tensor(i))
            dim += 1
        elif isinstance(i, int):
            t = aten.select.int(t, dim, i)
        elif isinstance(i, slice):
            start = 0 if i.start is None else i.start
            stop = 2**62 if i.stop is None else i.stop
            t = aten.slice.Tensor(t, dim, start, stop, i.step or 1)
            advanced.append(None)
            dim += 1
        else:
            raise TypeError(f"fake_cuda: index {i!r} not supported")
    return t, advanced


def _count_before(index, marker) -> int:
    """Dimensions the entries of `index` before `marker` consume."""
    n = 0
    for i in index:
        if i is marker:
            return n
        n += i is not None
    return n


def _getitem(t, index):
    t, adv = _basic(t, index)
    if any(a is not None for a in adv):
        return torch.ops.aten.index.Tensor(t, adv)
    return t


def _setitem(t, index, value):
    view, adv = _basic(t, index)
    if not isinstance(value, torch.Tensor):
        value = torch.ops.aten.scalar_tensor(value, dtype=t.dtype, device=t.device)
    if any(a is not None for a in adv):
        torch.ops.aten.index_put_(view, adv, value)
    else:
        torch.ops.aten.copy_(view, value)


class _Entry(TorchFunctionMode):
    """The Python-level calls: device moves, host reads, host-value factories."""

    def __init__(self, state: FakeCuda):
        super().__init__()
        self.s = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        s = self.s
        if name in READS and args and isinstance(args[0], FakeTensor):
            s.hit(name)
            value = s._fill(args[0])
            return value if name == "tolist" else (value if not isinstance(value, list) else 0)
        if name in FACTORIES and _cuda(kwargs.get("device")):
            data = args[0] if args else kwargs.get("data")
            if not isinstance(data, torch.Tensor) or data.device.type == "cpu":
                s.hit(f"torch.{name} on the device from a host value")
        if name == "pin_memory" and isinstance(args[0], torch.Tensor):
            out = torch.ops.aten.clone(args[0])  # page-locked memory of its own
            out._fake_pinned = True
            return out
        if name in ("to", "cuda") and isinstance(args[0], torch.Tensor):
            return self._to(name, args, kwargs)
        if name == "__getitem__" and _on_cuda(args[0]):
            return _getitem(args[0], args[1])
        if name == "__setitem__" and _on_cuda(args[0]):
            return _setitem(*args)
        if name == "copy_" and isinstance(args[0], torch.Tensor):
            dst, src = args[0], args[1]
            if dst.device.type == "cuda" and src.device.type == "cpu" and GPU[0] == "cuda":
                self._h2d(src, kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            with torch._C.DisableTorchFunctionSubclass():
                return torch.ops.aten.copy_(dst, src, kwargs.get("non_blocking", False))
        return func(*args, **kwargs)

    def _h2d(self, src, non_blocking: bool):
        if not (non_blocking and _pinned(src)):
            self.s.hit("blocking host-to-device copy" + ("" if non_blocking else " (non_blocking off)")
                       + ("" if _pinned(src) else " from unpinned memory"))  # fmt: skip

    def _to(self, name, args, kwargs):
        t, rest = args[0], list(args[1:])
        device = kwargs.get("device") or (torch.device("cuda") if name == "cuda" else None)
        dtype = kwargs.get("dtype")
        for a in rest:
            if isinstance(a, (str, torch.device)):
                device = torch.device(a)
            elif isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, torch.Tensor):
                device, dtype = a.device, a.dtype
        non_blocking = kwargs.get("non_blocking", False)
        if device is not None and not isinstance(device, torch.device):
            device = torch.device(device)
        if (
            device is not None
            and device.type == "cuda"
            and t.device.type == "cpu"
            and GPU[0] == "cuda"
        ):
            self._h2d(t, non_blocking)
        if (device is None or device.type == t.device.type) and (dtype in (None, t.dtype)):
            return t
        kw = {"dtype": dtype or t.dtype, "device": device or t.device}
        return torch.ops.aten._to_copy(t, **kw)


def _event_class(state: FakeCuda):
    class Event:
        """A CUDA event: recording costs nothing, waiting for one is a host sync."""

        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            pass

        def record(self, stream=None):
            pass

        def wait(self, stream=None):
            pass

        def query(self) -> bool:
            return True

        def synchronize(self):
            state.hit("Event.synchronize")

        def elapsed_time(self, end) -> float:
            return 0.0

    return Event


@contextmanager
def fake_cuda(int_fill: int = 1, gpu: str = "cuda"):
    """Fake CUDA tensors with the device's asks counted; yields a `FakeCuda`. `gpu`: the device
    type whose host-value factories count as blocking copies ("cpu": fake CPU tensors stand for
    the GPU, where autograd cannot run on fake CUDA tensors: a CPU-only torch build)."""
    GPU[0] = gpu
    state = FakeCuda(int_fill)
    rng = {}
    names = ("get_rng_state", "set_rng_state", "get_device_name", "Event", "synchronize")
    saved = {n: getattr(torch.cuda, n) for n in names}
    torch.cuda.Event = _event_class(state)
    torch.cuda.synchronize = lambda device=None: state.hit("torch.cuda.synchronize")
    torch.cuda.get_rng_state = lambda device="cuda": rng.get("state", torch.get_rng_state())
    torch.cuda.set_rng_state = lambda new_state, device="cuda": rng.__setitem__("state", new_state)
    torch.cuda.get_device_name = lambda device=None: "fake"
    saved_tolist = FakeTensor.tolist

    def tolist(self):  # FakeTensor's own reads each element: one read of the device
        state.hit("tolist")
        return state._fill(self)

    FakeTensor.tolist = tolist
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _Entry(state):
            yield state
    finally:
        FakeTensor.tolist = saved_tolist
        for n, fn in saved.items():
            setattr(torch.cuda, n, fn)
