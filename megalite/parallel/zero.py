"""ZeRO stages as strategies: where gradients live, how they are reduced over the data-parallel
replicas, what each rank keeps of the optimizer state and of the parameters, and what follows
from that: the bytes per parameter, the collectives a bucket makes per step, and ZeRO-3's
reshard policy. The gradient buffers (data_parallel.py, zero3.py), the optimizer, the run shape
and the planner ask one of these objects; no code outside this file compares stage numbers, and
adding a stage is one more entry.

  stage 0  all-reduce: every rank keeps the whole reduced gradient and the whole optimizer state
  stage 1  reduce-scatter: this rank's shard of the gradient buffer holds the reduced gradient;
           optimizer state (moments, fp32 masters) for that shard only; the updated parameter
           shards are all-gathered after the step
  stage 2  no whole-model gradient buffer: each micro-batch's bucket is staged, reduce-scattered
           and added into a shard-sized accumulator (m times the DP traffic, 4 (1 - 1/dp)
           bytes per parameter less memory)
  stage 3  also the parameters: each rank keeps 1/dp of them, gathered unit by unit (a layer)
           before use and freed after (zero3.py) as the reshard policy says; gradients as at
           stage 2

Hybrid sharding (--dp-replicate R, stages 1-3): everything above happens inside a shard group of
dp/R ranks; once a step, each rank's reduced shard is all-reduced over the R copies of its group
(reducers.StepReducer.finish), so the state is 1/(dp/R) per rank and the copies carry 1/(dp/R)
of the gradient bytes.
"""

from dataclasses import dataclass

from megalite.parallel.reducers import (
    AllReduce,
    ReduceScatter,
    ReduceScatterEachMicrobatch,
    StepReducer,
)

# ZeRO-3's reshard policies (zero3.py) and the gathers of each unit per step under each, with m
# micro-batches: "forward" before its forward and again before its backward, "backward"
# (--zero3-keep-params) once per micro-batch, "step" (the default under pp) once per step.
GATHERS = {"forward": lambda m: 2 * m, "backward": lambda m: m, "step": lambda m: 1}


@dataclass(frozen=True, kw_only=True)
class ZeroStage:
    stage: int
    doc: str
    # how the buffers reduce gradients (reducers.py): once per step or every micro-batch, in
    # place or into this rank's shard
    reducer: type[StepReducer]
    shard_params: bool = False  # parameters too: 1/dp each, gathered unit by unit around use
    # with reduce_each_microbatch: staged buckets reduced at once at most (a ZeRO-3 unit is a
    # whole layer: one reduced while the next fills, as FSDP)
    in_flight: int = 2
    experts: bool = True  # can shard a mixture-of-experts model's buffers
    searched: bool = True  # the planner's layout search tries it (ZeRO-3: planned when asked)

    @property
    def shard_state(self) -> bool:
        """Optimizer state for this rank's 1/dp of each bucket only."""
        return self.reducer.sharded

    @property
    def reduce_each_microbatch(self) -> bool:
        """Every micro-batch's gradients reduced as they come."""
        return self.reducer.each_microbatch

    @property
    def grad_buffer(self) -> bool:
        """A gradient buffer for the whole model (else per-shard accumulators)."""
        return not self.reducer.each_microbatch

    def shard(self, numel: int, dp: int) -> int:
        """Elements of a bucket of `numel` this rank updates."""
        return numel // dp if self.shard_state else numel

    def reshard(self, pipelined: bool, keep_params: bool) -> str | None:
        """The policy of GATHERS the parameters are kept gathered under (zero3.Zero3Buffer),
        None where they are not sharded: the whole step under pipelining (1F1B interleaves
        micro-batches, as torchtitan), from forward to backward with --zero3-keep-params, else
        freed after each use."""
        if not self.shard_params:
            return None
        return "step" if pipelined else "backward" if keep_params else "forward"

    def collectives(self, microbatches: int, policy: str | None = None) -> dict[str, int]:
        """The collectives one bucket makes over the replicas per step, by name -> calls:
        "all_reduce" or "reduce_scatter" of its gradient (once per step, or per micro-batch),
        "all_gather" of the updated parameter shards after the step, "param_gather": the
        parameters gathered before use under `policy` (ZeRO-3), and "shard_all_reduce": the
        reduced shard all-reduced over the copies of the shard group (--dp-replicate)."""
        reductions = microbatches if self.reduce_each_microbatch else 1
        if not self.shard_state:
            return {"all_reduce": reductions}
        if self.shard_params:
            return {"reduce_scatter": reductions, "param_gather": GATHERS[policy](microbatches),
                    "shard_all_reduce": 1}  # fmt: skip
        return {"reduce_scatter": reductions, "all_gather": 1, "shard_all_reduce": 1}

    def state_bytes(self, numel: int, dp: int, param_bytes: int, grad_bytes: int) -> dict:
        """Bytes this rank allocates for `numel` (padded) parameter elements: parameters,
        gradients and optimizer state (Adam moments, plus fp32 masters when the parameters are
        narrower than the gradients). Stage 3's gathered units come on top (the planner)."""
        shard = self.shard(numel, dp)
        masters = param_bytes < grad_bytes
        return {
            "params": (shard if self.shard_params else numel) * param_bytes,
            "grads": (numel if self.grad_buffer else numel // dp) * grad_bytes,
            "optimizer": shard * grad_bytes * (3 if masters else 2),
        }

    def staged_peak(self, sizes: list[int]) -> int:
        """The most a rank stages at once (elements), from its buckets' sizes: in_flight + 1
        buckets, the largest ones, or with fewer buckets than that some of them twice (the next
        micro-batch stages a bucket while its previous gradient is still being reduced); none
        where a gradient buffer holds every micro-batch."""
        if not self.reduce_each_microbatch or not sizes:
            return 0
        k = -(-(self.in_flight + 1) // len(sizes))
        return sum(sorted(sizes * k, reverse=True)[: self.in_flight + 1])


ZERO = {
    0: ZeroStage(stage=0, doc="replicated optimizer", reducer=AllReduce),
    1: ZeroStage(stage=1, doc="sharded optimizer state", reducer=ReduceScatter),
    2: ZeroStage(
        stage=2,
        doc="sharded optimizer state and gradients",
        reducer=ReduceScatterEachMicrobatch,
    ),
    3: ZeroStage(
        stage=3,
        doc="sharded optimizer state, gradients and parameters",
        reducer=ReduceScatterEachMicrobatch,
        shard_params=True,
        in_flight=1,
        experts=False,
        searched=False,
    ),
}
