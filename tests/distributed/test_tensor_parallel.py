"""Every tensor-parallel computation against the same computation in one process (fp64)."""

import pytest
import torch
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel import comm
from megalite.parallel import groups as pg
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.random import ShardedRNG, seed_replicated
from megalite.parallel.specs import spec_of
from megalite.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megalite.parallel.topology import Topology
from megalite.testing import spawn

pytestmark = pytest.mark.distributed
TOL = 1e-10


def tp_group(world):
    return pg.build_groups(Topology(tp=world), torch.device("cpu")).tp


def shard(t, dim, g):
    return t.chunk(g.size, dim)[g.rank]


def close(a, b, what, tol=TOL):
    err = (a - b).abs().max().item()
    assert err <= tol, f"{what}: max abs diff {err}"


def _layers(rank, world):
    g = tp_group(world)
    torch.manual_seed(0)  # same data and reference weights on every rank
    b, s, h, out, V = 2, 8, 8, 12, 37 * world
    x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.Linear(h, out, dtype=torch.float64)
    for sequence_parallel in (False, True):
        col = ColumnParallelLinear(
            h, out, g, sequence_parallel=sequence_parallel, gather_output=True, dtype=torch.float64
        )
        with torch.no_grad():
            col.weight.copy_(shard(ref.weight, 0, g))
            col.bias.copy_(shard(ref.bias, 0, g))
        xin = (
            shard(x, 1, g).detach().requires_grad_()
            if sequence_parallel
            else x.detach().clone().requires_grad_()
        )
        y = col(xin)
        close(y, ref(x), f"column forward sequence_parallel={sequence_parallel}")
        y.square().sum().backward()
        x.grad = None
        ref.zero_grad()
        ref(x).square().sum().backward()
        close(col.weight.grad, shard(ref.weight.grad, 0, g), "column weight grad")
        close(col.bias.grad, shard(ref.bias.grad, 0, g), "column bias grad")
        close(xin.grad, shard(x.grad, 1, g) if sequence_parallel else x.grad, "column input grad")
        # row parallel: input split along features
        row = RowParallelLinear(out, h, g, sequence_parallel=sequence_parallel, dtype=torch.float64)
        ref2 = torch.nn.Linear(out, h, dtype=torch.float64)
        with torch.no_grad():
            row.weight.copy_(shard(ref2.weight, 1, g))
            row.bias.copy_(ref2.bias)
        z = torch.randn(b, s, out, dtype=torch.float64, requires_grad=True)
        zin = shard(z, -1, g).detach().requires_grad_()
        y = row(zin)
        expected = ref2(z)
        close(
            y,
            shard(expected, 1, g) if sequence_parallel else expected,
            f"row forward sequence_parallel={sequence_parallel}",
        )
        (y * 3).sum().backward()
        (expected * 3).sum().backward()
        close(row.weight.grad, shard(ref2.weight.grad, 1, g), "row weight grad")
        bias_grad = row.bias.grad.clone()
        if sequence_parallel:
            comm.all_reduce(bias_grad, g)  # grad_sync_tp
        close(bias_grad, ref2.bias.grad, "row bias grad")
        close(zin.grad, shard(z.grad, -1, g), "row input grad")
    # vocab-parallel embedding (rows split) and cross entropy, vocab not divisible by tp
    emb_ref = torch.nn.Embedding(V, h, dtype=torch.float64)
    emb = VocabParallelEmbedding(V, h, g, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(shard(emb_ref.weight, 0, g))
    ids = torch.randint(0, V, (b, s))
    close(emb(ids), emb_ref(ids), "embedding forward")
    emb(ids).pow(3).sum().backward()
    emb_ref(ids).pow(3).sum().backward()
    close(emb.weight.grad, shard(emb_ref.weight.grad, 0, g), "embedding grad")
    real = V - 5  # last columns are padding
    logits = torch.randn(b, s, V, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, real, (b, s))
    labels[0, 0] = -100
    mine = shard(logits, -1, g).detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, labels, g, real)
    expected = F.cross_entropy(
        logits[..., :real].flatten(0, 1), labels.flatten(), reduction="none"
    ).view(b, s)
    close(loss, expected, "cross entropy forward")
    w = torch.rand(b, s, dtype=torch.float64)
    (loss * w).sum().backward()
    (expected * w).sum().backward()
    close(mine.grad, shard(logits.grad, -1, g), "cross entropy grad")
    # dropout streams: replicated regions agree over TP, sharded ones differ
    seed_replicated(7)
    same = torch.rand(64)
    with ShardedRNG(7, g.rank, torch.device("cpu")).fork():
        differ = torch.rand(64)
    both = torch.stack([same, differ])
    gathered = comm._gather(both.unsqueeze(0), 0, g)
    assert all(torch.equal(gathered[0, 0], gathered[r, 0]) for r in range(world))
    assert not any(torch.equal(gathered[0, 1], gathered[r, 1]) for r in range(1, world))
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_layers_match_one_process(world):
    assert all(spawn(_layers, world))


