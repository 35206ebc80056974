"""The 1F1B family: GPipe, 1F1B and Megatron's interleaved 1F1B, as compute orders.

Each builder gives one rank's computes in segments (`[[Action]]`): communication goes only
between segments, placed by `actions.with_comms`. A backward is whole (B); the bubble is
Megatron's (pp-1)/(vpp*m) of the first stage's compute. The registry (schedules.py) lists the
`Schedule`s defined here under their names.
"""

from megalite.pipeline.actions import Action, B, F, Schedule


def gpipe_order(pp: int, vpp: int, microbatches: int, rank: int) -> list[list[Action]]:
    """All forwards, then all backwards (in the same micro-batch order): m activations live."""
    m = range(microbatches)
    return [[Action(F, 0, k)] for k in m] + [[Action(B, 0, k)] for k in m]


def one_f_one_b_order(pp: int, vpp: int, microbatches: int, rank: int) -> list[list[Action]]:
    """Warm up with pp-rank-1 forwards, then alternate one forward and one backward, then
    drain the remaining backwards: at most pp-rank activations live (capped by m). Every
    compute is a segment of its own, so a result leaves as soon as it is computed."""
    warmup = min(pp - rank - 1, microbatches)
    out = [[Action(F, 0, k)] for k in range(warmup)]
    for k in range(microbatches - warmup):
        out += [[Action(F, 0, warmup + k)], [Action(B, 0, k)]]
    out += [[Action(B, 0, k)] for k in range(microbatches - warmup, microbatches)]
    return out


def interleaved_warmup(pp: int, vpp: int, microbatches: int, rank: int) -> int:
    """Megatron's warmup forwards for interleaved 1F1B: the first forward of the last chunk on
    the last rank must be reachable, and each rank upstream needs two more (one forward and one
    backward hop of slack per stage between it and the last)."""
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, microbatches * vpp)


def interleaved_order(pp: int, vpp: int, microbatches: int, rank: int) -> list[list[Action]]:
    """Interleaved 1F1B over vpp chunks per rank. Virtual micro-batch k (0 .. m*vpp-1) runs
    groups of pp micro-batches through one chunk before moving to the next chunk; backwards
    visit the chunks in reverse order. In the steady state a forward and a backward form one
    segment, so their results leave, and the next pair's inputs arrive, in one batch (as in
    Megatron): with a batch after each compute, ranks 0 and 1 of pp=2 deadlock."""
    total = microbatches * vpp

    def unit(k: int, forward: bool) -> Action:
        group, within = divmod(k, pp * vpp)
        chunk = within // pp
        mb = group * pp + k % pp
        return Action(F, chunk, mb) if forward else Action(B, vpp - 1 - chunk, mb)

    warmup = interleaved_warmup(pp, vpp, microbatches, rank)
    out = [[unit(k, True)] for k in range(warmup)]
    out += [[unit(warmup + k, True), unit(k, False)] for k in range(total - warmup)]
    out += [[unit(k, False)] for k in range(total - warmup, total)]
    return out


def _one_chunk(name):
    def check(pp, vpp, m):
        if vpp != 1:
            return (
                f"--vpp {vpp} needs the interleaved schedule, not {name} (which runs one chunk per "
                "rank); use interleaved or --vpp 1"
            )
        return None

    return check


def _interleaved_check(pp, vpp, m):
    if vpp < 2:
        return "the interleaved schedule needs vpp >= 2 (--vpp)"
    if m % pp:
        return (
            f"the interleaved schedule needs micro-batches per step ({m}) to be a multiple of "
            f"pp={pp}; raise --global-batch-size"
        )
    return None


GPIPE = Schedule(
    "gpipe", gpipe_order, _one_chunk("gpipe"), lambda pp, vpp, m, r: m, chunks=1,
    doc="all forwards, then all backwards",
)  # fmt: skip
ONE_F_ONE_B = Schedule(
    "1f1b", one_f_one_b_order, _one_chunk("1f1b"), lambda pp, vpp, m, r: min(pp - r, m),
    chunks=1, doc="one forward, one backward (default at vpp=1)",
)  # fmt: skip
INTERLEAVED = Schedule(
    "interleaved", interleaved_order, _interleaved_check,
    # the warmup forwards plus the steady state's one extra forward before its first backward,
    # unless the warmup already is everything
    lambda pp, vpp, m, r: min(interleaved_warmup(pp, vpp, m, r) + 1, m * vpp),
    doc="interleaved 1F1B over --vpp chunks per rank (default at vpp>=2)",
)  # fmt: skip

SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED)
