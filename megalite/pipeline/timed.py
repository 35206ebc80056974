"""Timed runs of a schedule, with free communication: what the schedule's bubble really is.

Two simulations, for two questions:

- `compute_times(pp, vpp, m, placement, build)`: when would each compute of a builder's orders
  run if each started as soon as its rank is free and its inputs exist (data dependencies only,
  no communication yet)? The V schedules place their messages from this (`lockstep_table`).
- `run_table(table, pp, vpp, placement, cost)`: run every rank's whole action table as the
  executor runs it (actions.py: each run of send/recv actions posted as one batch, a WAIT
  blocking until the batch holding its receive completed, at most MAX_IN_FLIGHT batches in
  flight) and time it; the k-th send from rank a to rank b must be b's k-th receive from a. A
  table that mismatches or deadlocks raises `ScheduleError`; one that runs gives each rank's
  idle share of the step. verify.py proves schedules with it, and the V schedules' bubble
  theory is their own table run through it.

Both time a compute by the cost rule `actions.compute_seconds`.
"""

from functools import lru_cache

from megalite.pipeline.actions import (
    COMM,
    MAX_IN_FLIGHT,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    WAITS,
    Action,
    B,
    F,
    I,
    W,
    batch_order,
    compute_seconds,
    format_action,
    neighbours,
    owner,
    wait_for,
)

UNIT = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}  # the costs the V schedules are timed and verified at


class ScheduleError(AssertionError):
    """A schedule that would compute the wrong thing, hang, or exceed its memory bound."""


def locate(rank: int, i: int, a, vpp: int) -> str:
    """How an error names an action: `rank 1 action 4 (B0.1)`."""
    return f"rank {rank} action {i} ({format_action(a, vpp)})"


@lru_cache(maxsize=256)
def compute_times(pp: int, vpp: int, m: int, placement, build) -> tuple:
    """Every rank's computes of `build` in order, as (start, end, Action): each starts when its
    rank is free and its inputs are there (costs `UNIT`). Raises RuntimeError where no compute
    can start (an order that waits on itself)."""
    stages = pp * vpp
    orders = [[a for seg in build(pp, vpp, m, r) for a in seg] for r in range(pp)]
    done, free, pos, out = {}, [0.0] * pp, [0] * pp, [[] for _ in range(pp)]

    def deps(a, v):
        if a.kind == F:
            return [(F, v - 1, a.mb)] if v else []
        if a.kind in (I, B):  # (a B of the next stage counts as its I)
            return [(F, v, a.mb)] + ([(I, v + 1, a.mb)] if v < stages - 1 else [])
        return [(I, v, a.mb)]

    for _ in range(sum(map(len, orders))):
        best = None  # the rank whose next compute can start first
        for r in range(pp):
            if pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                v = placement(pp, vpp, r, a.chunk)
                need = deps(a, v)
                if all(d in done for d in need):
                    start = max([free[r]] + [done[d] for d in need])
                    if best is None or start < best[0]:
                        best = (start, r, a, v)
        if best is None:
            raise RuntimeError(f"schedule stuck (pp={pp} vpp={vpp} m={m})")
        start, r, a, v = best
        done[a.kind, v, a.mb] = free[r] = end = start + compute_seconds(a.kind, v, UNIT)
        if a.kind == B:  # a whole backward is its I and its W
            done[I, v, a.mb] = done[W, v, a.mb] = end
        out[r].append((start, end, a))
        pos[r] += 1
    return tuple(tuple(o) for o in out)


def lockstep_table(pp: int, vpp: int, timed: tuple, placement) -> list[list[Action]]:
    """Every rank's actions from a timed simulation, the communication in lockstep: a message
    is posted by its sender and its receiver in the batch at the time it is produced (every
    rank posts the batches of the same times in the same order), so no two ranks can wait on
    each other; a WAIT comes right before the compute that reads the message. The batches of
    messages produced while a compute runs are posted before it, after its WAIT: not in the
    batch its input comes in (a batch completes whole), not after it (the sender's later
    batches would wait)."""
    batches = [{} for _ in range(pp)]  # rank -> time -> [comm actions]
    for r, events in enumerate(timed):
        for _, end, a in events:
            recv, send = neighbours(a, pp, vpp, r, placement)
            if send is None:
                continue
            vs = placement(pp, vpp, r, a.chunk) + (1 if send.kind == SEND_F else -1)
            peer, chunk = owner(placement, pp, vpp, vs)
            kind = RECV_F if send.kind == SEND_F else RECV_B
            batches[r].setdefault(end, []).append(send)
            batches[peer].setdefault(end, []).append(Action(kind, chunk, a.mb, r))
    table = []
    for r, events in enumerate(timed):
        acts, times = [], sorted(batches[r])
        for start, end, a in events:
            while times and times[0] <= start:
                acts += sorted(batches[r][times.pop(0)], key=batch_order)
            recv, _ = neighbours(a, pp, vpp, r, placement)
            if recv is not None:
                acts.append(wait_for(recv, a))
            while times and times[0] < end:  # receives of messages sent while this runs
                acts += sorted(batches[r][times.pop(0)], key=batch_order)
            acts.append(a)
        for t in times:
            acts += sorted(batches[r][t], key=batch_order)
        table.append(acts)
    return table


