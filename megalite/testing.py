"""What tests and benchmarks share: ranks spawned over gloo, a count of host syncs, tiny runs.

- `spawn(fn, n, *args)` runs `fn(rank, n, *args)` in n processes with torch.distributed already
  initialised (gloo, a `file://` rendezvous: no ports), and returns the list of their return
  values. An exception on any rank fails the caller with that rank's traceback; a rank that hangs
  past `timeout` fails it too (all ranks are killed), so a stuck collective never hangs a suite.
  `CONTEXT` is the multiprocessing context it starts them with (forkserver, torch preloaded).
- `HostSyncCounter` counts the places a step would make the host wait for the device, on a CPU
  run. A CPU has no device to wait for, so the count comes from what the code asks for: every op
  whose result the host must read (`.item()`, `bool(t)` and `float(t)` through
  `_local_scalar_dense`, `nonzero`, boolean-mask indexing, `masked_select`, `unique`, ...) seen
  by a dispatch mode, plus `Tensor.tolist`, `Tensor.numpy` (which do not dispatch) and
  `torch.cuda.synchronize` / `Event.synchronize` / `Stream.synchronize`, patched. The dispatch
  mode is thread-local: CPU autograd runs backward in the calling thread, so backward is counted.
- `tiny_config()` and `tiny_trainer(cfg)`: a tiny model and the real Trainer over random tokens,
  for driving a whole run in spawned ranks.
- `SleepChunk`: a pipeline chunk that sleeps instead of computing, so that a step's time is set
  by the schedule alone (its bubble, its messages, the executor's overhead).

Nothing here is imported by the training code; it sits at the top of the layers, beside cli.
"""

import contextlib
import os
import tempfile
import time
import traceback
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.config import Config
from megalite.parallel.groups import build_groups
from megalite.shape import validate

# ---- spawning ranks ---------------------------------------------------------------------------
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])


def _entry(rank, world_size, tmp, fn, args):
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size
        )
        result = fn(rank, world_size, *args)
        with open(f"{tmp}/out.{rank}", "wb") as fh:
            torch.save(result, fh)  # read back with weights_only: no pickle code runs
        if dist.is_initialized():  # (unless fn tore it down itself)
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        with open(f"{tmp}/err.{rank}", "w") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)


