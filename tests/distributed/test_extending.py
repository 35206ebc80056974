"""The recipe of docs/extending.md, exercised from a test module without editing megalite/:

- a new parallel axis "xp" (size 2), registered with `register_axis` as replicated and
  batch-splitting, so its gradients are reduced over dp+xp: tp2·xp2 trains exactly like tp2·dp2;
- a new pipeline schedule, registered with `register_schedule` together with its own
  (V-shaped) placement: the verifier checks it and the executor runs it, matching one process;
- a linear and an attention variant through the ops seam (tests/unit/test_extending_model.py)
  train at tp=2 like one process with the default ops, and compiled layers match eager at tp=2.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megalite.config import Config
from megalite.parallel.axes import AXES, register_axis
from megalite.parallel.groups import build_groups
from megalite.pipeline import schedules
from megalite.pipeline.actions import Action, B, F, Schedule
from megalite.pipeline.executor import run_schedule
from megalite.pipeline.partition import end_stages, rank_chunks
from megalite.pipeline.schedules import register_schedule
from megalite.pipeline.verify import verify
from megalite.shape import validate
from megalite.testing import spawn
from tests.distributed.test_pipeline import LAYERS, TOL, H, S, ToyChunk, _data, _reference
from tests.distributed.test_pipeline import B as MBS

pytestmark = pytest.mark.distributed


# ---- a new axis -----------------------------------------------------------------------------


class _Tokens:
    def __init__(self, n=64, seq=16, vocab=100):
        self.x = np.random.default_rng(0).integers(0, vocab, (n, seq + 1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


def _train(cfg: Config, world: int):
    """Three steps of the real trainer; (losses, parameters) of this rank."""
    from types import SimpleNamespace

    from megalite.training.trainer import Trainer

    shape = validate(cfg, world)
    groups = build_groups(shape.topology(), torch.device("cpu"))
    data = SimpleNamespace(train=_Tokens(), valid=None, tokenizer=None)
    trainer = Trainer(cfg, shape, groups, data=data)
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    trainer.opt.wait_params()
    params = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
    return losses, params, shape, groups


def _config(order="tp-dp-pp") -> Config:
    cfg = Config()
    m, t = cfg.model, cfg.training
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = (
        2,
        32,
        4,
        16,
        100,
    )
    m.hidden_dropout = 0.1  # dropout masks must differ across replicas as they do across dp
    t.micro_batch_size, t.global_batch_size = 2, 8
    cfg.parallel.tp, cfg.parallel.order = 2, order
    cfg.optimizer.zero_stage = 1
    cfg.logging.wandb_mode = "disabled"
    return cfg


def _new_axis(rank, world):
    losses, params, shape, _ = _train(_config(), world)
    assert dict(shape.sizes)["dp"] == 2
    register_axis("xp", "a test axis, like dp", replicated=True, splits_batch=True,
                  size=lambda cfg: 2)  # fmt: skip
    try:
        got, got_params, shape, groups = _train(_config("tp-xp-dp-pp"), world)
        assert dict(shape.sizes) == {"tp": 2, "xp": 2, "dp": 1, "pp": 1, "cp": 1, "dpr": 1}
        # gradients reduced (and ZeRO-sharded) over dp+xp: the ranks where dp was
        assert groups.replica is groups.get("dp+xp") and groups.replica.kind == "xp"
        assert groups.replica.ranks == [rank % 2, rank % 2 + 2]
        assert groups.ledger.calls["xp"] > 0 and not groups.ledger.calls["dp"]
    finally:
        del AXES["xp"]
    assert got == losses  # bit for bit: the same samples, reductions and dropout masks
    for n, p in params.items():
        assert torch.equal(p, got_params[n]), n
    return losses


def test_a_new_axis_trains_like_dp():
    results = spawn(_new_axis, 4)
    assert results[0] == results[1] == results[2] == results[3]


# ---- a new schedule with a placement of its own ------------------------------------------------


def v_placement(pp, vpp, rank, chunk):
    """Two chunks per rank in a V: chunk 0 on ranks 0..pp-1, chunk 1 back from pp-1 to 0."""
    return rank if chunk == 0 else 2 * pp - 1 - rank


def v_gpipe(pp, vpp, m, rank):
    """Every forward of chunk 0, then of chunk 1, then the backwards in reverse."""
    fwd = [[Action(F, c, k)] for c in (0, 1) for k in range(m)]
    return fwd + [[Action(B, c, k)] for c in (1, 0) for k in range(m)]


def _register():
    def check(pp, vpp, m):
        return None if vpp == 2 else "the v-gpipe schedule holds two chunks per rank"

    register_schedule(Schedule("v-gpipe", v_gpipe, check, lambda pp, vpp, m, r: 2 * m,
                               placement=v_placement, doc="a test schedule"))  # fmt: skip


def _run_toy(rank, world):
    from megalite.parallel.topology import Topology

    _register()
    groups = build_groups(Topology(pp=world), torch.device("cpu"), embed_stages=[0])
    m = 3
    microbatches = _data(m)
    kw = rank_chunks(LAYERS, world, 2, rank, v_placement)
    chunks = [ToyChunk(**k) for k in kw]
    actions = schedules.get_schedule("v-gpipe", world, 2, m, rank)
    result = run_schedule(actions, chunks, groups, microbatches, hidden_shape=(MBS, S, H),
                          dtype=torch.float64, placement=v_placement)  # fmt: skip
    ref_loss, ref_grads = _reference(microbatches)
    assert abs(result.loss - ref_loss) <= TOL
    for c in chunks:
        for n, p in c.named_parameters():
            assert (p.grad - ref_grads[n]).abs().max().item() <= TOL, n
    # the turn of the V is a local hand-over: rank pp-1 never sends activations to itself
    if rank == world - 1:
        assert not any(a.peer == rank for a in actions if a.peer is not None)
    dist.barrier()
    return [sorted(k["layers"]) for k in kw]


def test_a_new_schedule_is_verified_and_runs():
    _register()
    try:
        for pp in (1, 2, 3, 4):
            for m in (1, 3, 5):
                report = verify("v-gpipe", pp, 2, m)
                assert report.peak_activations == [2 * m] * pp
        assert end_stages(4, 2, v_placement) == [0]  # embedding and head on rank 0
        layers = spawn(_run_toy, 2)
        assert layers[0] == [[0, 1], [6, 7]] and layers[1] == [[2, 3], [4, 5]]
    finally:
        del schedules.SCHEDULES["v-gpipe"]


# ---- a linear and an attention variant through the ops seam, at tp=2 ---------------------------


def _sgd(chunk, ids, steps=3):
    """Losses of `steps` plain SGD steps on one batch (every rank's gradients are whole: no
    sequence parallelism, k/v heads split), and the parameters afterwards."""
    losses = []
    for _ in range(steps):
        loss = chunk(ids[:, :-1], ids[:, 1:])
        chunk.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in chunk.parameters():
                p -= 0.1 * p.grad
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in chunk.named_parameters()}


def _seams(rank, world):
    from megalite import kernels
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.parallel.specs import spec_of
    from megalite.parallel.topology import Topology
    from tests.unit.test_extending_model import CountingLinear, explicit_attention, small

    tp = build_groups(Topology(tp=world), torch.device("cpu")).tp
    cfg = small("llama")
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    ref, ref_params = _sgd(GPTChunk(cfg, LayerEnv(seed=7, dtype=torch.float64)), ids)
    linear = CountingLinear()
    ops = kernels.override(kernels.TORCH_OPS, linear=linear, attention=explicit_attention)
    explicit_attention.calls = 0
    chunk = GPTChunk(cfg, LayerEnv(tp=tp, ops=ops, seed=7, dtype=torch.float64))
    got, params = _sgd(chunk, ids)
    assert linear.calls == 3 * (4 * cfg.num_layers + 1) and explicit_attention.calls == 6
    assert got == pytest.approx(ref, rel=1e-12, abs=0)
    for n, p in chunk.named_parameters():
        assert (params[n] - spec_of(p).local(ref_params[n])).abs().max().item() <= 1e-10, n
    return got


def test_a_linear_and_an_attention_variant_train_like_one_process_at_tp2():
    results = spawn(_seams, 2)
    assert results[0] == results[1]


def _compiled(rank, world):
    """Compiled layers at tp=2, with and without sequence parallelism: dynamo breaks the graph
    at each collective (comm's functions call torch.distributed) and compiles the pieces."""
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.parallel.topology import Topology
    from tests.unit.test_extending_model import small

    tp = build_groups(Topology(tp=world), torch.device("cpu")).tp
    cfg = small("llama", num_layers=1)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    for sequence_parallel in (False, True):
        env = LayerEnv(tp=tp, seed=1, dtype=torch.float64, sequence_parallel=sequence_parallel)
        eager, compiled = (GPTChunk(cfg, env) for _ in range(2))
        for layer in compiled.layers.values():
            layer.compile(backend="aot_eager")
        a, b = (m(ids[:, :-1], ids[:, 1:]) for m in (eager, compiled))
        a.backward()
        b.backward()
        assert (a - b).abs().item() <= 1e-12
        for (n, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
            assert (p.grad - q.grad).abs().max().item() <= 1e-12, n


@pytest.mark.slow
def test_compiled_layers_match_eager_at_tp2():
    spawn(_compiled, 2)
