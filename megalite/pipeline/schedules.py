"""The schedule registry: name -> `Schedule`, and every rank's actions of a registered one.

The builders live in their families (one_f_one_b.py: gpipe, 1f1b, interleaved; zero_bubble.py:
zb-h1, zbv, dualpipev) and speak the vocabulary of actions.py; this module lists them and
builds each rank's action table: the compute order, its communication (`with_comms`, or the
schedule's own `table`), receives posted in the order the peer sends (`align_receives`).

Adding a schedule is one `register_schedule` call: config choices, `validate`, the verifier,
the planner and the timeline all read the registry.
"""

from functools import lru_cache

from megalite.errors import MegaliteError
from megalite.pipeline import one_f_one_b, zero_bubble
from megalite.pipeline.actions import (
    RECV_F,
    SEND_F,
    WAIT_F,
    Action,
    F,
    Kind,
    Schedule,
    align_receives,
    format_actions,
    megatron_bubble,
    with_comms,
)

SCHEDULES: dict[str, Schedule] = {}


def register_schedule(schedule: Schedule) -> Schedule:
    SCHEDULES[schedule.name] = schedule
    return schedule


for _s in (*one_f_one_b.SCHEDULES, *zero_bubble.SCHEDULES):
    register_schedule(_s)


def default_schedule(vpp: int) -> str:
    return "interleaved" if vpp > 1 else "1f1b"


def schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise MegaliteError(
            f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[name]


def check_shape(name: str, pp: int, vpp: int, microbatches: int) -> str | None:
    """Why schedule `name` cannot run this shape, or None."""
    if pp < 1 or vpp < 1 or microbatches < 1:
        return f"bad pipeline shape pp={pp} vpp={vpp} microbatches={microbatches}"
    return schedule(name).check(pp, vpp, microbatches)


def _check_rank(name: str, pp: int, vpp: int, microbatches: int, rank: int):
    """MegaliteError (one clear sentence) unless rank `rank` of this shape can run `name`."""
    reason = check_shape(name, pp, vpp, microbatches)
    if reason is None and not 0 <= rank < pp:
        reason = f"rank {rank} outside pp={pp}"
    if reason:
        raise MegaliteError(reason)


def get_schedule(
    name: str, pp: int, vpp: int, microbatches: int, rank: int, forward_only: bool = False
) -> list[Action]:
    """The actions of pipeline rank `rank`. `forward_only` (evaluation): the schedule's
    forwards in the same order, with their communication, and no backward."""
    _check_rank(name, pp, vpp, microbatches, rank)
    return list(_table(name, pp, vpp, microbatches, forward_only)[rank])


@lru_cache(maxsize=512)
def _table(name: str, pp: int, vpp: int, microbatches: int, forward_only: bool) -> tuple:
    """Every rank's actions: computes, their communication, and receives posted in the order
    the peer sends (`align_receives`)."""
    s = SCHEDULES[name]
    if s.table is not None:  # forward only: the forwards keep their (lockstep) places
        keep = (F, SEND_F, RECV_F, WAIT_F) if forward_only else tuple(Kind)
        table = [[a for a in acts if a.kind in keep] for acts in s.table(pp, vpp, microbatches)]
        return tuple(tuple(acts) for acts in align_receives(table))
    table = []
    for r in range(pp):
        segments = s.build(pp, vpp, microbatches, r)
        if forward_only:
            segments = [[a] for seg in segments for a in seg if a.kind == F]
        table.append(with_comms(segments, pp, vpp, r, s.placement))
    return tuple(tuple(acts) for acts in align_receives(table))


def format_table(name: str, pp: int, vpp: int, microbatches: int, comms: bool = False) -> str:
    """Every rank's schedule, one line per rank."""
    return "\n".join(
        f"rank {r}: " + format_actions(get_schedule(name, pp, vpp, microbatches, r), vpp, comms)
        for r in range(pp)
    )


def bubble_theory(pp: int, vpp: int, microbatches: int, name: str | None = None) -> float:
    """The first stage's idle time over its compute time, in theory: Megatron's (pp-1)/(vpp*m)
    unless the schedule says otherwise."""
    return (schedule(name).bubble if name else megatron_bubble)(pp, vpp, microbatches)


def idle_theory(pp: int, vpp: int, microbatches: int) -> float:
    """Megatron's bubble as a fraction of the whole step: (pp-1)/(vpp*m + pp-1)."""
    return (pp - 1) / (vpp * microbatches + pp - 1)
