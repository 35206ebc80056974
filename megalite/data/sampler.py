"""Which samples each data-parallel rank trains on, step by step, and the batch tensors.

The global sample stream is the concatenation of per-epoch permutations of [0, num_samples),
epoch e shuffled by `np.random.default_rng((seed, e))`. Global batch i is stream positions
[i*G, (i+1)*G) for global batch size G; DP rank r takes the r-th contiguous G/dp of it, split
in order into micro-batches. So global batch i holds the same samples whatever the DP size,
no sample repeats or is skipped within an epoch, and resuming at `consumed_samples` continues
the stream exactly. A global batch may straddle two epochs.
"""

import numpy as np
import torch

from megalite.errors import MegaliteError


class BatchSampler:
    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        consumed_samples: int = 0,
    ):
        if num_samples < 1:
            raise MegaliteError(
                "the dataset has no samples; give more data or a shorter --seq-length"
            )
        if global_batch_size % (micro_batch_size * dp_size):
            raise MegaliteError(
                f"global_batch_size={global_batch_size} is not divisible by micro_batch_size*dp="
                f"{micro_batch_size}*{dp_size}; make it a multiple of {micro_batch_size * dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.num_samples, self.seed = num_samples, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self._epoch, self._perm = None, None

    def _stream(self, start: int, stop: int) -> list[int]:
        """Sample indices at stream positions [start, stop)."""
        out = []
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.num_samples)
            if epoch != self._epoch:  # one permutation held at a time
                self._epoch = epoch
                self._perm = np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)
            take = min(stop - pos, self.num_samples - offset)
            out.extend(self._perm[offset : offset + take].tolist())
            pos += take
        return out

    def next_batch(self) -> list[list[int]]:
        """This rank's micro-batches of the next global batch; advances `consumed_samples`."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        mine = self._stream(start, start + per_rank)
        self.consumed_samples += self.global_batch_size
        mbs = self.micro_batch_size
        return [mine[k : k + mbs] for k in range(0, per_rank, mbs)]


def get_batch(dataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), each (mbs, seq) int64: a sample's inputs and the same shifted by one."""
    samples = torch.from_numpy(np.stack([dataset[i] for i in indices]))  # (mbs, seq + 1)
    return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
