"""Muon at every layout computes the single-process update: 10 steps of a tiny Llama-style
model (k/v narrower than q; a MoE twin with 4 experts for ep; GPT-2 with its tied embedding
split over pp) with the real Trainer, fp32, the parameters after every step within 1e-6 of one
process at tp2, pp2, dp2 with ZeRO 0-3 (and small buckets), ep2, cp2, tp2·dp2 ZeRO-1, ep2·tp2
ZeRO-2 and pp2·dp2 ZeRO-3; the planner's optimizer-state bytes equal each rank's, and so do
the bytes Muon's exchange sends per step (plan/traffic.muon_bytes, against the ledger; at
tp2·dp2 ZeRO-1 the whole step's tp and dp bytes too); each matrix is orthogonalised by one
rank of the layout per step (as many Newton-Schulz runs over the ranks as one process makes).
A checkpoint saved at tp2·dp2 ZeRO-1 resumes there bitwise and resharded at pp2·dp2 ZeRO-2
within 1e-6 of one process."""

import functools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megalite.config import Config
from megalite.optim import muon
from megalite.parallel.groups import build_groups, single_process_groups
from megalite.plan import memory, traffic
from megalite.shape import validate
from megalite.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS, TOL = 10, 1e-6


def config(model="llama", **parallel) -> Config:
    """model: "llama" (untied), "moe" (its MoE twin), "gpt2" (tied embedding, biases, learned
    positions)."""
    cfg = Config()
    m, t, o = cfg.model, cfg.training, cfg.optimizer
    m.flavour = "gpt2" if model == "gpt2" else "llama"
    m.num_layers, m.hidden_size, m.num_attention_heads = 2, 32, 4
    m.num_query_groups, m.seq_length, m.vocab_size, m.ffn_hidden_size = 2, 16, 100, 64
    if model == "gpt2":
        # the k bias's gradient is zero but for rounding (softmax ignores it): AdamW would
        # turn that noise into steps of lr whatever the layout; a larger eps keeps it small
        o.adam_eps = 1e-5
    if model == "moe":
        m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 4, 2, 24
    t.micro_batch_size, t.global_batch_size, t.kernels = 2, 8, "torch"
    o.optimizer, o.lr, o.lr_decay_style, o.clip_grad = "muon", 3e-3, "constant", 0.5
    cfg.logging.wandb_mode = "disabled"
    for k, v in parallel.items():
        setattr(cfg.optimizer if hasattr(cfg.optimizer, k) else cfg.parallel, k, v)
    return cfg


def trainer(cfg: Config, world: int, groups=None):
    from megalite.training.trainer import Trainer

    shape = validate(cfg, world)
    groups = groups or build_groups(shape.topology(), torch.device("cpu"))
    tokens = np.random.default_rng(0).integers(0, 100, (96, 17))
    data = SimpleNamespace(train=tokens, valid=None, tokenizer=None)
    return Trainer(cfg, shape, groups, data=data)


def params(tr) -> dict:
    """This rank's parameters, whole (gathered at ZeRO-3), with their region, by the logical
    tensor they hold (a tied copy: its twin's name)."""
    with tr.opt.gathered_params():
        return {p._spec.source + ("" if p._spec.source == n else " (copy)"):
                (p.detach().clone(), p._spec.region())
                for c in tr.chunks for n, p in c.named_parameters()}  # fmt: skip


@functools.lru_cache(maxsize=3)
def single(model: str):
    """The parameters after each step of one process."""
    tr = trainer(config(model), 1, single_process_groups())
    return [{n: p for n, (p, _) in (tr.train_step(log=False), params(tr))[1].items()}
            for _ in range(STEPS)]  # fmt: skip


@functools.lru_cache(maxsize=3)
def matrices(model: str) -> int:
    """The matrices one process orthogonalises per step (an expert weight: one per expert)."""
    tr = trainer(config(model), 1, single_process_groups())
    return sum(len(plan) for plan in tr.opt.muon.plans.values())


def counted(tr) -> list:
    """Per step from now: (the bytes the ledger records in Muon's step by group kind, the
    Newton-Schulz runs in it), appended to the list returned."""
    ledger, seen, state = tr.groups.ledger, [], tr.opt.muon
    step, ns = state.step, muon.orthogonalise
    runs = []

    def orthogonalise(*args):
        runs.append(1)
        return ns(*args)

    def wrapped(*args, **kw):
        before, n = dict(ledger.bytes), len(runs)
        muon.orthogonalise = orthogonalise
        try:
            step(*args, **kw)
        finally:
            muon.orthogonalise = ns
        sent = {k: v - before.get(k, 0) for k, v in ledger.bytes.items()}
        seen.append(({k: v for k, v in sent.items() if v}, len(runs) - n))

    state.step = wrapped
    return seen


LAYOUTS = {  # name: (world, model, parallel flags)
    "tp2": (2, "llama", {"tp": 2}),
    "pp2": (2, "llama", {"pp": 2}),
    **{f"dp2 zero{z}": (2, "llama", {"zero_stage": z}) for z in range(4)},
    # small buckets: matrices cut by shard and bucket edges, buckets holding no matrix
    "dp2 zero2 buckets": (2, "llama", {"zero_stage": 2, "bucket_size_mb": 0.004}),
    "ep2": (2, "moe", {"ep": 2}),
    "gpt2 pp2": (2, "gpt2", {"pp": 2}),  # the tied embedding's halves on two stages
    "cp2": (2, "llama", {"cp": 2}),
    "tp2 dp2 zero1": (4, "llama", {"tp": 2, "zero_stage": 1}),
    "ep2 tp2 zero2": (4, "moe", {"tp": 2, "ep": 2, "zero_stage": 2}),
    "pp2 dp2 zero3": (4, "llama", {"pp": 2, "zero_stage": 3}),
}


