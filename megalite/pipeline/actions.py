"""The vocabulary of pipeline schedules: action kinds, `Action`, placements, where communication
goes, the cost rule, and `Schedule`, what a registered schedule is. Builders (one_f_one_b.py,
zero_bubble.py), the registry (schedules.py), the verifier and the executor all speak it.

A schedule is built in two steps. First the *compute order* of one rank: its forwards F and
backwards B of (chunk, micro-batch). Then `with_comms` inserts the point-to-point actions
around each compute: the sends of a compute's output and the receive of the next segment's
inputs form one batch between the two (Megatron's send_forward_recv_backward and friends), and
a WAIT right before each compute whose input comes from another rank. Posting is separate from
waiting: the executor posts each run of consecutive send/recv actions as one batch and goes on;
it blocks only at a WAIT (for the batch holding that receive) and, to bound what is in flight,
before posting a batch while the batch MAX_IN_FLIGHT back is still incomplete; the rest
completes in the background (sends are never waited for in the step, only at its end). So a
receive needed by the second compute of a segment (interleaved: a forward, then a backward)
arrives while the first one runs. `verify.py` proves, under these semantics and with batches
completing in posting order (NCCL's stream order), that no schedule deadlocks and that every
send meets the receive it is meant for.

Where the layers live is the schedule's *placement*: chunk c of rank r holds virtual stage
`placement(pp, vpp, r, c)`; Megatron's interleaving is c*pp + r. Activations flow to virtual
stage + 1 and gradients to virtual stage - 1; a neighbour on the same rank (pp == 1, or a
V-shaped placement's turn) is handed the tensor locally, with no communication.
"""

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache


class Kind(str, enum.Enum):
    """What an action does. Compute: F forward, B full backward, I input-gradient backward,
    W weight-gradient backward (zero-bubble schedules split B into I then W). Communication
    (posted as one batch per run of consecutive actions): activations towards the next
    stage, gradients towards the previous one."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the papers' name
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    WAIT_F = "WAIT_F"  # block until the posted receive of (chunk, mb)'s activation completed
    WAIT_B = "WAIT_B"  # the same for its gradient

    def __str__(self) -> str:
        return self.value


F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
WAIT_F, WAIT_B = Kind.WAIT_F, Kind.WAIT_B
COMPUTE = (F, B, I, W)
BACKWARD = (B, I)  # the computes that produce the gradient sent to the previous stage
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)  # posted as one batch per run of consecutive actions
WAITS = {WAIT_F: RECV_F, WAIT_B: RECV_B}  # each wait and the receive it waits for
# Before posting batch j the executor waits for batch j - MAX_IN_FLIGHT: sends then hold at
# most that many batches of activations alive, and the verifier models the same rule.
MAX_IN_FLIGHT = 3


@dataclass(frozen=True, slots=True)
class Action:
    kind: Kind
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
    if a.kind in WAITS:
        return f"w{a.kind.value[-1]}{label}"
    arrow = ">" if a.kind in (SEND_F, SEND_B) else "<"
    return f"{a.kind.value[0].lower()}{a.kind.value[-1]}{label}{arrow}{a.peer}"


def format_actions(actions: list[Action], chunks: int = 1, comms: bool = False) -> str:
    """One rank's schedule on one line: `F0 F1 B0 F2 B1 ...`; with `comms`, each batch of
    send/recv actions in brackets: `F0 [sF0>1 rB0<1] B0 ...` (waits are implied: right before
    the compute that reads a received tensor)."""
    out, batch = [], []
    for a in actions:
        if a.kind in WAITS:
            continue
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


# ---- placements: (pp, vpp, rank, chunk) -> virtual stage ---------------------------------------


def interleaved_placement(pp: int, vpp: int, rank: int, chunk: int) -> int:
    """Megatron's interleaving: chunk c of rank r is virtual stage c*pp + r."""
    return chunk * pp + rank


def v_placement(pp: int, vpp: int, rank: int, chunk: int) -> int:
    """The V: chunk 0 on ranks 0..pp-1 in order, chunk 1 back from pp-1 to 0."""
    return rank if chunk == 0 else 2 * pp - 1 - rank


@lru_cache(maxsize=65536)  # the planner's search asks it for every action of every schedule
def owner(placement, pp: int, vpp: int, vstage: int) -> tuple[int, int]:
    """(rank, chunk) holding a virtual stage: the inverse of a placement."""
    for r in range(pp):
        for c in range(vpp):
            if placement(pp, vpp, r, c) == vstage:
                return r, c
    raise ValueError(f"no (rank, chunk) holds virtual stage {vstage} (pp={pp}, vpp={vpp})")


# ---- communication -------------------------------------------------------------------------


def neighbours(a: Action, pp: int, vpp: int, rank: int, placement=interleaved_placement):
    """(the receive a compute needs before it, the send of its result after it); None where the
    neighbour is on this rank (a local hand-over) or absent (the first or last stage)."""
    if a.kind == W:
        return None, None  # weight gradients stay where they are
    vs, last = placement(pp, vpp, rank, a.chunk), pp * vpp - 1
    prev = owner(placement, pp, vpp, vs - 1)[0] if vs > 0 else None
    nxt = owner(placement, pp, vpp, vs + 1)[0] if vs < last else None
    prev, nxt = (None if p == rank else p for p in (prev, nxt))
    if a.kind == F:
        recv = Action(RECV_F, a.chunk, a.mb, prev) if prev is not None else None
        send = Action(SEND_F, a.chunk, a.mb, nxt) if nxt is not None else None
    else:
        recv = Action(RECV_B, a.chunk, a.mb, nxt) if nxt is not None else None
        send = Action(SEND_B, a.chunk, a.mb, prev) if prev is not None else None
    return recv, send


