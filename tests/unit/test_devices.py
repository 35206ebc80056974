"""Every tensor megalite creates lives on the run's device, checked without a GPU.

A whole training step (model, pipeline executor, gradient buffer, clipping, AdamW) runs in one
process with the model on the `meta` device, a device that is not the CPU and needs no GPU (a
CPU build of torch cannot fake `cuda` far enough: FakeTensorMode refuses copies onto it). An op
mixing a CPU tensor with the device's raises, and every collective checks that its tensor is on
its group's device (`Group.check`), so a tensor created without a device fails the test. The
step's one host read is stood in for (meta tensors have no values: the status reads as zeros). Planting a CPU `torch.zeros` in the
norm reduction, the bug this guards against, makes it fail.
"""

import pytest
import torch

from megalite.config import Config, ModelConfig
from megalite.optim import distributed_optimizer
from megalite.parallel import comm
from megalite.parallel.groups import single_process_groups
from megalite.shape import validate
from megalite.training.build import build_rank

DEVICE = torch.device("meta")


@pytest.fixture
def no_values(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: [0.0] * t.numel())


def _step(flavour: str, precision="fp32", zero=1, vpp=2):
    cfg = Config()
    cfg.model = ModelConfig(flavour=flavour, num_layers=2, hidden_size=32,
                            num_attention_heads=4, seq_length=8, vocab_size=50)  # fmt: skip
    cfg.optimizer.zero_stage, cfg.parallel.vpp = zero, vpp
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 2, 4
    cfg.training.kernels, cfg.training.precision = "torch", precision
    groups = single_process_groups(DEVICE)
    parts = build_rank(cfg, validate(cfg, 1), groups)  # interleaved at vpp 2, else 1f1b
    chunks, opt = parts.chunks, parts.opt
    assert all(p.device.type == DEVICE.type for c in chunks for p in c.parameters())
    ids = torch.randint(0, 50, (2, 9), device=DEVICE)
    data = [(ids[:, :-1], ids[:, 1:])] * 2
    opt.zero_grad(2)
    result = parts.run(data)
    stats = opt.step(1e-3, flags={"signal": 0.0})
    assert result.loss_tensor.device == DEVICE and not stats.skipped
    return opt


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_a_step_on_another_device(no_values, flavour):
    _step(flavour)
    _step(flavour, "bf16", zero=2, vpp=1)


def test_a_cpu_tensor_in_the_norm_reduction_fails(no_values, monkeypatch):
    def planted(counted, checked, group, flags=()):  # step_status as it was: no device
        sumsq = torch.zeros((), dtype=torch.float64)
        for g in counted:
            sumsq += torch.linalg.vector_norm(g).double() ** 2
        status = torch.cat([torch.stack([sumsq, sumsq * 0]), torch.tensor(list(flags))])
        comm.all_reduce(status, group)
        return status.tolist()

    monkeypatch.setattr(distributed_optimizer, "step_status", planted)
    with pytest.raises(RuntimeError, match="device|cpu"):
        _step("gpt2")


def test_a_collective_refuses_a_tensor_off_its_device():
    groups = single_process_groups(DEVICE)  # no process group needed: the check comes first
    with pytest.raises(RuntimeError, match="handed a tensor on cpu"):
        comm.all_reduce(torch.ones(2), groups.world)
    comm.all_reduce(torch.ones(2, device=DEVICE), groups.world)  # on the device: fine
