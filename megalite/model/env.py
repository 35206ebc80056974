"""What every layer of a model chunk is built with beside its config: one frozen `LayerEnv`.

It holds how the rank runs the model: the tensor-parallel group and sequence parallelism, the
context-parallel group and its attention exchange, the expert groups, the kernels (`ops`), the
activation recompute, the dropout seed, the precision and the device. A one-process model needs
none of it: `LayerEnv()` is one rank with the torch ops in fp32 on the CPU, and a test writes
what differs, `LayerEnv(dtype=torch.float64)`. `model/assemble.py` `layer_env` fills it from a
run's config and groups (training, generation, the planner).

Two members are state, made from the fields when the env is created: `seq_parallel`, the one
`SequenceParallel` switch every layer holds (`GPTChunk.full_sequences` turns it off for all of
them), and `rng`, the dropout stream of this rank's shard. `env.replace(...)` (a layer's own
kernels, say) shares both; `env.fresh()` makes new ones (each chunk has its own).
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
_STATE_INPUTS = {"tp", "sequence_parallel", "cp", "seed", "device"}  # the switch's and rng's


@dataclass(frozen=True)
class LayerEnv:
    tp: Group = field(default_factory=lambda: LOCAL)
    sequence_parallel: bool = False  # asked for; in effect with tp > 1 only (`seq_parallel`)
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
    seq_parallel: SequenceParallel | None = field(default=None, repr=False, compare=False)
    rng: ShardedRNG | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        tp = self.tp
        if self.cp is None:
            object.__setattr__(self, "cp", Group("cp", [0], 0, device=tp.device))
        if self.experts is None:
            object.__setattr__(self, "experts", ExpertGroups(Group("ep", [0], 0, device=tp.device)))
        if self.seq_parallel is None:
            switch = SequenceParallel(self.sequence_parallel and tp.size > 1)
            object.__setattr__(self, "seq_parallel", switch)
        if self.rng is None:  # dropout of sharded activations: a stream per TP and per cp rank
            shard = tp.rank + tp.size * self.cp.rank
            rng = ShardedRNG(self.seed, shard, torch.device(self.device or "cpu"))
            object.__setattr__(self, "rng", rng)

    def replace(self, **changes) -> "LayerEnv":
        """This env with `changes`, sharing its switch and dropout stream unless a change is to
        what they are made from."""
        if changes.keys() & _STATE_INPUTS:
            changes = {"seq_parallel": None, "rng": None, **changes}
        return dataclasses.replace(self, **changes)

    def fresh(self) -> "LayerEnv":
        """This env with a switch and a dropout stream of its own."""
        return dataclasses.replace(self, seq_parallel=None, rng=None)

    @property
    def cp_attention(self) -> str | tuple[Group, Group]:
        """How attention crosses cp (`context_attention`'s comm_type): the levels when set."""
        return self.cp_levels or self.cp_comm_type

    @property
    def tensor_kw(self) -> dict:
        """The dtype and device of the parameters (the meta device with `meta`)."""
        return {"dtype": self.dtype, "device": "meta" if self.meta else self.device}