def batch_order(a: Action) -> int:
    """Where a comm action goes within its batch: sends before receives, activations before
    gradients (so two ranks exchanging both post them in the same order)."""
    return (SEND_F, SEND_B, RECV_F, RECV_B).index(a.kind)


def wait_for(recv: Action, a: Action) -> Action:
    """The WAIT that goes right before compute `a`, whose input `recv` brings."""
    return Action(WAIT_F if recv.kind == RECV_F else WAIT_B, a.chunk, a.mb)


def with_comms(segments, pp: int, vpp: int, rank: int, placement=interleaved_placement):
    """Insert send/recv actions: between two segments of computes one batch holding the sends
    of the first segment's results and the receives of the second segment's inputs. Pairing
    them is what keeps neighbours from deadlocking: in the steady state of 1F1B rank r posts
    [send F, recv B] while rank r+1 posts [send B, recv F]. In a batch activations come before
    gradients, so two ranks exchanging both (pp=2) post them in the same order."""
    out, pending = [], []
    for seg in segments:
        recvs, sends = zip(*(neighbours(a, pp, vpp, rank, placement) for a in seg))
        batch = pending + [x for x in recvs if x is not None]
        out += sorted(batch, key=batch_order)
        for a, recv in zip(seg, recvs):
            if recv is not None:  # wait for this compute's input right before it
                out.append(wait_for(recv, a))
            out.append(a)
        pending = [x for x in sends if x is not None]
    return out + sorted(pending, key=batch_order)


def align_receives(table: list[list[Action]]) -> list[list[Action]]:
    """Messages between two ranks are matched in posting order, so a rank must post its
    receives from a peer in the order the peer sends. Where one directed pair of ranks carries
    two streams (a V placement: activations of chunk 0 and gradients of chunk 1 both go from
    rank r to r+1), the consumer may need them in another order: such a receive is posted
    earlier, beside the one that comes first (its wait stays before its compute)."""
    sent = {}  # (sender, receiver) -> the messages in sending order: (kind, chunk-free key)
    for r, acts in enumerate(table):
        for a in acts:
            if a.kind in (SEND_F, SEND_B):
                sent.setdefault((r, a.peer), []).append(a)
    out = []
    for r, acts in enumerate(table):
        # each receive, by the send it matches: the message (kind, mb) from the peer's chunk
        recv_of = {}
        for a in acts:
            if a.kind in (RECV_F, RECV_B):
                recv_of.setdefault((a.peer, a.kind, a.mb), []).append(a)
        expected = {
            peer: list(sent.get((peer, r), []))
            for peer in {a.peer for a in acts if a.peer is not None}
        }
        done, new = set(), []
        for a in acts:
            if a.kind not in (RECV_F, RECV_B):
                new.append(a)
                continue
            if id(a) in done:
                continue
            queue = expected[a.peer]
            while True:  # post every receive the peer sends before this one, then this one
                s = queue.pop(0)
                kind = RECV_F if s.kind == SEND_F else RECV_B
                match = next(x for x in recv_of[a.peer, kind, s.mb] if id(x) not in done)
                done.add(id(match))
                new.append(match)
                if match is a:
                    break
        out.append(new)
    return out


# ---- cost and theory -------------------------------------------------------------------------


def compute_seconds(kind: Kind, vstage: int, cost: dict) -> float:
    """A compute's time in a timed run of a schedule: cost[kind], but the first virtual stage
    has no input gradient to pass on: the executor leaves its I empty and does the whole
    backward in its W."""
    if vstage == 0 and kind in (I, W):
        return 0.0 if kind == I else cost[I] + cost[W]
    return cost[kind]


def megatron_bubble(pp: int, vpp: int, microbatches: int) -> float:
    """Megatron's bubble: the first stage's idle time over its compute time, (pp-1)/(vpp*m)."""
    return (pp - 1) / (vpp * microbatches)


@dataclass(frozen=True)
class Schedule:
    """A schedule: its builder and what the checks, the planner and the shape need to know."""

    name: str
    build: Callable  # (pp, vpp, m, rank) -> compute segments ([[Action]])
    check: Callable  # (pp, vpp, m) -> why this shape is invalid, or None
    peak: Callable  # (pp, vpp, m, rank) -> the live activations the schedule promises
    bubble: Callable = megatron_bubble  # (pp, vpp, m) -> first stage's idle / compute, in theory
    placement: Callable = interleaved_placement  # (pp, vpp, rank, chunk) -> virtual stage
    cost: dict = field(default_factory=lambda: {F: 1.0, B: 2.0, I: 1.0, W: 1.0})  # per stage
    doc: str = ""
    # (pp, vpp, m) -> every rank's actions with their communication, for a schedule that
    # places its own (default: with_comms around the segments of `build`)
    table: Callable | None = None
    # the chunks per rank the schedule always runs (a V: 2), or None where --vpp chooses
    chunks: int | None = None

    def vpp(self, given: int) -> int:
        """The chunks per rank to run when --vpp is `given`: the schedule's own where it fixes
        them and `given` is the default 1 (`--pp-schedule zbv` needs no `--vpp 2`), else
        `given` (a wrong one is then refused by `check`)."""
        return self.chunks if self.chunks is not None and given == 1 else given
