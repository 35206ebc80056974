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
from megalite.checkpoint.checkpointer import Checkpointer
from megalite.config import Config
from megalite.data.gpt_dataset import build_datasets
from megalite.data.sampler import BatchSampler, get_batch
from megalite.errors import MegaliteError
from megalite.model.gpt import GPTChunk
from megalite.optim.distributed_optimizer import build_optimizer
from megalite.optim.lr_schedule import lr_at
from megalite.parallel import comm
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.random import seed_replicated
from megalite.pipeline.executor import run_schedule
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import bubble_theory, get_schedule
from megalite.training.flops import (
    device_peak_flops,
    hardware_flops_per_token,
    model_flops_per_token,
)
from megalite.training.logger import Logger
from megalite.training.timeline import Timeline

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer:
    def __init__(self, cfg: Config, groups: ProcessGroups, data=None):
        self.cfg, self.groups = cfg, groups
        m, p, t = cfg.model, cfg.parallel, cfg.training
        self.data = data or build_datasets(cfg)  # sets cfg.model.vocab_size from the tokenizer
        seed_replicated(t.seed, groups.pp.rank, groups.dp.rank)
        ops = kernels.select(t.kernels, groups.device)
        self.dtype = DTYPES[t.precision]
        self.chunks = [
            GPTChunk(m, groups.tp, **kw, sequence_parallel=p.sequence_parallel, ops=ops, recompute=t.recompute,
                     seed=t.seed, dtype=self.dtype, device=groups.device)
            for kw in rank_chunks(m.num_layers, p.pp, p.vpp, groups.pp.rank)
        ]  # fmt: skip
        self.opt = build_optimizer(self.chunks, groups, cfg)
        self.microbatches = t.global_batch_size // (t.micro_batch_size * p.dp)
        self.actions = get_schedule(p.pp_schedule, p.pp, p.vpp, self.microbatches, groups.pp.rank)
        seq = m.seq_length // p.tp if p.sequence_parallel else m.seq_length
        self.hidden_shape = (t.micro_batch_size, seq, m.hidden_size)
        self.sampler = BatchSampler(len(self.data.train), t.global_batch_size, t.micro_batch_size,
                                    groups.dp.rank, p.dp, t.seed)  # fmt: skip
        self.iteration = 0
        self.skipped_in_a_row = 0
        self.skipped_total = 0
        self.logger = Logger(cfg, enabled=groups.rank == 0)
        self.peak = device_peak_flops(groups.device, t.precision)
        self.timeline = Timeline.from_config(cfg, groups)  # --profile-steps A:B, else None
        self.checkpointer = Checkpointer(self)  # launch calls its resume(); train() saves

    # ---- one step -----------------------------------------------------------------------------

    def _microbatches(self, dataset, indices):
        return [tuple(x.to(self.groups.device) for x in get_batch(dataset, idx)) for idx in indices]

    def _mean_over_dp(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.groups.device)
        comm.all_reduce(t, self.groups.dp)
        return (t / self.groups.dp.size).tolist()

    def train_step(self) -> dict:
        t = self.cfg.training
        self.groups.ledger.reset()
        start = time.perf_counter()
        for c in self.chunks:
            c.train()
        batch = self._microbatches(self.data.train, self.sampler.next_batch())
        self.opt.zero_grad(len(batch))
        tl = self.timeline.at(self.iteration + 1) if self.timeline else None
        result = run_schedule(self.actions, self.chunks, self.groups, batch, hidden_shape=self.hidden_shape,
                              dtype=self.dtype, loss_scale=self.opt.loss_scale, timeline=tl)  # fmt: skip
        lr = lr_at(self.iteration, self.cfg.optimizer, t.train_iters)
        t_opt = time.perf_counter()
        stats = self.opt.step(lr)
        self.iteration += 1
        if self.groups.device.type == "cuda":
            torch.cuda.synchronize()
        if tl:
            tl.record("optimizer", t_opt, time.perf_counter())
        step_s = time.perf_counter() - start
        (loss,) = self._mean_over_dp([result.loss])
        self._count_skips(stats["skipped"], loss, stats["grad_norm"])
        tokens_per_s = t.global_batch_size * self.cfg.model.seq_length / step_s
        world = self.groups.topo.world_size
        p = self.cfg.parallel
        metrics = {
            "iteration": self.iteration,
            "loss": loss,
            "grad_norm": stats["grad_norm"],
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_s,
            "consumed_samples": self.sampler.consumed_samples,
            "mfu": None if self.peak is None else model_flops_per_token(self.cfg.model) * tokens_per_s / (self.peak * world),
            "hfu": None if self.peak is None else hardware_flops_per_token(self.cfg.model, t.recompute) * tokens_per_s / (self.peak * world),
            "bubble_measured": result.bubble_ratio if p.pp > 1 else 0.0,
            "bubble_theory": bubble_theory(p.pp, p.vpp, self.microbatches) if p.pp > 1 else 0.0,
            "comm_bytes": {k: v["bytes"] for k, v in self.groups.ledger.snapshot().items()},
            "comm": self.groups.ledger.snapshot(),
            "optimizer_state_bytes": self.opt.state_bytes(),
            "peak_memory_bytes": self._peak_memory(),
            "loss_scale": stats["loss_scale"],
            "skipped": stats["skipped"],
            "skipped_steps": self.skipped_total,
        }  # fmt: skip
        return metrics

    def _count_skips(self, skipped: bool, loss: float, grad_norm: float):
        if not skipped and math.isfinite(loss):
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        limit = self.cfg.training.max_skipped_steps
        if self.skipped_in_a_row > limit:
            raise MegaliteError(
                f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient (loss {loss}, grad norm "
                f"{grad_norm}) at iteration {self.iteration}; lower --lr or check the data (limit --max-skipped-steps {limit})"
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
        t, p = self.cfg.training, self.cfg.parallel
        if self.data.valid is None or t.eval_iters == 0:
            return None
        for c in self.chunks:
            c.eval()
        sampler = BatchSampler(len(self.data.valid), t.global_batch_size, t.micro_batch_size,
                               self.groups.dp.rank, p.dp, t.seed)  # fmt: skip
        actions = get_schedule(
            p.pp_schedule, p.pp, p.vpp, self.microbatches, self.groups.pp.rank, forward_only=True
        )
        losses = []
        for _ in range(t.eval_iters):
            batch = self._microbatches(self.data.valid, sampler.next_batch())
            result = run_schedule(actions, self.chunks, self.groups, batch, hidden_shape=self.hidden_shape,
                                  dtype=self.dtype, forward_only=True)  # fmt: skip
            losses.append(result.loss)
        return sum(self._mean_over_dp(losses)) / len(losses)

    # ---- the loop -----------------------------------------------------------------------------

    def train(self):
        t = self.cfg.training
        self.logger.print(
            f"training {sum(p.numel() for c in self.chunks for p in c.parameters()):,} parameters on this rank, "
            f"{self.microbatches} micro-batches per step, schedule {self.cfg.parallel.pp_schedule}"
        )
        with self.checkpointer.catch_preemption():
            while self.iteration < t.train_iters:
                try:
                    metrics = self.train_step()
                except RuntimeError as e:
                    if not _lost_peer(e):
                        raise
                    raise MegaliteError(self._collective_failure(e), every_rank=True) from e
                it = self.iteration
                if t.eval_interval and (it % t.eval_interval == 0 or it == t.train_iters):
                    eval_loss = self.evaluate()
                    if eval_loss is not None:
                        metrics["eval_loss"] = eval_loss
                        metrics["eval_ppl"] = math.exp(min(eval_loss, 50))
                if it % t.log_interval == 0 or it == t.train_iters or "eval_loss" in metrics:
                    self.logger.step(metrics, t.train_iters)
                if self.timeline:
                    self.timeline.step_done(
                        it, self.groups, self._timeline_meta(), self.logger.wandb
                    )
                if self.checkpointer.after_step():  # saved on preemption: stop cleanly
                    break
            else:
                self.checkpointer.finish()
        self.logger.finish()

    def _timeline_meta(self) -> dict:
        p = self.cfg.parallel
        return {
            "title": f"tp={p.tp} pp={p.pp} dp={p.dp} vpp={p.vpp} {p.pp_schedule}, m={self.microbatches}",
            "bubble_theory": bubble_theory(p.pp, p.vpp, self.microbatches),
        }

    def _collective_failure(self, e: Exception) -> str:
        g = self.groups
        reason = (str(e).strip().splitlines() or ["no reason given"])[0][-160:]
        return (
            f"rank {g.rank} (tp {g.tp.rank}, pipeline stage {g.pp.rank}, dp {g.dp.rank}) gave up in a collective "
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
