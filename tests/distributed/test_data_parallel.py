"""The data-parallel gradient buffer (parallel/data_parallel.py) over 2 gloo ranks, against the
same gradients computed in one process: every ZeRO stage's reduced shard is the mean over the
ranks of the sum over micro-batches, buckets reduce only after the step's last micro-batch
(no_sync), and sharded parameters are gathered back into every rank's model."""

import pytest
import torch
from torch import nn

from megalite.parallel.data_parallel import GradBuffer
from megalite.parallel.groups import build_groups
from megalite.parallel.topology import Topology
from megalite.testing import spawn

pytestmark = pytest.mark.distributed
MICRO = 2
BUCKET_MB = 80 / 2**20  # 10 float64 elements: the parameters spread over several buckets


def _model():
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(4, 3), "b": nn.Linear(3, 2)}).double()


def _loss(model, rank, k):
    x = torch.randn(
        5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + k)
    )
    return model["b"](torch.tanh(model["a"](x))).square().sum()


def _reference(world) -> dict:
    """Each parameter's gradient summed over micro-batches, averaged over the ranks."""
    model = _model()
    for rank in range(world):
        for k in range(MICRO):
            _loss(model, rank, k).backward()
    return {n: p.grad.flatten() / world for n, p in model.named_parameters()}


