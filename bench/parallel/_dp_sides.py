"""The two sides bench_dp.py times (its docstring describes them), with the hyperparameters
they share: megalite's ZeRO step (`megalite_side`: the pipeline executor at pp=1 and
`DistributedOptimizer`) and torch's (`torch_side`: DDP or FSDP2, torch.optim.AdamW), over the
same `GPTChunk` and the same initial weights; each rank's batches (`make_batches`) and the bytes
a set of tensors keeps (`storage_bytes`). bench_deepspeed.py, zero3_timeline.py and
profile_peers.py run these sides too."""

import torch
from megalite.kernels import TORCH_OPS

from bench._common import timed
from megalite.config import Config, ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel.specs import spec_of
from megalite.shape import validate
from megalite.training.build import build_rank

LR, WD, BETAS, EPS, CLIP = 1e-4, 0.1, (0.9, 0.95), 1e-8, 1.0
# torch.optim.AdamW's implementations (CPU: the single-tensor loop is torch's default there)
ADAMW_IMPL = {"foreach": dict(foreach=True), "fused": dict(fused=True),
              "single": dict(foreach=False)}  # fmt: skip


def model_config(a) -> ModelConfig:
    return ModelConfig(
        flavour="llama", num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        seq_length=a.seq, vocab_size=a.vocab,
    )  # fmt: skip


def storage_bytes(tensors) -> int:
    """The bytes of the storages behind `tensors`, each storage once (a DTensor: this rank's
    shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # DTensor (FSDP2): this rank's shard
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _megalite_cfg(a, m, stage, precision="fp32", keep_params=False) -> Config:
    cfg = Config()
    cfg.model = m
    o = cfg.optimizer
    o.zero_stage, o.clip_grad, o.weight_decay, o.bucket_size_mb = stage, CLIP, WD, a.bucket_mb
    o.zero3_keep_params = keep_params
    o.adam_beta1, o.adam_beta2 = BETAS
    o.adam_eps = EPS
    cfg.training.micro_batch_size, cfg.training.global_batch_size = a.mbs, a.gbs
    cfg.training.precision, cfg.training.kernels = precision, "torch"
    return cfg


def megalite_rank(a, m, groups, stage, precision="fp32", keep_params=False):
    cfg = _megalite_cfg(a, m, stage, precision, keep_params)
    return build_rank(cfg, validate(cfg, groups.topo.world_size), groups)


def megalite_side(a, m, groups, stage, keep_params=False):
    """`keep_params`: ZeRO-3 with --zero3-keep-params (each layer gathered once a micro-batch)."""
    parts = megalite_rank(a, m, groups, stage, keep_params=keep_params)  # 1F1B, pp=1
    opt = parts.opt

    def step(batch):
        opt.zero_grad(parts.microbatches)  # (the run shape's count)
        r = parts.run(batch)
        with timed() as t:
            opt.finalise_grads()  # the DP reductions still in flight after backward
        step.wait_s += t.wall
        with timed() as t:
            opt.step(LR)  # the global norm, clipping, AdamW (and ZeRO-1/2's gather launch)
        step.opt_s += t.wall
        return r

    def persistent():
        buf = opt.buffer
        grads = [buf.grad_buffer] if buf.grad_buffer is not None else []
        grads += [] if buf.zero.grad_buffer else [b.shard_grad for b in buf.buckets]
        return storage_bytes([buf.param_buffer, *grads]) + opt.state_bytes()

    step.wait_s = step.opt_s = 0.0
    step.persistent, step.opt, step.finish = persistent, opt, opt.wait_params
    step.loss = lambda r: r.loss
    return step


def torch_side(a, m, method):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = GPTChunk(m, LayerEnv(ops=TORCH_OPS, seed=1234))
    decay = [p for p in model.parameters() if not spec_of(p).no_weight_decay]
    other = [p for p in model.parameters() if spec_of(p).no_weight_decay]
    if method == "ddp":
        fwd = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=a.bucket_mb)
    else:
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fwd = fully_shard(model, mesh=mesh, reshard_after_forward=False)
        decay = [p for p in model.parameters() if p.dim() >= 2]  # DTensors now (no specs):
        other = [p for p in model.parameters() if p.dim() < 2]  # the norms are the 1-d ones
    params = decay + other
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS, **ADAMW_IMPL[a.torch_adamw],
    )  # fmt: skip

    def step(batch):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k, (tokens, labels) in enumerate(batch):
            last = k == len(batch) - 1
            if method == "ddp" and not last:
                with fwd.no_sync():
                    loss = fwd(tokens, labels)
                    (loss / len(batch)).backward()
            else:
                if method == "fsdp2":  # keep the parameters gathered until the last micro-batch
                    fwd.set_reshard_after_backward(last)
                loss = fwd(tokens, labels)
                (loss / len(batch)).backward()
            total += loss.detach()
        with timed() as t:
            norm = torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            opt.step()
        step.opt_s += t.wall
        return total / len(batch)

    def persistent():
        ps = list(model.parameters())
        state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        state = [v for v in state if v.numel() > 1]  # not the step counters
        return storage_bytes(ps + [p.grad for p in ps] + state)

    step.opt_s = 0.0
    step.persistent, step.finish = persistent, lambda: None
    step.loss = lambda r: float(r)
    return step


def make_batches(a, m, rank, n):
    """n steps of this rank's micro-batches [(tokens, labels)]: its half of the global batch."""
    g = torch.Generator().manual_seed(100 + rank)
    micro = a.gbs // (2 * a.mbs)
    out = []
    for _ in range(n):
        toks = torch.randint(0, m.vocab_size, (micro, a.mbs, a.seq + 1), generator=g)
        out.append([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks])
    return out