def _run(rank, world, save_dir):
    out = {}
    for name, (n, model, flags) in LAYOUTS.items():
        if n != world:
            continue
        cfg = config(model, **flags)
        tr = trainer(cfg, world)
        steps, seen = [], counted(tr)
        whole_step = name == "tp2 dp2 zero1"  # the last step logged: its loss mean over dp
        ledger, status = tr.groups.ledger, []
        for i in range(STEPS):
            before = ledger.bytes.get("world", 0)
            tr.train_step(log=whole_step and i == STEPS - 1)
            status.append(ledger.bytes.get("world", 0) - before)
            steps.append(params(tr))
        shape, g = validate(cfg, world), tr.groups
        ranks = {"dp_rank": g.replica.rank, "edp_rank": g.edp.rank if model == "moe" else 0}
        planned = memory.state_memory(cfg, shape, g.pp.rank, **ranks)
        sent = traffic.muon_bytes(cfg, shape, g.pp.rank, tp_rank=g.tp.rank, **ranks)
        whole = {}
        if whole_step:  # the whole last step's tp and dp bytes, Muon's hops included
            mb = cfg.training.global_batch_size // (cfg.training.micro_batch_size * g.batch.size)
            plan = traffic.comm_bytes(cfg, shape, g.pp.rank, mb, tp_rank=g.tp.rank, **ranks)
            whole = {k: (plan[k], g.ledger.bytes[k]) for k in ("tp", "dp")}
            whole["world"] = plan["world"], status[0]  # an unlogged step's status reduction
        out[name] = steps, (planned["optimizer"], tr.opt.state_bytes()), (sent, seen, whole)
    if save_dir:
        out["resume"] = _resume(world, save_dir)
    return out


def _resume(world, save_dir):
    """Save at tp2·dp2 ZeRO-1 after 3 steps; resume there and at pp2·dp2 ZeRO-2, 2 steps."""
    cfg = config(tp=2, zero_stage=1)
    cfg.checkpoint.save = save_dir
    tr = trainer(cfg, world)
    for _ in range(3):
        tr.train_step(log=False)
    tr.save()
    out = {}
    for name, flags in (
        ("same", {"tp": 2, "zero_stage": 1}),
        ("reshard", {"pp": 2, "zero_stage": 2}),
    ):
        cfg = config(**flags)
        cfg.checkpoint.load = save_dir
        tr = trainer(cfg, world)
        tr.resume()
        for _ in range(2):
            tr.train_step(log=False)
        out[name] = params(tr)
    return out


def _close(got: dict, ref: dict, what: str, tol=TOL):
    for n, (p, region) in got.items():
        full = ref[n.removesuffix(" (copy)")][tuple(slice(lo, hi) for lo, hi in region)]
        if full.numel():  # (a vocabulary slice may be all padding)
            err = (p[: full.shape[0]] - full).abs().max().item()
            assert err <= tol, f"{what}: {n} differs from one process by {err}"


def test_muon_layouts_equal_one_process(tmp_path):
    # the tolerance can fail: AdamW's run is far from Muon's
    results = spawn(_run, 2, None, timeout=600) + spawn(_run, 4, str(tmp_path), timeout=600)
    for name, (_, model, _) in LAYOUTS.items():
        ranks = [r[name] for r in results if name in r]
        assert ranks, name
        for rank, (steps, (planned, real), (sent, seen, whole)) in enumerate(ranks):
            assert planned == real, f"{name} rank {rank}: planner {planned} != {real} bytes"
            for i, (got, ref) in enumerate(zip(steps, single(model)), 1):
                _close(got, ref, f"{name} rank {rank} step {i}")
            assert len(seen) == STEPS, (name, seen)
            for i, (ledger, _) in enumerate(seen, 1):
                assert ledger == sent, f"{name} rank {rank} step {i}: {ledger} != planned {sent}"
            for kind, (plan, ledger) in whole.items():
                assert plan == ledger, f"{name} rank {rank}: {kind} {plan} planned, {ledger} sent"
        # one owner per matrix: as many Newton-Schulz runs per step over the ranks as one process
        for i in range(STEPS):
            runs = sum(seen[i][1] for _, _, (_, seen, _) in ranks)
            assert runs == matrices(model), f"{name} step {i + 1}: {runs} Newton-Schulz runs"
    # (not vacuous: there Muon sends over dp and tp, and the whole step was compared)
    tp_dp = [r["tp2 dp2 zero1"][2] for r in results if "tp2 dp2 zero1" in r]
    assert all(set(sent) == {"dp", "tp"} and whole for sent, _, whole in tp_dp), tp_dp
    # topology-free: the momentum of the whole logical matrix, no second moment for it
    tensors = json.loads((tmp_path / "iter_0000003" / "index.json").read_text())["tensors"]
    assert tensors["optimizer.momentum.layers.0.attention.k.weight"]["shape"] == [16, 32]
    assert "optimizer.exp_avg_sq.layers.0.attention.k.weight" not in tensors
    assert "optimizer.exp_avg_sq.layers.0.input_norm.weight" in tensors
    four = [r for r in results if "resume" in r]
    assert len(four) == 4
    ref = single("llama")[4]  # after 5 steps
    for r in four:
        uninterrupted = r["tp2 dp2 zero1"][0][4]
        for n, (p, _) in r["resume"]["same"].items():
            assert torch.equal(p, uninterrupted[n][0]), f"resume is not bitwise: {n}"
        _close(r["resume"]["reshard"], ref, "resharded resume")
