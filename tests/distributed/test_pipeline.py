"""The pipeline executor against the same computation in one process (fp64, strict: 1e-10).

A toy chunk model (embedding, residual tanh layers, a plain tanh layer, head, mean cross
entropy) whose parameters are drawn from (seed, logical name), so every layout starts from the
same weights. Each spawn runs every schedule of one pp size, so there are few processes.
"""

import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from megalite.parallel.comm import Group
from megalite.pipeline.executor import first_stage_times, idle_ratio, idle_share, run_schedule
from megalite.pipeline.partition import Partition, rank_chunks
from megalite.pipeline.schedules import SCHEDULES, get_schedule
from megalite.testing import spawn

VOCAB, H, LAYERS, B, S = 11, 6, 8, 2, 3
TOL = 1e-10


class ToyChunk(nn.Module):
    def __init__(self, layers, has_embedding, has_head, seed=0):
        super().__init__()
        self.has_embedding, self.has_head = has_embedding, has_head
        if has_embedding:
            self.embedding = nn.Embedding(VOCAB, H, dtype=torch.float64)
        self.layers = nn.ModuleDict({str(i): nn.Linear(H, H, dtype=torch.float64) for i in layers})
        if has_head:
            self.head = nn.Linear(H, VOCAB, dtype=torch.float64)
        for name, p in self.named_parameters():  # layout-independent init
            g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
            p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, x, labels=None):
        if self.has_embedding:
            x = self.embedding(x)  # (b, s) -> (b, s, h)
        for i, layer in self.layers.items():
            # layer 3 ends in a plain tanh, so some chunk's output is saved by its own backward:
            # releasing that output after sending must not break the gradient
            x = torch.tanh(layer(x)) if i == "3" else x + torch.tanh(layer(x))
        if not self.has_head:
            return x  # (b, s, h)
        return Fn.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _data(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(VOCAB, (B, S), generator=g), torch.randint(VOCAB, (B, S), generator=g))
        for _ in range(m)
    ]


def _reference(microbatches, loss_scale=1.0):
    """Plain autograd in one process: (mean loss, {name: grad})."""
    model = ToyChunk(range(LAYERS), True, True)
    m = len(microbatches)
    losses = [model(t, lab) for t, lab in microbatches]
    (sum(losses) * loss_scale / m).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return sum(x.item() for x in losses) / m, grads


def _build(pp, vpp, rank, name="1f1b"):
    placement = SCHEDULES[name].placement
    return [ToyChunk(**kw) for kw in rank_chunks(LAYERS, pp, vpp, rank, placement)]


def _check(result, chunks, microbatches, loss_scale=1.0):
    ref_loss, ref_grads = _reference(microbatches, loss_scale)
    assert abs(result.loss - ref_loss) <= TOL, (result.loss, ref_loss)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            err = (p.grad - ref_grads[name]).abs().max().item()
            assert err <= TOL, (name, err)


# (schedule, vpp, micro-batches, loss_scale): m < pp and m not a multiple of pp included
CASES = [
    ("gpipe", 1, 3, 1.0),
    ("1f1b", 1, 3, 1.0),
    ("1f1b", 1, 6, 4.0),
    ("interleaved", 2, 4, 1.0),
    ("interleaved", 2, 8, 1.0),
    ("zb-h1", 1, 3, 1.0),  # backward split into I and W
    ("zb-h1", 1, 6, 4.0),
    ("zbv", 2, 5, 1.0),  # two chunks per rank in a V
    ("dualpipev", 2, 8, 2.0),  # a V, whole and split backwards
]


def _run_all(rank, world):
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    out = []
    for name, vpp, m, scale in CASES:
        if name == "interleaved" and m % world:
            continue
        microbatches = _data(m)
        chunks = _build(world, vpp, rank, name)
        actions = get_schedule(name, world, vpp, m, rank)
        kw = {"hidden_shape": (B, S, H), "dtype": torch.float64,
              "placement": SCHEDULES[name].placement}  # fmt: skip
        groups.ledger.reset()
        result = run_schedule(actions, chunks, groups, microbatches, loss_scale=scale, **kw)
        _check(result, chunks, microbatches, scale)
        sends = sum(a.kind.startswith("SEND") for a in actions)
        assert groups.ledger.calls["pp"] >= 1 and groups.ledger.bytes["pp"] >= sends * B * S * H * 8

        # evaluation: the same loss, no gradients anywhere
        fresh = _build(world, vpp, rank, name)
        fwd = get_schedule(name, world, vpp, m, rank, forward_only=True)
        ev = run_schedule(fwd, fresh, groups, microbatches, forward_only=True, **kw)
        assert abs(ev.loss - result.loss) <= TOL
        assert all(p.grad is None for c in fresh for p in c.parameters())
        assert 0.0 <= idle_share(*first_stage_times([ev], groups.pp)) < 1.0
        compute, busy = first_stage_times([result], groups.pp)
        out.append((name, vpp, m, result.loss, idle_share(compute, busy), busy, result.step_s))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_one_process(pp):
    results = spawn(_run_all, pp)
    assert len(results[0]) == len(CASES)
    for case in zip(*results):
        # every rank reports the same loss and first-stage bubble, its idle time counted
        # against the longest schedule of any rank (in a V the first stage ends early)
        assert all(c[:6] == case[0][:6] for c in case)
        assert case[0][5] == max(c[6] for c in case)


