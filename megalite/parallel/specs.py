"""What a parameter is, logically: one small typed record per parameter, attached once.

A layer marks each parameter it creates with how it is sharded (`mark`); the model then names
them (`name_parameters`: logical name, global shape). Everything downstream — initialisation,
the optimizer (weight decay, gradient sums, the global norm), checkpoints (the slice a rank
holds), Hugging Face conversion and the planner — reads the record through `spec_of`, and
"this rank's part of a logical tensor" is computed here only (`ParamSpec.region`, `.local`).

Global means as one process would hold it, with the real vocabulary: a vocabulary tensor's
rows past `vocab_size` are padding that only exists locally.
"""

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Cut:
    """A second split of a tensor already split along `split_axis`: expert weights are split
    over "ep" by expert and over "etp" inside each expert. Dim `dim` holds `parts` equal blocks
    (a gated expert's gate rows then up rows), each cut into `size` contiguous slices; a rank
    holds slice `index` of every block, in block order."""

    dim: int
    size: int
    index: int
    parts: int = 1
    axis: str = "etp"


@dataclass(frozen=True)
class ParamSpec:
    name: str | None = None  # logical name, the same in every layout (owned by model/)
    shape: tuple | None = None  # global shape (real vocabulary rows)
    local_shape: tuple | None = None  # this rank's tensor (vocabulary padding included)
    split_dim: int | None = None  # dim cut into contiguous equal parts along `split_axis`
    split_axis: str = "tp"
    split_size: int = 1  # ranks along split_axis (1: not split)
    split_index: int = 0  # this rank's part along split_axis
    # Groups over which each rank holds only part of this gradient, summed after the data-
    # parallel reduction: "tp" (norms under sequence parallelism, k/v heads replicated over
    # TP), "embed" (the two halves of a tied word embedding on different pipeline stages).
    grad_sum: tuple = ()
    tied_to: str | None = None  # a copy of that logical tensor, not a tensor of its own
    no_weight_decay: bool = False
    vocab_dim: int | None = None  # rows of the vocabulary (padding past the real size)
    cut: Cut | None = None  # a second split (expert tensor parallelism)

    def region(self, index: int | None = None) -> list[tuple[int, int]]:
        """This rank's part of the global tensor: (lo, hi) per dim (another rank's with
        `index` along split_axis). Vocabulary rows past the real size are outside the global
        tensor, so the region may be shorter than the local tensor (or empty). A tensor whose
        cut has several parts is no one rectangle: see `to_global`."""
        if self.cut is not None and self.cut.parts > 1:
            raise ValueError(f"{self.name} is split into {self.cut.parts} parts; use to_global")
        region = self.to_global([(0, n) for n in self.local_shape], index)
        if self.vocab_dim is not None:
            v = self.shape[self.vocab_dim]
            lo, hi = region[self.vocab_dim]
            region[self.vocab_dim] = (min(lo, v), min(hi, v))
        return region

    def to_global(self, block: list, index: int | None = None) -> list[tuple[int, int]]:
        """The global rectangle of a rectangle of the local tensor ((lo, hi) per dim) that lies
        inside one part of the cut (vocabulary padding not trimmed)."""
        index = self.split_index if index is None else index
        out = list(block)
        if self.split_dim is not None:
            n, (lo, hi) = self.local_shape[self.split_dim], out[self.split_dim]
            out[self.split_dim] = (index * n + lo, index * n + hi)
        if self.cut is not None:
            c = self.cut
            m = self.local_shape[c.dim] // c.parts  # this rank's rows of one part
            (lo, hi), part = out[c.dim], out[c.dim][0] // m
            if hi > (part + 1) * m:
                raise ValueError(f"local rows {lo}:{hi} of {self.name} span two parts")
            shift = part * m * (c.size - 1) + c.index * m  # global row = local row + shift
            out[c.dim] = (lo + shift, hi + shift)
        return out

    def local_blocks(self) -> list[list[tuple[int, int]]]:
        """The local tensor as rectangles that each lie in one part of the cut (one rectangle,
        the whole tensor, without parts)."""
        whole = [(0, n) for n in self.local_shape]
        if self.cut is None or self.cut.parts == 1:
            return [whole]
        m = self.local_shape[self.cut.dim] // self.cut.parts
        return [whole[: self.cut.dim] + [(p * m, (p + 1) * m)] + whole[self.cut.dim + 1 :]
                for p in range(self.cut.parts)]  # fmt: skip

    def local(self, full: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """This rank's local tensor cut from a whole logical tensor (any vocabulary padding:
        trimmed or zero-padded to this layout's)."""
        index = self.split_index if index is None else index
        if self.vocab_dim is not None:
            d = self.vocab_dim
            rows = self.local_shape[d] * (self.split_size if self.split_dim == d else 1)
            full = full.narrow(d, 0, min(full.shape[d], self.shape[d]))
            pad = [0, 0] * (full.dim() - 1 - d) + [0, rows - full.shape[d]]
            full = F.pad(full, pad)
        if self.split_dim is not None:
            full = full.chunk(self.split_size, self.split_dim)[index]
        if self.cut is not None:
            c = self.cut
            parts = [p.chunk(c.size, c.dim)[c.index] for p in full.chunk(c.parts, c.dim)]
            full = torch.cat(parts, c.dim)
        return full

    @property
    def source(self) -> str:
        """The logical tensor this parameter holds (its own name, or what it is tied to)."""
        return self.tied_to or self.name

    @property
    def expert(self) -> bool:
        """An expert tensor (split over "ep"): reduced over its expert-data-parallel group."""
        return self.split_axis == "ep"

    def counted_in_norm(self, tp_rank: int) -> bool:
        """Each logical element once: sharded tensors on every TP rank, replicated ones on TP
        rank 0 only, a tied copy not at all (its twin counts)."""
        if self.tied_to:
            return False
        return self.split_dim is not None or tp_rank == 0


def mark(param: nn.Parameter, split_dim=None, split_size=1, split_index=0, **fields):
    """Attach how a new parameter is sharded (a layer calls this; the model names it later)."""
    split = split_dim is not None
    param._spec = ParamSpec(
        local_shape=tuple(param.shape), split_dim=split_dim, split_size=split_size if split else 1,
        split_index=split_index if split else 0, **fields,
    )  # fmt: skip
    return param


def update(param: nn.Parameter, **fields) -> nn.Parameter:
    param._spec = dataclasses.replace(spec_of(param), **fields)
    return param


def spec_of(param: torch.Tensor) -> ParamSpec:
    spec = getattr(param, "_spec", None)
    if spec is None:
        raise AttributeError(
            f"parameter of shape {tuple(param.shape)} carries no ParamSpec (mark it)"
        )
    return spec


def has_spec(param: torch.Tensor) -> bool:
    return getattr(param, "_spec", None) is not None


def name_parameters(module: nn.Module, vocab_size: int | None = None):
    """Give every parameter of `module` its logical name (its name in the module) and global
    shape; parameters nobody marked are replicated ones."""
    for name, p in module.named_parameters():
        spec = spec_of(p) if has_spec(p) else ParamSpec(local_shape=tuple(p.shape))
        shape = list(spec.local_shape)
        if spec.split_dim is not None:
            shape[spec.split_dim] *= spec.split_size
        if spec.cut is not None:
            shape[spec.cut.dim] *= spec.cut.size
        if spec.vocab_dim is not None:
            shape[spec.vocab_dim] = vocab_size
        p._spec = dataclasses.replace(spec, name=name, shape=tuple(shape))
