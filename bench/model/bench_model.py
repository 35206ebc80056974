"""Single-process CPU training throughput: megalite's GPT against transformers, same shape.

    .venv/bin/python bench/model/bench_model.py [--threads 1] [--shapes tiny tiny-llama gpt2-124m]
        [--rounds 20] [--rounds-124m 3] [--seq-124m 1024] [--mbs-124m 1] [--micro-124m 4]
        [--hf-adamw foreach] [--profile] [--summary PATH]

For each shape both models are built in this process with identical weights (megalite's
initialisation copied into transformers through `checkpoint.hf.to_hf`) and trained on the same
random token batches, fp32, with torch's thread count set once for both. A step is a full
optimizer step: zero_grad, forward + backward of every micro-batch (loss / m), clipping at 1.0,
AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices and embeddings only):

- megalite: `GPTChunk` (torch reference ops), the pipeline executor (`run_schedule`, 1F1B at
  pp=1: what the trainer runs) and `DistributedOptimizer` at dp=1 in a gloo world of one
  (HashStore). Its AdamW is torch.optim.AdamW's single-tensor arithmetic on flat buffers.
- transformers: GPT2LMHeadModel / LlamaForCausalLM (attn_implementation="sdpa"), the loss
  F.cross_entropy on its logits and the same labels, torch.nn.utils.clip_grad_norm_ and
  torch.optim.AdamW with foreach=True (torch's multi-tensor implementation, its default on GPUs;
  on CPU torch defaults to the single-tensor loop, `--hf-adamw single`), zero_grad(set_to_none).

The GPT-2-124M shape trains by default on 4 micro-batches of one 1024-token sequence (4096
tokens per step): a realistic shape, where the matmuls, not the optimizer, dominate the step.

GPT-2 uses activation "gelu_pytorch_tanh" on the transformers side, the same function as
megalite's F.gelu(approximate="tanh"); hf_config's "gelu_new" is the same function composed of
five python-level ops (slower; pass --hf-gelu gelu_new to measure it).

Before timing, one step of each on the same batch checks that the two compute the same thing
(loss and updated weights agree). Timed steps are interleaved A B B A A B ... (warm-up rounds
first); reported: the median step time of each side, and the median of the per-round ratios
(robust to load that drifts during the run). Ratio > 1: megalite is faster.
"""

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


from bench._common import figure, machine, timed, write_summary  # noqa: E402
from megalite.checkpoint.hf import hf_config, to_hf  # noqa: E402
from megalite.config import Config, ModelConfig  # noqa: E402
from megalite.parallel import groups as pg  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.shape import validate  # noqa: E402
from megalite.training.build import build_rank  # noqa: E402

LR, WD, BETAS, EPS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0


def shapes(args):
    """name -> (ModelConfig, micro_batch_size, micro-batches per step)."""
    tiny = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=2048)
    return {
        # configs/tiny.yaml's model and batch: 16 samples per step in micro-batches of 2
        "tiny": (ModelConfig(flavour="gpt2", **tiny), 2, 8),
        "tiny-llama": (ModelConfig(flavour="llama", num_query_groups=2, **tiny), 2, 8),
        # GPT-2 small (12 x 768, 12 heads, 50257 vocabulary, 1024 positions); by default
        # 4 micro-batches of one 1024-token sequence (a step takes about a minute per side)
        "gpt2-124m": (
            ModelConfig(
                flavour="gpt2",
                num_layers=12,
                hidden_size=768,
                num_attention_heads=12,
                seq_length=args.seq_124m,
                max_position_embeddings=1024,
                vocab_size=50257,
            ),
            args.mbs_124m,
            args.micro_124m,
        ),
    }


# ---- the two sides ---------------------------------------------------------------------------


class Megalite:
    name = "megalite"

    def __init__(self, m: ModelConfig, mbs: int, micro: int, groups):
        cfg = Config()
        cfg.model = m
        cfg.training.micro_batch_size, cfg.training.global_batch_size = mbs, mbs * micro
        cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = WD, CLIP
        cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2 = BETAS
        cfg.optimizer.adam_eps = EPS
        cfg.training.kernels = "torch"
        self.parts = build_rank(cfg, validate(cfg, 1), groups)  # one chunk, 1F1B over micro
        (self.model,), self.opt = self.parts.chunks, self.parts.opt
        # the logical tensors (the optimizer holds them in its flat buffer), for transformers
        self.state = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def step(self, batch) -> float:
        self.model.train()
        self.opt.zero_grad(self.parts.microbatches)  # (the run shape's count)
        result = self.parts.run(batch)
        self.opt.step(LR)
        return result.loss

    def weight(self, name):
        return dict(self.model.named_parameters())[name].detach()


