"""The sharded dropout stream's recompute context: each replay draws what the forward drew."""

import torch

from megalite.parallel.random import ShardedRNG


def test_replay_can_be_entered_twice():
    # a zero-bubble split backward (I, then W) may recompute a checkpointed region twice
    rng = ShardedRNG(seed=1, tp_rank=0, device=torch.device("cpu"))
    _, replay = rng.recompute_contexts()
    with rng.fork():
        first = torch.rand(8)  # the forward's draw
    after = rng.state
    for _ in range(2):
        with replay, rng.fork():
            assert torch.equal(torch.rand(8), first)
        assert torch.equal(rng.state, after)  # the stream is left where the forward left it
