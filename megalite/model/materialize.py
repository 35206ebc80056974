"""Storage for a model built on the meta device, without initialising it.

A model about to be filled from a checkpoint (generate, serve, --load, --finetune, --eval-only)
is built with `device="meta"`: shapes, names and specs only, no memory and no init kernel.
`materialize` then gives each parameter uninitialised memory on the real device (or the
caller gives it the checkpoint's own mapped bytes: checkpoint/mapped.py), so no weight is
drawn at random only to be overwritten.
"""

import torch
import torch.nn as nn

from megalite.model.rope import RotaryTable


def materialize(module: nn.Module, device, rope_rows: int | None = None) -> nn.Module:
    """Uninitialised memory on `device` for every meta parameter of `module` (dtype and
    requires_grad kept, and the spec and other attributes the parameter carries; a parameter
    two modules share stays one tensor); zeros for meta buffers (running statistics, expert
    biases: what their modules start from); the rotary tables computed, `rope_rows` rows
    (default: as built, the training sequence; 0: grown on first use to what is asked)."""
    new = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                 p.requires_grad)  # fmt: skip
                q.__dict__.update(p.__dict__)  # its ParamSpec (parallel/specs.py)
                new[id(p)] = q
            m._parameters[name] = new[id(p)]
    for m in module.modules():
        if isinstance(m, RotaryTable):
            m.build(m.cos.shape[0] if rope_rows is None else rope_rows, device)
            continue
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    return module
