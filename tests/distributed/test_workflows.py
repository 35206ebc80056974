"""Time limits and fine-tuning through the Trainer on two gloo ranks (dp 2, ZeRO-1).

- --exit-interval / --exit-duration-in-mins: every rank saves and leaves the loop at the same
  step; the resubmitted run resumes and ends bit-identical to an uninterrupted one.
- --finetune: the weights only, iteration 0, a fresh optimizer and data position;
  --no-load-optim keeps the position but not the moments; --no-load-rng re-seeds.
"""

from pathlib import Path

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.testing import spawn, tiny_config, tiny_trainer

pytestmark = pytest.mark.distributed


def _trainer(save=None, load=None, **kw):
    cfg = tiny_config()
    t, c = cfg.training, cfg.checkpoint
    t.train_iters, t.log_interval = 6, 100
    cfg.optimizer.zero_stage, cfg.optimizer.lr_decay_iters = 1, 6
    c.save, c.load = save and str(save), load
    for k, v in kw.items():
        setattr(t if hasattr(t, k) else c, k, v)
    return tiny_trainer(cfg)


def _params(tr):
    tr.opt.wait_params()
    return [p.detach().clone() for c in tr.chunks for p in c.parameters()]


def _limits(rank, world, root):
    root = Path(root)
    ref = _trainer(root / "ref")
    ref.train()
    out = {}
    for name, limit in (
        ("interval", {"exit_interval": 4}),
        ("duration", {"exit_duration_in_mins": 1e-9}),
    ):
        first = _trainer(root / name, **limit)
        first.train()  # leaves the loop early, saved
        again = _trainer(root / name)  # the resubmitted job (without the limit)
        state = again.resume()
        again.train()
        out[name] = (first.iteration, state.iteration, again.iteration,
                     all(torch.equal(a, b) for a, b in zip(_params(ref), _params(again))))  # fmt: skip
    return out


def test_time_limits_save_stop_and_resume_exactly(tmp_path):
    for out in spawn(_limits, 2, str(tmp_path)):
        assert out["interval"] == (4, 4, 6, True), out
        assert out["duration"] == (1, 1, 6, True), out
    assert (tmp_path / "interval" / "iter_0000004").is_dir()


def _finetune(rank, world, root):
    root = Path(root)
    base = _trainer(root / "base")
    base.train()
    weights = _params(base)
    out = {}
    for name, flags in (("finetune", {"finetune": True}), ("no_optim", {"load_optim": False}),
                        ("no_rng", {"load_rng": False}), ("all", {})):  # fmt: skip
        tr = _trainer(root / name, load=str(root / "base"), **flags)
        state = tr.resume()
        moments = sum(t.abs().sum().item() for t in tr.opt.exp_avg)
        same = all(torch.equal(a, b) for a, b in zip(weights, _params(tr)))
        out[name] = (state.iteration, tr.sampler.consumed_samples, tr.opt.step_count, moments > 0,
                     state.rng is not None, same)  # fmt: skip
        if name == "finetune":
            tr.train()  # a full fine-tuning run of its own: iterations 1..6 into its --save
            out["restart"] = (
                _trainer(root / name, load=str(root / "base"), finetune=True).resume().iteration
            )
    return out


def test_finetune_and_partial_loads(tmp_path):
    for out in spawn(_finetune, 2, str(tmp_path)):
        # (iteration, consumed samples, optimizer step, moments loaded, RNG restored, weights)
        assert out["all"] == (6, 24, 6, True, True, True), out
        assert out["finetune"] == (0, 0, 0, False, False, True), out
        assert out["no_optim"] == (6, 24, 0, False, True, True), out
        assert out["no_rng"] == (6, 24, 6, True, False, True), out
        assert out["restart"] == 6  # a restarted fine-tune resumes its own --save, not --load
    assert fmt.Checkpoint(tmp_path / "finetune").iteration == 6
