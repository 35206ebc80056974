"""checkpoint/torch_stream.py: a torch.save written a tensor at a time reads back as torch.save's
own file does and is a valid zip (the memory it saves: bench/checkpoint/bench_convert.py)."""

import argparse
import zipfile

import torch

from megalite.checkpoint.torch_stream import Later, save_streaming


def test_streamed_file_loads_as_torch_saves(tmp_path):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(6, 8, generator=g)
    obj = {
        "args": argparse.Namespace(num_layers=2, x=None),
        "iteration": 3,
        "model": {
            "w": Later((3, 8), torch.bfloat16, lambda: big[:3].bfloat16()),
            "view": big[2:4],  # a view: only its own bytes are written
            "ids": torch.arange(5),
            "empty": torch.empty(0, 4),
            "none": None,
            "nested": [Later((2,), torch.float32, lambda: torch.ones(2))],
        },
    }
    path = tmp_path / "model_optim_rng.pt"
    save_streaming(obj, path)
    got = torch.load(path, weights_only=False)
    assert got["args"] == obj["args"] and got["iteration"] == 3 and got["model"]["none"] is None
    m = got["model"]
    assert torch.equal(m["w"], big[:3].bfloat16()) and m["w"].dtype == torch.bfloat16
    assert torch.equal(m["view"], big[2:4]) and m["view"].untyped_storage().nbytes() == 64
    assert torch.equal(m["ids"], torch.arange(5)) and m["empty"].shape == (0, 4)
    assert torch.equal(m["nested"][0], torch.ones(2))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every record's CRC-32 is right


def test_a_made_tensor_of_another_shape_is_refused(tmp_path):
    import pytest

    with pytest.raises(RuntimeError, match="made \\(3,\\)"):
        save_streaming({"w": Later((2,), torch.float32, lambda: torch.ones(3))}, tmp_path / "x.pt")
