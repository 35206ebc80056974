"""AdamW over DP-sharded flat buffers (ZeRO 0-3), with mixed precision and global clipping.

The optimizer steps the gradient buffers it is given (parallel/buffers.Buffers, made by
parallel/data_parallel.build_buffers): it builds none and hooks nothing. Each bucket has this
rank's shard (the whole bucket at stage 0); the fp32 master weights (only when parameters are
bf16/fp16) and the Adam moments exist for that shard alone, so at stage >= 1 a rank holds 12/dp
bytes of optimizer state per parameter. A step:

  1. finalise gradients: wait for the DP reductions (with --dp-replicate, then each shard's
     all-reduce over the copies of its shard group), then sum the gradients each rank holds only
     part of (ParamSpec.grad_sum): over TP (sequence-parallel norms, replicated k/v), over
     `embed` (the tied embedding's two halves on the first and last stage)
  2. global norm over TP, PP (and DP where gradients are sharded) plus an inf/nan check and the
     caller's flags, in one all-reduce and one host read (the only one in a training step);
     any non-finite gradient skips the step on every rank
  3. unscale (fp16) and clip in one multiply, AdamW on the shards (or Muon: optim/muon.py,
     each matrix orthogonalised once, by one owner over DP and TP), masters -> parameters
  4. stage 1/2: all-gather the updated parameter shards into the flat parameter buffer, by
     default overlapped with the next forward (each bucket waited for where it is first read);
     stage 3 keeps the shards, gathered unit by unit where they are used (parallel/zero3.py)

The AdamW arithmetic is torch.optim.AdamW(fused=True)'s kernel, element for element, over the
shards (optim/adamw.py: two calls a step, whatever the number of buckets).
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from megalite.config import Config
from megalite.lr_schedule import Rates
from megalite.model.moe import update_expert_bias
from megalite.optim.adamw import adamw, complement
from megalite.optim.clip_grad import clip_coefficient, step_status
from megalite.optim.loss_scaler import scaler_for
from megalite.optim.muon import muon_state
from megalite.parallel import comm
from megalite.parallel.buckets import ParamRange
from megalite.parallel.buffers import Buffers
from megalite.parallel.data_parallel import build_buffers
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.specs import spec_of


@dataclass(frozen=True)
class StepReport:
    """What one optimizer step reports; the same on every rank (one reduction decided it)."""

    grad_norm: float  # the global norm, unscaled, before clipping (inf or nan if not finite)
    finite: bool  # no gradient on any rank was inf or nan
    spike: bool  # the caller's guard refused the step
    skipped: bool  # no update: not finite, or a spike
    loss_scale: float  # after this step's update of the scaler (1.0 without fp16)
    flags: dict[str, float] = field(default_factory=dict)  # the caller's, summed over the world
    # an fp16 overflow the dynamic loss scaler still answers by backing off (Megatron skips
    # such steps at the start of every fp16 run: they are not errors)
    backing_off: bool = False


@dataclass(frozen=True)
class StatePiece:
    """This rank's part of one parameter in its shards (what a checkpoint writes of it)."""

    range: ParamRange  # the parameter and where it lies in its bucket
    lo: int  # the part is [lo, hi) of the flattened parameter
    hi: int
    views: dict[str, torch.Tensor]  # "param" and each optimizer kind: 1-D views of the part
    writes: bool  # this rank is the one of its DP group to save it


