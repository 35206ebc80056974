"""One process against nanoGPT's CPU recipe: ms per iteration and the validation loss reached.

    .venv/bin/python bench/model/bench_nanogpt.py [--iters 300] [--block 25] [--threads 1]
        [--log-interval 1] [--peer-adamw single|foreach] [--megalite-flavour nanogpt|gpt2]
        [--peer-bias] [--peer-gelu none|tanh] [--megalite-compile] [--profile N] [--summary PATH]

nanoGPT (github.com/karpathy/nanoGPT) documents a CPU run in its README: "4 layers, 4 heads,
128 embedding size", context 64, batch 12, 2000 iterations with the learning rate decayed over
them, dropout 0, `--log_interval=1 --eval_iters=20` (its figure: "about ~3 minutes", validation
loss 1.88 on Shakespeare characters). Its train.py's other defaults give the rest of the
recipe: AdamW lr 1e-3 (config/train_shakespeare_char.py), betas (0.9, 0.99), weight decay 0.1
on the matrices and embeddings only, warm-up 100 iterations then cosine to min lr 1e-4, gradient
clipping at 1.0, bias-free linears and LayerNorms, GELU, tied embeddings, fp32 on CPU, and on
CPU torch's default (single-tensor) AdamW since it asks for the fused one only on CUDA.

`NanoGPT` below is that recipe written for this benchmark in nanoGPT's style (nn.Linear,
nn.LayerNorm, F.scaled_dot_product_attention, its loop: random windows of the token memmap,
forward, next batch, backward, clip, step, zero_grad(set_to_none)); nanoGPT's code is not
copied. megalite runs the same recipe through its one-process trainer path, `Trainer.train_step`
(the pipeline executor at pp=1, `DistributedOptimizer` over flat buffers, its LR schedule:
warm-up lr (it + 1) / 100 where nanoGPT's is (it + 1) / 101, the same cosine after), on
megalite's nanogpt flavour: nanoGPT's model (no bias in the linears or the LayerNorms, the
exact GELU, tied embeddings, learned positions), so both sides train the same model (the
parameter counts are checked equal). `--megalite-flavour gpt2 --peer-bias --peer-gelu tanh`
compares GPT-2's layout instead (biases, tanh GELU: on CPU 2-4x the cost of the exact one;
nanoGPT's bias=True is that layout).

Both train in this process, one thread each, on the same random windows of the built-in corpus
(the standard library's source, megalite's 2048-piece sentencepiece tokenizer: 90% of the token
stream to train, the last 10% to validate), from nanoGPT's initialisation (normal 0.02, the
residual projections 0.02 / sqrt(2 L)). Timed in blocks of `--block` iterations, A B, B A, ...
Reported: ms per iteration of each side (the median block), the median per-block ratio
(> 1: megalite is faster) and of CPU-time ratios, and each side's validation loss after the last iteration on the same
20 batches (nanoGPT's --eval_iters=20). A logging iteration (every `--log-interval`, 1 as in
nanoGPT's command) reads the loss on both sides; megalite's also builds its metrics.
"""

import argparse
import math
import os
import statistics
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import figure, machine, timed, write_summary  # noqa: E402
from megalite.config import Config  # noqa: E402
from megalite.data.gpt_dataset import prepare_builtin  # noqa: E402
from megalite.data.indexed_dataset import IndexedDataset  # noqa: E402
from megalite.parallel import groups as pg  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.shape import validate  # noqa: E402
from megalite.training.trainer import Trainer  # noqa: E402

# nanoGPT's CPU recipe (README command over train.py's defaults)
LAYERS, HEADS, WIDTH, CONTEXT, BATCH = 4, 4, 128, 64, 12
LR, MIN_LR, WARMUP, BETAS, WD, CLIP = 1e-3, 1e-4, 100, (0.9, 0.99), 0.1, 1.0
EVAL_BATCHES = 20
VOCAB = 2048  # megalite's built-in tokenizer


# ---- the peer: nanoGPT's recipe in its style --------------------------------------------------


