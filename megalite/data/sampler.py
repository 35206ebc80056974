"""Which samples each data-parallel rank trains on, step by step, and the batch tensors.

Megatron's MegatronPretrainingSampler: the samples are taken in order (the dataset holds the
shuffled order), global batch i is samples [i*G, (i+1)*G) for global batch size G, and within
it each run of mbs*dp samples is one micro-batch step, dp rank r taking its r-th mbs. So global
batch i holds the same samples whatever the layout, and resuming at `consumed_samples`
continues exactly. Past the dataset's end (it is built for the whole run, so only when the run
outgrows it) the order starts again from sample 0.
"""

import numpy as np
import torch

from megalite.errors import MegaliteError
from megalite.parallel.axes import split_batch


class BatchSampler:
    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
    ):
        if num_samples < 1:
            raise MegaliteError(
                "the dataset has no samples; give more data or a shorter --seq-length"
            )
        # the run shape's split (one check, one message): the trainer passes the shape's sizes
        self.microbatches = split_batch(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.num_samples = num_samples
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples

    def next_batch(self, global_batch_size: int | None = None) -> list[list[int]]:
        """This rank's micro-batches of the next global batch (of `global_batch_size` samples
        during a batch ramp-up, else the sampler's); advances `consumed_samples`."""
        g = global_batch_size or self.global_batch_size
        mbs, step = self.micro_batch_size, self.micro_batch_size * self.dp_size
        count = (
            self.microbatches if g == self.global_batch_size else split_batch(g, mbs, self.dp_size)
        )
        first = self.consumed_samples + self.dp_rank * mbs
        starts = range(first, first + count * step, step)
        self.consumed_samples += g
        return [[(s + k) % self.num_samples for k in range(mbs)] for s in starts]


def get_batch(dataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), each (mbs, seq) int64: a sample's inputs and the same shifted by one."""
    samples = torch.from_numpy(np.stack([dataset[i] for i in indices]))  # (mbs, seq + 1)
    return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