def _merge(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(segments):
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return [tuple(s) for s in out]


class DistributedOptimizer:
    def __init__(self, chunks: list[nn.Module], buffer: Buffers, groups: ProcessGroups,
                 cfg: Config):  # fmt: skip
        """Steps `buffer`, the gradient buffers of `chunks` (data_parallel.build_buffers);
        `chunks` are read for MoE's expert bias alone."""
        o, t = cfg.optimizer, cfg.training
        self.groups, self.opt_cfg = groups, o
        self.chunks, self.model_cfg = chunks, cfg.model
        self.buffer = buf = buffer
        self._bucket_index = {b: i for i, b in enumerate(buf.buckets)}
        self.scaler = scaler_for(t.precision, o)  # fp16's dynamic one, a static --loss-scale

        # Optimizer state for this rank's shard of each bucket.
        low = buf.param_dtype in (torch.bfloat16, torch.float16)
        state_dtype = torch.float32 if low else buf.param_dtype
        shards = [buf.param_shard(b) for b in buf.buckets]
        self.masters = [s.to(state_dtype, copy=True) for s in shards] if low else None
        self.step_count = 0
        # the learning-rate schedule's position (lr_schedule.py): samples of the successful
        # steps; a checkpoint without it (older) had a constant batch of this size
        self.schedule_samples, self._batch = 0, t.global_batch_size
        # --optimizer muon: the matrices' momentum orthogonalised, AdamW for the rest (muon.py)
        decay = lambda r: not spec_of(r.param).no_weight_decay  # noqa: E731
        self.muon = muon_state(o, buf, groups.tp, state_dtype, decay)
        if self.muon:  # (its momentum shares exp_avg; exp_avg_sq holds AdamW's elements only)
            self.exp_avg, self.exp_avg_sq = self.muon.exp_avg, self.muon.exp_avg_sq
        else:
            self.exp_avg = [torch.zeros_like(s, dtype=state_dtype) for s in shards]
            self.exp_avg_sq = [torch.zeros_like(s, dtype=state_dtype) for s in shards]

        # Per bucket shard: where weight decay applies, which elements count in the norm.
        self._decay = [[] for _ in buf.buckets]
        self._norm = [[] for _ in buf.buckets]
        # --decoupled-lr: the embedding and output layer (the vocabulary's tensors) own an lr
        self._embedding = [[] for _ in buf.buckets]
        for r in buf.ranges:
            b, i, spec = r.bucket, self._bucket_index[r.bucket], spec_of(r.param)
            s = r.shard_slice()
            if s is not None and not spec.no_weight_decay:
                self._decay[i].append(s[:2])
            if s is not None and o.decoupled_lr is not None and spec.vocab_dim is not None:
                self._embedding[i].append(s[:2])
            # Each rank counts its 1/dp of every bucket in the norm, also at stage 0 where it
            # holds all of it: the norm and the inf check can then be summed over the world.
            # With copies of the shard group (--dp-replicate) each copy counts a piece of that
            # 1/dp (`counted`, buffers.place): summed over the world, every element once.
            # Expert tensors are split, so they count on every rank: ep ranks hold different
            # experts, and their replicas (edp, TP ranks included) count 1/edp of each bucket.
            n = r.overlap(*b.counted)
            if n is not None and spec.counted_in_norm(groups.tp.rank):
                self._norm[i].append((n[0] - b.shard_start, n[1] - b.shard_start))
        self._decay = [_merge(s) for s in self._decay]
        self._embedding = [_merge(s) for s in self._embedding]
        self._norm = [_merge(s) for s in self._norm]
        # What the norm does not read is still checked for inf/nan, each element once.
        self._rest = [
            complement(segs, b.shard_end - b.shard_start)
            for segs, b in zip(self._norm, buf.buckets)
        ]
        # Gradients each rank holds only part of, by the group that sums them.
        self._partial = {}
        for r in buf.ranges:
            for g in spec_of(r.param).grad_sum:
                self._partial.setdefault(g, []).append(r)
        self._finalised = False

    # ---- the trainer's interface ----------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def zero_grad(self, microbatches: int):
        """Start a step; `microbatches` backward passes follow (the run shape's count)."""
        self.buffer.zero_grad(microbatches)
        self._finalised = False

    def step(self, lr: Rates | float, flags: dict | None = None, guard=None,
             samples: int = 0) -> StepReport:  # fmt: skip
        """Clip and update with `lr` (the schedule's Rates, or one learning rate with
        --weight-decay); an update advances `schedule_samples` by `samples`. `flags` ({name: float, or a 0-d tensor on the device such as the
        trainer's loss}) are summed over the world in the same reduction as the norm and
        reported by name (the trainer's preemption signal, time limit and loss).
        `guard(flags) -> bool`, when given, decides from them before the update: True skips
        the step like a non-finite one (`spike`; the loss scale is left as it is)."""
        self.finalise_grads()
        buf, o = self.buffer, self.opt_cfg
        buf.wait_params()  # (normally done already: the forward waited for every bucket)
        grads = [b.shard_grad for b in buf.buckets]
        if self.masters and grads and grads[0].dtype != self.masters[0].dtype:
            # --grad-reduce-in-bf16: the norm, clipping and update on fp32 copies (Megatron's
            # main_param.grad = main_grad.float())
            grads = [g.float() for g in grads]
        counted = [g[lo:hi] for g, segs in zip(grads, self._norm) for lo, hi in segs]
        rest = [g[lo:hi] for g, segs in zip(grads, self._rest) for lo, hi in segs]
        names = list(flags or {})
        sumsq, nonfinite, *values = step_status(
            counted, rest, self.groups.world, [flags[n] for n in names]
        )
        summed = dict(zip(names, values))
        found_inf = nonfinite > 0
        spike = not found_inf and guard is not None and guard(summed)
        scale = self.loss_scale
        backing_off = found_inf and self.scaler is not None and self.scaler.can_back_off()
        norm = (math.sqrt(sumsq) if sumsq >= 0 else sumsq) / scale
        if self.scaler and not spike:
            self.scaler.update(found_inf)
        report = StepReport(norm, not found_inf, spike, found_inf or spike, self.loss_scale, summed,
                            backing_off)  # fmt: skip
        if report.skipped:
            return report
        factor = clip_coefficient(norm, o.clip_grad) / scale
        if factor != 1.0:
            for g in grads:
                g.mul_(factor)
        self._adamw(lr if isinstance(lr, Rates) else Rates(lr, o.weight_decay, lr), grads)
        self.schedule_samples += samples
        buf.all_gather_params(overlap=o.overlap_param_gather)
        return report

    def _adamw(self, rates: Rates, grads: list[torch.Tensor]):
        """The AdamW update of this rank's shards (optim/adamw.py), into the fp32 masters
        when there are any, copied back to the parameters."""
        o, buf = self.opt_cfg, self.buffer
        self.step_count += 1
        shards = [buf.param_shard(b) for b in buf.buckets]
        weights = self.masters or shards
        if self.muon:
            self.muon.step(weights, grads, rates, self.step_count)
        else:
            adamw(weights, grads, self.exp_avg, self.exp_avg_sq, self._decay, rates,
                  self.step_count, o, self._embedding)  # fmt: skip
        if self.masters:
            torch._foreach_copy_(shards, self.masters)

    @contextmanager
    def gathered_params(self, write_back: bool = False):
        """The parameters whole and readable in the block (collective over DP at ZeRO-3, which
        gathers them; `write_back`: what the block wrote into them becomes the shards)."""
        with self.buffer.gathered(write_back):
            yield

    def memory_bytes(self) -> dict:
        """Bytes this rank holds for parameters (ZeRO-3: its shards; `param_gathered_peak_bytes`
        the most held gathered at once in the step), gradients and optimizer state."""
        return {**self.buffer.memory_bytes(), "optimizer_state_bytes": self.state_bytes()}

    def wait_params(self):
        """Wait for the parameter gathers of the last step (a forward waits for the buckets it
        reads by itself; whoever reads parameters otherwise calls this first)."""
        self.buffer.wait_params()

    def finalise_grads(self):
        """The DP reduction, then the sums of partial gradients (TP, the tied embedding)."""
        if self._finalised:
            return
        self.buffer.finish()
        for group, ranges in sorted(self._partial.items()):
            if group == "embed" and len(ranges) == 2:
                # Both halves of the tied embedding are on this rank (it holds the first and the
                # last virtual stage: pp=1 with vpp>1): the sum is local. Each has a bucket of
                # its own, so their shards line up.
                a, b = self._views(ranges) or (None, None)
                if a is not None:
                    a.add_(b)
                    b.copy_(a)
                continue
            self._sum_over(ranges, getattr(self.groups, group))
        if self.model_cfg.moe_router_enable_expert_bias:  # every rank: a world all-reduce
            update_expert_bias(self.chunks, self.groups.world, self.model_cfg.num_layers)
        self._finalised = True

    def _views(self, ranges: list[ParamRange]) -> list[torch.Tensor]:
        """The gradient pieces of `ranges` in this rank's shards."""
        views = []
        for r in ranges:
            s = r.shard_slice()
            if s is not None:
                views.append(r.bucket.shard_grad[s[0] : s[1]])
        return views

    def _sum_over(self, ranges: list[ParamRange], group):
        """All-reduce the gradient pieces of `ranges` that this rank holds, as one message.
        Peers hold the same pieces: TP ranks share a layout, tied halves have own buckets."""
        if group is None or group.size == 1:
            return  # (a middle stage has no embed group; its chunks hold no tied half either)
        views = self._views(ranges)
        if not views:
            return
        flat = torch.cat(views)
        comm.all_reduce(flat, group)
        offset = 0
        for v in views:
            v.copy_(flat[offset : offset + v.numel()])
            offset += v.numel()

    # ---- state for checkpoints and reports ------------------------------------------------

    def state_kinds(self, name: str, spec) -> tuple[str, ...]:
        """The optimizer state kinds a parameter has (besides "master")."""
        return self.muon.kinds(name, spec) if self.muon else ("exp_avg", "exp_avg_sq")

    def _state_views(self, r: ParamRange, i: int, lo: int, hi: int) -> dict:
        """The state of the piece [lo, hi) of bucket i's shard, which range r holds, by kind."""
        if self.muon:
            return self.muon.views(r, i, lo, hi)
        return {"exp_avg": self.exp_avg[i][lo:hi], "exp_avg_sq": self.exp_avg_sq[i][lo:hi]}

    def state_bytes(self) -> int:
        tensors = self.exp_avg + self.exp_avg_sq + (self.masters or [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _per_param(self, shards: list[torch.Tensor], skip_tied=True) -> dict[str, torch.Tensor]:
        """Full per-parameter tensors from per-bucket shards (collective over DP)."""
        full = self.buffer.gather_shards(shards)
        out = {}
        for r in self.buffer.ranges:
            if skip_tied and spec_of(r.param).tied_to:
                continue
            o = r.offset - r.bucket.start
            flat = full[self._bucket_index[r.bucket]]
            out[r.name] = flat[o : o + r.param.numel()].view_as(r.param).clone()
        return out

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        self.buffer.wait_params()  # the caller reads the parameters next (checkpoints)
        kinds = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.muon:
            kinds = self.muon.flat()
        if self.masters:
            kinds["master"] = self.masters
        once = {}  # (Muon's momentum and AdamW's first moment share their shards)
        gathered = {k: once.get(id(v)) or once.setdefault(id(v), self._per_param(v))
                    for k, v in kinds.items()}  # fmt: skip
        specs = {r.name: spec_of(r.param) for r in self.buffer.ranges}
        own = lambda n: (*self.state_kinds(n, specs[n]), *(("master",) if self.masters else ()))  # noqa: E731
        return {n: {k: gathered[k][n] for k in own(n)} for n in gathered["exp_avg"]}

    def state_pieces(self):
        """This rank's part of the weights and the optimizer state, parameter by parameter,
        without a collective (what a checkpoint writes): a StatePiece for each parameter with a
        part in this rank's shards. It `writes` when the buffer says this rank saves the
        bucket's shard (every rank its own when the state is sharded, DP rank 0 otherwise).
        Tied copies are left out."""
        self.buffer.wait_params()  # the parameter gathers write into the flat buffer
        for r in self.buffer.ranges:
            s, b = r.shard_slice(), r.bucket
            if s is None or spec_of(r.param).tied_to:
                continue
            i, (lo, hi, plo, phi) = self._bucket_index[b], s
            views = {"param": self.buffer.param_shard(b)[lo:hi]}
            views.update(self._state_views(r, i, lo, hi))
            if self.masters:
                views["master"] = self.masters[i][lo:hi]
            yield StatePiece(r, plo, phi, views, self.buffer.saves(b))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The finalised gradient of every parameter, tied copies included (for tests and
        debugging; after step() they are unscaled and clipped)."""
        self.finalise_grads()
        return self._per_param([b.shard_grad for b in self.buffer.buckets], skip_tied=False)

    @torch.no_grad()
    def load_state_tensors(self, d: dict[str, dict]):
        """Take this rank's shard of full per-parameter tensors (the inverse of state_tensors).
        A value may also be read lazily: any object whose [lo:hi] gives that flat range of the
        parameter's tensor (a checkpoint reads only this rank's shard: regions.load_optimizer).
        Without "master" the masters start from the parameters; with it and fp32 parameters,
        the parameters take the master values."""
        with self.gathered_params(write_back=True):
            self._load_state_tensors(d)

    def _load_state_tensors(self, d: dict[str, dict]):
        flat = lambda x: x.reshape(-1) if isinstance(x, torch.Tensor) else x  # noqa: E731
        for r in self.buffer.ranges:
            name = spec_of(r.param).tied_to or r.name
            if name not in d:
                raise KeyError(f"optimizer state for {name} is missing")
            entry, s = d[name], r.shard_slice()
            i = self._bucket_index[r.bucket]
            if s is not None:
                lo, hi, plo, phi = s
                for k, view in self._state_views(r, i, lo, hi).items():
                    if k not in entry:
                        raise KeyError(f"optimizer state {k} for {name} is missing")
                    view.copy_(flat(entry[k])[plo:phi])
                if self.masters:
                    src = entry["master"] if "master" in entry else r.param
                    self.masters[i][lo:hi].copy_(flat(src)[plo:phi])
            if not self.masters and "master" in entry:
                r.param.copy_(flat(entry["master"])[: r.param.numel()].view(r.param.shape))

    def scalar_state(self) -> dict:
        return {"step": self.step_count, "schedule_samples": self.schedule_samples,
                **(self.scaler.state_dict() if self.scaler else {})}  # fmt: skip

    def resume_schedule(self, samples: int):
        """Place the learning-rate schedule at `samples` (a resume without its position)."""
        self.schedule_samples = max(0, samples)

    def load_scalar_state(self, d: dict):
        self.step_count = int(d["step"])
        self.schedule_samples = int(d.get("schedule_samples", self.step_count * self._batch))
        if self.scaler and "loss_scale" in d:
            self.scaler.load_state_dict(d)


def build_optimizer(chunks: list[nn.Module], groups: ProcessGroups, cfg: Config):
    """The buffers of `chunks` (parallel/data_parallel.build_buffers), then their optimizer."""
    return DistributedOptimizer(chunks, build_buffers(chunks, groups, cfg), groups, cfg)
