import pytest
import torch
from megalite.kernels import _triton


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    # Each test sees its own "warn once" state, so fallback warnings can be asserted anywhere.
    monkeypatch.setattr(_triton, "_warned", set())


@pytest.fixture(params=[torch.float32, torch.float16], ids=["fp32", "fp16"])
def dtype(request):
    return request.param