MODEL_CASES = [
    dict(flavour="gpt2"),
    dict(flavour="nanogpt"),  # no bias anywhere (LayerNorms too), exact GELU
    dict(flavour="llama", num_query_groups=4),  # query groups split over TP
    dict(flavour="llama", num_query_groups=1),  # fewer query groups than TP ranks: replicated k/v
]


def _model(rank, world, sequence_parallel, case):
    g = tp_group(world)
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        vocab_size=301,
        make_vocab_size_divisible_by=8,
        **case,
    )
    ref = GPTChunk(cfg, LayerEnv(seed=11, dtype=torch.float64))
    model = GPTChunk(
        cfg, LayerEnv(tp=g, sequence_parallel=sequence_parallel, seed=11, dtype=torch.float64)
    )
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1))
    tokens, labels = ids[:, :-1], ids[:, 1:]
    close(model(tokens), ref(tokens), "logits")
    loss, expected = model(tokens, labels), ref(tokens, labels)
    close(loss, expected, "loss")
    loss.backward()
    expected.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad, full = p.grad.clone(), ref_params[name].grad
        spec = spec_of(p)
        if "tp" in spec.grad_sum:
            comm.all_reduce(grad, g)
        if name in ("embedding.word.weight", "output.weight"):  # padded further at tp > 1
            full = F.pad(full[: cfg.vocab_size], (0, 0, 0, model.vocab - cfg.vocab_size))
        if spec.split_dim is not None:
            full = shard(full, spec.split_dim, g)
        close(grad, full, f"grad of {name}")
    return True


def _models(rank, world, sequence_parallel):
    return all(_model(rank, world, sequence_parallel, case) for case in MODEL_CASES)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_model_matches_one_process(world, sequence_parallel):
    # one spawn for every case: processes cost seconds
    assert all(spawn(_models, world, sequence_parallel))


# ---- --tp-comm-overlap: the same computation in pieces -------------------------------------


