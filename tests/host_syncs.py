"""Count the places a step would make the host wait for the device, on a CPU run.

A CPU has no device to wait for, so the count comes from what the code asks for: every op whose
result the host must read (`.item()`, `bool(t)` and `float(t)` through `_local_scalar_dense`,
`nonzero`, boolean-mask indexing, `masked_select`, `unique`, ...) seen by a dispatch mode, plus
`Tensor.tolist`, `Tensor.numpy` (which do not dispatch) and `torch.cuda.synchronize` /
`Event.synchronize` / `Stream.synchronize`, patched. The dispatch mode is thread-local: CPU
autograd runs backward in the calling thread, so backward is counted too.
"""

import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops whose output shape or value the host must know: the device would have to finish first
READS = {
    aten._local_scalar_dense, aten.nonzero, aten.nonzero_static, aten.masked_select,
    aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.repeat_interleave,
    aten.is_nonzero, aten.equal,
}  # fmt: skip


class _Reads(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in READS and not (packet is aten.repeat_interleave and not args[1:]):
            self.counter.hit(str(packet))
        elif packet is aten.index and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        ):
            self.counter.hit("boolean-mask indexing")
        return func(*args, **kwargs)


class HostSyncCounter:
    def __init__(self):
        self.count, self.where = 0, []

    def hit(self, what: str):
        self.count += 1
        self.where.append((what, "".join(traceback.format_stack(limit=8)[:-2])))

    @contextlib.contextmanager
    def counting(self):
        patched = [(torch.Tensor, "tolist"), (torch.Tensor, "numpy"), (torch.cuda, "synchronize"),
                   (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]  # fmt: skip
        saved = [(obj, name, getattr(obj, name)) for obj, name in patched]

        def counted(what, fn):
            def wrapper(*a, **kw):
                self.hit(what)
                return fn(*a, **kw)

            return wrapper

        for obj, name, fn in saved:
            setattr(obj, name, counted(name, fn))
        try:
            with _Reads(self):
                yield self
        finally:
            for obj, name, fn in saved:
                setattr(obj, name, fn)
