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

The safetensors header is read here (8-byte length, JSON), the data mapped with
`torch.UntypedStorage.from_file(shared=False)`; checksums are the caller's (`Checkpoint.verify`).
"""

import json
import struct

import torch

from megalite.checkpoint.format import Checkpoint
from megalite.checkpoint.regions import check_model, rank_params
from megalite.errors import MegaliteError
from megalite.model.materialize import materialize
from megalite.model.moe import expert_biases

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


class MappedFile:
    """One safetensors file mapped privately: its tensors as views of the mapping."""

    def __init__(self, path):
        self.path = path
        try:
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                self.header = json.loads(fh.read(n))
                size = fh.seek(0, 2)
            self.header.pop("__metadata__", None)
            self.base = 8 + n
            self.bytes = torch.empty(0, dtype=torch.uint8)
            if size:  # a file of empty tensors maps nothing
                storage = torch.UntypedStorage.from_file(str(path), False, size)
                self.bytes = self.bytes.set_(storage)
        except (OSError, ValueError, struct.error) as e:
            raise MegaliteError(
                f"checkpoint file {path} is not a readable safetensors file ({e}); use another "
                "checkpoint"
            ) from None

    def tensor(self, key: str) -> torch.Tensor:
        """The stored tensor `key`, a view of the mapping (no byte read yet)."""
        try:
            meta = self.header[key]
            lo, hi = meta["data_offsets"]
            dtype, shape = _DTYPES[meta["dtype"]], meta["shape"]
        except (KeyError, TypeError, ValueError) as e:
            raise MegaliteError(
                f"checkpoint file {self.path} lacks a readable entry for {key} ({e}); the "
                "checkpoint is damaged"
            ) from None
        raw = self.bytes[self.base + lo : self.base + hi]
        if raw.numel() != (hi - lo):
            raise MegaliteError(f"checkpoint file {self.path} is truncated (tensor {key})")
        if (self.base + lo) % dtype.itemsize:  # safetensors does not align: a copy, aligned
            raw = raw.clone()
        return raw.view(dtype).view(shape)


def _slice(files: dict, ckpt: Checkpoint, name: str, region) -> torch.Tensor | None:
    """The region of logical tensor `name` as a view of the one mapped shard that holds all
    of it, or None (it spans shards)."""
    for s in ckpt.tensors[name]["shards"]:
        sl = s["slice"]
        if all(c <= lo and hi <= d for (lo, hi), (c, d) in zip(region, sl)):
            if s["file"] not in files:
                files[s["file"]] = MappedFile(ckpt.dir / s["file"])
            t = files[s["file"]].tensor(s.get("key", name))
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
    files: dict[str, MappedFile] = {}
    device = torch.device(device)
    for chunk in chunks:
        materialize(chunk, device, rope_rows)
    for name, p, spec in rank_params(chunks):
        region = spec.region()
        src = _slice(files, ckpt, name, region)
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
    missing = []
    for name, bias in expert_biases(chunks):
        if not ckpt.has(name):
            missing.append(name)
            bias.zero_()
        elif list(ckpt.shape(name)) != list(bias.shape):
            raise MegaliteError(
                f"tensor {name} has shape {list(ckpt.shape(name))} in checkpoint {ckpt.dir} but "
                f"{list(bias.shape)} in this model; use the model flags the checkpoint was "
                "trained with"
            )
        else:
            bias.copy_(ckpt.read(name))
    return missing
