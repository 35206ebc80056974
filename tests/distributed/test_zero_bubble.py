"""Zero-bubble schedules: the backward split into I and W, and whole optimizer steps.

- W is real: after I the parameters have no gradient yet (only the stage input has one); after
  W they hold exactly the gradient a full backward gives (also with two MTP modules, whose
  shared embedding is used at two depths of the path from the input).
- In fp64, ZB-H1, ZB-V and DualPipeV steps at pp 2 and 4, with dp2 at ZeRO 0/1/2 and with
  tp2, equal one process (loss, gradients, parameters after the step) within 1e-10: the
  data-parallel hooks, buckets and reduce-scatters, the tied embedding (on one rank in a V) and
  loss scaling all stay right when W runs late (loss scaling with W late:
  tests/distributed/test_pipeline.py).
"""

import pytest
import torch

from megalite.config import Config, ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.optim.distributed_optimizer import build_optimizer
from megalite.parallel.groups import build_groups, single_process_groups
from megalite.parallel.specs import spec_of
from megalite.parallel.topology import Topology
from megalite.pipeline.executor import run_schedule
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import SCHEDULES, get_schedule
from megalite.pipeline.split_backward import input_grad
from megalite.testing import spawn

TOL = 1e-10
V, S, MBS = 50, 6, 2


# two MTP modules: their shared embedding is used at two depths of the path from the input
MTP = dict(flavour="deepseek_v3", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
           v_head_dim=4, mtp_num_layers=2)  # fmt: skip


@pytest.mark.parametrize("model_kw", [{"flavour": "llama"}, MTP], ids=["llama", "mtp2"])
def test_weight_gradients_wait_for_w(model_kw):
    torch.manual_seed(0)
    model = GPTChunk(
        ModelConfig(
            num_layers=2,
            hidden_size=16,
            num_attention_heads=2,
            seq_length=S,
            vocab_size=V,
            **model_kw,
        ),
        LayerEnv(dtype=torch.float64),
        has_embedding=False,
    )
    x = torch.randn(2, S, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (2, S))
    model(x, labels).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_x, x.grad = x.grad.clone(), None
    model.zero_grad(set_to_none=True)
    w = input_grad(model(x, labels), None, x, model.parameters())
    assert torch.allclose(x.grad, want_x, rtol=0, atol=1e-14)
    assert all(p.grad is None for p in model.parameters())  # I computed no weight gradient
    w()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=0, atol=1e-14), n


def _config(flavour: str, zero: int, m: int) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(flavour=flavour, num_layers=8, hidden_size=16, num_attention_heads=2,
                            seq_length=S, vocab_size=V, make_vocab_size_divisible_by=8)  # fmt: skip
    cfg.optimizer.zero_stage, cfg.optimizer.bucket_size_mb = zero, 0.002  # several buckets
    cfg.training.micro_batch_size, cfg.training.global_batch_size = MBS, MBS * m
    return cfg


def _batch(n: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, V, (MBS, S), generator=g), torch.randint(0, V, (MBS, S), generator=g))
            for _ in range(n)]  # fmt: skip


def _step(cfg, groups, name, vpp, microbatches):
    placement = SCHEDULES[name].placement
    pp = groups.pp
    chunks = [GPTChunk(cfg.model, LayerEnv(tp=groups.tp, dtype=torch.float64), **kw)
              for kw in rank_chunks(cfg.model.num_layers, pp.size, vpp, pp.rank, placement)]  # fmt: skip
    opt = build_optimizer(chunks, groups, cfg)
    opt.zero_grad(len(microbatches))
    actions = get_schedule(name, pp.size, vpp, len(microbatches), pp.rank)
    result = run_schedule(actions, chunks, groups, microbatches, hidden_shape=(MBS, S, 16),
                          dtype=torch.float64, placement=placement)  # fmt: skip
    grads = opt.full_grads()
    opt.step(1e-2)
    opt.wait_params()
    params = {n: (p.detach().clone(), spec_of(p)) for c in chunks for n, p in c.named_parameters()}
    return result.loss, grads, params, opt


def _reference(cfg, microbatches):
    """One process, the whole batch, 1F1B at pp=1."""
    loss, grads, params, _ = _step(cfg, single_process_groups(), "1f1b", 1, microbatches)
    return loss, grads, params


def _compare(rank, world):
    out = []
    cases = [  # (topology, schedule, vpp, flavour, ZeRO stage)
        (dict(pp=2, dp=2), "zb-h1", 1, "gpt2", 0),
        (dict(pp=2, dp=2), "zb-h1", 1, "llama", 1),
        (dict(pp=2, dp=2), "zbv", 2, "gpt2", 2),
        (dict(pp=2, tp=2), "zbv", 2, "llama", 1),
        (dict(pp=4), "zb-h1", 1, "gpt2", 0),
        (dict(pp=4), "zbv", 2, "llama", 0),
        (dict(pp=2, dp=2), "dualpipev", 2, "gpt2", 1),  # whole and split backwards mixed
        (dict(pp=4), "dualpipev", 2, "llama", 0),
    ]
    for sizes, name, vpp, flavour, zero in cases:
        groups = build_groups(Topology(**sizes), torch.device("cpu"))
        dp = groups.batch
        m_total = 8
        cfg = _config(flavour, zero, m_total // dp.size)
        batch = _batch(m_total)
        ref_loss, ref_grads, ref_params = _reference(_config(flavour, 0, m_total), batch)
        mine = batch[dp.rank * len(batch) // dp.size : (dp.rank + 1) * len(batch) // dp.size]
        loss, grads, params, opt = _step(cfg, groups, name, vpp, mine)
        where = f"{sizes} {name} {flavour} zero {zero} rank {rank}"
        loss = torch.tensor([loss], dtype=torch.float64)
        from megalite.parallel import comm

        comm.all_reduce(loss, dp)
        assert abs(loss.item() / dp.size - ref_loss) <= TOL, where
        for n, (p, spec) in params.items():
            want = spec.local(ref_params[spec.source][0])  # a tied copy: the embedding's
            assert (p - want).abs().max().item() <= TOL, (where, n)
            g = grads[n]  # (finalised: reduced over dp, summed over the tied halves; clipped)
            want_g = spec.local(ref_grads[spec.source])
            assert (g - want_g).abs().max().item() <= TOL, (where, "grad", n)
        out.append(where)
    return len(out)


@pytest.mark.distributed
def test_zero_bubble_steps_match_one_process():
    assert spawn(_compare, 4, timeout=300) == [8] * 4
