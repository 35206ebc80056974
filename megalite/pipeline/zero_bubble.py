"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

A backward is split in two: I, the gradient with respect to the stage's input, which the
previous stage waits for, and W, the weight gradients, which nobody waits for. W can then fill
the slots where a stage would otherwise idle.

- `zb-h1`: one chunk per rank, at most as many activations alive as 1F1B (p - r on rank r); W
  fills the cool-down. With F, I and W of equal time the first stage idles (p-1)/3m of its
  compute, a third of 1F1B's (p-1)/m.
- `zbv`: two chunks per rank in a V (chunk 0 at virtual stage r, chunk 1 at 2p-1-r), so the
  first and the last stage share rank 0; with 2p chunk activations alive at most (1F1B's
  memory) the bubble is close to zero.

ZB-V is built from one timed simulation of every rank with costs F = I = W = 1 per chunk
(the first stage's I empty, its W the whole backward: the executor's), each rank taking, whenever it is free, a ready I first (someone waits for it),
then a ready F if its activation budget allows, else a ready W. Each rank's order of computes
is read off the simulation; `schedules.with_comms` adds the communication and `verify.py` proves
the result (matching, no deadlock, the activation bound) for every shape it is run on.
"""

from functools import lru_cache

from megalite.pipeline.schedules import (
    RECV_B,
    RECV_F,
    SEND_F,
    WAIT_B,
    WAIT_F,
    Action,
    F,
    I,
    Schedule,
    W,
    _batch_order,
    neighbours,
    owner,
    register_schedule,
)


def v_placement(pp: int, vpp: int, rank: int, chunk: int) -> int:
    """The V: chunk 0 on ranks 0..pp-1 in order, chunk 1 back from pp-1 to 0."""
    return rank if chunk == 0 else 2 * pp - 1 - rank


@lru_cache(maxsize=256)
def _simulate(pp: int, vpp: int, m: int, placement, budget: tuple) -> tuple:
    """Every rank's computes in order, as (start, end, Action), from a greedy timed
    simulation (module docstring). budget[r]: the most chunk activations rank r may hold
    (forwarded, W not yet done)."""
    stages = pp * vpp
    at = [owner(placement, pp, vpp, v) for v in range(stages)]  # virtual stage -> (rank, chunk)
    order = [[] for _ in range(pp)]
    free = [0.0] * pp  # when each rank is next idle
    live = [0] * pp

    def deps(kind, v, k):
        if kind == F:
            return [(F, v - 1, k)] if v else []
        if kind == I:
            return [(F, v, k)] + ([(I, v + 1, k)] if v < stages - 1 else [])
        return [(I, v, k)]

    waiting, after = {}, {}  # task -> inputs not done yet; task -> the tasks that need it
    ready = [{} for _ in range(pp)]  # per rank: task -> when its inputs are all there
    for v in range(stages):
        for k in range(m):
            for kind in (F, I, W):
                task, need = (kind, v, k), deps(kind, v, k)
                waiting[task] = len(need)
                for d in need:
                    after.setdefault(d, []).append(task)
                if not need:
                    ready[at[v][0]][task] = 0.0
    left = len(waiting)
    while left:
        # the rank that can start first picks its next compute among what is ready by then
        best = None
        for r in range(pp):
            options = [
                # I before F before W; the oldest micro-batch first; the deeper stage first
                (max(t, free[r]), {I: 0, F: 1, W: 2}[kind], k, -v, kind, v)
                for (kind, v, k), t in ready[r].items()
                if kind != F or live[r] < budget[r]
            ]
            if options:
                choice = min(options)
                if best is None or choice[0] < best[1][0]:
                    best = (r, choice)
        if best is None:
            raise RuntimeError(f"zero-bubble simulation stuck (pp={pp} vpp={vpp} m={m})")
        r, (start, _, k, _, kind, v) = best
        end = start + _time(kind, v)
        free[r], left = end, left - 1
        live[r] += 1 if kind == F else -1 if kind == W else 0
        del ready[r][kind, v, k]
        order[r].append((start, end, Action(kind, at[v][1], k)))
        for task in after.get((kind, v, k), []):
            waiting[task] -= 1
            if not waiting[task]:
                ready[at[task[1]][0]][task] = end  # (the last input is the latest one)
    return tuple(tuple(o) for o in order)


def _time(kind, vstage: int) -> float:
    """F = I = W = 1, but the first virtual stage has no input gradient to pass on: the
    executor leaves its I empty and does the whole backward in its W (as verify.py models)."""
    if vstage == 0 and kind != F:
        return 0.0 if kind == I else 2.0
    return 1.0


def lockstep_table(pp: int, vpp: int, timed: tuple, placement) -> list[list[Action]]:
    """Every rank's actions from a timed simulation, the communication in lockstep: a message
    is posted by its sender and its receiver in the batch at the time it is produced (every
    rank posts the batches of the same times in the same order), so no two ranks can wait on
    each other; a WAIT comes right before the compute that reads the message."""
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
        for start, _, a in events:
            while times and times[0] <= start:
                acts += sorted(batches[r][times.pop(0)], key=_batch_order)
            recv, _ = neighbours(a, pp, vpp, r, placement)
            if recv is not None:
                acts.append(Action(WAIT_F if recv.kind == RECV_F else WAIT_B, a.chunk, a.mb))
            acts.append(a)
        for t in times:
            acts += sorted(batches[r][t], key=_batch_order)
        table.append(acts)
    return table


def zb_h1_order(pp: int, vpp: int, microbatches: int, rank: int):
    """1F1B's warm-up and steady state with each backward split in I and W, the W of
    micro-batch k put off until after the I of k + rank: rank r then holds at most pp
    activations (1F1B's first stage), and the put-off W's fill the cool-down's waits."""
    warmup, m = min(pp - rank - 1, microbatches), microbatches
    out = [Action(F, 0, k) for k in range(warmup)]
    for k in range(m):
        if warmup + k < m:
            out.append(Action(F, 0, warmup + k))
        out.append(Action(I, 0, k))
        if k >= rank:
            out.append(Action(W, 0, k - rank))
    out += [Action(W, 0, k) for k in range(max(0, m - rank), m)]
    return [[a] for a in out]


def _zbv_budget(pp: int, m: int) -> tuple:
    return tuple(min(2 * pp, 2 * m) for _ in range(pp))


def zbv_order(pp: int, vpp: int, microbatches: int, rank: int):
    timed = _simulate(pp, 2, microbatches, v_placement, _zbv_budget(pp, microbatches))
    return [[a] for _, _, a in timed[rank]]


@lru_cache(maxsize=256)
def zbv_bubble(pp: int, vpp: int, microbatches: int) -> float:
    """The first stage's idle over compute time when its table runs as the executor runs it
    (verify.py's timed simulation, F = I = W = 1): the paper's ZB-V reaches zero in the
    steady state; the greedy warm-up and cool-down leave a little."""
    from megalite.pipeline.verify import verify_table  # (verify imports this module's registry)

    table = zbv_table(pp, 2, microbatches)
    report = verify_table(table, pp, 2, microbatches, placement=v_placement,
                          cost={F: 1.0, I: 1.0, W: 1.0})  # fmt: skip
    idle = report.idle[0]
    return idle / (1 - idle)


def zbv_table(pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    timed = _simulate(pp, 2, microbatches, v_placement, _zbv_budget(pp, microbatches))
    return lockstep_table(pp, 2, timed, v_placement)


def _zb_h1_check(pp, vpp, m):
    return None if vpp == 1 else f"the zb-h1 schedule runs one chunk per rank, not --vpp {vpp}"


def _zbv_check(pp, vpp, m):
    return (
        None
        if vpp == 2
        else f"the zbv schedule runs two chunks per rank in a V: --vpp 2, not {vpp}"
    )


register_schedule(Schedule(
    "zb-h1", zb_h1_order, _zb_h1_check, lambda pp, vpp, m, r: min(pp, m),
    # the first stage idles (p-1)(F + I - W) against m(F + I + W) of compute (F = I = W), and
    # with fewer micro-batches than stages one more F + I for each one missing
    bubble=lambda pp, vpp, m: (pp - 1 + max(0, pp - m)) / (3 * m),
    cost={F: 1.0, I: 1.0, W: 1.0},
    doc="zero bubble H1: 1F1B's memory, W fills the cool-down (backward split in I and W)",
))  # fmt: skip
register_schedule(Schedule(
    "zbv", zbv_order, _zbv_check, lambda pp, vpp, m, r: min(2 * pp, 2 * m),
    bubble=zbv_bubble,
    placement=v_placement,
    table=zbv_table,
    cost={F: 1.0, I: 1.0, W: 1.0},
    doc="zero bubble V: two chunks per rank in a V (--vpp 2), ~no bubble at 1F1B's memory",
))  # fmt: skip
