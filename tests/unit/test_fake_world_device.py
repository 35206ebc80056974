"""--fake-world-device: the fake world's device is a flag, cpu by default; cuda without a GPU
stops with one line before any role starts (docs/fake_world.md says what fails there)."""

from pathlib import Path

import pytest
import torch

from megalite.config_read import parse_args
from megalite.errors import MegaliteError
from megalite.training.fake_world import print_fake_world


def test_fake_cuda_without_a_gpu_is_one_clear_error():
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    base = ["--config", str(tiny), "--dry-run", "--fake-world"]
    assert parse_args(base).training.fake_world_device == "cpu"
    cfg = parse_args([*base, "--fake-world-device", "cuda"])
    assert cfg.training.fake_world_device == "cuda"
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: fake CUDA may run")
    with pytest.raises(MegaliteError, match="needs a CUDA build of torch and a visible GPU"):
        print_fake_world(cfg, None)
