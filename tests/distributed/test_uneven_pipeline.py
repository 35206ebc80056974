"""Uneven pipeline stages (Partition) against one process, including stages of 0 layers.

- The toy model of test_pipeline.py (fp64, 1e-10): every schedule at pp 2 and 4 on uneven
  partitions with an embedding-only first stage, a head-only last stage and a middle stage
  holding nothing at all (a rank without parameters): its forward returns its input, its
  backward hands the received gradient on, and a split backward (ZB) must still compute I.
- The real model (fp64, pp2 x dp2): 1F1B, interleaved, ZB-H1 and ZB-V whole optimizer steps on
  uneven partitions with 0-layer chunks, at ZeRO 1 and ZeRO 3 (a chunk with no layer units) and
  with full recompute, equal one process (loss, gradients, parameters after the step).
"""

import pytest
import torch

from megalite.pipeline.executor import run_schedule
from megalite.pipeline.partition import Partition
from megalite.pipeline.schedules import SCHEDULES, get_schedule
from megalite.testing import spawn
from tests.distributed.test_pipeline import LAYERS, B, H, S, ToyChunk, _check, _data

TOL = 1e-10

# (schedule, vpp, micro-batches, {pp: layers per virtual stage in pipeline order})
TOY_CASES = [
    ("gpipe", 1, 3, {2: [0, 8], 4: [0, 3, 3, 2]}),
    ("1f1b", 1, 3, {2: [8, 0], 4: [1, 0, 5, 2]}),  # head only; a rank with nothing
    ("1f1b", 1, 6, {2: [3, 5], 4: [3, 2, 3, 0]}),
    ("interleaved", 2, 4, {2: [0, 3, 5, 0], 4: [0, 1, 2, 1, 1, 0, 2, 1]}),
    ("zb-h1", 1, 3, {2: [0, 8], 4: [2, 0, 4, 2]}),
    ("zb-h1", 1, 6, {2: [6, 2], 4: [0, 4, 4, 0]}),
    ("zbv", 2, 5, {2: [1, 0, 4, 3], 4: [0, 1, 2, 0, 1, 1, 2, 1]}),
    ("dualpipev", 2, 8, {2: [2, 3, 0, 3], 4: [1, 1, 1, 1, 0, 2, 1, 1]}),
]


def _toy_run(rank, world):
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    out = []
    for name, vpp, m, counts in TOY_CASES:
        placement = SCHEDULES[name].placement
        part = Partition(counts[world], world, vpp, placement)
        assert part.num_layers == LAYERS
        microbatches = _data(m)
        kw = {"hidden_shape": (B, S, H), "dtype": torch.float64, "placement": placement}
        for forward_only in (False, True):
            chunks = [ToyChunk(**c) for c in part.rank_chunks(rank)]
            actions = get_schedule(name, world, vpp, m, rank, forward_only=forward_only)
            result = run_schedule(actions, chunks, groups, microbatches, forward_only=forward_only,
                                  **kw)  # fmt: skip
            if forward_only:
                assert abs(result.loss - out[-1][1]) <= TOL
                assert all(p.grad is None for c in chunks for p in c.parameters())
            else:
                try:
                    _check(result, chunks, microbatches)
                except AssertionError as e:
                    raise AssertionError(f"{name} {counts[world]} rank {rank}: {e}") from None
                out.append((name, result.loss))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_on_uneven_stages_matches_one_process(pp):
    results = spawn(_toy_run, pp)
    assert len(results[0]) == len(TOY_CASES) and all(r == results[0] for r in results)


# ---- the real model: whole steps with data parallelism, ZeRO 3, recompute ---------------------

V, SEQ, MBS, NL = 50, 6, 2, 6


def _config(zero: int, m: int, recompute: str = "none"):
    from megalite.config import Config, ModelConfig

    cfg = Config()
    cfg.model = ModelConfig(flavour="gpt2", num_layers=NL, hidden_size=16, num_attention_heads=2,
                            seq_length=SEQ, vocab_size=V, make_vocab_size_divisible_by=8)  # fmt: skip
    cfg.optimizer.zero_stage, cfg.optimizer.bucket_size_mb = zero, 0.002
    cfg.training.micro_batch_size, cfg.training.global_batch_size = MBS, MBS * m
    cfg.parallel.recompute = recompute
    return cfg


def _step(cfg, groups, name, part, microbatches):
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.optim.distributed_optimizer import build_optimizer
    from megalite.parallel.specs import spec_of

    pp = groups.pp
    chunks = [GPTChunk(cfg.model, LayerEnv(tp=groups.tp, dtype=torch.float64, recompute=cfg.parallel.recompute), **kw)
              for kw in part.rank_chunks(pp.rank)]  # fmt: skip
    opt = build_optimizer(chunks, groups, cfg)
    opt.zero_grad(len(microbatches))
    actions = get_schedule(name, pp.size, part.vpp, len(microbatches), pp.rank)
    result = run_schedule(actions, chunks, groups, microbatches, hidden_shape=(MBS, SEQ, 16),
                          dtype=torch.float64, placement=part.placement)  # fmt: skip
    grads = opt.full_grads()
    opt.step(1e-2)
    opt.wait_params()
    with opt.gathered_params():  # (ZeRO 3: whole between uses only when asked)
        params = {n: (p.detach().clone(), spec_of(p)) for c in chunks
                  for n, p in c.named_parameters()}  # fmt: skip
    return result.loss, grads, params


