"""Static checks on a pipeline schedule: the whole action table of all ranks, as data.

`verify_table(table, pp, vpp, m)` proves, or raises `ScheduleError` naming the rank and action:

- every action is well formed (chunk, micro-batch and peer in range; the peer is the neighbour
  that virtual stage really talks to);
- on every rank, each (chunk, micro-batch) is forwarded once and backwarded once, its forward
  before its backward, each compute after the wait for the receive of its input (or, when the
  neighbouring stage is on this rank, after the local compute that produces it), each wait
  after its receive was posted, each send after the compute that produced its tensor;
- the k-th send from rank a to rank b is the tensor that b's k-th receive from a expects
  (same kind, micro-batch, and the next or previous virtual stage): point-to-point messages
  between two ranks are matched in posting order on gloo and NCCL alike, and every tensor has
  the same shape, so a mismatch would otherwise corrupt silently;
- there is no deadlock when the ranks run as the executor runs them (actions.py): each run of
  consecutive comm actions is posted as one batch without waiting; a rank's batches complete
  in posting order (a stream), each only when every operation in it has met its partner in the
  peer's oldest incomplete batch (rendezvous: a send never completes on its own, stricter than
  any real backend); a rank blocks at a WAIT until the batch holding that receive completed,
  and before posting batch j until batch j - MAX_IN_FLIGHT completed; at the end of the step it
  waits for all. A table that passes cannot hang. (The matching and this run are
  `timed.run_table`.)

It reports, per rank, in a `Report`:

- the peak number of live activations (forwarded, not yet backwarded);
- the idle fraction of each rank's step in a timed run of the same simulation (the schedule's
  cost per compute kind over vpp, by default F = 1/vpp, B = 2/vpp, free communication): the
  schedule's real bubble, which on the first stage equals its theory `bubble_theory` as a share
  of the step, b/(1+b) ((pp-1)/(vpp*m + pp-1) for 1F1B and interleaved; tested), so a correct
  but serialising schedule shows up too.

`verify(name, pp, vpp, m)` builds the schedule's table, runs the checks, and also compares each
rank's peak with the schedule's bound (`peak_bound`).
"""

from dataclasses import dataclass

from megalite.pipeline.actions import (
    COMM,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    WAIT_B,
    WAIT_F,
    WAITS,
    B,
    F,
    I,
    W,
    interleaved_placement,
    megatron_bubble,
    owner,
)
from megalite.pipeline.schedules import get_schedule, schedule
from megalite.pipeline.timed import ScheduleError, locate, run_table


@dataclass
class Report:
    pp: int
    vpp: int
    microbatches: int
    peak_activations: list[int]  # per rank: most (chunk, micro-batch) forwarded, not backwarded
    batches: list[int]  # per rank: number of send/recv batches (p2p round trips)
    idle: list[float]  # per rank: simulated idle fraction of the step (the cost, free p2p)
    # the first stage's idle over compute in theory: Megatron's (pp-1)/(vpp*m) from
    # `verify_table`, the schedule's own `bubble_theory` from `verify`
    bubble_theory: float


def peak_bound(name: str, pp: int, vpp: int, microbatches: int, rank: int) -> int:
    """The live activations schedule `name` promises on `rank` (from the registry)."""
    return schedule(name).peak(pp, vpp, microbatches, rank)


def verify(name: str, pp: int, vpp: int, microbatches: int, forward_only: bool = False) -> Report:
    """Check registered schedule `name` at this shape: every rank's table (`verify_table`, at
    the schedule's placement and cost) and each rank's peak against the schedule's bound; the
    report carries the schedule's own bubble theory."""
    table = [get_schedule(name, pp, vpp, microbatches, r, forward_only) for r in range(pp)]
    s = schedule(name)
    report = verify_table(table, pp, vpp, microbatches, forward_only, s.placement, s.cost)
    report.bubble_theory = s.bubble(pp, vpp, microbatches)
    if not forward_only:
        for r, peak in enumerate(report.peak_activations):
            bound = peak_bound(name, pp, vpp, microbatches, r)
            if peak != bound:
                raise ScheduleError(
                    f"{name} pp={pp} vpp={vpp} m={microbatches}: rank {r} holds {peak} live "
                    f"activations at peak, the schedule's bound is {bound}"
                )
    return report


def verify_table(
    table: list[list], pp: int, vpp: int, microbatches: int, forward_only: bool = False,
    placement=interleaved_placement, cost=None,
) -> Report:  # fmt: skip
    """Check the action table of every rank (see the module docstring). `placement` maps
    (pp, vpp, rank, chunk) to virtual stages; `cost` gives the simulated time of each compute
    kind for a whole stage (default F=1, B=2)."""
    if len(table) != pp:
        raise ScheduleError(f"the table has {len(table)} ranks, expected pp={pp}")
    peaks = [
        _check_rank(acts, r, pp, vpp, microbatches, forward_only, placement)
        for r, acts in enumerate(table)
    ]
    batches, idle = run_table(table, pp, vpp, placement, cost or {F: 1.0, B: 2.0})
    return Report(
        pp, vpp, microbatches, peaks, batches, idle, megatron_bubble(pp, vpp, microbatches)
    )


