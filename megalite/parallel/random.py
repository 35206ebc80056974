"""Random streams for dropout under tensor parallelism.

Where activations are replicated over TP (hidden states without sequence parallelism) every TP
rank must drop the same elements: they draw from the default generator, seeded the same on all
ranks of a TP group. Where activations are sharded (attention heads, sequence-parallel hidden
states) ranks must draw differently: they draw inside `ShardedRNG.fork()`, a stream seeded per
TP rank.

Activation recomputation replays the forward during backward; `torch.utils.checkpoint`
restores the default generator for it, and `ShardedRNG.recompute_contexts` (its `context_fn`)
restores the sharded stream, so the recomputed forward draws the very same dropout masks
(Megatron's RNG tracker does this for its checkpoint function).
"""

from contextlib import contextmanager, nullcontext

import torch


def seed_replicated(seed: int, pp_rank: int = 0, dp_rank: int = 0):
    """Seed the default generator: equal across TP ranks, different across stages and replicas."""
    torch.manual_seed(seed + 100 * pp_rank + 10007 * dp_rank)


class ShardedRNG:
    """A generator state of its own, swapped in for the default one inside `fork()`."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed + 2718 + tp_rank)
            self.state = self._get()

    def _get(self):
        return (
            torch.cuda.get_rng_state(self.device)
            if self.device.type == "cuda"
            else torch.get_rng_state()
        )

    def _set(self, state):
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextmanager
    def fork(self):
        saved = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()  # a new tensor: states handed out earlier stay as they were
            self._set(saved)

    def recompute_contexts(self):
        """`context_fn` for torch.utils.checkpoint: the forward remembers where this stream
        stood, each recomputation replays from there and then leaves the stream where it was.
        The replay context can be entered more than once: a zero-bubble schedule's split
        backward (I, then W) may recompute a checkpointed region twice."""
        return nullcontext(), _Replay(self, self.state)


class _Replay:
    """Re-enterable: sets `rng`'s stream to `start` on entry and back to where it was on exit."""

    def __init__(self, rng: ShardedRNG, start):
        self.rng, self.start = rng, start

    def __enter__(self):
        self.now, self.rng.state = self.rng.state, self.start

    def __exit__(self, *exc):
        self.rng.state = self.now


def rng_state(chunks, device: torch.device) -> dict:
    """This rank's generators: the default CPU (and CUDA) one and each chunk's sharded stream."""
    cuda = device.type == "cuda"
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if cuda else None,
        "chunks": [c.rng.state for c in chunks],  # the TP-sharded dropout streams
    }


def set_rng_state(state: dict, chunks, device: torch.device):
    """Restore what `rng_state` captured (on the same layout)."""
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    for c, s in zip(chunks, state["chunks"]):
        c.rng.state = s.to(c.rng.state.device)
