"""FP8 layers quantise like one process: a tp2 model with sequence parallelism gives one
process's FP8 loss and gradients (fp64 sums of the same FP8 values), for every recipe, because
each amax of a tensor split over tp is max-reduced over tp before its scale is computed."""

import pytest
import torch
import torch.nn.functional as F
from megalite.kernels import fp8, fp8_linear

from megalite import kernels
from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel import comm
from megalite.parallel.specs import spec_of
from megalite.testing import spawn
from tests.distributed.test_tensor_parallel import shard, tp_group

pytestmark = pytest.mark.distributed
TOL = 1e-9


def _step(model, tokens, labels, **kw):
    model.zero_grad()
    loss = model(tokens, labels, **kw)
    loss.backward()
    return loss.detach()


def _fp8_model(rank, world, recipe, unreduced=False, pow2=True):
    g = tp_group(world)
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=128,
        flavour="llama",
        num_query_groups=4,
        ffn_hidden_size=128,
    )  # fmt: skip  (each rank's dims: multiples of 32)
    ops = kernels.override(
        kernels.TORCH_OPS, fp8_linear=fp8_linear.Fp8Maker(fp8.make_recipe(recipe, pow2=pow2))
    )
    ref = GPTChunk(cfg, LayerEnv(seed=11, dtype=torch.float64, ops=ops))
    model = GPTChunk(
        cfg, LayerEnv(tp=g, sequence_parallel=True, seed=11, dtype=torch.float64, ops=ops)
    )
    if unreduced:  # the check can fail: amaxes of this rank's shard only
        for lin in fp8_linear.fp8_linears(model.modules()):
            lin.shards = {}
    torch.manual_seed(0)
    worst = 0.0
    for _ in range(2):  # delayed scaling: the second step scales by the first step's amaxes
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))
        tokens, labels = ids[:, :-1], ids[:, 1:]
        loss, expected = _step(model, tokens, labels), _step(ref, tokens, labels)
        worst = max(worst, (loss - expected).abs().item())
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            grad, full = p.grad.clone(), ref_params[name].grad
            spec = spec_of(p)
            if "tp" in spec.grad_sum:
                comm.all_reduce(grad, g)
            if name in ("embedding.word.weight", "output.weight"):
                full = F.pad(full[: cfg.vocab_size], (0, 0, 0, model.vocab - cfg.vocab_size))
            if spec.split_dim is not None:
                full = shard(full, spec.split_dim, g)
            worst = max(
                worst, ((grad - full).abs().max() / full.abs().max().clamp(min=1e-30)).item()
            )
        fp8_linear.end_step(fp8_linear.fp8_linears(ref.modules()))
        fp8_linear.end_step(fp8_linear.fp8_linears(model.modules()),
                     lambda t: comm.all_reduce(t, g, op=torch.distributed.ReduceOp.MAX))  # fmt: skip
    return worst


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed", "mxfp8"])
def test_tp2_fp8_model_matches_one_process(recipe):
    assert max(spawn(_fp8_model, 2, recipe)) <= TOL


def test_without_the_amax_reduction_tp2_differs():
    """With the exact 448/amax scales: a power-of-two scale usually hides a shard's own amax
    (it falls in the whole tensor's binade), so the missing reduction shows only sometimes."""
    assert max(spawn(_fp8_model, 2, "tensorwise", True, False)) > 1e-4


def _cp_fp8_model(rank, world):
    """cp2 (the tokens split) against one process, tensorwise with exact 448/amax scales: with
    the amax max-reduced over cp (Fp8Maker's `tokens`), and without it (the check can fail)."""
    from megalite.parallel.context_parallel import shard_batch
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(cp=world), torch.device("cpu"))
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                      vocab_size=128, ffn_hidden_size=64, flavour="llama")  # fmt: skip
    worst = []
    for tokens_group in (groups.cp, None):
        recipe = fp8.make_recipe("tensorwise", pow2=False)
        ops = kernels.override(
            kernels.TORCH_OPS, fp8_linear=fp8_linear.Fp8Maker(recipe, tokens_group)
        )
        ref = GPTChunk(cfg, LayerEnv(seed=11, dtype=torch.float64, ops=ops))
        model = GPTChunk(cfg, LayerEnv(seed=11, dtype=torch.float64, ops=ops, cp=groups.cp))
        torch.manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))
        batch = [(ids[:, :-1], ids[:, 1:])]
        (t, lab, *sh), (rt, rlab, *_) = shard_batch(batch, world, rank, None)[0], batch[0]
        loss = _step(model, t, lab, **({"shard": sh[0]} if sh else {}))
        comm.all_reduce(loss, groups.cp)
        expected = _step(ref, rt, rlab)
        err = (loss / world - expected).abs().item()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            grad, full = p.grad.clone() / world, ref_params[name].grad
            comm.all_reduce(grad, groups.cp)
            err = max(err, ((grad - full).abs().max() / full.abs().max().clamp(min=1e-30)).item())
        worst.append(err)
    return worst


def test_cp2_fp8_model_matches_one_process_and_differs_without_the_reduction():
    for reduced, unreduced in spawn(_cp_fp8_model, 2):
        assert reduced <= TOL and unreduced > 1e-4


def _histories_at_pp2(rank, world, saved, again):
    from tests.unit.test_fp8 import _fp8_config, _fp8_trainer, _histories

    cfg = _fp8_config(again, pp=2)
    cfg.checkpoint.load = saved
    tr = _fp8_trainer(cfg, world=world)
    tr.resume()
    loaded = _histories(tr)
    tr.train_step(log=False)
    tr.checkpointer.save(tr.state())
    return loaded, _histories(tr)


def test_amax_histories_are_topology_free(tmp_path):
    """A one-process delayed-FP8 checkpoint loads at pp2 (each stage its layers' histories,
    bitwise), and pp2's checkpoint (each stage's first rank writes its own) loads in one."""
    from megalite.checkpoint import format as fmt
    from tests.unit.test_fp8 import _fp8_config, _fp8_trainer, _histories

    one = _fp8_trainer(_fp8_config(str(tmp_path / "one")))
    for _ in range(2):
        one.train_step(log=False)
    one.checkpointer.save(one.state())
    want = _histories(one)
    results = spawn(_histories_at_pp2, 2, str(tmp_path / "one"), str(tmp_path / "pp2"))
    loaded = {n: t for r in results for n, t in r[0].items()}
    assert sorted(loaded) == sorted(want) and {n.split(".")[1] for n in results[1][0]} == {"1"}
    assert all(torch.equal(loaded[n], t) for n, t in want.items())
    trained = {n: t for r in results for n, t in r[1].items()}
    back = _fp8_trainer(_fp8_config(None))
    back.checkpointer.load(str(fmt.resolve(tmp_path / "pp2")))
    got = _histories(back)
    assert got.keys() == trained.keys() and all(torch.equal(got[n], t) for n, t in trained.items())
    assert got["layers.0.attention.q.fp8_x.steps"] == 3
