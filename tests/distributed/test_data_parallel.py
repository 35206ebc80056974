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
    buf = GradBuffer([model], groups.replicas, zero_stage=stage, bucket_size_mb=BUCKET_MB)
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
        launched.append([b.launched for b in buf.buckets])
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
