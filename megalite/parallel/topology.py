"""Pure rank arithmetic over named parallel axes: no torch.distributed, so it is unit-tested alone.

The axes are those registered in axes.py (tp, dp, pp, ...). A rank's coordinates are its digits in a mixed-radix number whose first axis in the order varies
fastest. With the default order "tp-cp-dp-pp", TP ranks are adjacent (a TP group stays inside a
node), then CP (the ring of context parallelism, whose traffic is the next heaviest), then DP, and
the pipeline stages are farthest apart. Axes of size 1 may be left out of
an order; they are appended.

The same ranks can be decomposed a second time (`regroup`), as Megatron lays experts out as
etp-ep-edp-pp over the ranks of tp-cp-dp-pp: the two views must agree on the outermost axes
they share (the pipeline), so expert parallelism does not multiply the world size.
"""

import os

from megalite.config import DEFAULT_ORDER  # the config's default --order, one literal
from megalite.parallel.axes import AXES, Axis


def world_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment, or a world of one."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def parse_order(order: str, sizes: dict[str, int], known=None) -> tuple[str, ...]:
    """The axes of `order` ("tp-dp-pp"), checked: known names, each once, every axis of size > 1
    named; size-1 axes left out are appended. Raises ValueError with one sentence."""
    known = AXES if known is None else known
    axes = tuple(a for a in order.split("-") if a)
    unknown = [a for a in axes if a not in known]
    if unknown:
        raise ValueError(f"order {order!r} names unknown axes {unknown}; axes are {list(known)}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"order {order!r} names an axis twice")
    missing = [a for a, n in sizes.items() if n > 1 and a not in axes]
    if missing:
        raise ValueError(f"order {order!r} leaves out {missing}, which have size > 1")
    return axes + tuple(a for a in sizes if a not in axes)


class Topology:
    """Named axes with sizes, in rank order (fastest first). `Topology(tp=2, pp=2, dp=2)`;
    `order="pp-tp-dp"` to lay them out differently."""

    def __init__(self, order: str = DEFAULT_ORDER, known=None, **sizes: int):
        known = AXES if known is None else known
        for a, n in sizes.items():
            if a not in known:
                raise ValueError(f"unknown axis {a!r}; axes are {list(known)}")
            if n < 1:
                raise ValueError(f"{a}={n} must be at least 1")
        full = {a: sizes.get(a, 1) for a in known}
        self.axes = parse_order(order, full, known)
        self.sizes = {a: full[a] for a in self.axes}
        self.order = "-".join(self.axes)
        self._strides, s = {}, 1
        for a in self.axes:
            self._strides[a] = s
            s *= self.sizes[a]
        self.world_size = s
        self.expert = None  # the expert decomposition of the same ranks, when the model has experts
        self.cp_a2a = None  # a2a+p2p: the all-to-all level's size A of cp = A*P (groups.cp_levels)

    def __repr__(self):
        return f"Topology({', '.join(f'{a}={n}' for a, n in self.sizes.items())}, order={self.order!r})"

    def __eq__(self, other):
        return isinstance(other, Topology) and (self.axes, self.sizes) == (other.axes, other.sizes)

    def __hash__(self):
        return hash((self.axes, tuple(self.sizes.values())))

    def __getattr__(self, axis: str) -> int:  # topo.tp, topo.pp, ...: the size of an axis
        sizes = self.__dict__.get("sizes", {})
        if axis in sizes:
            return sizes[axis]
        raise AttributeError(axis)

    # ---- axes and products of axes ("dp+cp") -------------------------------------------------

    @staticmethod
    def split(expr: str) -> list[str]:
        return [a for a in expr.split("+") if a]

    def size(self, expr: str) -> int:
        """Ranks in a group along `expr` ("tp", or several joined by "+")."""
        n = 1
        for a in self.split(expr):
            n *= self.sizes[a]
        return n

    def stride(self, axis: str) -> int:
        return self._strides[axis]

    def label(self, rank: int, skip=()) -> str:
        """'tp 1, dp 0, pp 1': a rank's coordinates along tp, dp, pp and any other axis of size
        > 1 (those in `skip` left out), for messages."""
        return ", ".join(f"{a} {i}" for a, i in self.coords(rank).items()
                         if a not in skip and (self.sizes[a] > 1 or a in ("tp", "dp", "pp")))  # fmt: skip

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': i, 'dp': j, 'pp': k, ...} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return {a: rank // self._strides[a] % self.sizes[a] for a in self.axes}

    def rank(self, **coords: int) -> int:
        """The global rank at these coordinates (missing axes: 0)."""
        return sum(coords.get(a, 0) * self._strides[a] for a in self.axes)

    def index(self, expr: str, rank: int) -> int:
        """This rank's position along `expr`: mixed radix over its axes in order (the position
        in `group(expr, rank)`)."""
        c, i, s = self.coords(rank), 0, 1
        for a in self.axes:
            if a in self.split(expr):
                i += c[a] * s
                s *= self.sizes[a]
        return i

    def group(self, expr: str, rank: int) -> list[int]:
        """Ranks that share every coordinate with `rank` except along the axes of `expr`,
        in increasing order."""
        out = [rank]
        for a in self.split(expr):
            out = [self.rank(**{**self.coords(r), a: i}) for r in out for i in range(self.sizes[a])]
        return sorted(out)

    def groups(self, expr: str) -> list[list[int]]:
        """Every group along `expr`, each once, ordered by their first rank."""
        seen, out = set(), []
        for r in range(self.world_size):
            if r not in seen:
                g = self.group(expr, r)
                seen.update(g)
                out.append(g)
        return out

    def product(self, predicate) -> str:
        """The axes for which predicate(Axis) holds, as a group expression ("dp+cp"), in order.
        Axes of size 1 are left out (the group is the same), unless that leaves none."""
        axes = [a for a in self.axes if a in AXES and predicate(AXES[a])]
        big = [a for a in axes if self.sizes[a] > 1]
        return "+".join(big or axes[:1])

    # ---- the pipeline ---------------------------------------------------------------------------

    def next_stage(self, rank: int) -> int:
        """The rank holding the next pipeline stage (wrapping round, as interleaving needs)."""
        g = self.group("pp", rank)
        return g[(self.coords(rank)["pp"] + 1) % self.sizes["pp"]]

    def prev_stage(self, rank: int) -> int:
        g = self.group("pp", rank)
        return g[(self.coords(rank)["pp"] - 1) % self.sizes["pp"]]

    def stage_groups(self, stages: list[int]) -> list[list[int]]:
        """For each pipeline, the ranks at the given pipeline coordinates (e.g. the stages that
        hold the embedding and the head: the tied-embedding groups)."""
        return [sorted({g[s] for s in stages}) for g in self.groups("pp")]

    def regroup(self, order: str, **sizes: int) -> "Topology":
        """A second decomposition of the same ranks over axes of its own (experts: order
        "etp-ep-edp-pp"). It must cover the same world and give the same pipeline groups."""
        known = {a: AXES.get(a) or Axis(a, "a second decomposition") for a in order.split("-")}
        other = Topology(order, known=known, **{"pp": self.sizes["pp"], **sizes})
        if other.world_size != self.world_size or other.groups("pp") != self.groups("pp"):
            raise ValueError(
                f"{other} does not decompose the ranks of {self} with the same pipeline groups"
            )
        return other

    def experts(self, ep: int, etp: int = 1) -> "Topology":
        """The expert decomposition of these ranks, Megatron's etp-ep-edp-pp: each pipeline
        stage's tp*dp ranks split into ep groups holding different experts (edp: the ranks
        holding the same experts), with the dense pipeline groups, so ep divides tp*dp instead
        of multiplying the world. Consecutive ranks form an ep group, so with the default
        order experts spread over TP ranks first; with etp > 1 consecutive ranks form an etp
        group (each holding a slice of the same experts), then ep groups of such slices."""
        stage = self.world_size // self.sizes["pp"]
        if stage % (ep * etp):
            raise ValueError(f"ep*etp={ep}*{etp} does not divide the {stage} ranks of a stage")
        sizes = {"etp": etp, "ep": ep, "edp": stage // (ep * etp)}
        for order in ("etp-ep-edp-pp", "pp-etp-ep-edp"):  # pp outermost or innermost
            try:
                return self.regroup(order, **sizes)
            except ValueError:
                continue
        raise ValueError(
            f"experts need the pipeline axis first or last in the rank order, not {self.order!r}"
        )

    def describe(self, limit: int = 8) -> str:
        """The layout and each axis's groups, as launch prints them: every group while an axis
        has at most `limit`, else the first two, the last and how many (16,384 ranks: a dozen
        lines, not thousands)."""
        head = " ".join(f"{a}={n}" for a, n in self.sizes.items())
        lines = [f"layout: {head} order={self.order}"]
        shown = [(a, self) for a in self.axes if self.sizes[a] > 1 or a in ("tp", "pp", "dp")]
        if self.expert is not None:
            axes = ("etp", "ep", "edp") if self.expert.size("etp") > 1 else ("ep", "edp")
            shown += [(a, self.expert) for a in axes]
        for a, topo in shown:
            count = topo.world_size // topo.size(a)
            if count <= limit:
                groups = " ".join(map(str, topo.groups(a)))
            else:
                first = topo.group(a, 0)
                second = topo.group(a, min(set(range(len(first) + 1)) - set(first)))
                last = topo.group(a, topo.world_size - 1)
                groups = f"({count:,}) {_short(first)} {_short(second)} ... {_short(last)}"
            lines.append(f"  {a.upper()} groups: {groups}")
        return "\n".join(lines)


def _short(ranks: list[int]) -> str:
    """[0, 8, 16, 24] -> '[0,8..24]' (evenly spaced), else the list."""
    step = ranks[1] - ranks[0] if len(ranks) > 2 else 0
    if step and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"[{ranks[0]},{ranks[1]}..{ranks[-1]}]" if step > 1 else f"[{ranks[0]}..{ranks[-1]}]"
    return str(ranks)