def _check_rank(acts, rank, pp, vpp, m, forward_only, placement) -> int:
    """Per-rank order and completeness; returns the peak of live activations."""
    last = pp * vpp - 1
    # state per (chunk, mb) and per kind: seen once at most
    seen = {kind: set() for kind in (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, WAIT_F, WAIT_B)}

    def remote(vs: int) -> int | None:
        """The chunk on this rank holding virtual stage vs, or None when another rank does."""
        r, c = owner(placement, pp, vpp, vs)
        return c if r == rank else None

    def arrived(a, vs: int, wait_kind, local_kinds) -> bool:
        """Has compute a's input from neighbouring virtual stage vs arrived (waited for)?"""
        c = remote(vs)
        if c is None:
            return (a.chunk, a.mb) in seen[wait_kind]
        return any((c, a.mb) in seen[k] for k in local_kinds)

    live = peak = 0
    for i, a in enumerate(acts):
        where = locate(rank, i, a, vpp)
        if a.kind not in seen:
            raise ScheduleError(f"{where}: unknown action kind {a.kind!r}")
        if forward_only and a.kind in (B, I, W, SEND_B, RECV_B, WAIT_B):
            raise ScheduleError(f"{where}: a gradient in a forward-only schedule")
        if not (0 <= a.chunk < vpp and 0 <= a.mb < m):
            raise ScheduleError(f"{where}: chunk or micro-batch out of range (vpp={vpp}, m={m})")
        key = (a.chunk, a.mb)
        if key in seen[a.kind]:
            raise ScheduleError(f"{where}: repeated")
        vs = placement(pp, vpp, rank, a.chunk)
        if a.kind in COMM:
            towards_next = a.kind in (SEND_F, RECV_B)
            if vs == (last if towards_next else 0):
                raise ScheduleError(f"{where}: virtual stage {vs} has no neighbour that way")
            want = owner(placement, pp, vpp, vs + 1 if towards_next else vs - 1)[0]
            if want == rank:
                raise ScheduleError(f"{where}: its neighbour is on this rank (a local hand-over)")
            if a.peer != want:
                raise ScheduleError(f"{where}: wrong peer, expected rank {want}")
        if a.kind in WAITS:
            if key not in seen[WAITS[a.kind]]:
                what = "forward" if a.kind == WAIT_F else "backward"
                raise ScheduleError(
                    f"{where}: {what} before its input arrived: it waits for a receive never posted"
                )
        elif a.kind == F:
            if vs > 0 and not arrived(a, vs - 1, WAIT_F, (F,)):
                raise ScheduleError(f"{where}: forward before its input arrived")
            live += 1
            peak = max(peak, live)
        elif a.kind in (B, I):  # the input gradient: a full backward, or its first half
            if key not in seen[F]:
                raise ScheduleError(f"{where}: backward before its forward")
            if key in seen[B] or key in seen[I]:
                raise ScheduleError(f"{where}: a second backward of the same micro-batch")
            if vs < last and not arrived(a, vs + 1, WAIT_B, (B, I)):
                raise ScheduleError(f"{where}: backward before its output gradient arrived")
            live -= a.kind == B
        elif a.kind == W:  # the weight gradients: after the input gradient, frees the activations
            if key not in seen[I]:
                raise ScheduleError(f"{where}: weight gradient before its input gradient (I)")
            live -= 1
        elif a.kind == SEND_F and key not in seen[F]:
            raise ScheduleError(f"{where}: sends an activation not computed yet")
        elif a.kind == SEND_B and key not in seen[B] and key not in seen[I]:
            raise ScheduleError(f"{where}: sends a gradient not computed yet")
        seen[a.kind].add(key)
    everything = {(c, k) for c in range(vpp) for k in range(m)}
    if not forward_only and seen[I] != seen[W]:
        missing = sorted(seen[I] ^ seen[W])[:4]
        raise ScheduleError(f"rank {rank}: an I without its W, or the reverse, for {missing}")
    backward = seen[B] | seen[I]
    for kind, got in ((F, seen[F]),) if forward_only else ((F, seen[F]), (B, backward)):
        if got != everything:
            missing = sorted(everything - got)[:4]
            raise ScheduleError(f"rank {rank}: no {kind} for (chunk, micro-batch) {missing}")
    for kind, step in ((SEND_F, 1),) if forward_only else ((SEND_F, 1), (SEND_B, -1)):
        want = set()
        for c, k in everything:
            vs = placement(pp, vpp, rank, c) + step
            if 0 <= vs <= last and remote(vs) is None:
                want.add((c, k))
        if seen[kind] != want:
            missing = sorted(want - seen[kind])[:4]
            raise ScheduleError(f"rank {rank}: no {kind} for (chunk, micro-batch) {missing}")
    return peak
