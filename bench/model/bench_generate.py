"""Generation speed: megalite's KV cache against transformers `generate` and the old no-cache loop,
and at tp2*pp2 the time per new token at a short and a long context.

    .venv/bin/python bench/model/bench_generate.py [--flavour llama] [--layers 4] [--hidden 256]
        [--heads 8] [--groups 4] [--vocab 8192] [--seq 1024] [--prompt 64] [--new 64]
        [--batch 1 4] [--rounds 5] [--threads 1] [--contexts 64 512] [--skip-parallel]

One process: a random transformers model (LlamaForCausalLM or GPT2LMHeadModel, fp32, sdpa)
and the same weights in one megalite `GPTChunk` (checkpoint.hf.from_hf). Greedy generation of
--new tokens after --prompt random tokens (batch b: b prompts of that length), timed
interleaved round by round (the order rotates), after one warm-up round:

- megalite: `megalite.generation.generate` (prefill, then one token per step with the cache);
- transformers: `model.generate(do_sample=False, use_cache=True)` with its default cache;
- no-cache: the loop tools/generate.py ran before the cache (the whole context every token).

Reported: median tokens/s (new tokens x batch / time, prefill included) by wall clock and by
the process's CPU time (on a shared machine the CPU time is the steadier of the two), and
megalite's speed-up: the median of the per-round ratios variant time / megalite time (> 1:
megalite is faster). The tokens of the three are compared (fp32: a near-tie could differ; the
tests compare in fp64).

Real size (--real-size, bench/model/_load_at_size.py): a random Llama-3.2-3B-shaped bf16 model
written to safetensors (HF and megalite, under --scratch, deleted after); time to the first
token and peak RSS of `load_chunks` + one token against transformers' `from_pretrained` + one
`generate` step, each a fresh process, alternated over --real-rounds rounds (medians).

Parallel (4 gloo processes, megalite/testing.py, one thread each): tp2*pp2 of the same weights;
time per new token = (t(1 + n) - t(1)) / n at each context in --contexts (prefill excluded),
with the cache and with the no-cache path (`use_cache=False`, the whole context every token).
"""

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import figure, timed, write_summary  # noqa: E402
from megalite.checkpoint.hf import from_hf, model_config_from_hf  # noqa: E402
from megalite.config import Config  # noqa: E402
from megalite.generation import generate  # noqa: E402
from megalite.model.gpt import GPTChunk  # noqa: E402
from megalite.parallel.groups import build_groups, single_process_groups  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.shape import validate  # noqa: E402
from megalite.testing import spawn  # noqa: E402
from megalite.training.build import parallelize  # noqa: E402


def hf_model(a):
    import transformers

    torch.manual_seed(0)
    if a.flavour == "gpt2":
        c = transformers.GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.hidden,
                                    n_layer=a.layers, n_head=a.heads,
                                    activation_function="gelu_pytorch_tanh")  # fmt: skip
        m = transformers.GPT2LMHeadModel(c)
    else:
        c = transformers.LlamaConfig(
            vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3,
            num_hidden_layers=a.layers, num_attention_heads=a.heads,
            num_key_value_heads=a.groups, max_position_embeddings=a.seq, tie_word_embeddings=False,
        )  # fmt: skip
        m = transformers.LlamaForCausalLM(c)
    return m.eval()


@torch.no_grad()
def old_loop(chunk, ids, n):
    """tools/generate.py before the cache: the (cropped) context again for every token."""
    ids, window = ids, chunk.cfg.seq_length
    for _ in range(n):
        t = chunk(ids[:, -window:])[:, -1].argmax(-1, keepdim=True)  # (b, 1)
        ids = torch.cat([ids, t], 1)
    return ids[:, -n:].tolist()


def _variants(a, m, chunk, groups, ids) -> dict:
    """name -> a function generating a.new tokens greedily after ids (b, prompt)."""
    return {
        "megalite": lambda: generate([chunk], groups, ids.tolist(), a.new),
        "transformers": lambda: m.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=a.new,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            eos_token_id=None,
        )[:, a.prompt :].tolist(),  # fmt: skip
        "no-cache": lambda: old_loop(chunk, ids, a.new),
    }


