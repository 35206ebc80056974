"""Context parallelism against one process (fp64, 1e-10).

Ring and all-to-all attention at cp 2 and 4 against attention over the whole sequence: outputs
and the gradients of q, k and v, causal and with document masking; the ring moves cp-1 K/V
blocks per direction and keeps only this rank's tensors for backward. a2a+p2p at cp 4 = 2 x 2
(all-to-all over adjacent pairs, the ring across them) the same, with windows and sinks too.
The whole model at cp 2 (and cp 2 x tp 2, and cp 4 = a2a 2 x p2p 2), both flavours, each
attention, with packed documents (reset positions, document-masked attention, no loss on
end-of-document tokens): loss and every gradient as one process computes them. Document masking in one process: a packed row gives each document the
logits it has alone."""

import pytest
import torch
from megalite.kernels import attention_masked_ref

from megalite.parallel import comm
from megalite.parallel.context_parallel import (
    Shard,
    a2a_attention,
    chunk_positions,
    context_attention,
    ring_attention,
    shard_batch,
)
from megalite.parallel.groups import build_groups
from megalite.parallel.topology import Topology
from megalite.testing import spawn

pytestmark = pytest.mark.distributed
B, HQ, HKV, S, D = 2, 8, 4, 16, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    # packed documents: each row cut at its own places
    ends = torch.rand(B, S, generator=g) < 0.2
    docs = torch.cumsum(ends.long(), 1)
    return q, k, v, torch.randn(B, HQ, S, D, generator=g, dtype=torch.float64), docs


