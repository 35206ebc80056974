"""Hybrid sharding (--dp-replicate): dp=4 as 2 copies (dpr) of a ZeRO shard group of 2 (dp).

Each ZeRO stage (1, 2, 3) trains against one process holding the whole batch in fp64: the same
losses, gradients, gradient norm (each element counted once over the world, not once per copy:
torchtitan #2318's 8x norm), updated parameters and Adam moments. The ledger shows the split:
the shard group carries the reduce-scatters and parameter gathers, the copies (dpr) one
all-reduce of each shard per step, 1/S of a bucket. A checkpoint written at R=2 resumes at R=1
with the state it saved, element for element, its RNG streams and the next step's loss.
"""

import pytest
import torch

from megalite.optim.distributed_optimizer import build_optimizer
from megalite.parallel import comm
from megalite.parallel.groups import build_groups
from megalite.parallel.topology import Topology
from megalite.testing import spawn
from tests.distributed.test_zero import (
    Chunk,
    batch,
    blocks,
    check_against_reference,
    config,
    train,
)

pytestmark = pytest.mark.distributed


def _ring_all_reduce(n: int, nbytes: int) -> int:
    return int(2 * (n - 1) / n * nbytes)


def _hsdp(rank, world):
    groups = build_groups(Topology(dp=2, dpr=2), torch.device("cpu"))
    # the shard group is adjacent ranks (inside a node); its copies are dp=2 apart
    assert groups.zero_shard.ranks == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert groups.shard_copies.ranks == [rank % 2, rank % 2 + 2]
    assert groups.replica.size == groups.batch.size == 4

    def two_chunks():
        b = blocks(3, groups.tp, torch.float64)
        return [Chunk({0: b[0]}), Chunk({1: b[1], 2: b[2]})]

    state_bytes = check_against_reference(groups, two_chunks, 3, m=2, gbs=16, stages=(1, 2, 3))
    assert set(state_bytes) == {1, 2, 3}

    # the ledger of one step: per bucket, its shard (1/2 of it) all-reduced over the 2 copies
    traffic = {}
    for stage in (1, 2, 3):
        chunks = two_chunks()
        opt = build_optimizer(chunks, groups, config(stage, mbs=2, gbs=16))
        groups.ledger.reset()
        train(chunks, opt, groups, [batch(0, 16)], m=2)
        shard = sum(_ring_all_reduce(2, b.numel // 2 * 8) for b in opt.buffer.buckets)
        traffic[stage] = (dict(groups.ledger.bytes), dict(groups.ledger.calls), shard,
                          len(opt.buffer.buckets))  # fmt: skip
    return state_bytes, traffic


def test_hsdp_dp2_x_dpr2_matches_one_process_and_reduces_a_shard_over_the_copies():
    results = spawn(_hsdp, 4, timeout=300)
    for _, traffic in results:  # (check_against_reference: the state is 1/2 per rank, not 1/4)
        for stage, (nbytes, calls, shard, buckets) in traffic.items():
            assert nbytes["dpr"] == shard, (stage, nbytes)  # 1/S of each bucket, once a step
            assert calls["dpr"] == buckets, (stage, calls)  # nothing else goes over the copies
            assert ("dp_gather" in nbytes) == (stage == 3)  # ZeRO-3 gathers over the shard group
            assert "dp+dpr" in nbytes  # the loss mean: over every replica


def _planned(rank, world):
    """One step of a GPT chunk at dp=4 as dp2 x dpr2: the ledger's bytes per group kind and
    the buffers' bytes, against the planner's estimate of the same run shape."""
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.plan import memory, traffic
    from megalite.shape import derive
    from tests.distributed.test_ledger import M, config, data

    out = {}
    for zero in (1, 2, 3):
        cfg = config(dp=4, zero=zero)
        cfg.parallel.dp_replicate = 2
        shape = derive(cfg, world)
        groups = build_groups(shape.topology(), torch.device("cpu"))
        chunks = [GPTChunk(cfg.model, LayerEnv(tp=groups.tp, dtype=torch.float32))]
        opt = build_optimizer(chunks, groups, cfg)
        opt.zero_grad(M)
        loss = 0.0
        for k in range(M):
            x, y = data(10 * groups.batch.rank + k)
            out_ = chunks[0](x, y)
            (out_ / M).backward()
            loss += out_.item() / M
        comm.all_reduce(torch.tensor([loss], dtype=torch.float64), groups.replica)  # the mean
        opt.step(1e-3)
        # (the world's status: the trainer adds its flags to the norm's all-reduce, not done here)
        got = {k: n for k, n in groups.ledger.bytes.items() if k != "world"}
        want = {k: n for k, n in traffic.comm_bytes(cfg, shape, 0, M).items() if k != "world"}
        buf = opt.buffer
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        shards = [buf.param_shard(b) for b in buf.buckets]
        params = buf.param_buffer if zero < 3 else torch.cat(shards)
        real = {"params": nbytes(params), "optimizer": opt.state_bytes()}
        mem = memory.state_memory(cfg, shape, 0)
        out[zero] = (got, want, real, {k: mem[k] for k in real})
    return out


def test_the_planner_counts_the_shard_group_and_its_copies_apart():
    for got, want, real, planned in spawn(_planned, 4, timeout=300)[0].values():
        assert got == want, (got, want)  # dp (and dp_gather), dpr, dp+dpr
        assert {"dp", "dpr", "dp+dpr"} <= set(got)
        assert real == planned  # the state over the shard group: 1/2 each, not 1/4


def _config(save, stage, dp_replicate):
    from megalite.testing import resume_config

    cfg = resume_config(save, dp_replicate=dp_replicate)
    cfg.optimizer.zero_stage = stage
    cfg.optimizer.bucket_size_mb = 0.004  # a few buckets: shards cut parameters mid-row
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 1, 8  # 2 per rank
    return cfg


def _resume(rank, world, root):
    from megalite.checkpoint import format as fmt
    from megalite.testing import tiny_trainer

    out = {}
    for stage in (1, 3):
        save = f"{root}/zero{stage}"
        a = tiny_trainer(_config(save, stage, 2), samples=64)
        for _ in range(2):
            a.train_step(log=False)
        a.checkpointer.save(a.state())
        saved = a.opt.state_tensors()
        ck = fmt.Checkpoint(save)
        twice = [n for n, e in ck.tensors.items()
                 if sum(torch.Size([b - x for x, b in s["slice"]]).numel() for s in e["shards"])
                 != torch.Size(e["shape"]).numel()]  # fmt: skip
        after = a.train_step(log=True)
        log = []
        b = tiny_trainer(_config(save, stage, 1), samples=64, log=log)
        b.resume()
        loaded = b.opt.state_tensors()
        lost = [(n, k) for n in saved for k in saved[n]
                if not torch.equal(loaded[n][k], saved[n][k])]  # fmt: skip
        again = b.train_step(log=True)
        out[stage] = (twice, lost, b.iteration, after["loss"], again["loss"],
                      after["grad_norm"], again["grad_norm"], log)  # fmt: skip
    return out


def test_a_checkpoint_saved_at_dpr2_resumes_exactly_at_dpr1(tmp_path):
    results = spawn(_resume, 4, str(tmp_path), timeout=300)
    for stage, (twice, lost, it, loss2, loss1, norm2, norm1, log) in results[0].items():
        assert not twice, (stage, twice)  # the copies of a shard write it once
        assert not lost, (stage, lost)  # every element of the state as saved
        assert it == 3
        assert loss1 == loss2, stage  # the same parameters on the same samples
        assert norm1 == pytest.approx(norm2, rel=1e-6), stage
        assert not any("re-seeded" in line for line in log), log  # the same layout of RNG


def _moe(rank, world):
    """A mixture-of-experts model at ep=2 over dp=4, ZeRO-1: the dense buffer hybrid (dp2 x
    dpr2), the expert buffer over edp as before."""
    from tests.distributed.test_moe_training import config, trainer

    out = []
    for r in (1, 2):
        tr = trainer(config(ep=2, zero_stage=1, dp_replicate=r), world)
        steps = [tr.train_step(log=True) for _ in range(3)]
        out.append([s[k] for s in steps for k in ("loss", "grad_norm")])
    return out


def test_moe_with_hybrid_sharded_dense_parameters_matches_plain_dp():
    plain, hybrid = spawn(_moe, 4, timeout=300)[0]
    assert plain == pytest.approx(hybrid, rel=1e-5)
