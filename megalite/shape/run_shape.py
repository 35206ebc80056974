"""`RunShape`: the frozen shape of a run (megalite/shape/__init__.py), what `validate` returns:
the size of every axis in rank order, vpp, the schedule, the micro-batches per step, and what
follows from them (the topology, the partition, the layout a checkpoint records)."""

import dataclasses
from dataclasses import dataclass

from megalite import lr_schedule
from megalite.config import ModelConfig, TrainingConfig
from megalite.errors import MegaliteError
from megalite.parallel.axes import AXES, ranks, split_batch
from megalite.parallel.topology import Topology
from megalite.parallel.zero import ZERO, ZeroStage
from megalite.pipeline import schedules
from megalite.pipeline.partition import Partition


@dataclass(frozen=True)
class RunShape:
    world_size: int
    sizes: tuple  # ((axis, size), ...) in rank order, fastest first
    vpp: int
    schedule: str
    sequence_parallel: bool  # in effect (False at tp=1)
    microbatches: int  # per step, on each rank that splits the batch
    micro_batch_size: int
    global_batch_size: int
    model: ModelConfig  # the user's model section, its vocabulary filled in once known
    ep: int = 1  # expert-parallel size: a second decomposition of tp*dp, not an axis of its own
    etp: int = 1
    zero: ZeroStage = ZERO[0]  # the ZeRO stage (--zero-stage)
    stage_layers: tuple = ()  # transformer layers per virtual stage, pipeline order (partition.py)
    cp_a2a: int | None = None  # a2a+p2p: the all-to-all level A of cp = A*P (Topology.cp_a2a)

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    def __getattr__(self, axis: str) -> int:  # shape.tp, shape.pp, shape.dpr, ...
        # (not dp: shape.dp is the user's --dp, below; the dp axis alone is size("dp"))
        if axis in AXES:
            return self.size(axis)
        raise AttributeError(axis)

    @property
    def order(self) -> str:
        return "-".join(a for a, _ in self.sizes)

    @property
    def dp(self) -> int:
        """The data-parallel ranks, the user's --dp: every axis that splits the batch. With
        --dp-replicate R that is the dp axis (a ZeRO shard group, `size("dp")`) times R (dpr)."""
        return ranks(dict(self.sizes), splits_batch=True)

    def __str__(self) -> str:  # "tp=2 pp=2 dp=4 vpp=2 zero=1 sp": the layout, as plans print it
        sizes = dict(self.sizes)
        out = f"tp={self.tp} pp={self.pp} dp={self.dp}"  # (dp x dpr: --dp, as the user gave it)
        out += "".join(
            f" {a}={n}" for a, n in sizes.items() if a not in ("tp", "pp", "dp") and n > 1
        )
        out += f" ep={self.ep}" if self.model.num_experts else ""
        out += f" etp={self.etp}" if self.etp > 1 else ""
        out += f" vpp={self.vpp}" if self.vpp > 1 else ""
        return out + f" zero={self.zero.stage}" + (" sp" if self.sequence_parallel else "")

    def topology(self) -> Topology:
        """The ranks' layout; with experts, carrying their decomposition (`topo.expert`)."""
        topo = Topology(self.order, **dict(self.sizes))
        if self.model.num_experts:
            topo.expert = topo.experts(self.ep, self.etp)
        topo.cp_a2a = self.cp_a2a
        return topo

    @property
    def placement(self):
        return schedules.schedule(self.schedule).placement

    @property
    def partition(self) -> Partition:
        """Which layers live on which (pipeline rank, chunk): `shape.partition.rank_chunks(r)`."""
        counts = (
            self.stage_layers or Partition.even(self.model.num_layers, self.pp, self.vpp).counts
        )
        return Partition(counts, self.pp, self.vpp, self.placement)

    @property
    def padded_vocab_size(self) -> int:
        return self.model.padded_vocab_size(self.tp)

    @property
    def hidden_shape(self) -> tuple[int, int, int]:
        """The tensor between pipeline stages: (b, s/cp, h), (b, s/cp/tp, h) with sequence
        parallelism (cp: this rank's share of each sequence, context parallelism)."""
        s = self.model.seq_length // self.cp
        return (self.micro_batch_size, s // self.tp if self.sequence_parallel else s,
                self.model.hidden_size)  # fmt: skip

    def with_vocab(self, vocab_size: int) -> "RunShape":
        """The shape once the tokenizer is known: --vocab-size if given (at least the
        tokenizer's), else the tokenizer's."""
        given = self.model.vocab_size
        if given is not None and given < vocab_size:
            raise MegaliteError(
                f"the tokenizer has {vocab_size} pieces but --vocab-size is {given}; raise "
                f"--vocab-size to at least {vocab_size} or omit it"
            )
        model = dataclasses.replace(self.model, vocab_size=given or vocab_size)
        return dataclasses.replace(self, model=model)

    def layout(self) -> dict:
        """What a checkpoint records of the layout that wrote it."""
        # a newer axis of size 1 goes unrecorded: checkpoints written before it match this layout.
        # An axis whose copies hold the same shards (dpr) right after dp numbers the ranks as
        # dp x dpr plain dp ranks do and changes only how gradients are reduced: it is recorded
        # as that dp, so a run resumed at another --dp-replicate keeps its RNG streams.
        sizes, prev = {}, None
        for a, n in self.sizes:
            if prev == "dp" and AXES[a].replicated and not AXES[a].shards:
                sizes["dp"] *= n
            elif n > 1 or a in ("tp", "dp", "pp"):
                sizes[a] = n
            prev = a
        out = {**sizes, "vpp": self.vpp, "world_size": self.world_size}
        return {**out, "ep": self.ep} if self.ep > 1 else out

    def microbatches_at(self, global_batch_size: int) -> int:
        """Micro-batches per step on each data rank for a step of `global_batch_size` samples:
        `microbatches` at the shape's own, fewer during a batch ramp-up (--rampup-batch-size);
        the one derivation the trainer, the schedule and the optimizer are given."""
        return split_batch(global_batch_size, self.micro_batch_size, self.dp)

    def microbatch_counts(self, t: TrainingConfig) -> list[int]:
        """Every micro-batch count a run of `t` steps with, smallest first: the shape's own and
        those of a batch-size ramp-up (lr_schedule.batch_sizes), each by `microbatches_at`."""
        sizes = lr_schedule.batch_sizes(t, self.model.seq_length)
        return sorted({self.microbatches, *map(self.microbatches_at, sizes)})
