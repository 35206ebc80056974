"""parallel/param_gather.py without processes: buckets whose gather is a note in a log, one per
parameter, waited for by forward pre-hooks where the parameters are read, and no module's class
changed (a plain container the chunk reads itself is waited for in the chunk's pre-hook)."""

import torch
from torch import nn

from megalite.parallel.param_gather import wait_before_use


class _Bucket:
    def __init__(self, name, log):
        self.name, self.log = name, log
        self.gather = (self, None)  # (work, ...): the overlapped gather in flight

    def wait(self):
        self.log.append(("wait", self.name))


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        return x @ self.weight.t()


class _Chunk(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embedding = nn.Module()  # a container of called modules
        self.embedding.word = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(2)})
        self.final_norm = nn.LayerNorm(8)
        self.output = _Head()
        self.scale = nn.Module()  # a plain container whose weight the chunk reads itself
        self.scale.weight = nn.Parameter(torch.ones(8))

    def forward(self, ids):
        x = self.embedding.word(ids) * self.scale.weight
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.final_norm(x))


def test_gathers_are_waited_for_by_hooks_where_read_and_no_class_changes():
    chunk, log = _Chunk(), []
    types = {name: type(m) for name, m in chunk.named_modules()}
    names = [n for n, _ in chunk.named_parameters()]
    bucket_of = {p: _Bucket(n, log) for n, p in chunk.named_parameters()}
    order = {b: i for i, b in enumerate(bucket_of.values())}
    wait_before_use([chunk], bucket_of, order)
    for name, m in chunk.named_modules():  # after the waits' hooks: they run first
        m.register_forward_pre_hook(lambda m, a, name=name: log.append(("run", name)))
    chunk(torch.arange(6).view(2, 3))
    assert {name: type(m) for name, m in chunk.named_modules()} == types
    waits = [n for kind, n in log if kind == "wait"]
    assert sorted(waits) == sorted(names)  # each once
    run = {n: log.index(("run", n)) for n in ("", "embedding.word", "layers.0", "final_norm")}
    # read by the chunk itself: before anything of it runs
    assert log.index(("wait", "scale.weight")) < run["embedding.word"]
    assert run["embedding.word"] < log.index(("wait", "layers.0.weight")) < run["layers.0"]
    assert log.index(("wait", "output.weight")) > run["final_norm"]  # the head's own hook
    assert log.index(("wait", "embedding.word.weight")) < run["embedding.word"]