def run_table(table, pp, vpp, placement, cost) -> tuple[list[int], list[float]]:
    """Pair sends with receives in posting order per directed rank pair, check the pairs agree,
    then run every rank as the executor does (module docstring), timing it with free
    communication and computes of cost[kind] / vpp (`cost` is per stage: a chunk holds 1/vpp of
    a stage's layers). Returns, per rank, the number of send/recv batches and the simulated
    idle fraction of the step; raises ScheduleError on a mismatch or a deadlock."""
    cost = {k: v / vpp for k, v in cost.items()}

    def seconds(a, r) -> float:
        return compute_seconds(a.kind, placement(pp, vpp, r, a.chunk), cost)

    batches, batch_of, busy = [], {}, []  # batches[r][j]: action indices posted together
    for r, acts in enumerate(table):
        bs, prev_comm = [], False
        for i, a in enumerate(acts):
            if a.kind in COMM:
                if not prev_comm:
                    bs.append([])
                bs[-1].append(i)
                batch_of[r, i] = len(bs) - 1
            prev_comm = a.kind in COMM
        batches.append(bs)
        busy.append(sum(seconds(a, r) for a in acts if a.kind in cost))

    # static matching: the k-th send a->b meets b's k-th recv from a
    sends, recvs = {}, {}
    for r, acts in enumerate(table):
        for i, a in enumerate(acts):
            if a.kind in (SEND_F, SEND_B):
                sends.setdefault((r, a.peer), []).append(i)
            elif a.kind in (RECV_F, RECV_B):
                recvs.setdefault((a.peer, r), []).append(i)
    partner = {}
    for pair in set(sends) | set(recvs):
        src, dst = pair
        s_list, r_list = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(s_list), len(r_list))):
            if k >= len(s_list):
                a = table[dst][r_list[k]]
                raise ScheduleError(f"{locate(dst, r_list[k], a, vpp)}: rank {src} never sends it")
            if k >= len(r_list):
                a = table[src][s_list[k]]
                raise ScheduleError(
                    f"{locate(src, s_list[k], a, vpp)}: rank {dst} never receives it"
                )
            s, rv = table[src][s_list[k]], table[dst][r_list[k]]
            vs = placement(pp, vpp, src, s.chunk)
            want_vs, want_kind = (vs + 1, RECV_F) if s.kind == SEND_F else (vs - 1, RECV_B)
            got_vs = placement(pp, vpp, dst, rv.chunk)
            if rv.kind != want_kind or rv.mb != s.mb or got_vs != want_vs:
                raise ScheduleError(
                    f"{locate(src, s_list[k], s, vpp)} is send #{k} from rank {src} to rank "
                    f"{dst}, but receive #{k} there is {locate(dst, r_list[k], rv, vpp)}"
                )
            partner[src, s_list[k]] = (dst, r_list[k])
            partner[dst, r_list[k]] = (src, s_list[k])
    recv_at = {  # (rank, kind of the wait, chunk, mb) -> index of the batch holding the receive
        (r, k, a.chunk, a.mb): batch_of[r, i]
        for r, acts in enumerate(table)
        for i, a in enumerate(acts)
        for k, rk in WAITS.items()
        if a.kind == rk
    }

    # Each rank runs its actions on a clock; its batches complete in order (`done`), the oldest
    # incomplete one being its active batch since `since`.
    pc, clock = [0] * pp, [0.0] * pp
    posted = [[None] * len(bs) for bs in batches]  # when each batch was posted
    done = [[None] * len(bs) for bs in batches]  # when each batch completed
    met = {}  # (rank, action index) -> when the operation met its partner
    head = [0] * pp  # each rank's oldest incomplete batch

    def active(r):
        """(index, since) of rank r's oldest incomplete posted batch, or None."""
        j = head[r]
        if j >= len(done[r]) or posted[r][j] is None:
            return None
        return j, max(posted[r][j], done[r][j - 1] if j else 0.0)

    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(table):  # run each rank until it blocks
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if a.kind in COMM:  # post the batch (maybe after bounding what is in flight)
                    j = batch_of[r, pc[r]]
                    if j >= MAX_IN_FLIGHT:
                        if done[r][j - MAX_IN_FLIGHT] is None:
                            break
                        clock[r] = max(clock[r], done[r][j - MAX_IN_FLIGHT])
                    posted[r][j] = clock[r]
                    pc[r] += len(batches[r][j])
                elif a.kind in WAITS:
                    d = done[r][recv_at[r, a.kind, a.chunk, a.mb]]
                    if d is None:
                        break
                    clock[r] = max(clock[r], d)
                    pc[r] += 1
                else:
                    clock[r] += seconds(a, r)
                    pc[r] += 1
                progress = True
        for r in range(pp):  # operations of two active batches meet
            if (act := active(r)) is None:
                continue
            for i in batches[r][act[0]]:
                pr, pi = partner[r, i]
                other = active(pr)
                if (r, i) not in met and other is not None and other[0] == batch_of[pr, pi]:
                    met[r, i] = met[pr, pi] = max(act[1], other[1])
        for r in range(pp):  # a batch whose operations all met is complete
            while (act := active(r)) is not None and all((r, i) in met for i in batches[r][act[0]]):
                done[r][act[0]] = max([act[1], *(met[r, i] for i in batches[r][act[0]])])
                head[r] += 1
                progress = True
    stuck = [r for r in range(pp) if pc[r] < len(table[r]) or None in done[r]]
    if stuck:
        lines = []
        for r in stuck:
            act = active(r)
            if act is None:
                i = pc[r]
                a = table[r][i]
                what = "the batch it waits for" if a.kind in WAITS else "an earlier batch"
                lines.append(f"{locate(r, i, a, vpp)} waits for {what}")
                continue
            i = next(i for i in batches[r][act[0]] if (r, i) not in met)
            pr, pi = partner[r, i]
            lines.append(
                f"{locate(r, i, table[r][i], vpp)} waits for {locate(pr, pi, table[pr][pi], vpp)}"
            )
        raise ScheduleError("deadlock: " + "; ".join(lines))
    end = [max([clock[r], *done[r]]) for r in range(pp)]
    step = max(end)
    return [len(bs) for bs in batches], [1.0 - busy[r] / step for r in range(pp)]