def one_process(a, m, cfg, state) -> list:
    """Prints a table per batch size; returns the headline figures."""
    figures = []
    chunk = GPTChunk(cfg)
    chunk.load_full_state(state)
    chunk.eval()
    groups = single_process_groups()
    for b in a.batch:
        ids = torch.randint(0, a.vocab, (b, a.prompt), generator=torch.Generator().manual_seed(b))
        runs = _variants(a, m, chunk, groups, ids)
        wall, cpu, out = {k: [] for k in runs}, {k: [] for k in runs}, {}
        names = list(runs)
        for r in range(a.rounds + 1):
            for k in names[r % 3 :] + names[: r % 3]:
                with timed() as t:
                    out[k] = runs[k]()
                if r:  # round 0 warms up
                    wall[k].append(t.wall)
                    cpu[k].append(t.cpu)
        same = out["megalite"] == out["transformers"] == out["no-cache"]
        print(f"\n## One process, batch {b}: prompt {a.prompt}, {a.new} new tokens "
              f"(tokens equal: {'yes' if same else 'NO'})\n")  # fmt: skip
        print("| variant | tokens/s (wall) | tokens/s (CPU) | megalite speed-up, wall | CPU |")
        print("| --- | --- | --- | --- | --- |")
        for k in names:
            ratios = [statistics.median(x / y for x, y in zip(t[k], t["megalite"]))
                      for t in (wall, cpu)]  # fmt: skip
            tps = [b * a.new / statistics.median(t[k]) for t in (wall, cpu)]
            print(f"| {k} | {tps[0]:.1f} | {tps[1]:.1f} | **{ratios[0]:.2f}x** | "
                  f"**{ratios[1]:.2f}x** |")  # fmt: skip
            if k == "transformers":
                figures.append(figure(
                    f"generation tokens/s (CPU time) vs transformers generate, batch {b}",
                    round(ratios[1], 2), target=">= 1.0x", met=ratios[1] >= 1.0,
                    how=f"bench_generate.py, median of {a.rounds} per-round ratios"))  # fmt: skip
    return figures


