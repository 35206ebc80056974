"""The flat layout every gradient buffer shares: which parameters go in which bucket, where each
parameter sits, and the dtype gradients accumulate in. Pure bookkeeping: the DP buffer
(data_parallel.py), the ZeRO-3 buffer (zero3.py) and the planner (plan/memory.py) lay
parameters out with it."""

from dataclasses import dataclass

import torch
from torch import nn

# Buckets are padded to a multiple of dp * ALIGN elements so every shard starts aligned.
ALIGN = 64
# The default bucket: 25 MB of gradients, or 2^20 elements per rank of the group it is reduced
# over, whichever is larger (Megatron: max(40M, 1M * dp) parameters). A ring collective of a
# bucket of B bytes over d ranks sends d-1 pieces of B/d bytes; each piece costs a latency a plus
# (B/d)/bandwidth, so B/d must stay well above a * bandwidth (about 0.5 MB between nodes) to be
# bandwidth-bound: 2^20 fp32 elements (4 MB) per rank keeps the latency under ~12% at any dp.
DEFAULT_BUCKET_MB = 25.0
MIN_PER_RANK = 2**20


def bucket_numel(bucket_size_mb: float | None, dp: int, element_size: int) -> int:
    """Elements per gradient bucket: --bucket-size-mb if given, else the default above."""
    if bucket_size_mb is not None:
        return max(1, int(bucket_size_mb * 2**20 / element_size))
    return max(int(DEFAULT_BUCKET_MB * 2**20 / element_size), MIN_PER_RANK * dp)


class Packer:
    """Lays buckets end to end in a flat buffer: `out` holds [(start, end, [(name, offset,
    numel)])], each bucket's `end - start` a multiple of `pad`."""

    def __init__(self, pad: int):
        self.pad, self.out, self.offset = pad, [], 0

    def close(self, ranges: list[tuple]):
        """Append one bucket holding `ranges` [(name, numel)] in order."""
        start, placed = self.offset, []
        for name, n in ranges:
            placed.append((name, self.offset, n))
            self.offset += n
        self.offset = -(-self.offset // self.pad) * self.pad
        self.out.append((start, self.offset, placed))


def trainable(chunks: list[nn.Module], select=lambda name, p: True) -> tuple[list, torch.dtype]:
    """Per chunk [(name, parameter)] of the trainable parameters `select` keeps, and their one
    dtype; refuses mixed dtypes and names repeated across chunks."""
    named = [[(n, p) for n, p in c.named_parameters() if p.requires_grad and select(n, p)]
             for c in chunks]  # fmt: skip
    params = [x for c in named for x in c]
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ValueError(f"all parameters must share one dtype, got {sorted(map(str, dtypes))}")
    names = [n for n, _ in params]
    if len(set(names)) != len(names):
        raise ValueError("parameter names repeat across chunks; logical names must be unique")
    return named, dtypes.pop()


def bucket_layout(chunks: list[list[tuple]], bucket_numel: int, pad: int) -> list[tuple]:
    """Cut parameters into buckets: [(start, end, [(name, offset, numel)])], `end - start` a
    multiple of `pad`. `chunks`: per model chunk, its [(name, numel, alone)] in registration
    order; within a chunk the order is reversed (roughly the order backward produces gradients,
    so early buckets fill and start reducing first); a bucket never spans two chunks, closes
    once it holds `bucket_numel` elements, and an `alone` parameter gets one of its own. The
    gradient buffer and the planner both lay parameters out with this."""
    pack = Packer(pad)
    for params in chunks:
        current, held = [], 0
        for name, n, alone in reversed(params):
            if current and (alone or held >= bucket_numel):
                pack.close(current)
                current, held = [], 0
            current.append((name, n))
            held += n
            if alone:
                pack.close(current)
                current, held = [], 0
        if current:
            pack.close(current)
    return pack.out


@dataclass(frozen=True, eq=False)
class Bucket:
    """One bucket of a rank's flat buffers, fixed once it is placed (buffers.place): where it
    lies, the part of it this rank updates and counts, and the tensor its reduced gradient
    lands in. What changes during a step is its reducer's (reducers.Reduction), ZeRO-3's
    parameter storage is the Zero3Buffer's. Compared and hashed by identity."""

    start: int  # [start, end) in the flat buffers, end - start a multiple of dp
    end: int
    params: list
    chunk: int = 0  # the model chunk its parameters belong to
    dp_start: int = 0  # this rank's 1/dp of the bucket (= the shard at stage >= 1)
    shard_start: int = 0  # the part of the bucket this rank updates (all of it at stage 0)
    shard_end: int = 0
    # [start, end) of the bucket this rank counts in the gradient norm: its 1/dp, or with
    # copies of the shard group (--dp-replicate) its copy's piece of that (buffers.place)
    counted: tuple = (0, 0)
    # the reduced gradient of this rank's shard: its part of the gradient buffer (stages 0/1)
    # or an accumulator of its own (stages 2/3); the reducer writes it, the optimizer reads it
    shard_grad: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def used(self) -> int:
        """Elements the parameters fill (the rest, up to numel, is padding)."""
        return sum(p.numel() for p in self.params)


@dataclass(frozen=True)
class ParamRange:
    """Where a parameter sits: its name, flat offset and bucket."""

    name: str
    param: nn.Parameter
    offset: int
    bucket: Bucket

    def overlap(self, start: int, end: int) -> tuple[int, int, int, int] | None:
        """(lo, hi, plo, phi): the part of this parameter inside the flat range [start, end),
        as flat offsets and as offsets into the flattened parameter; None when disjoint."""
        lo, hi = max(self.offset, start), min(self.offset + self.param.numel(), end)
        if lo >= hi:
            return None
        return lo, hi, lo - self.offset, hi - self.offset

    def shard_slice(self) -> tuple[int, int, int, int] | None:
        """Like overlap() for this rank's shard, with lo/hi relative to the bucket's shard."""
        s = self.overlap(self.bucket.shard_start, self.bucket.shard_end)
        if s is None:
            return None
        base = self.bucket.shard_start
        return s[0] - base, s[1] - base, s[2], s[3]


def grad_dtype(param_dtype: torch.dtype, bf16_grads: bool = False) -> torch.dtype:
    """Gradients accumulate in fp32 when parameters are bf16/fp16 (micro-batch sums keep their
    bits), in the parameters' dtype otherwise; `bf16_grads` (--grad-reduce-in-bf16, Megatron's
    bf16 main_grad): bf16 parameters accumulate and reduce their gradients in bf16."""
    if bf16_grads and param_dtype == torch.bfloat16:
        return param_dtype
    return torch.float32 if param_dtype in (torch.bfloat16, torch.float16) else param_dtype
