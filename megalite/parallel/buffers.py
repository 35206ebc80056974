"""The interface of a rank's gradient buffers: what the optimizer (optim/distributed_optimizer.py),
and through it the checkpointer, read of them. Three classes have it: `GradBuffer` (stages 0-2,
data_parallel.py), `GradBuffers` (a dense and an expert GradBuffer seen as one) and `Zero3Buffer`
(zero3.py); `data_parallel.build_buffers` picks one. The planner (plan/memory.py) lays out the
same buckets from the same functions (buckets.bucket_layout, zero3.unit_layout) without
building a buffer. The helpers below are the parts the classes share."""

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch

from megalite.parallel import comm
from megalite.parallel.buckets import Bucket, ParamRange
from megalite.parallel.comm import Group


@runtime_checkable
class Buffers(Protocol):
    """Parameters and gradients of this rank in flat buckets, each with this rank's shard (the
    whole bucket where the optimizer state is not sharded)."""

    buckets: list[Bucket]  # in layout order; the optimizer keeps state per bucket shard
    ranges: list[ParamRange]  # every parameter and where it lies in its bucket
    param_dtype: torch.dtype

    def group_of(self, b: Bucket) -> Group:
        """The group bucket `b` is reduced and sharded over."""

    def param_shard(self, b: Bucket) -> torch.Tensor:
        """This rank's shard of bucket `b`'s parameters (what the optimizer updates)."""

    def zero_grad(self, microbatches: int) -> None:
        """Start a step of `microbatches` backward passes per parameter."""

    def finish(self) -> None:
        """Launch the reductions backward did not, wait for all: `shard_grad` holds the sum."""

    def all_gather_params(self, overlap: bool = False) -> None:
        """After the update: give every rank the parameters it reads (overlapped with the next
        forward where `overlap`)."""

    def wait_params(self) -> None:
        """Wait for the parameter gathers still in flight (before reading the parameters)."""

    def gathered(self, write_back: bool = False) -> AbstractContextManager:
        """Every parameter whole in the block; with `write_back` what the block wrote into
        them becomes the shards."""

    def memory_bytes(self) -> dict:
        """Bytes this rank holds for parameters and gradients, by kind."""

    def saves(self, b: Bucket) -> bool:
        """Whether this rank writes bucket `b`'s shard to a checkpoint."""

    def gather_shards(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full-bucket tensors from this rank's per-bucket shards (collective)."""


def place(start: int, end: int, params: list, chunk: int, shard: Group, shard_copies: Group,
          sharded: bool, shard_grad: Callable[[int, int], torch.Tensor]) -> Bucket:  # fmt: skip
    """Bucket [start, end) of `params` (model chunk `chunk`) and where this rank sits in it:
    `dp_start`, the start of its 1/shard.size of the bucket; its shard (that part where the
    state is `sharded`, else the whole bucket); and `counted`, what it counts in the gradient
    norm: of its 1/shard.size, the piece of its copy (`shard_copies`: the copies of the shard
    group holding the same shards, --dp-replicate), so every element is counted once over the
    world however many copies hold it. `shard_grad(lo, hi)`: the tensor the reduced gradient
    of the shard [lo, hi) lands in."""
    n = (end - start) // shard.size
    dp_start = start + shard.rank * n
    lo, hi = (dp_start, dp_start + n) if sharded else (start, end)
    r, k = shard_copies.rank, shard_copies.size
    counted = (dp_start + n * r // k, dp_start + n * (r + 1) // k)
    return Bucket(start, end, params, chunk, dp_start, lo, hi, counted, shard_grad(lo, hi))


def solo(group: Group) -> Group:
    """A group of this rank alone on `group`'s ledger and device (no copies to reduce over)."""
    me = group.ranks[group.rank]
    return Group(f"{group.kind}_alone", [me], 0, None, group.ledger, group.device)


def saves(b: Bucket, group: Group, shard_copies: Group) -> bool:
    """Every rank writes its own shard when the state is sharded, DP rank 0 the whole bucket
    otherwise; of the copies of a shard group (`shard_copies`), the first alone."""
    return shard_copies.rank == 0 and (b.shard_end - b.shard_start < b.numel or group.rank == 0)


def gather_shards(buckets: list[Bucket], shards: list[torch.Tensor], group: Group):
    """Full-bucket tensors from this rank's shards of `buckets`, gathered over `group`."""
    out = []
    for b, s in zip(buckets, shards):
        full = s.new_empty(b.numel)
        comm.all_gather(full, s, group)
        out.append(full)
    return out


def from_reducer(name: str) -> property:
    """A buffer's read-only attribute that is its reducer's (reducers.py)."""
    return property(lambda self: getattr(self.reducer, name))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