def _ring(rank, world):
    cp = build_groups(Topology(dp=world), torch.device("cpu")).dp  # any group of the ranks
    positions = torch.stack([chunk_positions(S, world, r) for r in range(world)])  # (cp, s/cp)
    mine = positions[rank]
    q, k, v, dout, docs = _inputs()
    out, saved = [], []
    for with_docs in (False, True):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        every = torch.arange(S)
        doc_args = (docs, docs) if with_docs else (None, None)
        ref = attention_masked_ref(*full, every, every, *doc_args)
        ref.backward(dout)
        local = [t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v)]
        rank_docs = torch.stack([docs[:, p] for p in positions]) if with_docs else None
        cp.ledger.reset()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            got = ring_attention(*local, cp, positions, rank_docs)
        sends_forward = cp.ledger.calls["dp"]
        got.backward(dout[:, :, mine])
        err = (got - ref[:, :, mine]).abs().max().item()
        grads = [(a.grad - b.grad[:, :, mine]).abs().max().item() for a, b in zip(local, full)]
        out.append((err, max(grads), sends_forward, cp.ledger.calls["dp"] - sends_forward))
        # all-to-all: the same result, three exchanges forward and three back
        a2a = [t.detach().clone().requires_grad_() for t in local]
        cp.ledger.reset()
        got = a2a_attention(*a2a, cp, positions, rank_docs)
        calls_forward = cp.ledger.calls["dp"]
        got.backward(dout[:, :, mine])
        err = (got - ref[:, :, mine]).abs().max().item()
        grads = [(a.grad - b.grad[:, :, mine]).abs().max().item() for a, b in zip(a2a, full)]
        out.append((err, max(grads), calls_forward, cp.ledger.calls["dp"] - calls_forward))
    return out, sum(t.numel() * t.element_size() for t in saved[: len(saved) // 2])


def _saved_bytes_one_rank() -> int:
    """What attention over the whole sequence keeps, through the same function at cp = 1."""
    from megalite.parallel.comm import Group

    q, k, v, _, _ = _inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ring_attention(*(t.requires_grad_() for t in (q, k, v)), Group("cp", [0], 0),
                       torch.arange(S)[None])  # fmt: skip
    return sum(t.numel() * t.element_size() for t in saved)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_whole_sequence(cp):
    whole = _saved_bytes_one_rank()
    for rank_out, saved in spawn(_ring, cp):
        # q, k, v, out and lse of this rank's tokens (positions: a few bytes more)
        assert saved <= whole / cp * 1.1, (saved, whole)
        for (err, grad_err, forward_hops, backward_hops), a2a in zip(rank_out[::2], rank_out[1::2]):
            assert err <= 1e-10 and grad_err <= 1e-10, (err, grad_err)
            assert forward_hops == cp - 1  # K/V blocks sent on by each rank, forward
            assert backward_hops == 2 * cp - 1  # cp-1 K/V hops; cp of dK/dV, the last one home
            assert a2a[0] <= 1e-10 and a2a[1] <= 1e-10, a2a
            assert a2a[2:] == (3, 3)  # q, k+v and the output; their reverses backward


def _hierarchical(rank, world):
    """a2a+p2p at cp 4 = a2a 2 x p2p 2 against attention over the whole sequence, with
    grouped queries: causal, document-masked, with a sliding window, with sinks."""
    from megalite.kernels import attention_sinks_ref

    topo = Topology(cp=world)
    topo.cp_a2a = 2
    groups = build_groups(topo, torch.device("cpu"))
    levels = groups.cp_levels
    positions = torch.stack([chunk_positions(S, world, r) for r in range(world)])  # (cp, s/cp)
    mine = positions[rank]
    q, k, v, dout, docs = _inputs()
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = []
    for with_docs, window, with_sinks in [(False, None, False), (True, None, False),
                                          (True, 5, False), (True, None, True)]:  # fmt: skip
        full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        every = torch.arange(S)
        ids = (every, every, *((docs, docs) if with_docs else (None, None)))
        if with_sinks:
            ref = attention_sinks_ref(*full, *ids, window=window)
        else:
            ref = attention_masked_ref(*full[:3], *ids, window=window)
        ref.backward(dout)
        local = [t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v)]
        local.append(sinks.clone().requires_grad_())
        rank_docs = torch.stack([docs[:, p] for p in positions]) if with_docs else None
        groups.ledger.reset()
        got = context_attention(*local[:3], groups.cp, Shard(mine[None], positions, rank_docs),
                                levels, sinks=local[3] if with_sinks else None, window=window)  # fmt: skip
        calls_forward = groups.ledger.calls["cp"]
        got.backward(dout[:, :, mine])
        calls_backward = groups.ledger.calls["cp"] - calls_forward
        err = (got - ref[:, :, mine]).abs().max().item()
        grads = [(a.grad - b.grad[:, :, mine]).abs().max().item() for a, b in zip(local, full[:3])]
        if with_sinks:  # each rank has its heads' sink gradient of its tokens: summed over cp
            g = local[3].grad.clone()
            comm.all_reduce(g, groups.cp)
            grads.append((g - full[3].grad).abs().max().item())
        out.append((err, max(grads), calls_forward, calls_backward))
        if not with_sinks:  # (the sinks' all-reduce in the test is no attention's)
            nbytes = dict(groups.ledger.bytes)
    edges = []  # one level alone: cp 4 = 4 x 1 (all-to-all only), 1 x 4 (the ring only)
    for a2a in (4, 1):
        topo.cp_a2a = a2a  # (a second build in this world: every rank makes every group)
        other = build_groups(topo, torch.device("cpu"))
        local = [t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v)]
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = attention_masked_ref(*full, torch.arange(S), torch.arange(S), docs, docs)
        ref.backward(dout)
        rank_docs = torch.stack([docs[:, p] for p in positions])
        got = context_attention(*local, other.cp, Shard(mine[None], positions, rank_docs),
                                other.cp_levels)  # fmt: skip
        got.backward(dout[:, :, mine])
        grads = [(a.grad - b.grad[:, :, mine]).abs().max().item() for a, b in zip(local, full)]
        edges.append(max((got - ref[:, :, mine]).abs().max().item(), *grads))
    return [g.ranks for g in levels], out, nbytes, edges


