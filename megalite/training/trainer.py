"""The training loop that every layout runs: data -> schedule -> optimizer step -> metrics.

`train` loops as nanoGPT's does: `train_step` (this DP rank's micro-batches of global batch i,
the same samples for every layout; one pipeline schedule over this rank's model chunks, pp=1
being F0 B0 F1 B1 ...; the optimizer finalises gradients (DP, TP, tied embeddings), clips and
updates), then on their iterations an evaluation, a log line and a save. What watches a step
(hang reports, timeline, profiler, GC, stragglers, spike guard, preemption, the comm ledger)
is one list of observers (observers.py).
"""

import math
import resource
import time

import torch

from megalite import lr_schedule
from megalite.checkpoint.checkpointer import Checkpointer
from megalite.checkpoint.local_restore import Restart
from megalite.checkpoint.local_tier import LocalTier
from megalite.checkpoint.local_tier import check as check_local_tier
from megalite.checkpoint.resume import TrainState, resume_path
from megalite.config import Config
from megalite.data.gpt_dataset import build_datasets
from megalite.data.sampler import BatchSampler, get_batch
from megalite.errors import MegaliteError
from megalite.model.moe import moe_metrics
from megalite.optim.distributed_optimizer import StepReport
from megalite.parallel import comm
from megalite.parallel.context_parallel import shard_batch
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.random import rng_state, seed_replicated, set_rng_state
from megalite.pipeline.executor import first_stage_times, idle_ratio, idle_share
from megalite.pipeline.schedules import bubble_theory
from megalite.shape import RunShape
from megalite.training import observers as watch
from megalite.training.build import build_rank
from megalite.training.flops import (
    device_peak_flops,
    hardware_flops_per_token,
    model_flops_per_token,
)
from megalite.training.hang import HangRecorder
from megalite.training.health import SpikeGuard, StragglerMonitor
from megalite.training.launch_phases import LaunchPhases, format_summary
from megalite.training.logger import Logger
from megalite.training.manual_gc import ManualGC
from megalite.training.preemption import Preemption
from megalite.training.timeline import Timeline
from megalite.training.torch_profile import TorchProfile


