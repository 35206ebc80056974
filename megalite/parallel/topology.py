"""Pure rank arithmetic for 3D parallelism: no torch.distributed, so it is unit-tested alone.

A rank's coordinates along the axes tp, dp, pp are its digits in a mixed-radix number whose
first axis in `order` varies fastest. With the default order "tp-dp-pp", TP ranks are adjacent
(a TP group stays inside a node), then DP, and the pipeline stages are farthest apart.
"""

import os
from dataclasses import dataclass

AXES = ("tp", "dp", "pp")


def world_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment, or a world of one."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = "tp-dp-pp"

    def __post_init__(self):
        axes = self.order.split("-")
        if sorted(axes) != sorted(AXES):
            raise ValueError(f"order must name tp, dp and pp once each, got {self.order!r}")
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis}={getattr(self, axis)} must be at least 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def axes(self) -> list[str]:
        return self.order.split("-")

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        s = 1
        for a in self.axes:
            if a == axis:
                return s
            s *= self.size(a)
        raise KeyError(axis)

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': i, 'dp': j, 'pp': k} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return {a: rank // self.stride(a) % self.size(a) for a in AXES}

    def rank(self, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        c = {"tp": tp, "dp": dp, "pp": pp}
        return sum(c[a] * self.stride(a) for a in AXES)

    def group(self, axis: str, rank: int) -> list[int]:
        """Ranks that share every coordinate with `rank` except along `axis` ("tp", or several
        joined by "+" such as "tp+pp"), in increasing order."""
        out = [rank]
        for a in axis.split("+"):
            out = [self.rank(**{**self.coords(r), a: i}) for r in out for i in range(self.size(a))]
        return sorted(set(out)) if "+" in axis else out

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, each once, ordered by their first rank."""
        seen, out = set(), []
        for r in range(self.world_size):
            if r not in seen:
                g = self.group(axis, r)
                seen.update(g)
                out.append(g)
        return out

    def is_first_stage(self, rank: int) -> bool:
        return self.coords(rank)["pp"] == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank)["pp"] == self.pp - 1

    def next_stage(self, rank: int) -> int:
        """The rank holding the next pipeline stage (wrapping round, as interleaving needs)."""
        g = self.group("pp", rank)
        return g[(self.coords(rank)["pp"] + 1) % self.pp]

    def prev_stage(self, rank: int) -> int:
        g = self.group("pp", rank)
        return g[(self.coords(rank)["pp"] - 1) % self.pp]

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: where tied embeddings live."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]

    def describe(self) -> str:
        lines = [f"layout: tp={self.tp} pp={self.pp} dp={self.dp} order={self.order}"]
        for axis in ("tp", "pp", "dp"):
            lines.append(f"  {axis.upper()} groups: " + " ".join(map(str, self.groups(axis))))
        return "\n".join(lines)
