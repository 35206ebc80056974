"""MoE training end to end with the real Trainer: 20 steps of a tiny Llama-style model with
4 experts, top-2, the load-balancing and z losses on, at ep2 (over dp), ep2·tp2 (over TP),
ep2·pp2 (the losses of both stages' layers back-propagated) and ep2·dp2 with ZeRO-1 (experts
sharded over edp), each matching the single-process loss curve within 1e-4 and its final
parameters within 1e-4 (fp32); ZeRO-2 runs with experts over TP and edp over dp. A checkpoint
saved at ep2·tp2 resumes at ep4·dp4 and continues like the single-process run, and one host
read per MoE layer forward is all a step adds to the optimizer's one."""

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megalite.config import Config
from megalite.parallel.groups import build_groups, single_process_groups
from megalite.shape import validate
from megalite.testing import HostSyncCounter, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS = 20


def config(**parallel) -> Config:
    cfg = Config()
    m, t = cfg.model, cfg.training
    m.flavour, m.num_layers, m.hidden_size, m.num_attention_heads = "llama", 2, 32, 4
    m.seq_length, m.vocab_size, m.ffn_hidden_size = 16, 100, 64
    m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 4, 2, 32
    m.moe_aux_loss_coeff, m.moe_z_loss_coeff = 1e-2, 1e-3
    t.micro_batch_size, t.global_batch_size, t.kernels = 2, 8, "torch"
    cfg.optimizer.lr = 3e-3
    cfg.logging.wandb_mode = "disabled"
    for k, v in parallel.items():
        setattr(cfg.optimizer if k == "zero_stage" else cfg.parallel, k, v)
    return cfg


def trainer(cfg: Config, world: int, groups=None):
    from megalite.training.trainer import Trainer

    shape = validate(cfg, world)
    groups = groups or build_groups(shape.topology(), torch.device("cpu"))
    tokens = np.random.default_rng(0).integers(0, 100, (64, 17))
    return Trainer(
        cfg, shape, groups, data=SimpleNamespace(train=tokens, valid=None, tokenizer=None)
    )


def params(tr) -> dict:
    """Whole logical tensors of this rank's parameters (its experts' rows of expert tensors)."""
    tr.opt.wait_params()
    return {
        n: (p.detach().clone(), p._spec.region())
        for c in tr.chunks
        for n, p in c.named_parameters()
    }


@functools.lru_cache(maxsize=1)
def single():
    """The single-process run: its losses and final parameters."""
    tr = trainer(config(), 1, single_process_groups())
    losses = [tr.train_step()["loss"] for _ in range(STEPS)]
    return losses, {n: p for n, (p, _) in params(tr).items()}


LAYOUTS = {  # name: (world, parallel flags)
    "ep2": (2, {"ep": 2}),  # experts over the two data-parallel ranks
    "ep2 tp2 zero2": (4, {"tp": 2, "ep": 2, "zero_stage": 2}),  # ep over TP; edp over dp 2
    "ep2 pp2": (4, {"pp": 2, "ep": 2}),
    "ep2 dp2 zero1": (4, {"ep": 2, "zero_stage": 1}),  # dp 4: ep 2 x edp 2
}


def _run(rank, world, save_dir, ref_losses):
    out = {}
    for name, (n, flags) in LAYOUTS.items():
        if n != world:
            continue
        tr = trainer(config(**flags), world)
        rows = [tr.train_step() for _ in range(STEPS)]
        out[name] = [r["loss"] for r in rows], params(tr)
        if name == "ep2 tp2 zero2":
            out["metrics"] = rows[-1]  # the trainer's logging step reports the MoE metrics
    if world == 4:
        out["resume"] = _resume(world, save_dir, ref_losses)
    return out


def _resume(world, save_dir, ref_losses):
    """Save at ep2 tp2 (experts over TP), resume at ep4 dp4 (one expert per rank, over dp),
    continue like the single process; count the host reads of a step."""
    cfg = config(tp=2, ep=2)
    cfg.checkpoint.save = save_dir
    tr = trainer(cfg, world)
    for _ in range(3):
        tr.train_step(log=False)
    tr.save()
    cfg = config(ep=4, zero_stage=1)
    cfg.checkpoint.load = save_dir
    tr = trainer(cfg, world)
    tr.resume()
    losses = [tr.train_step()["loss"] for _ in range(2)]
    counter = HostSyncCounter()
    with counter.counting():
        tr.train_step(log=False)
    # grouped_mm_ref (the CPU path) reads its offsets; the Triton kernel does not
    reads = [w for w, where in counter.where if "grouped_mm_ref" not in where]
    return tr.iteration, losses, len(reads), tr.shape.microbatches


def _compare(results, name):
    ref_losses, ref_params = single()
    for step, (a, b) in enumerate(zip(results[0][name][0], ref_losses), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"{name} step {step}: {a} vs one process {b}"
    for r in results:
        for n, (p, region) in r[name][1].items():
            full = ref_params[n][tuple(slice(lo, hi) for lo, hi in region)]
            if full.numel():  # (a vocabulary slice may be all padding)
                assert (p[: full.shape[0]] - full).abs().max() <= 1e-4, (name, n)


def test_moe_layouts_match_one_process(tmp_path):
    ref_losses, _ = single()
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learns
    results = spawn(_run, 4, str(tmp_path / "ckpt"), ref_losses, timeout=600)
    for name in [n for n, (w, _) in LAYOUTS.items() if w == 4]:
        _compare(results, name)
    m = results[0]["metrics"]
    assert 0 < m["moe_aux_loss"] < 1 and m["moe_dropped_share"] == 0
    assert set(m["moe_load"]) == {"0", "1"} and abs(sum(m["moe_load"]["0"]) - 1) < 1e-3
    for iteration, losses, reads, microbatches in (r["resume"] for r in results):
        assert iteration == 3 + 3  # resumed at 3, then 2 compared steps and 1 counted
        for a, b in zip(losses, ref_losses[3:5]):
            assert abs(a - b) <= 1e-4 * abs(b), (losses, ref_losses[3:5])
        assert reads == 1 + 2 * microbatches  # the status, and one per MoE layer's forward
    _compare(spawn(_run, 2, None, ref_losses, timeout=300), "ep2")