def test_hierarchical_attention_matches_whole_sequence():
    """cp 4 = a2a 2 x p2p 2: each rank holds chunks r and 7-r of 8; the all-to-all over the
    adjacent pair (0,1) or (2,3) hands each of them chunks {0,7,1,6} or {2,5,3,4} for half the
    heads, and the ring runs over (0,2) or (1,3) on those."""
    from megalite.config_read import parse_args
    from megalite.plan import traffic
    from megalite.shape import validate

    argv = ["--cp", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
            "2", "2", "--num-attention-heads", str(HQ), "--num-query-groups", str(HKV),
            "--hidden-size", str(HQ * D), "--seq-length", str(S), "--micro-batch-size", str(B),
            "--global-batch-size", str(B), "--precision", "fp32"]  # fmt: skip
    cfg = parse_args(argv)
    planned = sum(traffic.cp_layer_bytes(cfg, validate(cfg, 4)))
    for rank, (levels, rank_out, nbytes, edges) in enumerate(spawn(_hierarchical, 4)):
        assert max(edges) <= 1e-10, edges
        assert nbytes == {"cp": 2 * planned}, (nbytes, planned)  # the planner's, at fp64
        assert levels == [[rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]]
        for err, grad_err, forward, backward in rank_out:
            assert err <= 1e-10 and grad_err <= 1e-10, (err, grad_err)
            # q, k+v, out exchanged and P-1 = 1 ring hop; their reverses, 1 K/V hop, 2 dK/dV
            assert (forward, backward) == (4, 6), (forward, backward)


def test_load_balanced_positions():
    for cp in (1, 2, 4):
        got = sorted(torch.cat([chunk_positions(16, cp, r) for r in range(cp)]).tolist())
        assert got == list(range(16))
    # rank 0 holds the first and the last chunk: as much causal work as rank 1
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


# ---- the model ---------------------------------------------------------------------------------

EOD = 2
MODEL_CASES = [  # both flavours: learned positions and rotary (with grouped queries)
    dict(flavour="gpt2"),
    dict(flavour="llama", num_query_groups=2),
]


