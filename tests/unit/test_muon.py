"""Muon in one process against a plain reference written here: Keller Jordan's Newton-Schulz
on each matrix in fp64 (q, k, v, out, each expert's gate and up apart, down), AdamW
(torch.optim.AdamW, fp64) on the embedding, norms, router and output layer; which parameters
are matrices, the planner's state bytes, no host read added, the flags and their checks."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megalite.config import Config
from megalite.config_read import parse_args
from megalite.errors import MegaliteError
from megalite.optim.muon import muon_parts, newton_schulz, scale
from megalite.parallel.groups import single_process_groups
from megalite.parallel.specs import ParamSpec, spec_of
from megalite.shape import validate

LR, WD, BETA = 1e-2, 0.1, 0.95


def ns_reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """One (m, n) matrix, fp64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    if g.shape[0] > g.shape[1]:
        x = x.T
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def muon_reference(w, g, buf, parts: int, mode: str, nesterov: bool):
    """The update of one parameter (2-D, or (E, out, in) experts), in place, fp64."""
    buf.lerp_(g, 1 - BETA)
    u = g.lerp(buf, BETA) if nesterov else buf
    mats = u.reshape(-1, u.shape[-2] // parts, u.shape[-1])  # every matrix of the parameter
    out = torch.stack([ns_reference(m) for m in mats]).reshape(u.shape)
    rows, cols = u.shape[-2] // parts, u.shape[-1]
    s = 0.2 * math.sqrt(max(rows, cols)) if mode == "rms" else math.sqrt(max(1, rows / cols))
    w.mul_(1 - LR * WD).add_(out, alpha=-LR * s)


def config(mode="rms", nesterov=True) -> Config:
    cfg = Config()
    m, t, o = cfg.model, cfg.training, cfg.optimizer
    m.flavour, m.num_layers, m.hidden_size, m.num_attention_heads = "llama", 2, 32, 4
    m.num_query_groups = 2  # k and v narrower than q
    m.seq_length, m.vocab_size, m.ffn_hidden_size = 16, 100, 64
    m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 4, 2, 24
    t.micro_batch_size, t.global_batch_size, t.kernels = 2, 4, "torch"
    o.optimizer, o.muon_scale, o.lr, o.weight_decay = "muon", mode, LR, WD
    o.lr_decay_style, o.clip_grad, o.muon_nesterov = "constant", 0.5, nesterov
    cfg.logging.wandb_mode = "disabled"
    return cfg


def trainer(cfg):
    from megalite.training.trainer import Trainer

    tokens = np.random.default_rng(0).integers(0, 100, (32, 17))
    data = SimpleNamespace(train=tokens, valid=None, tokenizer=None)
    return Trainer(cfg, validate(cfg, 1), single_process_groups(), data)


def test_newton_schulz_orthogonalises_each_matrix_as_the_reference():
    g = torch.randn(3, 12, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = newton_schulz(g, 5)
    for x, y in zip(g, out):
        assert (y - ns_reference(x)).abs().max() < 1e-12
        sv = torch.linalg.svdvals(y)
        assert sv.min() > 0.5 and sv.max() < 1.5  # near-orthogonal: U S' V^T, S' about 1
    # a tall matrix is iterated transposed: the same as its transpose's result
    assert torch.equal(newton_schulz(g.mT, 5), out.mT)
    assert newton_schulz(g.float(), 5).dtype == torch.float32
    assert scale(64, 32, "rms") == 0.2 * 8 and scale(64, 32, "shape") == math.sqrt(2)


@pytest.mark.parametrize("mode, nesterov", [("rms", True), ("shape", False)])
def test_single_process_muon_equals_the_reference(mode, nesterov):
    tr = trainer(config(mode, nesterov))
    params = {n: p for c in tr.chunks for n, p in c.named_parameters()}
    parts = {n: muon_parts(n, spec_of(p)) for n, p in params.items()}
    assert parts["layers.0.mlp.experts.gate_up.weight"] == 2
    assert parts["layers.1.attention.k.weight"] == 1 and parts["layers.0.mlp.router.weight"] == 0
    assert parts["embedding.word.weight"] == parts["output.weight"] == 0
    ref = {n: p.detach().double().clone() for n, p in params.items()}
    adam = {n: torch.nn.Parameter(ref[n]) for n in ref if not parts[n]}
    decay = [p for n, p in adam.items() if not spec_of(params[n]).no_weight_decay]
    torch_adam = torch.optim.AdamW(
        [{"params": decay}, {"params": [p for p in adam.values() if all(p is not d for d in decay)],
                             "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD,
    )  # fmt: skip
    bufs = {n: torch.zeros_like(ref[n]) for n in ref if parts[n]}
    for _ in range(3):
        row = tr.train_step()
        assert row["lr"] == LR
        grads = tr.opt.full_grads()  # clipped, what the update read
        for n, p in adam.items():
            p.grad = grads[n].double()
        torch_adam.step()
        for n, buf in bufs.items():
            muon_reference(ref[n], grads[n].double(), buf, parts[n], mode, nesterov)
        for n, p in params.items():
            want = adam[n].detach() if n in adam else ref[n]
            assert (p.detach().double() - want).abs().max() < 1e-6, n
    state = tr.opt.state_tensors()
    assert set(state["layers.0.attention.q.weight"]) == {"momentum"}
    assert set(state["layers.0.mlp.router.weight"]) == {"exp_avg", "exp_avg_sq"}
    # AdamW's second moment only for what AdamW updates
    adam_numel = sum(params[n].numel() for n in adam)
    assert sum(t.numel() for t in tr.opt.exp_avg_sq) == adam_numel


def test_expert_biases_and_vectors_stay_on_adamw():
    ep = {"split_dim": 0, "split_axis": "ep", "split_size": 2}
    bias = ParamSpec(shape=(4, 8), local_shape=(2, 8), **ep)
    down = ParamSpec(shape=(4, 8, 6), local_shape=(2, 8, 6), **ep)
    assert muon_parts("layers.0.mlp.experts.up.bias", bias) == 0
    assert muon_parts("layers.0.mlp.experts.down.weight", down) == 1
    assert muon_parts("layers.0.attention.sinks", ParamSpec(shape=(4,), local_shape=(4,))) == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planned_state_bytes_are_the_real_ones(precision):
    from megalite.plan import memory

    cfg = config()
    cfg.training.precision = precision
    tr = trainer(cfg)
    adam = sum(p.numel() for c in tr.chunks for n, p in c.named_parameters()
               if not muon_parts(n, spec_of(p)))  # fmt: skip
    planned = memory.state_memory(cfg, validate(cfg, 1), 0)["optimizer"]
    assert planned == tr.opt.state_bytes()
    # momentum / first moment for every element (bucket padding too), a second moment for
    # AdamW's alone, fp32 masters under bf16
    padded = sum(b.numel for b in tr.opt.buffer.buckets)
    assert planned == 4 * (padded + adam + (padded if precision == "bf16" else 0))


def test_muon_adds_no_host_read_to_a_step():
    from megalite.testing import HostSyncCounter

    reads = {}
    for name in ("adamw", "muon"):
        cfg = config()
        cfg.optimizer.optimizer = name
        tr = trainer(cfg)
        tr.train_step(log=False)
        counter = HostSyncCounter()
        with counter.counting():
            tr.train_step(log=False)
        reads[name] = [w for w, where in counter.where if "grouped_mm_ref" not in where]
    assert len(reads["muon"]) == len(reads["adamw"]) > 0, reads


def test_muon_flags_parse():
    o = parse_args(["--optimizer", "muon", "--muon-scale", "shape", "--no-muon-nesterov",
                    "--muon-ns-steps", "4", "--muon-momentum", "0.9"]).optimizer  # fmt: skip
    assert (o.optimizer, o.muon_scale, o.muon_nesterov, o.muon_ns_steps, o.muon_momentum) == (
        "muon", "shape", False, 4, 0.9)  # fmt: skip
    assert parse_args([]).optimizer.optimizer == "adamw"


def test_validate_refuses_bad_muon_flags():
    for field, value in (("muon_momentum", 1.0), ("muon_ns_steps", 0)):
        cfg = config()
        setattr(cfg.optimizer, field, value)
        with pytest.raises(MegaliteError, match=field.replace("_", "-")):
            validate(cfg, 1)


def test_an_adamw_checkpoint_does_not_resume_as_muon(tmp_path):
    cfg = config()
    cfg.optimizer.optimizer, cfg.checkpoint.save = "adamw", str(tmp_path)
    tr = trainer(cfg)
    tr.train_step(log=False)
    tr.save()
    index = (tmp_path / "iter_0000001" / "index.json").read_text()
    assert "optimizer.exp_avg_sq.layers.0.attention.q.weight" in index
    cfg = config()
    cfg.checkpoint.load = str(tmp_path)
    with pytest.raises(MegaliteError, match="another --optimizer"):
        trainer(cfg).resume()


def _plan(n: int, tp: int, zero: int, experts=False):
    """The plan of a bucket of a q (split over tp), a k copied over tp and a down (split on
    its columns), or four experts' down (E, 8, 6), over `n` ranks; their shards."""
    from megalite.optim.muon_owners import Owners, bounds, matrices

    if experts:
        ep = {"split_dim": 0, "split_axis": "ep", "split_size": 1}
        ranges = [("layers.0.mlp.experts.down.weight", 0, 192,
                   ParamSpec(shape=(4, 8, 6), local_shape=(4, 8, 6), **ep))]  # fmt: skip
    else:
        split = {"split_axis": "tp", "split_size": tp}
        ranges = [
            ("layers.0.attention.q.weight", 0, 32 * 32 // tp,
             ParamSpec(shape=(32, 32), local_shape=(32 // tp, 32), split_dim=0, **split)),
            ("layers.0.attention.k.weight", 1024 // tp, 16 * 32,
             ParamSpec(shape=(16, 32), local_shape=(16, 32))),
            ("layers.0.mlp.down.weight", 1024 // tp + 512, 32 * 64 // tp,
             ParamSpec(shape=(32, 64), local_shape=(32, 64 // tp), split_dim=1, **split)),
        ]  # fmt: skip
    numel = -(-(ranges[-1][1] + ranges[-1][2]) // (8 * n)) * 8 * n  # padded as a bucket
    plan = Owners(n, tp).assign(matrices(ranges, tp, muon_parts))
    return plan, bounds(0, numel, n, zero > 0)


def test_owners_take_the_longest_first_onto_the_least_loaded():
    from megalite.optim.muon_owners import Matrix, Owners

    mats = [Matrix(f"m{c}", 0, 1, (1, 1), 1, None, None, c) for c in (3, 8, 5, 4, 2)]
    owners = Owners(2, 1)
    got = [m.owner for m in owners.assign(mats)]
    assert got == [(0, 0), (0, 0), (1, 0), (1, 0), (1, 0)]  # 8 3 | 5 4 2
    assert owners.load == {(0, 0): 11, (1, 0): 11}
    # loads carry over buckets; a TP stage spreads over replicas x tp; ties to the lowest
    split = [Matrix("q", 0, 1, (1, 1), 1, "split", 0, 1)] * 4
    assert [m.owner for m in Owners(2, 2).assign(split)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [m.owner for m in owners.assign(mats[:1] * 2)] == [(0, 0), (1, 0)]


@pytest.mark.parametrize("n, tp, zero, experts", [(2, 2, 1, False), (4, 1, 2, False),
                                                  (2, 2, 0, False), (2, 1, 1, True)])  # fmt: skip
def test_the_hops_pair_up_and_every_matrix_is_orthogonalised_once(n, tp, zero, experts):
    from megalite.optim.muon_owners import cut, extent, gather_sizes, scatter_sizes, tp_sizes

    plan, shards = _plan(n, tp, zero, experts)
    assert len(plan) == (4 if experts else 3)
    assert len({m.owner for m in plan}) == min(len(plan), n * (1 if experts else tp))
    for sizes in (gather_sizes, scatter_sizes):  # what j sends k is what k takes from j
        table = [sizes(plan, shards, j) for j in range(n)]
        assert all(table[j][0][k] == table[k][1][j] for j in range(n) for k in range(n))
    # ZeRO-0: each replica holds the bucket, nothing is gathered; the result goes to all
    assert (sum(gather_sizes(plan, shards, 0)[0]) == 0) == (zero == 0)
    sent = sum(sum(scatter_sizes(plan, shards, j)[0]) for j in range(n))
    kept = sum(extent(cut(m, *shards[m.owner[0]])) for m in plan)  # the owner's own piece
    assert sent == (sum(m.numel for m in plan) - kept if zero else kept * (n - 1))
    for d in range(n):
        for hop in (0, 1):
            table = [tp_sizes(plan, d, t, tp)[hop] for t in range(tp)]
            assert all(table[j][0][k] == table[k][1][j] for j in range(tp) for k in range(tp))
    if tp > 1:  # hop B: q's slices both ways; the k copy is only sent back, whole
        for m, gathered in ((plan[0], plan[0].numel), (plan[1], 0)):
            d, t = m.owner
            (_, g_recv), (s_send, _) = tp_sizes([m], d, t, tp)
            assert sum(g_recv) == gathered * (tp - 1) and sum(s_send) == m.numel * (tp - 1)


def test_muon_bytes_plan_nothing_under_adamw():
    from megalite.plan import traffic

    cfg = config()
    assert traffic.muon_bytes(cfg, validate(cfg, 1), 0) == {}  # one process sends nothing
    cfg.optimizer.optimizer = "adamw"
    assert traffic.muon_bytes(cfg, validate(cfg, 1), 0) == {}
