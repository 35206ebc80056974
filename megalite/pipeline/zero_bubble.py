"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

A backward is split in two: I, the gradient with respect to the stage's input, which the
previous stage waits for, and W, the weight gradients, which nobody waits for. W can then fill
the slots where a stage would otherwise idle.

- `zb-h1`: one chunk per rank, at most as many activations alive as 1F1B's first stage (p, on
  every rank: a put-off W keeps its activations); W fills the cool-down. With F, I and W of equal time the first stage idles (p-1)/3m of its
  compute, a third of 1F1B's (p-1)/m.
- `zbv`: two chunks per rank in a V (chunk 0 at virtual stage r, chunk 1 at 2p-1-r), so the
  first and the last stage share rank 0; with 2p chunk activations alive at most (1F1B's
  memory) the bubble is close to zero.
- `dualpipev`: DeepSeek-V3's DualPipeV on the same V, m >= 2p: after the warm-up each rank
  pairs a forward of one chunk with a whole backward (B) of the other (run one after the
  other: the overlap of their communication DualPipe adds on GPUs is not built), and splits
  the last backwards in I and W again; 2p + 1 chunk activations, ZB-V's bubble.

ZB-V is the paper's pattern (its section 6). Rank r runs, on its chunks c0 (virtual stage r)
and c1 (stage 2p-1-r): a warm-up of 2(p-r)-1 forwards of c0, then r pairs (F c1, F c0), then
p-r triples (F c1, I c1, W c1); a steady state of (F c0, I c0, W c0, F c1, I c1, W c1) until
every forward is done; a cool-down of r pairs (I c0, I c1) whose W's wait, p-r pairs (I c0,
W c0), then the waiting W's. Every W but the cool-down's follows its own I at once: the pattern
keeps each rank's work per cycle the same, so it stays close to zero bubble when F, I and W
differ in cost or a rank holds more (rank 0 holds the embedding and the head), where a
schedule tuned for F = I = W = 1 idles (docs/pipeline.md has the measurements). With fewer
than 2p-1 micro-batches the pattern is built for 2p-1 and the extra ones left out. A timed
run of the orders (F = I = W = 1, B = 2) places the communication (timed.py: `compute_times`,
`lockstep_table`) and `verify.py` proves the result (matching, no deadlock, the activation
bound) for every shape it is run on.
"""

from functools import lru_cache

from megalite.pipeline.actions import Action, B, F, I, Schedule, W, v_placement
from megalite.pipeline.timed import UNIT, compute_times, lockstep_table, run_table


def zbv_order(pp: int, vpp: int, microbatches: int, rank: int):
    """Rank `rank`'s computes in the paper's ZB-V pattern (module docstring)."""
    p, r, n = pp, rank, max(microbatches, 2 * pp - 1)
    f0, f1, i0, i1, w0, w1 = ((kind, c) for kind in (F, I, W) for c in (0, 1))
    seq = [f0] * (2 * (p - r) - 1) + [f1, f0] * r + [f1, i1, w1] * (p - r)
    for i in range(n - p):  # the steady state: one forward of c1 each, so n - p of them
        seq += [f0] * (2 * p - r - 1 + i < n) + [i0, w0, f1, i1, w1]
    seq += [i0, i1] * r + [i0, w0] * (p - r)
    seq += [w1] * (n - seq.count(w1)) + [w0] * (n - seq.count(w0))
    return _numbered(seq, microbatches)


def dualpipev_order(pp: int, vpp: int, microbatches: int, rank: int):
    """Rank `rank`'s computes in DualPipeV's order (module docstring). B is a whole backward;
    the F and B written side by side in the steady state run one after the other."""
    p, r, m = pp, rank, microbatches
    f0, f1, b0, b1, i0, i1, w = (F, 0), (F, 1), (B, 0), (B, 1), (I, 0), (I, 1), (W, None)
    seq = [f0] * (2 * (p - r - 1)) + [f0, f1] * (r + 1) + [i1, w, f1] * (p - r - 1)
    seq += [f0, b1, f1, b0] * (m - 2 * p + r + 1) + [b1, f1, b0] * (p - r - 1)
    half, split = (r + 1) // 2, False  # the last backwards: whole ones, then halves
    for i in range(r + 1):
        split |= i == half and r % 2 == 1
        seq.append(i1 if split else b1)
        split |= i == half and r % 2 == 0
        seq.append(i0 if split else b0)
    seq += [w, i0 if split else b0] * (p - r - 1) + [w] * (r + 1)
    return _numbered(seq, m)


def _numbered(seq, microbatches: int) -> list[list[Action]]:
    """A rank's computes from (kind, chunk) tokens: the forwards of a chunk, and its backwards
    (B or I), take its micro-batches in order; a W takes the oldest I still without its W, of
    its chunk (of any chunk where the token's chunk is None), if there is one. Micro-batches
    from `microbatches` on are left out."""
    forwards, backwards, pending, out = [0, 0], [0, 0], [], []
    for kind, c in seq:
        if kind == W:
            i = next((i for i, (pc, _) in enumerate(pending) if c in (None, pc)), None)
            if i is not None:
                out.append([Action(W, *pending.pop(i))])
            continue
        count = forwards if kind == F else backwards
        k, count[c] = count[c], count[c] + 1
        if k < microbatches:
            out.append([Action(kind, c, k)])
            if kind == I:
                pending.append((c, k))
    return out


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


def v_table(build):
    """Every rank's actions of a V schedule built by `build`: its computes timed
    (`timed.compute_times`), the communication in lockstep (`timed.lockstep_table`)."""

    def table(pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
        timed = compute_times(pp, 2, microbatches, v_placement, build)
        return lockstep_table(pp, 2, timed, v_placement)

    return table


def v_bubble(build):
    """The first stage's idle over compute time of a V schedule's table run as the executor
    runs it (`timed.run_table`, F = I = W = 1, B = 2), its idle counted against the longest
    rank: ZB-V reaches zero in the steady state, and the warm-up and cool-down leave a little."""

    @lru_cache(maxsize=256)
    def bubble(pp: int, vpp: int, microbatches: int) -> float:
        _, idle = run_table(v_table(build)(pp, 2, microbatches), pp, 2, v_placement, UNIT)
        return idle[0] / (1 - idle[0])

    return bubble


def _zb_h1_check(pp, vpp, m):
    return None if vpp == 1 else f"the zb-h1 schedule runs one chunk per rank, not --vpp {vpp}"


def v_check(name, per_stage: int = 0):
    """A V schedule's shape check: --vpp 2, and at least `per_stage`·pp micro-batches."""

    def check(pp, vpp, m):
        if vpp != 2:
            return f"the {name} schedule runs two chunks per rank in a V: --vpp 2, not {vpp}"
        if m < per_stage * pp:
            return (
                f"the {name} schedule needs at least {per_stage}*pp={per_stage * pp} "
                f"micro-batches per step, not {m}; raise --global-batch-size"
            )
        return None

    return check


ZB_H1 = Schedule(
    "zb-h1", zb_h1_order, _zb_h1_check, lambda pp, vpp, m, r: min(pp, m),
    # the first stage idles (p-1)(F + I - W) against m(F + I + W) of compute (F = I = W), and
    # with fewer micro-batches than stages one more F + I for each one missing
    bubble=lambda pp, vpp, m: (pp - 1 + max(0, pp - m)) / (3 * m),
    cost={F: 1.0, I: 1.0, W: 1.0}, chunks=1,
    doc="zero bubble H1: 1F1B's memory, W fills the cool-down (backward split in I and W)",
)  # fmt: skip
ZBV = Schedule(
    "zbv", zbv_order, v_check("zbv"),
    # the warm-up's forwards of c0 and c1, and the first F c1 before its W (2p once m >= 2p-1)
    lambda pp, vpp, m, r: min(m, 2 * pp - r - 1) + min(m, r) + (r < m),
    bubble=v_bubble(zbv_order),
    placement=v_placement,
    table=v_table(zbv_order),
    cost={F: 1.0, I: 1.0, W: 1.0}, chunks=2,
    doc="zero bubble V: two chunks per rank in a V (vpp 2), ~no bubble at 1F1B's memory",
)  # fmt: skip
DUALPIPEV = Schedule(
    "dualpipev", dualpipev_order, v_check("dualpipev", per_stage=2),
    lambda pp, vpp, m, r: 2 * pp + 1,
    bubble=v_bubble(dualpipev_order),
    placement=v_placement,
    table=v_table(dualpipev_order),
    cost=UNIT, chunks=2,
    doc="DualPipeV (DeepSeek-V3): a V (vpp 2) whose steady state pairs an F with a B "
    "(run one after the other), m >= 2*pp",
)  # fmt: skip

SCHEDULES = (ZB_H1, ZBV, DUALPIPEV)