def _overlap(rank, world):
    """Two llama layers (fused q/k/v and gate/up, row-parallel out and down) at tp=world with
    sequence parallelism, fp64, b = 2: with --tp-comm-overlap (world pieces per collective)
    the outputs and every gradient equal the one-piece run's and one process's, its TP bytes
    are the same and its collectives `world` times as many, but for the fused blocks'
    backward re-gather and reduce-scatter, which stay whole; and zero-bubble's split backward (I, then W) gives the same gradients."""
    from megalite.pipeline.split_backward import input_grad

    g = tp_group(world)
    cfg = ModelConfig(flavour="llama", num_layers=2, hidden_size=32, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=48, seq_length=16, vocab_size=64)  # fmt: skip
    x = torch.randn(2, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    kw = {"layers": range(2), "has_embedding": False, "has_head": False}
    ref = GPTChunk(cfg, LayerEnv(seed=3, dtype=torch.float64), **kw)
    xr = x.clone().requires_grad_()
    ref(xr).square().sum().backward()
    runs = {}
    for overlap in (False, True):
        env = LayerEnv(tp=g, sequence_parallel=True, tp_comm_overlap=overlap, seed=3,
                       dtype=torch.float64)  # fmt: skip
        model = GPTChunk(cfg, env, **kw)
        mine = shard(x, 1, g).detach().requires_grad_()
        g.ledger.reset()
        y = model(mine)
        y.square().sum().backward()
        close(y, shard(ref(x), 1, g), f"output overlap={overlap}")
        close(mine.grad, shard(xr.grad, 1, g), f"input grad overlap={overlap}")
        grads = [p.grad.clone() for p in model.parameters()]
        runs[overlap] = grads, g.ledger.bytes["tp"], g.ledger.calls["tp"]
        for p in model.parameters():  # zero-bubble: the input's gradient, then the weights'
            p.grad = None
        mine.grad = None
        y = model(mine)
        weights = input_grad(y, 2 * y, mine, list(model.parameters()))
        close(mine.grad, shard(xr.grad, 1, g), f"split I overlap={overlap}")
        weights()
        for a, p in zip(grads, model.parameters()):
            close(p.grad, a, f"split W overlap={overlap}")
    (grads0, bytes0, calls0), (grads1, bytes1, calls1) = runs[False], runs[True]
    for a, c in zip(grads0, grads1):
        close(a, c, "grads overlap against one piece", tol=1e-12)
    # per layer: forward 2 gathers + 2 scatters, backward 2 gathers (in pieces) and the fused
    # blocks' 2 re-gathers + 2 scatters (whole)
    assert bytes1 == bytes0 and (calls0, calls1) == (2 * 10, 2 * (6 * world + 4)), (calls0, calls1)
    return True


@pytest.mark.parametrize("world", [2])
def test_tp_comm_overlap_is_the_same_computation(world):
    assert all(spawn(_overlap, world))


# ---- recomputation replays the dropout masks ------------------------------------------------


def _recompute(rank, world):
    """Gradients with --recompute selective/full equal --recompute none, with attention and
    hidden dropout, with and without SP: the recomputed forward draws the same masks."""
    g = tp_group(world) if world > 1 else pg.single_process_groups().tp
    cfg = ModelConfig(flavour="llama", num_layers=2, hidden_size=32, num_attention_heads=4,
                      seq_length=8, vocab_size=50, make_vocab_size_divisible_by=8,
                      hidden_dropout=0.2, attention_dropout=0.2)  # fmt: skip
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    out = []
    for sequence_parallel in (False, True) if world > 1 else (False,):
        grads = {}
        for recompute in ("none", "selective", "full"):
            seed_replicated(5)
            model = GPTChunk(
                cfg,
                LayerEnv(
                    tp=g,
                    sequence_parallel=sequence_parallel,
                    recompute=recompute,
                    seed=3,
                    dtype=torch.float64,
                ),
            )
            for _ in range(2):  # the second pass starts from streams the first one advanced
                model(ids[:, :-1], ids[:, 1:]).backward()
            grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
        for recompute in ("selective", "full"):
            for n, grad in grads[recompute].items():
                close(grad, grads["none"][n], f"sp={sequence_parallel} {recompute} {n}", tol=1e-12)
        out.append(sequence_parallel)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_recompute_with_dropout_gives_the_same_gradients(world):
    if world == 1:
        assert _recompute(0, 1) == [False]
    else:
        assert spawn(_recompute, world) == [[False, True]] * 2


# ---- what a TP + SP layer keeps for backward ------------------------------------------------


def _saved(rank, world):
    """One llama layer at tp=world with sequence parallelism, fp64: the bytes autograd keeps
    (each storage once, parameters left out) against the same layer whose fused q/k/v and
    gate/up run the way they did before (any `ops.linear` but F.linear: on the concatenated
    weights, keeping it and the whole all-gathered input). The fused path keeps neither: it
    saves exactly the two joined weights and (b, s - s/t, h) of each block's input less, and
    its gradients and the traffic of its re-gathers are the same computation."""
    g = tp_group(world)
    cfg = ModelConfig(flavour="llama", num_layers=1, hidden_size=32, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=48, seq_length=8, vocab_size=64)  # fmt: skip
    for b in (1, 2):  # at b = 1 the rows are a contiguous view of the gathered input
        _saved_at(g, cfg, b, world)
    return True


def _saved_at(g, cfg, b, world):
    from megalite.kernels import TORCH_OPS, override

    from tests.unit.test_plan_activations import saved_bytes

    s, h, e = cfg.seq_length, cfg.hidden_size, 8
    x = torch.randn(b, s, h, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mine = shard(x, 1, g).detach().requires_grad_()
    plain = override(TORCH_OPS, linear=lambda x, w, b=None: F.linear(x, w, b))
    out = {}
    for name, ops in (("fused", TORCH_OPS), ("before", plain)):
        env = LayerEnv(tp=g, sequence_parallel=True, ops=ops, seed=3, dtype=torch.float64)
        model = GPTChunk(cfg, env, layers=range(1), has_embedding=False, has_head=False)
        kept = saved_bytes(model, mine, None)
        g.ledger.bytes.clear()
        mine.grad = None
        model(mine).square().sum().backward()
        grads = [mine.grad.clone(), *(p.grad for p in model.parameters())]
        out[name] = kept, grads, g.ledger.bytes.get("tp", 0)
    (kept, grads, traffic), (kept0, grads0, traffic0) = out["fused"], out["before"]
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim // world
    joined = (qkv + 2 * cfg.ffn_hidden_size // world) * h * e
    assert kept0 - kept == joined + 2 * b * (s - s // world) * h * e, (kept0, kept)
    for a, c in zip(grads, grads0):
        close(a, c, "fused against concatenated", tol=1e-12)
    assert traffic - traffic0 == 2 * (world - 1) / world * b * s * h * e  # one re-gather a block


@pytest.mark.parametrize("world", [2])
def test_fused_layers_keep_their_rows_of_the_input_and_no_weight_copy(world):
    assert all(spawn(_saved, world))
