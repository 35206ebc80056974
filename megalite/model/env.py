"""What every layer of a model chunk is built with beside its config: one frozen `LayerEnv`.

It holds how the rank runs the model: the tensor-parallel group and sequence parallelism, the
context-parallel group and its attention exchange, the expert groups, the kernels (`ops`), the
activation recompute, the dropout seed, the precision and the device. A one-process model needs
none of it: `LayerEnv()` is one rank with the torch ops in fp32 on the CPU, and a test writes
what differs, `LayerEnv(dtype=torch.float64)`. `model/assemble.py` `layer_env` fills it from a
run's config and groups (training, generation, the planner).

Sequence parallelism has one name, `sequence_parallel`: what is in effect (normalised when the
env is made: off with tp = 1, where there is nothing to split; `replace(tp=...)` does not turn
it back on). A layer built on its own reads a bool there. A `GPTChunk` puts its own `SequenceParallel` switch there instead, in the env it
builds its layers with, so every layer holds the chunk's one switch and `chunk.full_sequences()`
turns sequence parallelism off for all of them at once (inference). The chunk owns the switch
(`chunk.sequence_parallel`); the env only carries it down, under the same name, so there is no
second spelling and no hidden state made behind the caller's back. The alternatives were worse:
making every env hold a switch of its own keeps a mutable object in every frozen env (and loses
the bool's equality), and handing the switch to each layer as an argument of its own breaks the
rule that a layer is built from `(cfg, env)` and at most two arguments of its own.

One member is state, made from the fields when the env is created: `rng`, the dropout stream of
this rank's shard. `env.replace(...)` (a layer's own kernels, say) shares it; `env.fresh()` makes
a new one (each chunk has its own).
"""

import dataclasses
from dataclasses import dataclass, field

import torch

from megalite.kernels import TORCH_OPS
from megalite.parallel.comm import Group
from megalite.parallel.expert_parallel import ExpertGroups
from megalite.parallel.random import ShardedRNG
from megalite.parallel.tensor_parallel import SequenceParallel

LOCAL = Group("tp", [0], 0)  # a TP group of one: the single-process model
_STATE_INPUTS = {"tp", "cp", "seed", "device"}  # what rng is made from


@dataclass(frozen=True)
class LayerEnv:
    tp: Group = field(default_factory=lambda: LOCAL)
    # in effect (False with tp = 1); in a chunk's layers, the chunk's switch (see above)
    sequence_parallel: bool | SequenceParallel = False
    tp_comm_overlap: bool = False  # with sequence parallelism: collectives cut behind matmuls
    ops: object = field(default_factory=lambda: TORCH_OPS)  # the kernels (megalite.kernels)
    cp: Group | None = None  # context parallelism: this rank holds s/cp tokens of each sequence
    cp_comm_type: str = "p2p"  # the attention's exchange over cp: "p2p" (ring) or "a2a"
    cp_levels: tuple[Group, Group] | None = None  # a2a+p2p: (inner, outer) groups of cp
    experts: ExpertGroups | None = None  # the MoE layers' expert groups (None: all experts here)
    seed: int = 1234  # initialisation and the dropout streams
    recompute: str = "none"  # "none", "selective" (the attention core) or "full" (each layer)
    dtype: torch.dtype = torch.float32
    device: torch.device | str | None = None
    meta: bool = False  # parameters on the meta device: a model about to be loaded
    # state made from the fields above (see the module's docstring)
    rng: ShardedRNG | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        tp = self.tp
        if self.cp is None:
            object.__setattr__(self, "cp", Group("cp", [0], 0, device=tp.device))
        if self.experts is None:
            object.__setattr__(self, "experts", ExpertGroups(Group("ep", [0], 0, device=tp.device)))
        given = self.sequence_parallel  # a bool, or a chunk's switch (kept as it is)
        if tp.size == 1 or not isinstance(given, SequenceParallel):
            object.__setattr__(self, "sequence_parallel", bool(given) and tp.size > 1)
        if self.rng is None:  # dropout of sharded activations: a stream per TP and per cp rank
            shard = tp.rank + tp.size * self.cp.rank
            rng = ShardedRNG(self.seed, shard, torch.device(self.device or "cpu"))
            object.__setattr__(self, "rng", rng)

    def replace(self, **changes) -> "LayerEnv":
        """This env with `changes`, sharing its dropout stream unless a change is to what it is
        made from."""
        if changes.keys() & _STATE_INPUTS:
            changes = {"rng": None, **changes}
        return dataclasses.replace(self, **changes)

    def fresh(self) -> "LayerEnv":
        """This env with a dropout stream of its own."""
        return dataclasses.replace(self, rng=None)

    @property
    def cp_attention(self) -> str | tuple[Group, Group]:
        """How attention crosses cp (`context_attention`'s comm_type): the levels when set."""
        return self.cp_levels or self.cp_comm_type

    @property
    def tensor_kw(self) -> dict:
        """The dtype and device of the parameters (the meta device with `meta`)."""
        return {"dtype": self.dtype, "device": "meta" if self.meta else self.device}
