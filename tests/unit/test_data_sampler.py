"""BatchSampler: Megatron's in-order sampler, the same global batches for every DP size,
resume; get_batch."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megalite.data.sampler import BatchSampler, get_batch
from megalite.errors import MegaliteError


def global_batches(num_samples, gbs, mbs, dp, steps, consumed=0):
    """For each step, every rank's micro-batches: [[rank0 mbs...], [rank1 ...], ...]."""
    samplers = [BatchSampler(num_samples, gbs, mbs, r, dp, consumed) for r in range(dp)]
    return [[s.next_batch() for s in samplers] for _ in range(steps)]


def flat(step):
    """A global batch in Megatron's order: micro-batch step m of rank 0, of rank 1, ..."""
    return [i for mbs in zip(*step) for mb in mbs for i in mb]


@settings(max_examples=40, deadline=None)
@given(
    num_samples=st.integers(1, 50),
    per_dp8=st.integers(1, 3),  # global batch = 8 * mbs * per_dp8, divisible by every dp
    mbs=st.integers(1, 3),
    consumed_steps=st.integers(0, 5),
)
def test_global_batch_is_the_same_multiset_for_every_dp(num_samples, per_dp8, mbs, consumed_steps):
    gbs = 8 * mbs * per_dp8
    consumed = consumed_steps * gbs
    reference = None
    for dp in (1, 2, 4, 8):
        steps = global_batches(num_samples, gbs, mbs, dp, steps=3, consumed=consumed)
        for step in steps:
            assert all(len(mb) == mbs for rank in step for mb in rank)
            assert all(len(rank) == gbs // (mbs * dp) for rank in step)
        got = [Counter(flat(step)) for step in steps]
        reference = reference or got
        assert got == reference, dp
        # in fact the same order: micro-batch step m, rank r holds the r-th mbs of its run
        single = global_batches(num_samples, gbs, mbs, 1, 3, consumed)
        assert [flat(s) for s in steps] == [flat(s) for s in single]


def test_samples_in_order_then_from_the_start():
    n, gbs = 24, 8  # 3 steps: the dataset holds the shuffled order, the sampler walks it
    stream = [i for step in global_batches(n, gbs, 2, 2, steps=5) for i in flat(step)]
    assert stream == list(range(n)) + list(range(16))


def test_megatron_interleaves_ranks_per_micro_batch_step():
    # MegatronPretrainingSampler: each run of mbs*dp samples is one micro-batch step
    assert global_batches(100, 8, 2, 2, steps=2) == [
        [[[0, 1], [4, 5]], [[2, 3], [6, 7]]],
        [[[8, 9], [12, 13]], [[10, 11], [14, 15]]],
    ]


def test_batch_straddling_the_end():
    n, gbs = 10, 4
    stream = [i for step in global_batches(n, gbs, 1, 2, steps=5) for i in flat(step)]
    assert stream[:10] == list(range(10)) and stream[10:20] == list(range(10))


def test_resume_continues_with_exactly_the_next_samples():
    n, gbs, mbs, dp = 37, 12, 3, 2
    full = global_batches(n, gbs, mbs, dp, steps=10)
    first_epoch = [i for step in full[:3] for i in flat(step)]
    assert len(set(first_epoch)) == 3 * gbs  # the steps move on through the stream
    for k in (0, 1, 3, 7):
        resumed = global_batches(n, gbs, mbs, dp, steps=10 - k, consumed=k * gbs)
        assert resumed == full[k:]
    s = BatchSampler(n, gbs, mbs, 0, dp)
    s.next_batch()
    assert s.consumed_samples == gbs


def test_bad_batch_sizes():
    with pytest.raises(MegaliteError, match="not divisible"):
        BatchSampler(10, 6, 2, 0, 2)
    with pytest.raises(MegaliteError, match="no samples"):
        BatchSampler(0, 4, 2, 0, 2)


def test_get_batch_shifts_labels():
    data = [np.arange(k, k + 6, dtype=np.int64) for k in range(0, 50, 10)]
    tokens, labels = get_batch(data, [3, 1])
    assert tokens.dtype == labels.dtype == torch.long and tokens.shape == (2, 5)
    assert tokens.tolist() == [[30, 31, 32, 33, 34], [10, 11, 12, 13, 14]]
    assert labels.tolist() == [[31, 32, 33, 34, 35], [11, 12, 13, 14, 15]]