class Attention(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH, bias=bias)
        self.c_proj = nn.Linear(WIDTH, WIDTH, bias=bias)

    def forward(self, x):  # (b, s, h)
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        q, k, v = (t.view(b, s, HEADS, h // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, d)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h))


class Block(nn.Module):
    def __init__(self, bias: bool, gelu: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH, bias=bias)
        self.attn = Attention(bias)
        self.ln_2 = nn.LayerNorm(WIDTH, bias=bias)
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH, bias=bias)
        self.gelu = nn.GELU(approximate=gelu)
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH, bias=bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(self.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """`bias`: nanoGPT's config.bias (False in its train.py; True is GPT-2's layout, as
    megalite's); `gelu`: "none" (nanoGPT's nn.GELU()) or "tanh" (GPT-2's, megalite's)."""

    def __init__(self, vocab: int, bias: bool = False, gelu: str = "none"):
        super().__init__()
        self.wte = nn.Embedding(vocab, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.h = nn.ModuleList(Block(bias, gelu) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH, bias=bias)
        self.lm_head = nn.Linear(WIDTH, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):  # (b, s) -> mean token loss
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (b, s, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def nanogpt_lr(it: int, iters: int) -> float:
    """nanoGPT's schedule: linear warm-up, then cosine down to MIN_LR at `iters`."""
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > iters:
        return MIN_LR
    ratio = (it - WARMUP) / (iters - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


class Batches:
    """Random windows of one split of the token stream, as nanoGPT's get_batch draws them (its
    own generator per side: both sides see the same windows)."""

    def __init__(self, tokens: np.ndarray, seed: int):
        self.tokens, self.g = tokens, torch.Generator().manual_seed(seed)

    def __call__(self):
        ix = torch.randint(len(self.tokens) - CONTEXT, (BATCH,), generator=self.g)
        x = torch.stack(
            [torch.from_numpy(self.tokens[i : i + CONTEXT].astype(np.int64)) for i in ix]
        )
        y = torch.stack(
            [torch.from_numpy(self.tokens[i + 1 : i + 1 + CONTEXT].astype(np.int64)) for i in ix]
        )
        return x, y


@torch.no_grad()
def evaluate(model, batches) -> float:
    """The mean loss of `model` (called as model(x, y)) over `batches`, in eval mode."""
    model.eval()
    out = statistics.mean(model(x, y).item() for x, y in batches)
    model.train()
    return out


class Peer:
    name = "nanogpt"

    def __init__(self, train, iters, log_interval, a, seed=1337):
        torch.manual_seed(seed)
        self.model = NanoGPT(VOCAB, a.peer_bias, a.peer_gelu)
        params = [p for p in self.model.parameters()]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, foreach=a.peer_adamw == "foreach")
        self.params, self.batches = params, Batches(train, 0)
        self.iters, self.log_interval, self.it = iters, log_interval, 0
        self.x, self.y = self.batches()

    def iteration(self):
        lr = nanogpt_lr(self.it, self.iters)
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss = self.model(self.x, self.y)
        self.x, self.y = self.batches()  # nanoGPT fetches the next batch before backward
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.it += 1
        if self.it % self.log_interval == 0:
            loss.item()


# ---- megalite's one-process trainer path ------------------------------------------------------


def megalite_config(iters: int, cache: str, compile_layers: bool = False,
                    flavour: str = "nanogpt") -> Config:  # fmt: skip
    cfg = Config()
    m = cfg.model
    m.flavour, m.num_layers, m.hidden_size, m.num_attention_heads = flavour, LAYERS, WIDTH, HEADS
    m.seq_length, m.hidden_dropout, m.attention_dropout = CONTEXT, 0.0, 0.0
    t = cfg.training
    t.micro_batch_size = t.global_batch_size = BATCH
    t.train_iters, t.kernels, t.log_interval = iters, "torch", 1
    t.compile = compile_layers  # --megalite-compile: each layer through torch.compile
    o = cfg.optimizer
    o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters = LR, MIN_LR, WARMUP, iters
    o.adam_beta1, o.adam_beta2 = BETAS
    o.weight_decay, o.clip_grad = WD, CLIP
    cfg.data.data_cache_dir, cfg.data.tokenizer_vocab_size = cache, VOCAB
    cfg.logging.wandb_mode = "disabled"  # nanoGPT's wandb_log is off by default too
    return cfg


class Megalite:
    name = "megalite"

    def __init__(self, train, iters, log_interval, groups, cache, compile_layers=False,
                 flavour="nanogpt", seed=1337):  # fmt: skip
        cfg = megalite_config(iters, cache, compile_layers, flavour)
        self.doc = cfg.model.features.doc
        torch.manual_seed(seed)
        self.trainer = Trainer(cfg, validate(cfg, 1), groups)
        (self.model,) = self.trainer.chunks
        self.batches, self.log_interval = Batches(train, 0), log_interval

    def iteration(self):
        tr = self.trainer
        tr.train_step(log=(tr.iteration + 1) % self.log_interval == 0, batch=[self.batches()])


# ---- measurement ------------------------------------------------------------------------------


def splits(cache: str):
    prefix, _ = prepare_builtin(cache, VOCAB)
    tokens = IndexedDataset(prefix).tokens
    n = int(0.9 * len(tokens))
    return tokens[:n], tokens[n:]


def profile(side, n: int):
    """Op-level buckets of `n` iterations (bench/parallel/profile_tp.py's), and the top ops."""
    from bench.parallel.profile_tp import BUCKETS, buckets

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with timed() as t:
            for _ in range(n):
                side.iteration()
        wall = t.wall
    b = buckets(prof.events(), wall)
    cells = " | ".join(f"{1e3 * b[k] / n:.2f} ({b[k] / wall:.0%})" for k in BUCKETS)
    print(f"| {side.name} | {cells} | {1e3 * wall / n:.2f} |")
    return prof


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=300, help="training iterations per side")
    ap.add_argument("--block", type=int, default=25, help="iterations per timed block")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    ap.add_argument("--log-interval", type=int, default=1, help="iterations between loss reads")
    ap.add_argument("--peer-adamw", default="single", choices=("single", "foreach"),
                    help="nanoGPT's AdamW on CPU: torch's default single-tensor loop")  # fmt: skip
    ap.add_argument(
        "--megalite-flavour",
        default="nanogpt",
        choices=("nanogpt", "gpt2"),
        help="megalite's model: nanoGPT's (default), or GPT-2's layout (with --peer-bias "
        "--peer-gelu tanh)",
    )
    ap.add_argument(
        "--peer-bias",
        action="store_true",
        help="nanoGPT with bias=True (GPT-2's layout, megalite's gpt2); default its False",
    )
    ap.add_argument(
        "--peer-gelu",
        default="none",
        choices=("none", "tanh"),
        help="the peer's GELU: nanoGPT's exact one, or GPT-2's tanh (megalite's gpt2)",
    )
    ap.add_argument(
        "--megalite-compile",
        action="store_true",
        help="megalite with --compile (inductor C++); nanoGPT's CPU command has "
        "--compile=False, so the peer stays eager",
    )
    ap.add_argument("--cache", default="data_cache", help="built-in corpus cache directory")
    ap.add_argument("--profile", type=int, default=0, help="profile N iterations per side first")
    ap.add_argument("--summary", help="write the headline figures as JSON here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    os.environ.pop("MASTER_ADDR", None)
    device = pg.init_distributed()  # a gloo world of one (HashStore)
    groups = pg.build_groups(Topology(), device)
    print(f"machine: {machine()}; threads {torch.get_num_threads()}")
    train, valid = splits(a.cache)
    vb = Batches(valid, 1)
    val = [vb() for _ in range(EVAL_BATCHES)]
    sides = [Megalite(train, a.iters, a.log_interval, groups, a.cache, a.megalite_compile,
                      a.megalite_flavour),
             Peer(train, a.iters, a.log_interval, a)]  # fmt: skip
    n_ml = sum(p.numel() for p in sides[0].model.parameters())
    n_peer = sum(p.numel() for p in sides[1].model.parameters())
    if n_ml != n_peer:  # not the same model: the ratio would compare architectures
        sys.exit(f"megalite's {a.megalite_flavour} has {n_ml:,} parameters, the peer {n_peer:,} "
                 f"(bias {a.peer_bias}): pass --megalite-flavour gpt2 with --peer-bias "
                 "--peer-gelu tanh, or neither")  # fmt: skip
    if a.megalite_compile:
        print("megalite with --compile (its first block, compiling, is not counted)")
    print(f"{LAYERS} layers x {WIDTH}, {HEADS} heads, context {CONTEXT}, batch {BATCH}, vocabulary "
          f"{VOCAB}; parameters {n_ml:,} each: megalite {a.megalite_flavour} "
          f"({sides[0].doc}), nanoGPT-style (bias {a.peer_bias}, GELU {a.peer_gelu}, AdamW "
          f"{a.peer_adamw}); {a.iters} iterations, blocks of {a.block}, {len(train):,} train "
          "tokens")  # fmt: skip
    if a.profile:
        from bench.parallel.profile_tp import BUCKETS

        print(f"\nms per iteration by bucket ({a.profile} profiled iterations per side):")
        print("| side | " + " | ".join(BUCKETS) + " | profiled iteration |")
        print("| --- |" + " ---: |" * (len(BUCKETS) + 1))
        profs = [profile(s, a.profile) for s in sides]
        for s, p in zip(sides, profs):
            print(f"\n{s.name}, top ops by self CPU time:")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        return
    times = {s.name: [] for s in sides}
    ratios, cpu_ratios = [], []
    for r in range(math.ceil(a.iters / a.block)):
        n = min(a.block, a.iters - r * a.block)
        got = {}
        for s in sides if r % 2 == 0 else sides[::-1]:  # A B, B A, ...
            with timed() as t:
                for _ in range(n):
                    s.iteration()
            got[s.name] = (t.wall / n, t.cpu / n)
        for k, v in got.items():
            times[k].append(v[0])
        if r > 0:  # the first block warms up
            ratios.append(got["nanogpt"][0] / got["megalite"][0])
            # one thread per side: the CPU time is the steadier measure on a loaded machine
            cpu_ratios.append(got["nanogpt"][1] / got["megalite"][1])
    losses = {s.name: evaluate(s.model, val) for s in sides}
    ms = {k: 1e3 * statistics.median(v[1:] or v) for k, v in times.items()}
    ratio = statistics.median(ratios) if ratios else ms["nanogpt"] / ms["megalite"]
    cpu = statistics.median(cpu_ratios) if cpu_ratios else ratio
    print("\n| side | ms/iteration (median block) | validation loss |")
    print("| --- | ---: | ---: |")
    for k in times:
        print(f"| {k} | {ms[k]:.2f} | {losses[k]:.4f} |")
    print(f"megalite/nanoGPT speed: {ratio:.3f}x (median of {len(ratios)} per-block ratios, range "
          f"{min(ratios, default=ratio):.2f}-{max(ratios, default=ratio):.2f}), by CPU time "
          f"{cpu:.3f}x; validation loss "
          f"megalite {losses['megalite']:.4f} vs {losses['nanogpt']:.4f}")  # fmt: skip
    print(f"load average after: {os.getloadavg()}")
    lower = losses["megalite"] <= losses["nanogpt"]
    figures = [
        figure("one process vs nanoGPT's CPU recipe, iterations/s", round(ratio, 3),
               target=">= 1.1x at equal or lower validation loss", met=ratio >= 1.1 and lower,
               how=f"median of {len(ratios)} interleaved blocks of {a.block} iterations, "
                   f"{a.iters} iterations, fp32, {a.threads} thread(s)"),
        figure("one process vs nanoGPT's CPU recipe, by CPU time", round(cpu, 3),
               how="median of the same blocks' CPU-time ratios"),
        figure("validation loss, megalite - nanoGPT", round(losses["megalite"] - losses["nanogpt"], 4),
               unit="nats", how=f"after {a.iters} iterations, {EVAL_BATCHES} batches of {BATCH}"),
    ]  # fmt: skip
    write_summary(a.summary, "bench_nanogpt", figures, " ".join(sys.argv))
    pg.destroy()


if __name__ == "__main__":
    main()