def _parallel(rank, world, a, cfg, state):
    torch.set_num_threads(1)
    groups = build_groups(Topology(tp=2, pp=2, dp=1), torch.device("cpu"))
    run = Config(model=cfg)
    run.parallel.tp, run.parallel.pp, run.training.kernels = 2, 2, "torch"
    run.training.micro_batch_size, run.training.global_batch_size = 1, 2
    # this stage's layers
    chunks, _ = parallelize(run, validate(run, world), groups, data_parallel=False)
    for c in chunks:
        c.load_full_state(state)
    res = {}
    for cache, n in ((True, a.steps), (False, max(2, a.steps // 4))):
        for ctx in a.contexts:
            ids = torch.randint(0, a.vocab, (1, ctx), generator=torch.Generator().manual_seed(ctx))
            per = []
            for r in range(a.rounds + 1):
                t = []
                for steps in (1, 1 + n):
                    with timed() as one:
                        generate(chunks, groups, ids.tolist(), steps, use_cache=cache)
                    t.append(one.wall)
                if r:
                    per.append((t[1] - t[0]) / n)
            res[(cache, ctx)] = per
    return res


def parallel(a, cfg, state) -> list:
    res = spawn(_parallel, 4, a, cfg, state, timeout=3600)[0]
    lo, hi = min(a.contexts), max(a.contexts)
    print("\n## tp2*pp2 (4 processes): time per new token, prefill excluded\n")
    print("| path | " + " | ".join(f"context {c} (ms)" for c in a.contexts) + f" | {hi} / {lo} |")
    print("| --- | " + " | ".join("---" for _ in a.contexts) + " | --- |")
    for cache in (True, False):
        med = {c: statistics.median(res[(cache, c)]) for c in a.contexts}
        ratio = statistics.median(x / y for x, y in zip(res[(cache, hi)], res[(cache, lo)]))
        cells = " | ".join(f"{1000 * med[c]:.1f}" for c in a.contexts)
        print(f"| {'KV cache' if cache else 'no cache'} | {cells} | **{ratio:.2f}x** |")
        if cache:
            figures = [figure(f"tp2*pp2 time per new token, context {hi} / {lo}, KV cache",
                              round(ratio, 2), target="<= 1.5x", met=ratio <= 1.5,
                              how=f"bench_generate.py, median of {a.rounds} rounds")]  # fmt: skip
    return figures


def real_size(a) -> list:
    """Time to first token and peak RSS at the Llama-3.2-3B shape (bench/model/_load_at_size.py)."""
    import shutil
    import tempfile

    from bench.model import _load_at_size as big

    root = Path(tempfile.mkdtemp(prefix="bench_generate_", dir=a.scratch))
    try:
        hf, ml = big.write_models(root)
        kinds = {"hf": hf, "megalite": ml, "megalite-nosha": ml}
        runs = {k: [] for k in kinds}
        big.measure("hf", hf)  # warm-up: the files into the page cache
        big.measure("megalite", ml)
        for r in range(a.real_rounds):
            for k in list(kinds)[r % 3 :] + list(kinds)[: r % 3]:  # the order rotates
                runs[k].append(big.measure(k, kinds[k]))
                print(f"  round {r} {k}: {runs[k][-1]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("ttft_s", "peak_rss", "peak_anon")}
           for k, v in runs.items()}  # fmt: skip
    for k, m in med.items():
        print(
            f"# {k:15s} time to first token {m['ttft_s']:6.1f} s, peak RSS "
            f"{m['peak_rss'] / 2**30:5.2f} GiB (anonymous {m['peak_anon'] / 2**30:5.2f} GiB)"
        )
    ml, hf = med["megalite"], med["hf"]
    return [
        figure("Llama-3.2-3B bf16: time to first token, megalite / transformers",
               round(ml["ttft_s"] / hf["ttft_s"], 2), "x", "<= 1.5", ml["ttft_s"] <= 1.5 * hf["ttft_s"]),
        figure("Llama-3.2-3B bf16: peak RSS, megalite / transformers",
               round(ml["peak_rss"] / hf["peak_rss"], 2), "x", "<= 1.2",
               ml["peak_rss"] <= 1.2 * hf["peak_rss"]),
        figure("Llama-3.2-3B bf16: time to first token without the sha256, megalite / "
               "transformers", round(med["megalite-nosha"]["ttft_s"] / hf["ttft_s"], 2)),
    ]  # fmt: skip


def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--flavour", choices=("gpt2", "llama"), default="llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 512])
    p.add_argument("--steps", type=int, default=16, help="new tokens timed per parallel run")
    p.add_argument("--skip-parallel", action="store_true")
    p.add_argument("--summary", help="write the headline figures as JSON here")
    p.add_argument(
        "--real-size",
        action="store_true",
        help="also time the first token of a Llama-3.2-3B-shaped model (13 GB disk)",
    )
    p.add_argument("--real-rounds", type=int, default=2)
    p.add_argument("--scratch", help="directory for the real-size files (default: the temp dir)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    m = hf_model(a)
    cfg = model_config_from_hf(m.config.to_dict())
    state = from_hf(m.state_dict(), cfg)
    print(f"# bench_generate: {a.flavour}, {a.layers} layers, h {a.hidden}, {a.heads} heads "
          f"({a.groups} kv), vocab {a.vocab}, fp32, {a.threads} thread(s); torch "
          f"{torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    figures = one_process(a, m, cfg, state)
    if not a.skip_parallel:
        figures += parallel(a, cfg, state)
    if a.real_size:
        figures += real_size(a)
    write_summary(a.summary, "bench_generate", figures, " ".join(sys.argv))


if __name__ == "__main__":
    main()
