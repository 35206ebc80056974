"""A ledger clock for pipeline tests: time that the schedule drives, not the wall, so a timing
property holds whatever the machine's load.

Every rank (process) keeps a ledger. A `LedgerChunk`'s forward advances it by t, its input
gradient (I) and its weight gradients (W) by t each, in separate autograd nodes so that a split
backward really runs them apart (a full backward B: 2t); the first stage has no input gradient
to pass on, so its W does the whole backward (2t), as the real model's does
(pipeline/actions.py `compute_seconds`). `ledger_post` stamps every p2p message with its
sender's ledger time (a companion message), and a wait moves the receiver's clock to at least
that time: a rank is idle exactly where the schedule makes it wait for a neighbour.
"""

import torch

LEDGER = {"now": 0.0, "busy": 0.0}  # this rank's clock and its compute time (one per process)


def _spend(seconds: float):
    LEDGER["now"] += seconds
    LEDGER["busy"] += seconds


def _timed(seconds: float):
    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            _spend(seconds)
            return g

    return Timed.apply


class LedgerChunk(torch.nn.Module):
    """A chunk over (2, 4) activations whose computes advance the ledger by t = `stage` / vpp
    (`stage`: a whole stage's forward)."""

    def __init__(self, layers, has_embedding, has_head, vpp=1, stage=1.0):
        super().__init__()
        self.has_embedding, self.has_head, self.t = has_embedding, has_head, stage / vpp
        self.w = torch.nn.Parameter(torch.ones(4))
        self.input_grad = _timed(self.t)
        self.weight_grad = _timed(2 * self.t if has_embedding else self.t)

    def forward(self, x, labels=None):
        _spend(self.t)
        x = torch.ones(2, 4) * x[:, :1] if self.has_embedding else self.input_grad(x * 1.0)
        wv = self.weight_grad(self.w)  # W: on the path to w only, its value cancelled
        y = x + wv - wv.detach()
        return y.sum() if self.has_head else y


def ledger_post(post, delay: float = 0.0, blocking: bool = False):
    """p2p.post whose messages carry their sender's ledger time: a wait for a receive moves
    this rank's clock to at least the sender's time at posting plus `delay` (the message's
    latency; with a delay, a wait for a send too: it completes when its message arrives, as on
    gloo). `blocking`: every batch waited for whole right after it is posted."""

    def ledger_post(ops, group):
        stamps = [torch.tensor([LEDGER["now"] if send else 0.0], dtype=torch.float64)
                  for send, _, _ in ops]  # fmt: skip
        n = len(ops)
        batch = post([*ops, *[(s, t, p) for (s, _, p), t in zip(ops, stamps)]], group)

        def wait(op=None):
            which = range(n) if op is None else [op]
            for i in which:
                for j in (i, n + i):  # the operation and its stamp
                    if j not in batch.waited:
                        batch.works[j].wait()
                        batch.waited.add(j)
            arrived = [stamps[i].item() + delay for i in which if delay or not ops[i][0]]
            LEDGER["now"] = max([LEDGER["now"], *arrived])
            return 0.0

        batch.wait = wait
        if blocking:
            wait()
        return batch

    return ledger_post