def spawn(fn, world_size, *args, timeout=180):
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            CONTEXT.Process(target=_entry, args=(r, world_size, tmp, fn, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = None
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                break
            for r, p in enumerate(procs):
                if not p.is_alive() and p.exitcode not in (0, None) and failed is None:
                    failed = r
            if failed is not None:
                time.sleep(2)  # let the other ranks write their own errors first
                break
            time.sleep(0.05)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = {
            r: open(f"{tmp}/err.{r}").read()
            for r in range(world_size)
            if os.path.exists(f"{tmp}/err.{r}")
        }
        if errors:
            # a crashed rank makes its peers fail with "connection closed": show the cause first
            secondary = ("Connection closed", "Connection reset", "Broken pipe")
            r = min(errors, key=lambda r: (any(m in errors[r] for m in secondary), r))
            raise AssertionError(f"rank {r} of {world_size} failed:\n{errors[r]}")
        if alive:
            raise TimeoutError(
                f"ranks {alive} of {world_size} still running after {timeout}s (hang?)"
            )
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks {bad} exited with {[procs[r].exitcode for r in bad]}")
        out = []
        for r in range(world_size):
            with open(f"{tmp}/out.{r}", "rb") as fh:
                out.append(torch.load(fh, weights_only=True))
        return out


# ---- counting host syncs -----------------------------------------------------------------------

aten = torch.ops.aten
# ops whose output shape or value the host must know: the device would have to finish first
READS = {
    aten._local_scalar_dense, aten.nonzero, aten.nonzero_static, aten.masked_select,
    aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.repeat_interleave,
    aten.is_nonzero, aten.equal,
}  # fmt: skip


class _Reads(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in READS and not (packet is aten.repeat_interleave and not args[1:]):
            self.counter.hit(str(packet))
        elif packet is aten.index and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        ):
            self.counter.hit("boolean-mask indexing")
        return func(*args, **kwargs)


class HostSyncCounter:
    def __init__(self):
        self.count, self.where = 0, []

    def hit(self, what: str):
        self.count += 1
        self.where.append((what, "".join(traceback.format_stack(limit=8)[:-2])))

    @contextlib.contextmanager
    def counting(self):
        patched = [(torch.Tensor, "tolist"), (torch.Tensor, "numpy"), (torch.cuda, "synchronize"),
                   (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]  # fmt: skip
        saved = [(obj, name, getattr(obj, name)) for obj, name in patched]

        def counted(what, fn):
            def wrapper(*a, **kw):
                self.hit(what)
                return fn(*a, **kw)

            return wrapper

        for obj, name, fn in saved:
            setattr(obj, name, counted(name, fn))
        try:
            with _Reads(self):
                yield self
        finally:
            for obj, name, fn in saved:
                setattr(obj, name, fn)


# ---- tiny runs ---------------------------------------------------------------------------------


def tiny_config(hidden: int = 32, vocab: int = 100) -> Config:
    """2 layers of `hidden`, 4 heads, 16 tokens per sample, 4 samples per step, W&B off."""
    cfg = Config()
    m, t = cfg.model, cfg.training
    m.num_layers, m.hidden_size, m.num_attention_heads = 2, hidden, 4
    m.seq_length, m.vocab_size = 16, vocab
    t.micro_batch_size, t.global_batch_size = 1, 4
    cfg.logging.wandb_mode = "disabled"
    return cfg


def random_batch(cfg: Config, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch of `cfg`'s shape as (tokens, labels) micro-batches of random ids drawn
    from `seed`: labels are the tokens shifted by one."""
    m, t = cfg.model, cfg.training
    g = torch.Generator().manual_seed(seed)
    micro = t.global_batch_size // t.micro_batch_size
    ids = torch.randint(0, m.vocab_size, (micro, t.micro_batch_size, m.seq_length + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def resume_config(save=None, **parallel) -> Config:
    """`tiny_config` as the checkpoint-resume tests run it: MLP width 64, 2 samples per
    micro-batch, torch ops, 4 iterations at lr 3e-3, saved to `save`, `parallel`'s flags set."""
    cfg = tiny_config()
    m, t = cfg.model, cfg.training
    m.ffn_hidden_size = 64
    t.micro_batch_size, t.kernels, t.train_iters = 2, "torch", 4
    cfg.optimizer.lr = 3e-3
    cfg.checkpoint.save = save
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def tiny_trainer(cfg: Config, samples: int = 256, world: int | None = None, log=None):
    """The Trainer of `cfg` on `samples` random token rows, at `world` ranks (default: this
    spawned world's size; 1: one process, no process group needed). `log`, a list, collects
    the checkpointer's log lines."""
    from megalite.parallel.groups import single_process_groups
    from megalite.training.trainer import Trainer

    world = dist.get_world_size() if world is None else world
    shape = validate(cfg, world)
    groups = (
        single_process_groups()
        if world == 1
        else build_groups(shape.topology(), torch.device("cpu"))
    )
    m = cfg.model
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (samples, m.seq_length + 1))
    tr = Trainer(cfg, shape, groups, SimpleNamespace(train=tokens, valid=None, tokenizer=None))
    if log is not None:
        tr.checkpointer.log = log.append
    return tr


def perturbed(model: torch.nn.Module, scale: float = 0.05, louder: tuple = (), loud: float = 0.3):
    """`model` in eval mode with noise (scale x N(0, 1)) added to every parameter, `loud` for
    those whose name holds one of `louder`: at init norms are 1 and biases 0, so a converter
    that mixed up two of them would still match."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (loud if any(x in name for x in louder) else scale))
    return model.eval()


# ---- a pipeline stage that sleeps -------------------------------------------------------------


def _sleeper(seconds):
    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(seconds)
            return g

    return Sleep.apply


class SleepChunk(torch.nn.Module):
    """A chunk (as `rank_chunks` describes it) over (2, 4) activations that sleeps `seconds / vpp`
    per forward and, in backward, as long for the input gradient (I) and for the weight
    gradients (W), the two in separate autograd nodes so that a split backward really runs them
    apart (a full backward B sleeps twice as long). `seconds` is a whole stage's time."""

    def __init__(self, layers, has_embedding, has_head, vpp=1, seconds=0.1):
        super().__init__()
        self.has_embedding, self.has_head, self.t = has_embedding, has_head, seconds / vpp
        self.w = torch.nn.Parameter(torch.ones(4))
        self.input_grad, self.weight_grad = _sleeper(self.t), _sleeper(self.t)

    def forward(self, x, labels=None):
        if self.has_embedding:  # a leaf that wants a gradient: the first stage's I runs too
            x = (torch.ones(2, 4) * x[:, :1]).requires_grad_()
        time.sleep(self.t)
        # I sleeps on the path to x, W on the path to w only: a split backward runs them apart
        y = self.input_grad(x * 1.0) + 0.0 * self.weight_grad(self.w)
        return y.sum() if self.has_head else y


# ---- the way in: one training step in one process, by hand -------------------------------------


def reference_steps(cfg: Config, tokens: np.ndarray, steps: int) -> tuple[list[float], dict]:
    """What megalite's step computes at one process, written out with plain torch: the model,
    the data order, the loss, global-norm clipping and AdamW, with nothing parallel in between.
    A reader starts here; tests/unit/test_build.py checks the trainer matches it. `tokens`:
    (samples, seq + 1) token rows. Returns each step's mean loss and the parameters after.
    Differences from `Trainer.step` are only where the work happens: megalite keeps gradients
    and optimizer state in flat (DP-sharded) buffers and runs the micro-batches through the
    pipeline schedule (pp=1: F0 B0 F1 B1 ...)."""
    from megalite.data.sampler import get_batch
    from megalite.lr_schedule import LRSchedule, batch_size
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.parallel.specs import spec_of

    m, t, o = cfg.model, cfg.training, cfg.optimizer
    model = GPTChunk(m, LayerEnv(seed=t.seed))  # the same initialisation as the trainer's chunk
    params = list(model.parameters())
    # Megatron's parameter groups: weight decay or not (norms and biases), and with
    # --decoupled-lr the embedding and output layer (the vocabulary's tensors) on their own lr
    own = lambda p: o.decoupled_lr is not None and spec_of(p).vocab_dim is not None  # noqa: E731
    kinds = [(d, e) for d in (True, False) for e in (False, True)]
    groups = [{"params": [p for p in params if (not spec_of(p).no_weight_decay, own(p)) == k],
               "kind": k} for k in kinds]  # fmt: skip
    adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr,
                             betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)  # fmt: skip
    schedule, consumed = LRSchedule.from_config(cfg), 0
    losses = []
    for _ in range(steps):
        # the next global batch is the rows [consumed, consumed + G) in order (data/sampler.py);
        # G grows during a batch ramp-up (--rampup-batch-size)
        g = batch_size(t, m.seq_length, consumed)
        micro = g // t.micro_batch_size  # micro-batches of this step (dp = 1)
        rows = [[consumed + k * t.micro_batch_size + j for j in range(t.micro_batch_size)]
                for k in range(micro)]  # fmt: skip
        adam.zero_grad(set_to_none=True)
        total = 0.0
        for idx in rows:
            x, y = get_batch(tokens, idx)  # inputs, and the same shifted by one
            loss = model(x, y)  # the mean cross-entropy over the micro-batch's tokens
            (loss / micro).backward()  # the gradient of the step's mean loss
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        rates = schedule.rates(consumed)  # its position: the samples so far (no step skipped)
        for group in adam.param_groups:
            decayed, embedding = group["kind"]
            group["lr"] = rates.embedding_lr if embedding else rates.lr
            group["weight_decay"] = rates.weight_decay if decayed else 0.0
        adam.step()
        losses.append(total / micro)
        consumed += g
    return losses, {n: p.detach() for n, p in model.named_parameters()}