def _packed(b=3, s=16, vocab=301):
    """Token rows with end-of-document tokens at places of their own (a row may hold one)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (b, s + 1), generator=g)
    ids[0, [3, 9]] = EOD
    ids[1:2, 12] = EOD
    return ids[:, :-1], ids[:, 1:]


def _cp_model(rank, world, tp, comm_type):
    from megalite.config import ModelConfig
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.parallel import comm
    from megalite.parallel.specs import spec_of

    cp = world // tp
    topo = Topology(tp=tp, cp=cp)
    topo.cp_a2a = 2 if comm_type == "a2a+p2p" else None  # cp = 2 x cp/2
    groups = build_groups(topo, torch.device("cpu"))
    out = []
    for case in MODEL_CASES:
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                          vocab_size=301, make_vocab_size_divisible_by=8, **case)  # fmt: skip
        ref = GPTChunk(cfg, LayerEnv(seed=11, dtype=torch.float64))
        model = GPTChunk(
            cfg,
            LayerEnv(
                tp=groups.tp,
                seed=11,
                dtype=torch.float64,
                cp=groups.cp,
                cp_comm_type=comm_type,
                cp_levels=groups.cp_levels,
            ),
        )
        for documents in (False, True):
            flags = (documents,) * 3  # reset positions, attention within documents, EOD loss mask
            batch = [_packed(), _packed(2)]  # two micro-batches: the loss counts span both
            whole = shard_batch(batch, 1, 0, EOD, *flags)
            mine = shard_batch(batch, cp, groups.cp.rank, EOD, *flags)
            for m in (ref, model):
                m.zero_grad()
            loss = expected = 0.0
            for (t, lab, *sh), (rt, rlab, *rsh) in zip(mine, whole):
                kw = {"shard": sh[0]} if sh else {}
                rkw = {"shard": rsh[0]} if rsh else {}
                mb_loss, mb_expected = model(t, lab, **kw) / 2, ref(rt, rlab, **rkw) / 2
                (mb_loss / cp).backward()  # gradients averaged over cp, as over dp+cp in training
                mb_expected.backward()
                loss, expected = loss + mb_loss.detach(), expected + mb_expected.detach()
            comm.all_reduce(loss, groups.cp)
            errs = {"loss": (loss / cp - expected).abs().item()}
            ref_params = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                grad, full, spec = p.grad.clone(), ref_params[name].grad, spec_of(p)
                comm.all_reduce(grad, groups.cp)
                if "tp" in spec.grad_sum:
                    comm.all_reduce(grad, groups.tp)
                if name in ("embedding.word.weight", "output.weight"):  # padded further at tp > 1
                    full = torch.nn.functional.pad(full[: cfg.vocab_size],
                                                   (0, 0, 0, model.vocab - cfg.vocab_size))  # fmt: skip
                if spec.split_dim is not None:
                    full = full.chunk(tp, spec.split_dim)[groups.tp.rank]
                errs[name] = (grad - full).abs().max().item()
            out.append((case["flavour"], documents, expected.item(), errs))
    return out


@pytest.mark.parametrize(
    "tp,world,comm_types",  # a2a at tp 2: 2 heads, one kv head; a2a+p2p: cp 4 = 2 x 2
    [(1, 2, ["p2p", "a2a"]), (2, 4, ["p2p"]), (1, 4, ["a2a+p2p"])],
)
def test_model_matches_one_process(tp, world, comm_types):
    for comm_type in comm_types:
        results = spawn(_cp_model, world, tp, comm_type)
        for rank_out in results:
            losses = {}
            for flavour, documents, expected, errs in rank_out:
                bad = {k: v for k, v in errs.items() if v > 1e-10}
                assert not bad, (comm_type, flavour, documents, bad)
                losses[flavour, documents] = expected
            # the document flags change the loss: the comparison above was not of two no-ops
            assert losses["gpt2", True] != losses["gpt2", False]


def test_documents_see_only_themselves():
    """A packed row with --reset-position-ids and --reset-attention-mask gives each document the
    logits it gets alone (one process, both flavours)."""
    from megalite.config import ModelConfig
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk

    for case in MODEL_CASES:
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                          vocab_size=301, **case)  # fmt: skip
        model = GPTChunk(cfg, LayerEnv(seed=5, dtype=torch.float64))
        tokens, labels = _packed(1)  # documents [0, 4), [4, 10), [10, 16)
        ((t, _, shard),) = shard_batch([(tokens, labels)], 1, 0, EOD, True, True, False)
        packed = model(t, shard=shard)
        for start, stop in ((0, 4), (4, 10), (10, 16)):
            alone = model(tokens[:, start:stop])
            assert (packed[:, start:stop] - alone).abs().max().item() <= 1e-10
        assert (model(tokens)[:, 4:10] - packed[:, 4:10]).abs().max().item() > 1e-3


def _cp_timeline(rank, world):
    from megalite.config import ModelConfig
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.pipeline.executor import run_schedule
    from megalite.pipeline.schedules import get_schedule
    from megalite.training import timeline

    groups = build_groups(Topology(cp=world), torch.device("cpu"))
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                      vocab_size=301, make_vocab_size_divisible_by=8)  # fmt: skip
    model = GPTChunk(cfg, LayerEnv(seed=11, cp=groups.cp))
    batch = shard_batch([_packed(), _packed()], world, rank)
    tl = timeline.Timeline((1, 2), rank, groups.topo.coords(rank))
    run_schedule(get_schedule("1f1b", 1, 1, 2, 0), [model], groups, batch,
                 hidden_shape=(3, 16 // world, 32), dtype=torch.float32, timeline=tl.at(1))  # fmt: skip
    assert groups.ledger.timeline is None  # only while the profiled schedule runs
    spans = tl.relative_spans()
    hops = [s for s in spans if s["kind"] == "cp"]
    computes = [s for s in spans if s["kind"] in timeline.COMPUTE]
    inside = all(any(c["start"] <= h["start"] <= h["end"] <= c["end"] for c in computes)
                 for h in hops)  # fmt: skip
    data = {"ranks": [{"rank": rank, "coords": tl.coords, "spans": spans}]}
    return len(hops), inside, timeline.exposed_share(data)


def test_ring_hops_are_timeline_spans():
    """A profiled schedule at cp 2 records every ring hop it waited for inside its compute
    spans: per layer and micro-batch cp-1 forward, cp-1 K/V and cp dK/dV backward."""
    for hops, inside, share in spawn(_cp_timeline, 2):
        assert hops == 2 * 2 * (1 + 1 + 2) and inside, (hops, inside)
        assert 0 < share < 1
