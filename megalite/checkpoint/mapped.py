"""Loading a meta-built model straight from its checkpoint's memory-mapped files.

`load_mapped(chunks, tp, ckpt, device)` gives the parameters of chunks built on the meta device
(model/materialize.py) the bytes of this rank's slices, and nothing else:

- where a parameter is one stored tensor's rows (this rank's whole slice inside one shard, as
  at tp 1 or a vocabulary or column split of rows), in the dtype it is stored in, on the CPU,
  the parameter *is* the file's bytes: a view of a private (copy-on-write) mapping, read from
  the page cache when first touched, never written back. No anonymous copy is made, as
  transformers' `from_pretrained` does not make one.
- otherwise (another dtype, a device, a slice across dims or shards, vocabulary padding) its
  memory is allocated on the device, uninitialised, and filled once from the mapped slice (or
  from `Checkpoint.read` where the slice spans shards), cast on the way.

The files are mapped by `Checkpoint.part` (safetensors_file.MappedSafetensors); checksums are the
caller's (`Checkpoint.verify_while_reading`: the hash runs beside the build and the first reads).
"""

import torch

from megalite.checkpoint.format import Checkpoint
from megalite.checkpoint.regions import check_model, load_expert_biases, rank_params
from megalite.model.materialize import materialize


def _slice(ckpt: Checkpoint, name: str, region) -> torch.Tensor | None:
    """The region of logical tensor `name` as a view of the one mapped shard that holds all
    of it, or None (it spans shards)."""
    for s in ckpt.tensors[name]["shards"]:
        sl = s["slice"]
        if all(c <= lo and hi <= d for (lo, hi), (c, d) in zip(region, sl)):
            t = ckpt.part(s, name)
            for dim, ((lo, hi), (c, _)) in enumerate(zip(region, sl)):
                t = t.narrow(dim, lo - c, hi - lo)
            return t
    return None


@torch.no_grad()
def load_mapped(chunks, tp, ckpt: Checkpoint, device, rope_rows: int | None = 0) -> list[str]:
    """Materialise meta-built `chunks` on `device` from `ckpt` (this rank's slices only; the
    chunks' dtype: a parameter stored in another is cast while it is copied), the expert
    biases too. Returns the expert biases the checkpoint lacks (they start from zero), as
    `regions.load_model` does. `rope_rows`: see `materialize` (0: sized by first use)."""
    check_model(chunks, tp, ckpt)
    device = torch.device(device)
    for chunk in chunks:
        materialize(chunk, device, rope_rows)
    for name, p, spec in rank_params(chunks):
        if spec.cut is not None and spec.cut.parts > 1:  # one rectangle per part
            for block in spec.local_blocks():
                dst = p[tuple(slice(lo, hi) for lo, hi in block)]
                dst.copy_(ckpt.read(name, spec.to_global(block)))
            continue
        region = spec.region()
        src = _slice(ckpt, name, region)
        shape = [hi - lo for lo, hi in region]
        if (src is not None and device.type == "cpu" and src.dtype == p.dtype
                and list(src.shape) == list(p.shape) and src.is_contiguous()):  # fmt: skip
            p.data = src  # the file's bytes themselves (copy-on-write)
            continue
        if src is None:
            src = ckpt.read(name, region)
        if list(shape) != list(p.shape):  # vocabulary padding rows past the real vocabulary
            p.zero_()
        p[tuple(slice(0, n) for n in shape)].copy_(src)
    return load_expert_biases(chunks, ckpt)