class HF:
    name = "transformers"

    def __init__(self, m: ModelConfig, state: dict, hf_gelu: str, adamw: str = "foreach"):
        import transformers

        d = hf_config(m)
        arch = d.pop("architectures")[0]
        if m.flavour == "gpt2":
            d["activation_function"] = hf_gelu
        config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        cls = getattr(transformers, arch)
        self.model = cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        missing, unexpected = self.model.load_state_dict(to_hf(state, m), strict=False)
        assert not [k for k in missing if k != "lm_head.weight"] and not unexpected, (
            missing,
            unexpected,
        )
        if m.tied:
            self.model.tie_weights()
        params = list(self.model.parameters())  # unique: the tied head is the embedding
        decay = [p for p in params if p.dim() >= 2]
        other = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
            lr=LR,
            betas=BETAS,
            eps=EPS,
            foreach=adamw == "foreach",
        )
        self.params = params
        self.vocab = m.vocab_size

    def step(self, batch) -> float:
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, labels in batch:
            logits = self.model(input_ids=tokens).logits  # (b, s, V)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            (loss / len(batch)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        return total / len(batch)


def make_batches(m: ModelConfig, mbs: int, micro: int, n: int, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        toks = torch.randint(0, m.vocab_size, (micro, mbs, m.seq_length + 1), generator=g)
        out.append([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks])
    return out


# ---- measurement ------------------------------------------------------------------------------


def timed_step(side, batch) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one step: with one thread per side the
    CPU time is the steadier measure on a machine that other jobs load."""
    with timed() as t:
        side.step(batch)
    return t.wall, t.cpu


def check_same(ml: Megalite, hf: HF, batch, m: ModelConfig):
    """One step of each on the same batch: same loss, same updated weights."""
    l_ml, l_hf = ml.step(batch), hf.step(batch)
    if m.flavour == "gpt2":
        a, b = ml.weight("layers.0.mlp.up.weight"), hf.model.transformer.h[0].mlp.c_fc.weight.t()
    else:
        a, b = ml.weight("layers.0.mlp.up.weight"), hf.model.model.layers[0].mlp.up_proj.weight
    diff = (a - b).abs().max().item()
    print(f"  check: loss megalite {l_ml:.6f} transformers {l_hf:.6f}; "
          f"max |w diff| after one step {diff:.2e}", flush=True)  # fmt: skip
    if abs(l_ml - l_hf) > 1e-3 * abs(l_hf) or diff > 1e-5:
        raise SystemExit("the two models do not compute the same step; the comparison is void")


def profile(side, batches, steps=2, top=15):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        for i in range(steps):
            side.step(batches[i % len(batches)])
    print(f"  profile {side.name} ({steps} steps), top ops by self CPU time:")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def run_shape(name, m, mbs, micro, args, groups):
    tokens = mbs * micro * m.seq_length
    print(f"\n== {name}: {m.flavour} L={m.num_layers} h={m.hidden_size} heads={m.num_attention_heads}"
          f" kv={m.heads_kv} ffn={m.ffn} V={m.vocab_size} s={m.seq_length}; {micro} micro-batch(es)"
          f" of {mbs}: {tokens} tokens/step", flush=True)  # fmt: skip
    ml = Megalite(m, mbs, micro, groups)
    hf = HF(m, ml.state, args.hf_gelu, args.hf_adamw)
    n_ml = sum(p.numel() for p in ml.model.parameters())
    n_hf = sum(p.numel() for p in hf.model.parameters())
    print(f"  parameters: megalite {n_ml:,} (vocabulary padded to {m.padded_vocab_size(1)}), "
          f"transformers {n_hf:,}", flush=True)  # fmt: skip
    batches = make_batches(m, mbs, micro, 4)
    check_same(ml, hf, batches[0], m)
    if args.profile:
        profile(ml, batches)
        profile(hf, batches)
    big = tokens * n_ml > 1e10
    warm = 1 if big else args.warmup
    rounds = args.rounds_124m if name == "gpt2-124m" else args.rounds
    t = {"megalite": [], "transformers": []}
    ratios, cpu_ratios = [], []
    for r in range(warm + rounds):
        batch = batches[r % len(batches)]
        order = (ml, hf) if r % 2 == 0 else (hf, ml)  # A B, B A, ...
        got = {s.name: timed_step(s, batch) for s in order}
        if r >= warm:
            for k, v in got.items():
                t[k].append(v[0])
            ratios.append(got["transformers"][0] / got["megalite"][0])
            cpu_ratios.append(got["transformers"][1] / got["megalite"][1])
    med = {k: statistics.median(v) for k, v in t.items()}
    row = {
        "shape": name,
        "tokens_per_step": tokens,
        "megalite_s": med["megalite"],
        "transformers_s": med["transformers"],
        "megalite_tok_s": tokens / med["megalite"],
        "transformers_tok_s": tokens / med["transformers"],
        "ratio_of_medians": med["transformers"] / med["megalite"],
        "median_ratio": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
        "median_cpu_ratio": statistics.median(cpu_ratios),
        "rounds": rounds,
    }
    print(f"  step time median over {rounds} rounds: megalite {med['megalite']:.4f} s "
          f"({row['megalite_tok_s']:.0f} tok/s), transformers {med['transformers']:.4f} s "
          f"({row['transformers_tok_s']:.0f} tok/s); megalite/transformers tokens/s: "
          f"{row['ratio_of_medians']:.3f}x (median of per-round ratios {row['median_ratio']:.3f}x, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}); by CPU time "
          f"{row['median_cpu_ratio']:.3f}x", flush=True)  # fmt: skip
    del ml, hf
    return row


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    ap.add_argument("--shapes", nargs="+", default=["tiny", "tiny-llama", "gpt2-124m"])
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds (1 for gpt2-124m)")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds for the tiny shapes")
    ap.add_argument("--rounds-124m", type=int, default=3, help="timed rounds for gpt2-124m")
    ap.add_argument("--seq-124m", type=int, default=1024, help="sequence length for gpt2-124m")
    ap.add_argument("--mbs-124m", type=int, default=1, help="micro-batch size for gpt2-124m")
    ap.add_argument("--micro-124m", type=int, default=4, help="micro-batches per step, gpt2-124m")
    ap.add_argument(
        "--hf-adamw",
        default="foreach",
        choices=("foreach", "single"),
        help="transformers side: torch AdamW foreach (multi-tensor) or single-tensor",
    )
    ap.add_argument("--summary", help="write the headline figures as JSON here")
    ap.add_argument(
        "--hf-gelu", default="gelu_pytorch_tanh", choices=("gelu_pytorch_tanh", "gelu_new")
    )
    ap.add_argument("--profile", action="store_true", help="torch.profiler top ops per side")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    os.environ.pop("MASTER_ADDR", None)
    device = pg.init_distributed()  # a gloo world of one (HashStore)
    groups = pg.build_groups(Topology(), device)
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    print(f"machine: {machine()}; threads {torch.get_num_threads()} (load average {load})")
    table = shapes(args)
    rows = [run_shape(n, *table[n], args, groups) for n in args.shapes]
    print("\n| shape | tokens/step | megalite s/step | transformers s/step | megalite tok/s | "
          "transformers tok/s | ratio of medians | median per-round ratio (range) | "
          "by CPU time |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        lo, hi = r["ratio_range"]
        print(f"| {r['shape']} | {r['tokens_per_step']} | {r['megalite_s']:.4f} | "
              f"{r['transformers_s']:.4f} | {r['megalite_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | "
              f"{r['ratio_of_medians']:.3f}x | {r['median_ratio']:.3f}x ({lo:.2f}-{hi:.2f}) | "
              f"{r['median_cpu_ratio']:.3f}x |")  # fmt: skip
    print(f"load average after: {os.getloadavg()}")
    figures = [
        figure(f"single-process tokens/s vs transformers, {r['shape']} "
               f"({r['tokens_per_step']} tokens/step)", round(r["median_ratio"], 3),
               target=">= 1.0x", met=r["median_ratio"] >= 1.0,
               how=f"median of {r['rounds']} interleaved per-round ratios, fp32, 1 thread")
        for r in rows
    ]  # fmt: skip
    write_summary(args.summary, "bench_model", figures, " ".join(sys.argv))
    pg.destroy()


if __name__ == "__main__":
    main()
