"""The run's shape: every value derived from the config and the world size, computed once.

`validate(cfg, world_size)` rejects impossible combinations with one clear sentence (before any
process group exists; nothing here imports torch) and returns a frozen `RunShape`. Nothing is
written into the user's config: code that needs a derived value (dp, the schedule, the
micro-batches per step, the padded vocabulary, ...) reads the shape. The planner's layout search
calls `derive` too, so a layout it proposes is one `validate` accepts.
"""

import dataclasses
import os
import sys
from dataclasses import dataclass

from megalite.config import Config, ModelConfig
from megalite.errors import MegaliteError
from megalite.parallel.axes import AXES, INFERRED
from megalite.parallel.topology import Topology, parse_order
from megalite.pipeline import schedules


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

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    def __getattr__(self, axis: str) -> int:  # shape.tp, shape.dp, ...
        if axis in AXES:
            return self.size(axis)
        raise AttributeError(axis)

    @property
    def order(self) -> str:
        return "-".join(a for a, _ in self.sizes)

    def topology(self) -> Topology:
        return Topology(self.order, **dict(self.sizes))

    @property
    def data_parallel(self) -> int:
        """Ranks that train on different samples (the product of batch-splitting axes)."""
        n = 1
        for a, s in self.sizes:
            n *= s if AXES[a].splits_batch else 1
        return n

    @property
    def placement(self):
        return schedules.schedule(self.schedule).placement

    @property
    def padded_vocab_size(self) -> int:
        return self.model.padded_vocab_size(self.tp)

    @property
    def hidden_shape(self) -> tuple[int, int, int]:
        """The tensor between pipeline stages: (b, s, h), (b, s/tp, h) with sequence parallelism."""
        s = self.model.seq_length
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
        return {**dict(self.sizes), "vpp": self.vpp, "world_size": self.world_size}


def _positive(cfg: Config):
    m, p, t = cfg.model, cfg.parallel, cfg.training
    values = {
        "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "num-layers": m.num_layers,
        "hidden-size": m.hidden_size, "num-attention-heads": m.num_attention_heads,
        "seq-length": m.seq_length, "micro-batch-size": t.micro_batch_size,
        "global-batch-size": t.global_batch_size, "train-iters": t.train_iters,
        "log-interval": t.log_interval, "dp": p.dp, "num-query-groups": m.num_query_groups,
        "ffn-hidden-size": m.ffn_hidden_size, "vocab-size": m.vocab_size,
    }  # fmt: skip
    for name, v in values.items():
        if v is not None and v < 1:
            raise MegaliteError(f"--{name}={v} must be a positive integer")


def derive(cfg: Config, world_size: int) -> RunShape:
    """The shape of this layout (cfg.parallel) on `world_size` ranks, or MegaliteError naming
    why the model or the batch cannot run that way."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    sizes = {a: (ax.size(cfg) if ax.size else None) for a, ax in AXES.items()}
    sizes[INFERRED] = p.dp
    given = 1
    for a, n in sizes.items():
        given *= n if a != INFERRED else 1
    named = "*".join(a for a in sizes if a != INFERRED)
    values = "*".join(str(n) for a, n in sizes.items() if a != INFERRED)
    if world_size % given:
        raise MegaliteError(
            f"world size {world_size} is not divisible by {named}={values}; "
            f"launch a multiple of {given} processes or change {'/'.join('--' + a for a in sizes if a != INFERRED)}"
        )
    if p.dp is not None and p.dp * given != world_size:
        raise MegaliteError(
            f"{named}*dp={values}*{p.dp}={given * p.dp} does not equal the world size {world_size}; "
            "fix --dp or omit it to infer it"
        )
    sizes[INFERRED] = world_size // given
    try:
        axes = parse_order(p.order, sizes)
    except ValueError as e:
        raise MegaliteError(f"--order: {e}") from None
    if m.hidden_size % m.num_attention_heads:
        raise MegaliteError(
            f"hidden_size={m.hidden_size} is not divisible by num_attention_heads={m.num_attention_heads}"
        )
    if m.num_attention_heads % m.heads_kv:
        raise MegaliteError(
            f"num_attention_heads={m.num_attention_heads} is not divisible by num_query_groups={m.heads_kv}"
        )
    if m.flavour == "llama" and m.head_dim % 2:
        raise MegaliteError(f"head dim {m.head_dim} must be even for rotary embeddings")
    for ax in AXES.values():
        reason = ax.check(cfg, sizes) if ax.check else None
        if reason:
            raise MegaliteError(reason)
    data = 1
    for a, n in sizes.items():
        data *= n if AXES[a].splits_batch else 1
    if t.global_batch_size % (t.micro_batch_size * data):
        raise MegaliteError(
            f"global_batch_size={t.global_batch_size} is not divisible by micro_batch_size*dp="
            f"{t.micro_batch_size}*{data}; make it a multiple of {t.micro_batch_size * data}"
        )
    microbatches = t.global_batch_size // (t.micro_batch_size * data)
    name = p.pp_schedule or schedules.default_schedule(p.vpp)
    reason = schedules.check_shape(name, sizes["pp"], p.vpp, microbatches)
    if reason:
        raise MegaliteError(reason)
    if m.max_position_embeddings is not None and m.seq_length > m.max_position_embeddings:
        raise MegaliteError(
            f"seq_length={m.seq_length} exceeds max_position_embeddings={m.max_position_embeddings}"
        )
    return RunShape(
        world_size=world_size,
        sizes=tuple((a, sizes[a]) for a in axes),
        vpp=p.vpp,
        schedule=name,
        sequence_parallel=p.sequence_parallel and sizes["tp"] > 1,
        microbatches=microbatches,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        model=dataclasses.replace(m),
    )


def validate(cfg: Config, world_size: int) -> RunShape:
    """Reject impossible configs with one sentence; the run's shape. cfg is not changed."""
    _positive(cfg)
    o, p = cfg.optimizer, cfg.parallel
    shape = derive(cfg, world_size)
    if p.sequence_parallel and p.tp == 1 and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        # Documented choice: sequence parallelism is a TP feature; at tp=1 it is ignored.
        print("megalite: warning: --sequence-parallel has no effect at tp=1; ignored",
              file=sys.stderr)  # fmt: skip
    if o.min_lr > o.lr:
        raise MegaliteError(f"min_lr={o.min_lr} is larger than lr={o.lr}")
    if p.distributed_timeout_minutes <= 0:
        raise MegaliteError("--distributed-timeout-minutes must be positive")
    return shape