# (schedule, vpp, layers per virtual stage, ZeRO stage, recompute) at pp2 x dp2
GPT_CASES = [
    ("1f1b", 1, [0, 6], 3, "none"),  # the embedding alone: ZeRO 3's outer unit only
    ("interleaved", 2, [2, 0, 4, 0], 1, "full"),  # the head alone, recomputed
    ("zb-h1", 1, [5, 1], 3, "full"),
    ("zbv", 2, [0, 3, 3, 0], 3, "none"),  # V: rank 0 holds the embedding and the head alone
]


def _gpt_run(rank, world):
    from megalite.parallel import comm
    from megalite.parallel.groups import build_groups, single_process_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=2, dp=2), torch.device("cpu"))
    dp = groups.batch
    g = torch.Generator().manual_seed(7)
    batch = [(torch.randint(0, V, (MBS, SEQ), generator=g),
              torch.randint(0, V, (MBS, SEQ), generator=g)) for _ in range(8)]  # fmt: skip
    mine = batch[dp.rank * 4 : (dp.rank + 1) * 4]
    done = []
    for name, vpp, counts, zero, recompute in GPT_CASES:
        ref = _step(_config(0, 8), single_process_groups(), "1f1b", Partition([NL], 1), batch)
        ref_loss, ref_grads, ref_params = ref
        part = Partition(counts, 2, vpp, SCHEDULES[name].placement)
        loss, grads, params = _step(_config(zero, 4, recompute), groups, name, part, mine)
        where = f"{name} {counts} zero {zero} recompute {recompute} rank {rank}"
        loss = torch.tensor([loss], dtype=torch.float64)
        comm.all_reduce(loss, dp)
        assert abs(loss.item() / dp.size - ref_loss) <= TOL, where
        for n, (p, spec) in params.items():
            assert (p - spec.local(ref_params[spec.source][0])).abs().max() <= TOL, (where, n)
            want = spec.local(ref_grads[spec.source])
            assert (grads[n] - want).abs().max() <= TOL, (where, "grad", n)
        done.append(where)
    return len(done)


@pytest.mark.distributed
def test_uneven_steps_with_zero3_and_recompute_match_one_process():
    assert spawn(_gpt_run, 4, timeout=300) == [len(GPT_CASES)] * 4


# ---- resume: a checkpoint of uneven stages is keyed by global layer, whatever the split -------


def _trainer(world, save=None, load=None, **parallel):
    from megalite.testing import resume_config, tiny_trainer

    cfg = resume_config(save, **parallel)
    cfg.model.flavour, cfg.model.num_layers = "llama", 4
    cfg.checkpoint.load = load
    return tiny_trainer(cfg, samples=64, world=world)


def _params(tr) -> dict:
    """This rank's parameters, whole, by the logical tensor they hold."""
    with tr.opt.gathered_params():
        return {p._spec.source: p.detach().clone() for c in tr.chunks for p in c.parameters()}


def _resume_run(rank, world, root):
    ref = _trainer(1)  # one process, 4 steps
    ref_params = []
    for _ in range(4):
        ref.train_step(log=False)
        ref_params.append(_params(ref))
    uneven = _trainer(world, save=f"{root}/uneven", pp=2, decoder_first_pipeline_num_layers=1)
    for _ in range(2):
        uneven.train_step(log=False)
    got = {"uneven, step 2": (_params(uneven), ref_params[1])}
    uneven.save()
    for name, flags in (("pp2 even", {"pp": 2}), ("pp1 dp2", {})):
        tr = _trainer(world, load=f"{root}/uneven", **flags)
        tr.resume()
        for _ in range(2):
            tr.train_step(log=False)
        got[f"{name}, step 4"] = (_params(tr), ref_params[3])
    return {what: max((p - ref[n]).abs().max().item() for n, p in mine.items())
            for what, (mine, ref) in got.items()}  # fmt: skip


@pytest.mark.distributed
def test_uneven_stages_resume_at_even_stages(tmp_path):
    """Saved at pp2 as 1 | 3 layers after 2 steps, resumed at pp2 as 2 | 2 and at pp1 (dp2):
    the parameters after step 4 are one process's (the uneven steps too)."""
    for errors in spawn(_resume_run, 2, str(tmp_path), timeout=300):
        assert all(err <= 1e-6 for err in errors.values()), errors