def test_single_process_executor():
    """pp=1 (no communication), one chunk and two chunks on one rank, against plain autograd."""
    groups = SimpleNamespace(pp=Group("pp", [0], 0), device=torch.device("cpu"))
    microbatches = _data(3)
    chunks = _build(1, 1, 0)
    actions = get_schedule("1f1b", 1, 1, 3, 0)
    result = run_schedule(actions, chunks, groups, microbatches, hidden_shape=(B, S, H), dtype=None)
    _check(result, chunks, microbatches)
    assert len(result.losses) == 3 and idle_ratio(*first_stage_times([result], groups.pp)) >= 0
    # two virtual chunks on one rank hand their tensors over locally
    chunks = [ToyChunk(Partition.even(LAYERS, 1, 2).layers(0, c), c == 0, c == 1) for c in range(2)]
    actions = get_schedule("interleaved", 1, 2, 3, 0)
    result = run_schedule(actions, chunks, groups, microbatches, hidden_shape=(B, S, H), dtype=None)
    _check(result, chunks, microbatches)


# ---- the real model ---------------------------------------------------------------------------


def _gpt_cfg(flavour):
    from megalite.config import ModelConfig

    return ModelConfig(
        flavour=flavour, num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=S,
        vocab_size=VOCAB, make_vocab_size_divisible_by=8,
    )  # fmt: skip


def _gpt_run(rank, world):
    import torch.distributed as dist

    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.parallel.groups import build_groups
    from megalite.parallel.specs import spec_of
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    # gpt2 ties the word embedding to the head: the two copies' gradients add up
    # gpt2's tied embedding: in a V the embedding and the head are both on rank 0
    for flavour, name, vpp, m in (("llama", "interleaved", 2, 4), ("gpt2", "1f1b", 1, 3),
                                  ("gpt2", "zbv", 2, 3), ("llama", "zb-h1", 1, 3)):  # fmt: skip
        cfg, microbatches = _gpt_cfg(flavour), _data(m, seed=1)
        ref = GPTChunk(cfg, LayerEnv(dtype=torch.float64))
        ref_loss = sum(ref(t, lab) for t, lab in microbatches) / m
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        placement = SCHEDULES[name].placement
        chunks = [
            GPTChunk(cfg, LayerEnv(dtype=torch.float64), **kw)
            for kw in rank_chunks(cfg.num_layers, world, vpp, rank, placement)
        ]
        actions = get_schedule(name, world, vpp, m, rank)
        result = run_schedule(actions, chunks, groups, microbatches, hidden_shape=(B, S, 16),
                              dtype=torch.float64, placement=placement)  # fmt: skip
        assert abs(result.loss - ref_loss.item()) <= TOL, (flavour, result.loss, ref_loss.item())
        tied = torch.zeros_like(ref_grads["embedding.word.weight"])
        for chunk in chunks:
            for n, p in chunk.named_parameters():
                if "embed" in spec_of(p).grad_sum:  # a half of the tied embedding
                    tied += p.grad
                    continue
                err = (p.grad - ref_grads[n]).abs().max().item()
                assert err <= TOL, (flavour, n, err)
        if cfg.tied:
            dist.all_reduce(tied)
            err = (tied - ref_grads["embedding.word.weight"]).abs().max().item()
            assert err <= TOL, (flavour, "tied embedding", err)


@pytest.mark.distributed
def test_gpt_chunks_match_one_process():
    pytest.importorskip("megalite.model.gpt")
    spawn(_gpt_run, 2)


def test_a_failing_step_leaves_no_timeline_behind():
    """The executor lends its timeline to the pipeline group's ledger for the step; a step that
    raises must take it back, or the next step's waits would be recorded into it."""
    groups = SimpleNamespace(pp=Group("pp", [0], 0), device=torch.device("cpu"))
    chunks = _build(1, 1, 0)
    chunks[0].layers["0"].register_forward_hook(lambda *_: 1 / 0)
    actions = get_schedule("1f1b", 1, 1, 2, 0)
    with pytest.raises(ZeroDivisionError):
        run_schedule(actions, chunks, groups, _data(2), hidden_shape=(B, S, H), dtype=None,
                     timeline=object())  # fmt: skip
    assert groups.pp.ledger.timeline is None