class Trainer:
    def __init__(self, cfg: Config, shape: RunShape, groups: ProcessGroups, data=None,
                 launch: LaunchPhases | None = None, logger: Logger | None = None,
                 vocab_from: str = "--vocab-size"):  # fmt: skip
        t = cfg.training
        self.cfg, self.groups = cfg, groups
        self.launch = launch or LaunchPhases()  # time to the first step (launch_phases.py)
        with self.launch.phase("data index"):
            self.data = data or build_datasets(cfg, vocab_from)  # (where its size came from)
        tok = getattr(self.data, "tokenizer", None)
        self.shape = shape = shape.with_vocab(tok.vocab_size) if tok else shape
        # dropout differs across replicas: the data ranks, and the cp ranks (other tokens)
        seed_replicated(t.seed, groups.pp.rank, groups.batch.rank * groups.cp.size + groups.cp.rank)
        # what the run resumes from (--load, or --save's latest), resolved once: the model is
        # built empty for it (the load fills it) and `resume` loads it
        self.resume_from = resume_path(cfg)
        # node-local checkpoints (checkpoint/local_tier.py): the ranks agree on the newest
        # complete copy, local or persistent (local_restore.py), before the model is built
        c, self.restart = cfg.checkpoint, None
        check_local_tier(c, groups.topo.world_size)
        if c.non_persistent_ckpt_type == "local" and c.non_persistent_local_ckpt_dir:
            with self.launch.phase("locate"):
                self.restart = Restart(cfg, groups, self.resume_from).agree()
        loading = self.resume_from is not None or bool(self.restart and self.restart.local)
        with self.launch.phase("model build"):  # chunks, optimizer, schedule
            self.parts = build_rank(cfg, shape, groups, loading=loading)
        # --eval-only without a training split: nothing to sample
        self.sampler = self._sampler(self.data.train) if self.data.train is not None else None
        self.iteration = 0
        # Megatron's schedule (lr_schedule.py): its position is the optimizer's
        # `schedule_samples`; the steps of --train-iters, or counted from --train-samples
        self.lr_schedule = lr_schedule.LRSchedule.from_config(cfg)
        self.train_iters = lr_schedule.train_iters(t, cfg.model.seq_length)
        self.skipped_in_a_row = self.skipped_total = self.spikes_total = 0
        self._interval, self._interval_start = [], time.perf_counter()  # steps since the last log
        self._interval_samples = 0
        # the launch's, opened before the process groups (W&B then logs every line); else here
        self.logger = logger or Logger(cfg, enabled=groups.rank == 0)
        self.peak = device_peak_flops(groups.device, t.precision)
        self.bubble = bubble_theory(shape.pp, shape.vpp, shape.microbatches, shape.schedule)
        self.gc = ManualGC(t.manual_gc, t.manual_gc_interval)
        self.hang = HangRecorder(cfg, shape, groups, shape.microbatches)
        # what watches each step (observers.py), called in this order: the timeline before the
        # hang watch (its gather is in the hang report's previous phase), the stop flags before
        # the loss (the order of the step's read), the stragglers' gather before the ledger's
        # snapshot (which counts it)
        self.preemption = Preemption(t, catch_signals=bool(cfg.checkpoint.save))
        self.stop = watch.Stop(self.preemption)  # why every rank saves and stops (or None)
        guard = SpikeGuard(t.spike_threshold, t.spike_window, t.spike_min_steps)
        self.spikes = watch.SpikeWatch(guard, heads=groups.topo.world_size // shape.pp)
        self.spike_rerun = guard.on and t.spike_rerun
        timeline = Timeline.from_config(cfg, groups)  # --profile-steps A:B, else None
        profile = TorchProfile.from_config(cfg, groups.rank, groups.device)  # --profile
        stragglers = StragglerMonitor(groups.topo, t.straggler_threshold, t.straggler_window)
        sizes = " ".join(f"{a}={n}" for a, n in shape.sizes)
        meta = {"title": f"{sizes} vpp={shape.vpp} {shape.schedule}, m={shape.microbatches}",
                "bubble_theory": self.bubble}  # fmt: skip
        self.watch = watch.Observers(
            timeline and watch.TimelineWatch(timeline, groups, meta, self.logger),
            self.stop,
            self.spikes,
            profile and watch.ProfileWatch(profile),
            watch.FirstStep(self.launch),
            watch.GCWatch(self.gc),
            watch.StragglerWatch(stragglers, groups, self.logger),
            watch.LedgerWatch(groups.ledger),
            watch.HangWatch(self.hang),
        )
        self.checkpointer = Checkpointer(cfg, shape, groups, self.chunks, self.opt,
                                         tok.model_path if tok else None, self.logger.print)  # fmt: skip
        self.local = None  # --non-persistent-save-interval: the local saves
        if c.non_persistent_save_interval:
            self.local = LocalTier(cfg, groups, self.checkpointer, self.logger.print)

    @property
    def chunks(self):
        return self.parts.chunks

    @property
    def opt(self):
        return self.parts.opt

    def _sampler(self, dataset) -> BatchSampler:
        """This DP rank's sampler over `dataset`, split as the run shape says."""
        s, data = self.shape, self.groups.batch
        return BatchSampler(len(dataset), s.global_batch_size, s.micro_batch_size, data.rank,
                            data.size)  # fmt: skip

    # ---- checkpoints: the trainer owns what a checkpoint restores -------------------------------

    def state(self) -> TrainState:
        return TrainState(self.iteration, self.sampler.consumed_samples, self.skipped_total,
                          rng_state(self.chunks, self.groups.device), self.logger.run_ids())  # fmt: skip

    def resume(self) -> TrainState | None:
        """Load --load, or the latest checkpoint in --save, and continue from it."""
        if self.restart is not None and self.restart.local:  # the local tier's copy
            state = self.checkpointer.load(self.restart.fetch(self.chunks), own=True)
            self.restart.done()
        elif self.resume_from is None:
            if self.restart is not None and self.restart.line:
                self.logger.print(f"megalite: {self.restart.line}")
            return None
        else:
            state = self.checkpointer.load(self.resume_from)
        if self.restart is not None and self.restart.line:
            self.logger.print(f"megalite: {self.restart.line}")
        if state is not None:
            self.iteration = state.iteration
            if self.sampler is not None:
                self.sampler.consumed_samples = state.consumed_samples
            self.skipped_total = state.skipped_steps
            if state.schedule_samples is not None and not self.opt.schedule_samples:
                self.opt.resume_schedule(state.schedule_samples)  # Megatron's own position
            elif state.iteration and not self.opt.schedule_samples:
                # no schedule position came with the optimizer (a converted checkpoint, or
                # --no-load-optim): the samples of the steps that updated, at the full batch
                g = self.cfg.training.global_batch_size
                self.opt.resume_schedule(state.consumed_samples - state.skipped_steps * g)
            if state.rng is not None:
                set_rng_state(state.rng, self.chunks, self.groups.device)
            self.logger.resume(state.run_ids, state.iteration)  # the same W&B run, TB dir
        return state

    def save(self):
        self.checkpointer.save(self.state())

    # ---- one step -----------------------------------------------------------------------------

    def _microbatches(self, dataset, indices):
        device, d, cp = self.groups.device, self.cfg.data, self.groups.cp
        cuda = device.type == "cuda"  # pinned host memory: the copy does not wait for the device
        tok = getattr(self.data, "tokenizer", None)
        # this cp rank's tokens of each sample (whole samples at cp=1), documents if asked for
        batch = shard_batch([get_batch(dataset, idx) for idx in indices], cp.size, cp.rank,
                            tok.eos_id if tok else None, d.reset_position_ids,
                            d.reset_attention_mask, d.eod_mask_loss)  # fmt: skip
        return [tuple((x.pin_memory() if cuda and isinstance(x, torch.Tensor) else x)
                      .to(device, non_blocking=cuda) for x in mb) for mb in batch]  # fmt: skip

    def _mean_over_dp(self, values: list[float]) -> list[float]:
        g = self.groups.replica
        t = torch.tensor(values, dtype=torch.float64, device=self.groups.device)
        comm.all_reduce(t, g)
        return (t / g.size).tolist()

    def train_step(self, log: bool = True, batch=None) -> dict | None:
        """One optimizer step on the train split's next global batch (or on `batch`: this
        rank's micro-batches [(tokens, labels, ...)] of it, on its device). It reads the device
        once (the optimizer's status: norm, skip and the observers' flags: preemption, time
        limit, the spike guard's loss); a logging step (`log`) also reads the loss, the
        timings of the steps since the last logging step and the memory, and returns the
        metrics. With --spike-rerun a spiking step runs once more on the same batch."""
        it, seq = self.iteration + 1, self.cfg.model.seq_length
        self.watch.before_step(it)
        # the global batch (a batch-size ramp-up grows it) and this rank's micro-batches of it
        g = lr_schedule.batch_size(self.cfg.training, seq, self.sampler.consumed_samples)
        m = self.shape.microbatches_at(g)
        if batch is None:
            batch = self._microbatches(self.data.train, self.sampler.next_batch(g))
        rates = self.lr_schedule.rates(self.opt.schedule_samples)
        rng = rng_state(self.chunks, self.groups.device) if self.spike_rerun else None
        result, report = self._forward_backward_update(batch, m, g, rates)
        if report.spike and rng is not None:  # the same batch from the same state: the same loss?
            result, report = self.spikes.guard.rerun(
                it, lambda: set_rng_state(rng, self.chunks, self.groups.device),
                lambda: self._forward_backward_update(batch, m, g, rates), self.logger.print)  # fmt: skip
        self.iteration = it
        self._interval.append(result)
        self._interval_samples += g
        self._count_skips(report, result)
        metrics = None
        if log:
            self.watch.phase(it, "logging")
            metrics = self._metrics(result, report, rates)
        self.watch.after_step(it, report)
        return metrics

    def _forward_backward_update(self, batch, m: int, samples: int, rates):
        """The schedule over this rank's chunks (`m` micro-batches' gradients), then the
        optimizer's update of the `samples` global batch, with the step's one device read."""
        it = self.iteration + 1
        for c in self.chunks:
            if not c.training:  # (train() walks every module: skipped when nothing changed)
                c.train()
        self.opt.zero_grad(m)
        self.watch.phase(it, "schedule")
        result = self.parts.run(batch, m, **self.watch.run_hooks(m))
        self.watch.phase(it, "optimizer")
        report = self.opt.step(rates, flags=self.watch.flags(result), guard=self.watch.refuses,
                               samples=samples)  # fmt: skip
        return result, report

    def _metrics(self, result, stats: StepReport, rates) -> dict:
        """What a logging step reports: the loss, and throughput and the pipeline bubble over
        the steps since the last logging step (`first_stage_times` reads their clock marks)."""
        t, shape, m = self.cfg.training, self.shape, self.shape.model
        (loss,) = self._mean_over_dp([result.loss])
        steps = len(self._interval)
        compute, busy = first_stage_times(self._interval, self.groups.pp)
        watched = self.watch.metrics(self._interval)  # stragglers, the step's communication
        now = time.perf_counter()  # after the reads above: the device has caught up
        step_s = (now - self._interval_start) / steps
        samples, self._interval_samples = self._interval_samples, 0
        self._interval, self._interval_start = [], now
        tokens_per_s = samples / steps * m.seq_length / step_s
        world = self.groups.topo.world_size
        pipelined = shape.pp > 1
        return {
            "iteration": self.iteration,
            "loss": loss,
            "grad_norm": stats.grad_norm,
            "lr": rates.lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_s,
            "consumed_samples": self.sampler.consumed_samples,
            "mfu": None if self.peak is None else model_flops_per_token(m) * tokens_per_s / (self.peak * world),
            "hfu": None if self.peak is None else hardware_flops_per_token(m, t.recompute) * tokens_per_s / (self.peak * world),
            # the first stage's idle time over its compute time, over the log interval
            "bubble_measured": idle_ratio(compute, busy) if pipelined else 0.0,
            "bubble_theory": self.bubble,
            # the same idle time as a share of the schedule, and its theory ((p-1)/(v*m+p-1)
            # for 1F1B and interleaved)
            "idle_share": idle_share(compute, busy) if pipelined else 0.0,
            "idle_share_theory": self.bubble / (1 + self.bubble),
            # bytes per rank: parameters (ZeRO-3: shards, and the most gathered at once),
            # gradients, optimizer state
            **self.opt.memory_bytes(),
            "peak_memory_bytes": self._peak_memory(),
            "loss_scale": stats.loss_scale,
            "skipped": stats.skipped,
            "skipped_steps": self.skipped_total,
            "spike": stats.spike,
            "spikes": self.spikes_total,
            **watched,
            # per-layer expert load, auxiliary losses and dropped share since the last logging
            # step (one all-reduce over the world and one host read)
            **(moe_metrics(self.chunks, self.groups.world, m.num_layers, m.num_experts)
               if m.num_experts else {}),
        }  # fmt: skip

    def _count_skips(self, stats: StepReport, result):
        self.spikes_total += stats.spike
        if not stats.skipped:
            self.skipped_in_a_row = 0
            return
        self.skipped_total += 1
        if stats.backing_off:  # fp16's loss scaler finding its scale: not counted as a failure
            return
        self.skipped_in_a_row += 1
        limit = self.cfg.training.max_skipped_steps
        if self.skipped_in_a_row > limit:
            guard = self.spikes.guard
            spike = f" or a loss spike (--spike-threshold {guard.threshold})" if guard.on else ""
            raise MegaliteError(
                f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient{spike} (loss {result.loss}, grad norm "
                f"{stats.grad_norm}) at iteration {self.iteration}; lower --lr or check the data (limit --max-skipped-steps {limit})"
            )

    def _peak_memory(self) -> int:
        if self.groups.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.groups.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: the peak RSS

    # ---- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over eval_iters global batches of the valid split (the same batches each time)."""
        t = self.cfg.training
        if self.data.valid is None or t.eval_iters == 0:
            return None
        for c in self.chunks:
            c.eval()
        sampler = self._sampler(self.data.valid)
        losses = []
        for _ in range(t.eval_iters):
            batch = self._microbatches(self.data.valid, sampler.next_batch())
            losses.append(self.parts.run(batch, self.shape.microbatches, forward_only=True).loss)
        return sum(self._mean_over_dp(losses)) / len(losses)

    # ---- the loop -----------------------------------------------------------------------------

    def train(self):
        """The loop: a step, then on their iterations an evaluation, a log line and a save."""
        t = self.cfg.training
        self.logger.print(
            f"training {sum(p.numel() for c in self.chunks for p in c.parameters()):,} parameters on this rank, "
            f"{self.shape.microbatches} micro-batches per step, schedule {self.shape.schedule}"
        )
        self.logger.begin(self.iteration)  # the ETA counts this run's steps
        with self.preemption.catching(), self.gc.running(), self.hang.reporting():
            while self.iteration < self.train_iters:
                it = self.iteration + 1
                last = it == self.train_iters
                evaluate = t.eval_interval and (it % t.eval_interval == 0 or last)
                log = evaluate or it % t.log_interval == 0 or last
                metrics = self.train_step(log)  # (returns after the step's read of the device)
                if evaluate:
                    self.watch.phase(it, "evaluation")
                    metrics.update(self._eval_metrics(self.evaluate()))
                    self.gc.collect()  # (--manual-gc: every rank, after every evaluation)
                if log:
                    self._log(metrics)
                if self._checkpoint(it):  # a stop (a signal, a limit): saved, every rank leaves
                    break
            else:
                self.watch.phase(self.iteration, "checkpoint")
                self.checkpointer.finish(self.state())
            if self.local is not None:
                self.local.wait()
        self.logger.finish()

    def _eval_metrics(self, eval_loss: float | None) -> dict:
        if eval_loss is None:
            return {}
        return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50))}

    def _log(self, metrics: dict):
        if not self.launch.reported:  # the metrics file's first line: every rank reduces
            metrics["launch"] = self.launch.summary(self.groups.world)
            self.logger.print(format_summary(metrics["launch"]))
        self.logger.step(metrics, self.train_iters)

    def _checkpoint(self, it: int) -> bool:
        """Save if the interval or a stop asks (True: stop now, every rank)."""
        self.watch.phase(it, "checkpoint")
        stop = self.checkpointer.after_step(self.state, self.stop.reason)  # saved when stopping
        if self.local is not None:  # node-local saves, replicated to peers in the background
            self.local.wait() if stop else self.local.after_step(self.state, it)
        return stop

    def eval_only(self):
        """--eval-only: the loaded model's eval_loss on the valid split, into the metrics file."""
        eval_loss = self.evaluate()
        if eval_loss is None:
            raise MegaliteError(
                "--eval-only found no validation data; give the valid split a share with --split "
                "(e.g. 90,10,0) and --eval-iters of at least 1"
            )
        metrics = {"iteration": self.iteration, **self._eval_metrics(eval_loss)}
        self.logger.print(f"iteration {self.iteration}: eval loss {eval_loss:.4f}")
        self.logger.write(metrics, merge=True)  # beside the training row of its iteration
        self.logger.finish()
