"""The training loop that every layout runs: data -> schedule -> optimizer step -> metrics.

Each step: this DP rank's micro-batches of global batch i (the same samples for every layout),
one pipeline schedule over this rank's model chunks (pp=1 is the schedule F0 B0 F1 B1 ...), then
the optimizer finalises gradients (DP, TP, tied embeddings), clips and updates.
"""

import math
import resource
import time

import torch

from megalite import kernels
from megalite.checkpoint.checkpointer import Checkpointer, TrainState
from megalite.config import Config
from megalite.data.gpt_dataset import build_datasets
from megalite.data.sampler import BatchSampler, get_batch
from megalite.errors import MegaliteError
from megalite.model.gpt import GPTChunk
from megalite.optim.distributed_optimizer import build_optimizer
from megalite.optim.lr_schedule import lr_at
from megalite.parallel import comm
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.random import rng_state, seed_replicated, set_rng_state
from megalite.pipeline.executor import first_stage_times, idle_ratio, run_schedule
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import bubble_theory, get_schedule, idle_theory
from megalite.shape import RunShape
from megalite.training.flops import (
    device_peak_flops,
    hardware_flops_per_token,
    model_flops_per_token,
)
from megalite.training.logger import Logger
from megalite.training.timeline import Timeline

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer:
    def __init__(self, cfg: Config, shape: RunShape, groups: ProcessGroups, data=None):
        t = cfg.training
        self.cfg, self.groups = cfg, groups
        self.data = data or build_datasets(cfg)
        tok = getattr(self.data, "tokenizer", None)
        self.shape = shape = shape.with_vocab(tok.vocab_size) if tok else shape
        m = shape.model
        seed_replicated(t.seed, groups.pp.rank, groups.data.rank)
        ops = kernels.select(t.kernels, groups.device)
        self.dtype = DTYPES[t.precision]
        self.chunks = [
            GPTChunk(m, groups.tp, **kw, sequence_parallel=shape.sequence_parallel, ops=ops, recompute=t.recompute,
                     seed=t.seed, dtype=self.dtype, device=groups.device)
            for kw in rank_chunks(m.num_layers, shape.pp, shape.vpp, groups.pp.rank, shape.placement)
        ]  # fmt: skip
        self.opt = build_optimizer(self.chunks, groups, cfg)
        self.microbatches = shape.microbatches
        self.actions = get_schedule(
            shape.schedule, shape.pp, shape.vpp, self.microbatches, groups.pp.rank
        )
        self.hidden_shape = shape.hidden_shape
        self.sampler = BatchSampler(len(self.data.train), t.global_batch_size, t.micro_batch_size,
                                    groups.data.rank, groups.data.size, t.seed)  # fmt: skip
        self.iteration = 0
        self.skipped_in_a_row = 0
        self.skipped_total = 0
        self.stop = False  # a rank got SIGTERM/SIGINT: save and stop after this step
        self._interval, self._interval_start = [], time.perf_counter()  # steps since the last log
        self.logger = Logger(cfg, enabled=groups.rank == 0)
        self.peak = device_peak_flops(groups.device, t.precision)
        self.timeline = Timeline.from_config(cfg, groups)  # --profile-steps A:B, else None
        self.checkpointer = Checkpointer(cfg, shape, groups, self.chunks, self.opt,
                                         tok.model_path if tok else None, self.logger.print)  # fmt: skip

    # ---- checkpoints: the trainer owns what a checkpoint restores -------------------------------

    def state(self) -> TrainState:
        return TrainState(self.iteration, self.sampler.consumed_samples, self.skipped_total,
                          rng_state(self.chunks, self.groups.device))  # fmt: skip

    def resume(self) -> TrainState | None:
        """Load --load, or the latest checkpoint in --save, and continue from it."""
        state = self.checkpointer.resume()
        if state is not None:
            self.iteration = state.iteration
            self.sampler.consumed_samples = state.consumed_samples
            self.skipped_total = state.skipped_steps
            if state.rng is not None:
                set_rng_state(state.rng, self.chunks, self.groups.device)
        return state

    def save(self):
        self.checkpointer.save(self.state())

    # ---- one step -----------------------------------------------------------------------------

    def _microbatches(self, dataset, indices):
        device = self.groups.device
        cuda = device.type == "cuda"  # pinned host memory: the copy does not wait for the device
        return [tuple((x.pin_memory() if cuda else x).to(device, non_blocking=cuda)
                      for x in get_batch(dataset, idx)) for idx in indices]  # fmt: skip

    def _mean_over_dp(self, values: list[float]) -> list[float]:
        g = self.groups.replicas
        t = torch.tensor(values, dtype=torch.float64, device=self.groups.device)
        comm.all_reduce(t, g)
        return (t / g.size).tolist()

    def train_step(self, log: bool = True) -> dict | None:
        """One optimizer step. It reads the device once (the optimizer's status: norm, skip,
        preemption); a logging step (`log`) also reads the loss, the timings of the steps since
        the last logging step and the memory, and returns the metrics."""
        t = self.cfg.training
        self.groups.ledger.reset()
        for c in self.chunks:
            c.train()
        batch = self._microbatches(self.data.train, self.sampler.next_batch())
        self.opt.zero_grad(len(batch))
        tl = self.timeline.at(self.iteration + 1) if self.timeline else None
        result = run_schedule(self.actions, self.chunks, self.groups, batch, hidden_shape=self.hidden_shape,
                              dtype=self.dtype, loss_scale=self.opt.loss_scale, timeline=tl,
                              placement=self.shape.placement)  # fmt: skip
        self._interval.append(result)
        lr = lr_at(self.iteration, self.cfg.optimizer, t.train_iters)
        t_opt = tl.clock.mark() if tl else None
        stats = self.opt.step(lr, flags=[float(self.checkpointer.signalled)])
        self.iteration += 1
        self.stop = stats["flags"][0] > 0  # some rank was signalled: every rank saves and stops
        if tl:
            tl.record("optimizer", t_opt, tl.clock.mark())
        self._count_skips(stats, result)
        return self._metrics(result, stats, lr) if log else None

    def _metrics(self, result, stats: dict, lr: float) -> dict:
        """What a logging step reports: the loss, and throughput and the pipeline bubble over
        the steps since the last logging step (`first_stage_times` reads their clock marks)."""
        t, p = self.cfg.training, self.shape
        (loss,) = self._mean_over_dp([result.loss])
        steps = len(self._interval)
        compute, busy = first_stage_times(self._interval, self.groups.pp)
        now = time.perf_counter()  # after the reads above: the device has caught up
        step_s = (now - self._interval_start) / steps
        self._interval, self._interval_start = [], now
        tokens_per_s = t.global_batch_size * p.model.seq_length / step_s
        world = self.groups.topo.world_size
        pipelined = p.pp > 1
        return {
            "iteration": self.iteration,
            "loss": loss,
            "grad_norm": stats["grad_norm"],
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_s,
            "consumed_samples": self.sampler.consumed_samples,
            "mfu": None if self.peak is None else model_flops_per_token(p.model) * tokens_per_s / (self.peak * world),
            "hfu": None if self.peak is None else hardware_flops_per_token(p.model, t.recompute) * tokens_per_s / (self.peak * world),
            # the first stage's idle time over its compute time, over the log interval
            "bubble_measured": idle_ratio(compute, busy) if pipelined else 0.0,
            "bubble_theory": bubble_theory(p.pp, p.vpp, self.microbatches, p.schedule) if pipelined else 0.0,
            # the same idle time as a share of the schedule, and its theory (p-1)/(v*m+p-1)
            "idle_share": 1 - compute / max(busy, 1e-12) if pipelined else 0.0,
            "idle_share_theory": idle_theory(p.pp, p.vpp, self.microbatches) if pipelined else 0.0,
            "comm_bytes": {k: v["bytes"] for k, v in self.groups.ledger.snapshot().items()},
            "comm": self.groups.ledger.snapshot(),
            "optimizer_state_bytes": self.opt.state_bytes(),
            "peak_memory_bytes": self._peak_memory(),
            "loss_scale": stats["loss_scale"],
            "skipped": stats["skipped"],
            "skipped_steps": self.skipped_total,
        }  # fmt: skip

    def _count_skips(self, stats: dict, result):
        if not stats["skipped"]:
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        limit = self.cfg.training.max_skipped_steps
        if self.skipped_in_a_row > limit:
            raise MegaliteError(
                f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient (loss {result.loss}, grad norm "
                f"{stats['grad_norm']}) at iteration {self.iteration}; lower --lr or check the data (limit --max-skipped-steps {limit})"
            )

    def _peak_memory(self) -> int:
        if self.groups.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.groups.device)
        return (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )  # CPU: the process's peak RSS

    # ---- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over eval_iters global batches of the valid split (the same batches each time)."""
        t, p = self.cfg.training, self.shape
        if self.data.valid is None or t.eval_iters == 0:
            return None
        for c in self.chunks:
            c.eval()
        data = self.groups.data
        sampler = BatchSampler(len(self.data.valid), t.global_batch_size, t.micro_batch_size,
                               data.rank, data.size, t.seed)  # fmt: skip
        actions = get_schedule(
            p.schedule, p.pp, p.vpp, self.microbatches, self.groups.pp.rank, forward_only=True
        )
        losses = []
        for _ in range(t.eval_iters):
            batch = self._microbatches(self.data.valid, sampler.next_batch())
            result = run_schedule(actions, self.chunks, self.groups, batch, hidden_shape=self.hidden_shape,
                                  dtype=self.dtype, forward_only=True,
                                  placement=p.placement)  # fmt: skip
            losses.append(result.loss)
        return sum(self._mean_over_dp(losses)) / len(losses)

    # ---- the loop -----------------------------------------------------------------------------

    def train(self):
        t = self.cfg.training
        self.logger.print(
            f"training {sum(p.numel() for c in self.chunks for p in c.parameters()):,} parameters on this rank, "
            f"{self.microbatches} micro-batches per step, schedule {self.shape.schedule}"
        )
        with self.checkpointer.catch_preemption():
            while self.iteration < t.train_iters:
                it = self.iteration + 1
                evaluate = t.eval_interval and (it % t.eval_interval == 0 or it == t.train_iters)
                log = evaluate or it % t.log_interval == 0 or it == t.train_iters
                try:
                    metrics = self.train_step(log)
                except RuntimeError as e:
                    if not _lost_peer(e):
                        raise
                    raise MegaliteError(self._collective_failure(e), every_rank=True) from e
                if evaluate:
                    eval_loss = self.evaluate()
                    if eval_loss is not None:
                        metrics["eval_loss"] = eval_loss
                        metrics["eval_ppl"] = math.exp(min(eval_loss, 50))
                if log:
                    self.logger.step(metrics, t.train_iters)
                if self.timeline:
                    self.timeline.step_done(
                        it, self.groups, self._timeline_meta(), self.logger.wandb
                    )
                if self.checkpointer.after_step(self.state, self.stop):  # saved on a signal
                    break
            else:
                self.checkpointer.finish(self.state())
        self.logger.finish()

    def _timeline_meta(self) -> dict:
        p = self.shape
        sizes = " ".join(f"{a}={n}" for a, n in p.sizes)
        return {
            "title": f"{sizes} vpp={p.vpp} {p.schedule}, m={self.microbatches}",
            "bubble_theory": bubble_theory(p.pp, p.vpp, self.microbatches, p.schedule),
        }

    def _collective_failure(self, e: Exception) -> str:
        g = self.groups
        where = "".join(f"{a} {c}, " for a, c in g.topo.coords(g.rank).items() if a != "pp")
        reason = (str(e).strip().splitlines() or ["no reason given"])[0][-160:]
        return (
            f"rank {g.rank} ({where}pipeline stage {g.pp.rank}) gave up in a collective "
            f"of iteration {self.iteration + 1}: another rank died or stalled ({reason}); see its log, or raise "
            "--distributed-timeout-minutes if it was only slow"
        )

    def eval_only(self):
        """--eval-only: the loaded model's eval_loss on the valid split, into the metrics file."""
        eval_loss = self.evaluate()
        if eval_loss is None:
            raise MegaliteError(
                "--eval-only found no validation data; give the valid split a share with --split "
                "(e.g. 90,10,0) and --eval-iters of at least 1"
            )
        metrics = {"iteration": self.iteration, "eval_loss": eval_loss,
                   "eval_ppl": math.exp(min(eval_loss, 50))}  # fmt: skip
        self.logger.print(f"iteration {self.iteration}: eval loss {eval_loss:.4f}")
        self.logger.write(metrics)
        self.logger.finish()


def _lost_peer(e: RuntimeError) -> bool:
    """A collective that timed out or whose peer went away (gloo and NCCL wordings)."""
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e)
    return any(k in text for k in ("Timed out", "timed out", "Connection closed", "pair closure",
                                   "Connection reset", "Broken pipe"))  # fmt: skip