def _reduce(rank, world, stage):
    groups = build_groups(Topology(dp=world), torch.device("cpu"))
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    buf = GradBuffer([model], groups.replica, zero_stage=stage, bucket_size_mb=BUCKET_MB)
    out = {"buckets": len(buf.buckets)}
    # every parameter now reads the flat buffer, with its value unchanged
    out["views"] = all(
        p.untyped_storage().data_ptr() == buf.param_buffer.untyped_storage().data_ptr()
        and torch.equal(p, before[n])
        for n, p in model.named_parameters()
    )
    buf.zero_grad(MICRO)
    launched = []
    for k in range(MICRO):
        _loss(model, rank, k).backward()
        launched.append([buf.reducer.state[b].launched for b in buf.buckets])
    buf.finish()
    out["launched"] = launched
    # this rank's reduced shard of every parameter
    out["shards"] = {}
    for r in buf.ranges:
        s = r.shard_slice()
        if s is not None:
            lo, hi, plo, phi = s
            out["shards"][r.name, plo, phi] = r.bucket.shard_grad[lo:hi].clone()
    if stage == 0:  # one more backward than the step was started with
        try:
            _loss(model, rank, 0).backward()
            out["extra"] = None
        except RuntimeError as e:
            out["extra"] = str(e)
    else:  # each rank writes rank + 1 into its shards; the gather brings everyone's
        with torch.no_grad():
            for b in buf.buckets:
                buf.param_shard(b).fill_(rank + 1)
        buf.all_gather_params()
        shard = [b.numel // world for b in buf.buckets]
        out["gathered"] = all(
            torch.equal(buf.param_buffer[b.start + i * n : b.start + (i + 1) * n],
                        torch.full((n,), i + 1.0, dtype=torch.float64))
            for b, n in zip(buf.buckets, shard) for i in range(world)
        )  # fmt: skip
        out["model_reads_it"] = all(bool((p >= 1).all()) for p in model.parameters())
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_reduced_gradients_equal_one_process(stage):
    world = 2
    ref = _reference(world)
    results = spawn(_reduce, world, stage)
    covered = {n: torch.zeros(len(g), dtype=torch.bool) for n, g in ref.items()}
    for out in results:
        assert out["buckets"] > 1 and out["views"]
        for (name, lo, hi), got in out["shards"].items():
            torch.testing.assert_close(got, ref[name][lo:hi], rtol=1e-12, atol=1e-12)
            covered[name][lo:hi] = True
        if stage < 2:  # no_sync: nothing reduced before the last micro-batch, then all
            assert out["launched"] == [[False] * out["buckets"], [True] * out["buckets"]]
        if stage == 0:
            assert "more backward passes than the 2 micro-batches" in out["extra"]
        else:
            assert out["gathered"] and out["model_reads_it"]
    # the shards of the ranks hold every element (stage 0: each rank all of them)
    assert all(c.all() for c in covered.values())


class _Chunk(nn.Module):
    """A GPT chunk's shape: an embedding in a plain container, layers in a ModuleDict, each
    with a router in a plain container read by the layer, the head a module of its own called
    after the final norm (model/gpt.py `Output`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embedding = nn.Module()
        self.embedding.word = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({str(i): _RoutedLayer() for i in range(3)})
        self.final_norm = nn.LayerNorm(8)
        self.output = _Weighted(torch.randn(16, 8), lambda x, w: x @ w.t())
        # registered last, read first: registration order is no guide
        self.scale = _Weighted(1 + 0.1 * torch.randn(8), lambda x, w: x * w)

    def forward(self, ids):
        x = self.scale(self.embedding.word(ids))
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.final_norm(x))


class _Weighted(nn.Module):
    def __init__(self, w, fn):
        super().__init__()
        self.weight, self.fn = nn.Parameter(w), fn

    def forward(self, x):
        return self.fn(x, self.weight)


class _RoutedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.randn(8, 8))
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        return self.mlp(torch.tanh(x @ self.router.weight.t()))


class _Noted:
    """A gather's work that notes in `log` when it is waited for."""

    def __init__(self, work, name, log):
        self.work, self.name, self.log = work, name, log

    def wait(self):
        self.log.append(("wait", self.name))
        return self.work.wait()


def _overlapped_gather(rank, world):
    groups = build_groups(Topology(dp=world), torch.device("cpu"))
    chunk = _Chunk().double()
    whole = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    # one parameter a bucket: each gather belongs to one module
    buf = GradBuffer([chunk], groups.replica, zero_stage=1, bucket_size_mb=8 / 2**20)
    names = {r.bucket: r.name for r in buf.ranges}
    with torch.no_grad():  # every rank's shard right, the rest of the buffer garbage
        values = buf.param_buffer.clone()
        buf.param_buffer.fill_(float("nan"))
        for b in buf.buckets:
            buf.param_shard(b).copy_(values[b.shard_start : b.shard_end])
    buf.all_gather_params(overlap=True)
    log = []
    for b, g in buf.gathers.items():
        g.gather = (_Noted(g.gather[0], names[b], log), g.gather[1])
    for name, m in chunk.named_modules():  # after the buffer's hooks: they run first
        m.register_forward_pre_hook(lambda m, a, name=name: log.append(("run", name)))
    out = chunk(torch.arange(6).view(2, 3))
    return {"log": log, "out": out.detach(), "whole": whole}


def test_overlapped_gathers_are_waited_for_where_the_forward_reads_them():
    """--overlap-param-gather: the embedding waits for its own gather only, each layer for its
    own (router included), the untied head's weight after the final norm; the forward's
    result equals one process's."""
    for out in spawn(_overlapped_gather, 2):
        log = out["log"]
        first = log.index(("run", "embedding.word"))
        assert [n for k, n in log[:first] if k == "wait"] == ["embedding.word.weight"]
        for i in range(3):  # a layer waits for its router and linear, no later layer's
            at = log.index(("run", f"layers.{i}"))
            mine = {f"layers.{i}.router.weight", f"layers.{i}.mlp.weight", f"layers.{i}.mlp.bias"}
            waited = {n for k, n in log[:at] if k == "wait"}
            assert mine <= waited and not any(n.startswith(f"layers.{i + 1}") for n in waited)
        head = log.index(("wait", "output.weight"))
        assert head > log.index(("run", "final_norm"))  # read by the head, after the norm
        assert first < log.index(("wait", "scale.weight")) < log.index(("run", "layers.0"))
        assert len([e for e in log if e[0] == "wait"]) == len(out["whole"])  # each once
        model = _Chunk().double()
        model.load_state_dict(out["whole"])
        torch.testing.assert_close(out["out"], model(torch.arange(6).view(2, 3)), rtol=0, atol=0)


def _partial(rank, world):
    """ZeRO-2 over one bucket holding `a`, `b` and `c`, where `c` takes part in the first
    micro-batch only: the second pass's staged bucket is partial (launched by finish())."""
    groups = build_groups(Topology(dp=world), torch.device("cpu"))
    model = _model()
    torch.manual_seed(1)
    model["c"] = nn.Linear(4, 2).double()
    buf = GradBuffer([model], groups.replica, zero_stage=2, bucket_size_mb=1 / 2**10)
    buf.zero_grad(MICRO)
    for k in range(MICRO):
        loss = _loss(model, rank, k)
        if k == 0:
            loss = loss + model["c"](torch.ones(1, 4, dtype=torch.float64)).sum() * (rank + 1)
        loss.backward()
    buf.finish()
    (b,) = buf.buckets
    return {r.name: (r.shard_slice(), b.shard_grad.clone()) for r in buf.ranges}


def test_zero2_partial_pass_reduces_zeros_where_no_gradient_came():
    world = 2
    ref = _reference(world)
    torch.manual_seed(1)
    c = nn.Linear(4, 2).double()
    for rank in range(world):  # c's gradient of micro-batch 0 only, the mean over the ranks
        (c(torch.ones(1, 4, dtype=torch.float64)).sum() * (rank + 1) / world).backward()
    ref.update({f"c.{n}": p.grad.flatten() for n, p in c.named_parameters()})
    for out in spawn(_partial, world):
        for name, (s, shard) in out.items():
            if s is not None:
                lo, hi, plo, phi = s
                torch.testing.assert_close(shard[lo:hi], ref[name][plo:phi], rtol=1e-12, atol=0)
