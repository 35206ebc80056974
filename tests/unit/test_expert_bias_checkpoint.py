"""The MoE expert bias (DeepSeek-V3's auxiliary-loss-free balancing) in checkpoints: 2 + 2 steps
resumed from a checkpoint give the 4-step run's losses and biases bitwise (one process, the real
Trainer); a checkpoint without the biases (written before they were saved) still loads, the
biases at zero and a note in the log line. The MTP modules' MoE layers move theirs too, and
the planner counts their rows of the update's all-reduce."""

import json

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.config import Config
from megalite.model.moe import expert_biases, moe_layers
from megalite.testing import resume_config, tiny_trainer


def _config(save=None, mtp=0, **parallel) -> Config:
    cfg = resume_config(save, **parallel)
    m = cfg.model
    m.flavour = "llama"
    m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 4, 2, 16
    m.moe_router_score_function, m.moe_router_enable_expert_bias = "sigmoid", True
    m.moe_router_bias_update_rate = 1e-2
    m.mtp_num_layers = mtp
    return cfg


def _trainer(cfg, log=None, world=1):
    """The Trainer of `cfg` (one process, or this spawned world's ranks)."""
    return tiny_trainer(cfg, 64, world, log)


def _biases(tr) -> dict:
    return {n: b.clone() for n, b in expert_biases(tr.chunks)}


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_restores_the_expert_bias_bitwise(tmp_path, async_save):
    ref = _trainer(_config())
    losses = [ref.train_step()["loss"] for _ in range(4)]
    want = _biases(ref)
    assert sorted(want) == ["layers.0.mlp.expert_bias", "layers.1.mlp.expert_bias"]
    assert all(b.abs().sum() > 0 for b in want.values())  # they moved

    cfg = _config(str(tmp_path / "run"))
    cfg.checkpoint.async_save = async_save  # the host copy holds the biases too
    first = _trainer(cfg)
    assert [first.train_step()["loss"] for _ in range(2)] == losses[:2]
    first.checkpointer.save(first.state())
    first.checkpointer.wait()
    ck = fmt.Checkpoint(tmp_path / "run")
    saved = ck.read("layers.1.mlp.expert_bias")
    assert saved.dtype == torch.float32
    assert torch.equal(saved, _biases(first)["layers.1.mlp.expert_bias"])

    log = []
    again = _trainer(_config(str(tmp_path / "run")), log)
    again.resume()
    assert [again.train_step()["loss"] for _ in range(2)] == losses[2:]
    got = _biases(again)
    for n, b in want.items():
        assert torch.equal(got[n], b), n
    assert "expert bias" not in log[0]


def test_a_checkpoint_without_the_bias_loads_it_as_zero(tmp_path):
    first = _trainer(_config(str(tmp_path / "run")))
    first.train_step(log=False)
    first.checkpointer.save(first.state())
    d = fmt.resolve(tmp_path / "run")
    index = json.loads((d / fmt.INDEX).read_text())  # as written before the biases were saved
    index["tensors"] = {n: e for n, e in index["tensors"].items() if "expert_bias" not in n}
    (d / fmt.INDEX).write_text(json.dumps(index))
    log = []
    again = _trainer(_config(str(tmp_path / "run")), log)
    for _, b in expert_biases(again.chunks):
        b.fill_(1.0)
    again.resume()
    assert all(not b.any() for _, b in expert_biases(again.chunks))
    assert "holds no expert bias (layers.0.mlp.expert_bias, ...)" in log[0]


def test_the_mtp_modules_move_their_expert_bias_and_report_their_load():
    tr = _trainer(_config(mtp=1))
    assert [i for i, _ in moe_layers(tr.chunks)] == [0, 1, 2]  # the MTP layer is layer 2
    metrics = tr.train_step()
    assert sorted(metrics["moe_load"]) == ["0", "1", "2"]
    bias = dict(expert_biases(tr.chunks))["mtp.0.layer.mlp.expert_bias"]
    assert bias.abs().sum() > 0


def test_the_planner_counts_the_mtp_rows_of_the_bias_update():
    from megalite.plan import traffic
    from megalite.plan.layouts import layout

    def world_bytes(mtp):
        cfg = _config(mtp=mtp)
        return traffic.comm_bytes(cfg, layout(cfg, dp=2, zero=1), 0, 2)["world"]

    row = 4 * 8  # E float64 loads
    # one more (E,) row in the all-reduce over the 2 ranks (a ring's bus factor: 1)
    assert world_bytes(1) - world_bytes(0) == row
