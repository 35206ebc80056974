"""MLP activations: SwiGLU (llama) and tanh-approximated GELU (gpt2)."""

import torch
import torch.nn.functional as F


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_ref(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")
