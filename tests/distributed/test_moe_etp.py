"""Expert tensor parallelism (--expert-tensor-parallel-size): the MoE layer with each expert's
width split over etp ranks against the same layer in one process, in fp64.

Four gloo ranks run, in one spawn, the layer of tests/distributed/test_moe.py (shared expert,
load-balancing and z losses) beside tp2 (or tp1) attention ranks, its experts at etp2·ep2,
etp2·ep1 (edp 2), etp4 and etp2·ep2 with sequence parallelism, with a plain and a skewed router
and once with a capacity. Each data-parallel replica feeds its own micro-batch; the reference
runs every replica's micro-batch through the whole layer. Outputs, input gradients and every
parameter gradient (reduced as the optimizer does: experts over edp, the router over tp and dp)
agree within 1e-10. Tokens: every rank routes its own; each assignment goes to all etp ranks of
its expert's ep slot, which return partial fc2 outputs that the sender sums.
"""

import pytest
import torch

from megalite.parallel import comm
from megalite.parallel.groups import build_groups
from megalite.parallel.specs import spec_of
from megalite.parallel.topology import Topology
from megalite.testing import spawn
from tests.distributed.test_moe import TOL, E, H, S, cfg, inputs, layer, reference

pytestmark = pytest.mark.distributed


def case(rank, tp, ep, etp, sequence_parallel, skew, capacity=None):
    topo = Topology(tp=tp, dp=4 // tp)
    topo.expert = topo.experts(ep, etp)
    groups = build_groups(topo, torch.device("cpu"))
    d, t = groups.dp.rank, groups.tp.rank
    ref_out, _, ref_xg, ref_grads, _ = reference(4 // tp, skew, capacity)
    moe = layer(cfg(capacity), groups.tp, groups.experts, sequence_parallel and tp > 1, skew)
    x, g = inputs(d, skew)
    rows = slice(t * S // tp, (t + 1) * S // tp) if sequence_parallel and tp > 1 else slice(None)
    x = x[:, rows].clone().requires_grad_(True)
    groups.ledger.reset()
    out = moe(x)
    (out * g[:, rows]).sum().backward()
    err = {
        "out": (out - ref_out[d][:, rows]).abs().max().item(),
        "x grad": (x.grad - ref_xg[d][:, rows]).abs().max().item(),
    }
    shapes = {}
    for name, p in moe.named_parameters():
        grad, spec = p.grad.clone(), spec_of(p)
        comm.all_reduce(grad, groups.edp if spec.expert else groups.dp)
        if "tp" in spec.grad_sum:  # the router
            comm.all_reduce(grad, groups.tp)
        err[name] = (grad - spec.local(ref_grads[name])).abs().max().item()
        shapes[name] = tuple(p.shape)
    calls = dict(groups.ledger.calls)
    return err, shapes, (calls.get("ep"), calls.get("ep_sizes"))


def run(rank, world):
    out = {}
    for tp, ep, etp, sequence_parallel in [
        (2, 2, 2, False),
        (2, 1, 2, False),
        (1, 1, 4, False),
        (2, 2, 2, True),
    ]:
        for skew in (False, True):
            out[tp, ep, etp, sequence_parallel, skew] = case(
                rank, tp, ep, etp, sequence_parallel, skew
            )
    out["capacity"] = case(rank, 2, 2, 2, False, True, capacity=1.0)
    return out


def test_moe_layer_at_etp_matches_one_process():
    results = spawn(run, 4, timeout=300)
    for rank, res in enumerate(results):
        for key, (err, shapes, calls) in res.items():
            worst = max(err, key=err.get)
            assert err[worst] <= TOL, (rank, key, worst, err[worst])
            ep, etp = (2, 2) if key == "capacity" else key[1:3]
            f = 12 // etp  # test_moe's F_ = 12: each rank holds its 1/etp of every expert
            assert shapes["experts.gate_up.weight"] == (E // ep, 2 * f, H), (key, shapes)
            assert shapes["experts.down.weight"] == (E // ep, H, f), (key, shapes)
            # dispatch and combine forward, their reverses backward; one size exchange
            assert calls == (4, 1), (key, calls)


# ---- the trainer: 20 steps at tp2·ep2·etp2, and checkpoints across etp ---------------------


def _exact(tr, path) -> list[str]:
    """The parameters and optimizer state of this rank that differ from checkpoint `path`
    (cut from its whole logical tensors): [] when the rank holds exactly what it holds."""
    from megalite.checkpoint import format as fmt

    ck, wrong = fmt.Checkpoint(path), []
    state = tr.opt.state_tensors()  # gathered over the data-parallel group (ZeRO shards)
    with tr.opt.gathered_params():
        for c in tr.chunks:
            for n, p in c.named_parameters():
                spec = spec_of(p)
                want = {n: p, **{fmt.opt_name(k, n): t for k, t in state.get(n, {}).items()}}
                for key, t in want.items():
                    if not torch.equal(spec.local(ck.read(key)), t.view(p.shape)):
                        wrong.append(key)
    return wrong


def _trained(rank, world, root):
    from tests.distributed.test_moe_training import STEPS, config, trainer

    def cfg(**kw):
        c = config(tp=2, ep=2, zero_stage=1, **kw)
        c.optimizer.bucket_size_mb = 0.004  # a few buckets: ZeRO shards cut experts mid-row
        return c

    a = cfg(etp=2)
    a.checkpoint.save = f"{root}/etp2"
    tr = trainer(a, world)
    losses = [tr.train_step()["loss"] for _ in range(STEPS)]
    tr.opt.wait_params()
    params = {  # each local rectangle with the global one it holds (vocabulary padding kept)
        n: (p.detach().clone(), [(b, spec_of(p).to_global(b)) for b in spec_of(p).local_blocks()])
        for c in tr.chunks
        for n, p in c.named_parameters()
    }
    tr.save()
    saved = _exact(tr, a.checkpoint.save)
    b = cfg()  # etp1: edp 2
    b.checkpoint.load, b.checkpoint.save = a.checkpoint.save, f"{root}/etp1"
    tr = trainer(b, world)
    tr.resume()
    at_etp1 = _exact(tr, b.checkpoint.load)
    tr.train_step(log=False)
    tr.save()
    c = cfg(etp=2)
    c.checkpoint.load = b.checkpoint.save
    tr = trainer(c, world)
    tr.resume()
    return losses, params, saved, at_etp1, _exact(tr, c.checkpoint.load) + _mapped(tr, c)


def _mapped(tr, cfg) -> list[str]:
    """The parameters that a meta-built model at this layout, materialised from the
    checkpoint's mapped files (load_mapped, as tools/generate.py loads), holds otherwise."""
    from megalite.checkpoint import format as fmt
    from megalite.cli.generate import load_chunks

    chunks = load_chunks(fmt.Checkpoint(cfg.checkpoint.load), tr.shape.model, tr.shape, tr.groups)
    mine = {n: p for c in tr.chunks for n, p in c.named_parameters()}
    return [n for c in chunks for n, p in c.named_parameters() if not torch.equal(p, mine[n])]


@pytest.mark.slow
def test_training_at_etp2_matches_one_process_and_checkpoints_reshard(tmp_path):
    """20 steps at tp2·ep2·etp2 (ZeRO-1) follow the single-process loss curve within 1e-4 and
    end at its parameters within 1e-4; the checkpoint saved there loads exactly at etp1
    (edp 2), and one saved at etp1 loads exactly at etp2: weights and optimizer state, and
    the weights through the mapped loader of a meta-built model too."""
    from tests.distributed.test_moe_training import single

    ref_losses, ref_params = single()
    results = spawn(_trained, 4, str(tmp_path), timeout=600)
    for step, (a, b) in enumerate(zip(results[0][0], ref_losses), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: {a} vs one process {b}"
    for rank, (_, params, saved, at_etp1, at_etp2) in enumerate(results):
        for n, (p, blocks) in params.items():
            for mine, glob in blocks:
                full = ref_params[n][tuple(slice(lo, hi) for lo, hi in glob)]
                part = p[tuple(slice(lo, lo + m) for (lo, _), m in zip(mine, full.shape))]
                assert full.numel() == 0 or (part - full).abs().max() <= 1e-4, (rank, n)
        assert not saved and not at_etp1 and not at_etp2, (rank, saved, at_etp1, at_etp2)
    _converts(results, tmp_path / "etp2")


def _converts(results, path):
    """The ranks' etp slices make up exactly the whole logical tensors the checkpoint holds,
    which are all that the Hugging Face conversion reads: to HF (Mixtral's expert names) and
    back gives them again."""
    from megalite.checkpoint import format as fmt
    from megalite.checkpoint.hf import from_hf, to_hf
    from megalite.shape import validate
    from tests.distributed.test_moe_training import config

    ck = fmt.Checkpoint(path)
    state = {n: ck.read(n) for n in ck.names() if not n.endswith(".expert_bias")}
    for n in [n for n in state if ".experts." in n]:
        whole = torch.full_like(state[n], float("nan"))
        for _, params, *_ in results:
            p, blocks = params[n]
            for mine, glob in blocks:
                whole[tuple(slice(a, b) for a, b in glob)] = p[tuple(slice(a, b) for a, b in mine)]
        assert torch.equal(whole, state[n]), n
    model = validate(config(tp=2, ep=2, etp=2), 4).model
    hf = to_hf(state, model)
    assert any(".experts." in k for k in hf)  # Mixtral's expert names
    back = from_hf(hf, model)
    # (from_hf pads the vocabulary rows; the checkpoint holds the real ones)
    assert all(torch.equal(back[n][: t.shape[0]], t) for n, t in state.items())
