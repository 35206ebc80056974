"""The expert biases across layouts (one spawn of 2 ranks, pp2, an MTP module with experts on
the last stage): trained there they are the single process's bitwise (the loads are counts, the
update their sign), the MTP layer's included; a single-process checkpoint loads them at pp2."""

import pytest
import torch

from megalite.testing import spawn
from tests.unit.test_expert_bias_checkpoint import _biases, _config, _trainer

pytestmark = pytest.mark.distributed
STEPS = 3


def _at_pp2(rank, world, saved):
    tr = _trainer(_config(mtp=1, pp=2), world=world)
    for _ in range(STEPS):
        tr.train_step(log=False)
    trained = _biases(tr)
    cfg = _config(mtp=1, pp=2)
    cfg.checkpoint.load = saved
    loaded = _trainer(cfg, world=world)
    loaded.resume()
    return trained, _biases(loaded)


def test_expert_biases_agree_across_layouts_and_load_at_pp2(tmp_path):
    one = _trainer(_config(str(tmp_path / "one"), mtp=1))
    for _ in range(STEPS):
        one.train_step(log=False)
    one.checkpointer.save(one.state())
    want = _biases(one)
    assert len(want) == 3 and all(b.any() for b in want.values())  # the MTP layer's moved too
    results = spawn(_at_pp2, 2, str(tmp_path / "one"))
    trained = {n: b for r in results for n, b in r[0].items()}
    loaded = {n: b for r in results for n, b in r[1].items()}
    assert sorted(trained) == sorted(loaded) == sorted(want)
    assert sorted(results[1][0]) == ["layers.1.mlp.expert_bias", "mtp.0.layer.mlp.expert_bias"]
    for n, b in want.items():
        assert torch.equal(trained[n], b), n
        assert torch.equal(loaded[n], b), n
