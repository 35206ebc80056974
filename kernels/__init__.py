"""Fused kernels (installed as megalite.kernels), each beside its plain-torch reference.

`select(mode, device)` returns the ops the model calls: the Triton kernels when mode is
"triton" (or "auto" on CUDA), the torch references otherwise.
"""

from types import SimpleNamespace

import torch

from megalite.kernels.activations import gelu_ref, swiglu_ref
from megalite.kernels.attention import attention_ref
from megalite.kernels.cross_entropy import cross_entropy_ref
from megalite.kernels.layer_norm import layer_norm_ref
from megalite.kernels.rms_norm import rms_norm_ref
from megalite.kernels.rotary import rotary_ref

TORCH_OPS = SimpleNamespace(
    rms_norm=rms_norm_ref,
    layer_norm=layer_norm_ref,
    rotary=rotary_ref,
    swiglu=swiglu_ref,
    gelu=gelu_ref,
    cross_entropy=cross_entropy_ref,
    attention=attention_ref,
)


def select(mode: str, device: torch.device) -> SimpleNamespace:
    if mode == "torch" or (mode == "auto" and device.type != "cuda"):
        return TORCH_OPS
    raise NotImplementedError("Triton kernels are not wired in yet")
