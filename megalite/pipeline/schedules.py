"""Pipeline schedules as pure functions: (pp, vpp, microbatches, rank) -> list[Action].

A schedule is built in two steps. First the *compute order* of one rank: its forwards F and
backwards B of (chunk, micro-batch). Then `with_comms` inserts the point-to-point actions
around each compute: the sends of a compute's output and the receive of the next compute's
input form one batch between the two (Megatron's send_forward_recv_backward and friends).
The executor posts each run of consecutive send/recv actions as one batch and waits for all of
it before the next compute; `verify.py` proves, with rendezvous semantics, that this cannot
deadlock and that every send meets the receive it is meant for.

Chunk c of rank r is virtual stage c*pp + r (see partition.py). Forward activations flow to
virtual stage + 1, gradients to virtual stage - 1; with pp == 1 both neighbours are on this
rank and no communication is needed (the executor hands tensors over locally).
"""

from dataclasses import dataclass

from megalite.errors import MegaliteError

F, B = "F", "B"  # compute
SEND_F, RECV_F = "SEND_F", "RECV_F"  # activations, towards the next stage
SEND_B, RECV_B = "SEND_B", "RECV_B"  # gradients, towards the previous stage
COMPUTE = (F, B)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # one of F, B, SEND_F, RECV_F, SEND_B, RECV_B
    chunk: int  # the local model chunk the tensor belongs to (produces it or consumes it)
    mb: int  # micro-batch index
    peer: int | None = None  # pipeline rank at the other end (comm actions only)

    def __str__(self) -> str:
        return format_action(self, chunks=2)


def format_action(a: Action, chunks: int = 1) -> str:
    """`F3`, `B3.1` (micro-batch 3, chunk 1, when there are several chunks), `sF3>1`
    (send activations of micro-batch 3 to rank 1), `rB3<1` (receive its gradient from rank 1)."""
    label = f"{a.mb}.{a.chunk}" if chunks > 1 else f"{a.mb}"
    if a.kind in COMPUTE:
        return f"{a.kind}{label}"
    arrow = ">" if a.kind.startswith("SEND") else "<"
    return f"{a.kind[0].lower()}{a.kind[-1]}{label}{arrow}{a.peer}"


def format_actions(actions: list[Action], chunks: int = 1, comms: bool = False) -> str:
    """One rank's schedule on one line: `F0 F1 B0 F2 B1 ...`; with `comms`, each batch of
    send/recv actions in brackets: `F0 [sF0>1 rB0<1] B0 ...`."""
    out, batch = [], []
    for a in actions:
        if a.kind in COMM:
            batch.append(format_action(a, chunks))
            continue
        if batch and comms:
            out.append("[" + " ".join(batch) + "]")
        batch = []
        out.append(format_action(a, chunks))
    if batch and comms:
        out.append("[" + " ".join(batch) + "]")
    return " ".join(out)


def format_table(name: str, pp: int, vpp: int, microbatches: int, comms: bool = False) -> str:
    """Every rank's schedule, one line per rank."""
    return "\n".join(
        f"rank {r}: " + format_actions(get_schedule(name, pp, vpp, microbatches, r), vpp, comms)
        for r in range(pp)
    )


# ---- compute orders ------------------------------------------------------------------------


def gpipe_order(pp: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards (in the same micro-batch order): m activations live."""
    m = range(microbatches)
    return [[Action(F, 0, k)] for k in m] + [[Action(B, 0, k)] for k in m]


def one_f_one_b_order(pp: int, microbatches: int, rank: int) -> list[list[Action]]:
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
    if microbatches % pp:
        raise MegaliteError(
            f"the interleaved schedule needs the micro-batches per step ({microbatches}) to be a "
            f"multiple of pp={pp}"
        )
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


# ---- communication -------------------------------------------------------------------------


def _neighbours(a: Action, pp: int, vpp: int, rank: int) -> tuple[Action | None, Action | None]:
    """(the receive a compute needs before it, the send of its result after it)."""
    if pp == 1:
        return None, None  # the neighbouring chunk is on this rank: a local hand-over
    vs, last = a.chunk * pp + rank, pp * vpp - 1
    nxt, prev = (rank + 1) % pp, (rank - 1) % pp
    if a.kind == F:
        recv = Action(RECV_F, a.chunk, a.mb, prev) if vs > 0 else None
        send = Action(SEND_F, a.chunk, a.mb, nxt) if vs < last else None
    else:
        recv = Action(RECV_B, a.chunk, a.mb, nxt) if vs < last else None
        send = Action(SEND_B, a.chunk, a.mb, prev) if vs > 0 else None
    return recv, send


def with_comms(segments: list[list[Action]], pp: int, vpp: int, rank: int) -> list[Action]:
    """Insert send/recv actions: between two segments of computes one batch holding the sends
    of the first segment's results and the receives of the second segment's inputs. Pairing
    them is what keeps neighbours from deadlocking: in the steady state of 1F1B rank r posts
    [send F, recv B] while rank r+1 posts [send B, recv F]. In a batch activations come before
    gradients, so two ranks exchanging both (pp=2) post them in the same order."""
    out, pending = [], []
    for seg in segments:
        recvs, sends = zip(*(_neighbours(a, pp, vpp, rank) for a in seg))
        batch = pending + [x for x in recvs if x is not None]
        out += sorted(batch, key=_batch_order) + seg
        pending = [x for x in sends if x is not None]
    return out + sorted(pending, key=_batch_order)


def _batch_order(a: Action) -> int:
    return (SEND_F, SEND_B, RECV_F, RECV_B).index(a.kind)


def compute_order(name: str, pp: int, vpp: int, microbatches: int, rank: int) -> list[list[Action]]:
    """One rank's computes, in segments: communication happens only between segments."""
    if name not in SCHEDULES:
        raise MegaliteError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")
    if pp < 1 or vpp < 1 or microbatches < 1 or not 0 <= rank < pp:
        raise MegaliteError(
            f"bad pipeline shape pp={pp} vpp={vpp} microbatches={microbatches} rank={rank}"
        )
    if name == "interleaved":
        if vpp < 2:
            raise MegaliteError("the interleaved schedule needs vpp >= 2")
        return interleaved_order(pp, vpp, microbatches, rank)
    if vpp != 1:
        raise MegaliteError(
            f"the {name} schedule runs one chunk per rank; use interleaved for vpp={vpp}"
        )
    if name == "gpipe":
        return gpipe_order(pp, microbatches)
    return one_f_one_b_order(pp, microbatches, rank)


def get_schedule(
    name: str, pp: int, vpp: int, microbatches: int, rank: int, forward_only: bool = False
) -> list[Action]:
    """The actions of pipeline rank `rank`. `forward_only` (evaluation): the schedule's
    forwards in the same order, with their communication, and no backward."""
    segments = compute_order(name, pp, vpp, microbatches, rank)
    if forward_only:
        segments = [[a] for seg in segments for a in seg if a.kind == F]
    return with_comms(segments, pp, vpp, rank)


def bubble_theory(pp: int, vpp: int, microbatches: int) -> float:
    """Megatron's bubble fraction: idle time over ideal compute time, (pp-1)/(vpp*m)."""
    return (pp - 1) / (vpp * microbatches)


def idle_theory(pp: int, vpp: int, microbatches: int) -> float:
    """The same bubble as a fraction of the whole step (what a stage measures as idle time):
    (pp-1)/(vpp*m + pp-1)."""
    return (pp - 1) / (vpp * microbatches + pp - 1)
