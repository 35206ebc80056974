"""A fake rank's memory: every storage its ops create, live from the op that made it until the
tensor is freed, summed, and its peak (fake tensors hold no data, but their storages are made
and freed as on the device, ZeRO-3's resizes included). It sees only tensors made inside it:
the fake world enters it before the trainer is built, and restarts the peak once it is
(`reset_peak`): the model's initialisation draws each whole tensor on the host before keeping
this rank's slice (model/gpt.py), which on a GPU run is host memory, and the fake CPU tensors
that play the GPU cannot tell it apart.

`where` (with `sites=True`, a stack walk per op): the bytes alive at the peak per allocating
site (the last megalite frame), for finding what the planner misses.
"""

import traceback
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/megalite/" in f.filename]
    skip = ("fake_cuda.py", "fake_memory.py")
    frames = [f for f in frames if not f.filename.endswith(skip)]
    f = frames[-1] if frames else None
    return f"{f.filename.split('/megalite/')[-1]}:{f.lineno}" if f else "?"


class StorageTrace(TorchDispatchMode):
    """Bytes of the live storages (`current`) and their peak."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.sites = sites
        self.live = {}  # storage key -> (bytes, site)
        self._refs = {}
        self.current = self.peak = 0
        self.where = Counter()

    def _grew(self, size: int):
        self.current += size
        if self.current > self.peak:
            self.peak = self.current
            if self.sites:
                self.where = Counter()
                for n, site in self.live.values():
                    self.where[site] += n

    def reset_peak(self):
        """The peak from now on, of what is alive now and what comes."""
        self.peak = self.current
        if self.sites:
            self.where = Counter()
            for n, site in self.live.values():
                self.where[site] += n

    def _freed(self, key, _ref):
        size, _ = self.live.pop(key)
        self._refs.pop(key, None)
        self.current -= size

    def _note(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        size = st.nbytes()
        self.live[key] = (size, _site() if self.sites else "")
        self._refs[key] = weakref.ref(st, lambda ref, key=key: self._freed(key, ref))
        self._grew(size)

    def _resized(self, st, size: int):
        """ZeRO-3 frees and refills its gathered units by resizing their storage: not an op."""
        self._resize(st, size)
        key = st._cdata
        if key in self.live:
            old, site = self.live[key]
            self.live[key] = (st.nbytes(), site)
            self._grew(st.nbytes() - old)

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = lambda st, size: self._resized(st, size)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._note(t)
        return out
