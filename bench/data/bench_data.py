"""Data pipeline throughput: tools/preprocess_data.py against a plain tokenizer loop, with a
sentencepiece model and a Hugging Face byte-level BPE (tokenizer.json) of the same vocabulary
side by side, and the cost of fetching a training sample; then GPT-2's BPE on a large generated
corpus beside Megatron-LM's own tools/preprocess_data.py.

    python bench/data/bench_data.py [--repeats 5] [--json out.json] [--summary PATH]
        [--corpus-mb 1024] [--scratch DIR] [--megatron-lm PATH/TO/Megatron-LM]

The first part runs on the built-in corpus, prepared in a temporary directory. Each figure is the
best of --repeats runs (the machine may be shared; the best run is the least disturbed one).
The Hugging Face rows need the tokenizers package (megalite[hf]); without it they are skipped.

The second part (skipped with --corpus-mb 0) writes a corpus of --corpus-mb MiB whose words
recur as in real text (bench/data/text_corpus.py) and a GPT-2-style vocab.json + merges.txt trained on
more of it, under --scratch (kept for the next run), and preprocesses it with Megatron's
offline command line (--tokenizer-type GPT2BPETokenizer --legacy-tokenizer --append-eod) at 1
and 2 workers. With --megatron-lm (a checkout of Megatron-LM, never a dependency: it is run, with
its megatron/ first on PYTHONPATH) its tool runs the same command, the two alternating; the
outputs must be byte-identical. Reported: tokens per CPU-second (user + system of the whole
process tree, start-up included), wall time, and peak RSS (the sum over the process tree,
sampled every 0.2 s).
"""

import argparse
import filecmp
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import sentencepiece as spm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # text_corpus

from bench._common import figure, machine, measured_run, timed, write_summary  # noqa: E402
from megalite.data import corpus
from megalite.data.gpt_dataset import GPTDataset, Sequences
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.sampler import get_batch
from megalite.data.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]


def best(fn, repeats):
    return min(fn() for _ in range(repeats))


def plain_encode_seconds(jsonl, model):
    """The baseline: one process, sentencepiece's own encode, one document at a time."""
    docs = list(corpus.iter_documents([str(jsonl)]))
    sp = spm.SentencePieceProcessor(model_file=str(model))
    with timed() as t:
        tokens = sum(len(sp.encode(d)) + 1 for d in docs)  # + EOS, as the tool counts
    return t.wall, tokens


def plain_hf_seconds(jsonl, tokenizer_json, batch=False):
    """The same loop with a tokenizers.Tokenizer: one document at a time in this thread, or
    (batch) every document in one encode_batch_fast over the library's thread pool."""
    from tokenizers import Tokenizer as HF

    docs = list(corpus.iter_documents([str(jsonl)]))
    tok = HF.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True  # as megalite encodes documents
    with timed() as t:
        if batch:
            encoded = tok.encode_batch_fast(docs, add_special_tokens=False)
            tokens = sum(len(e.ids) + 1 for e in encoded)
        else:
            tokens = sum(len(tok.encode(d, add_special_tokens=False).ids) + 1 for d in docs)
    return t.wall, tokens


def train_hf_bpe(jsonl, out, vocab_size):
    """A GPT-2-style byte-level BPE of `vocab_size` tokens trained on the corpus; its file."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(corpus.iter_documents([str(jsonl)]), trainer)
    tok.save(str(out))
    return out


def tool_seconds(jsonl, model, prefix, workers):
    """tools/preprocess_data.py: (seconds by its own timer, which covers reading, worker
    start-up, tokenizing and writing but not the interpreter start, tokens)."""
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(jsonl),
           "--tokenizer-model", str(model), "--output-prefix", str(prefix),
           "--workers", str(workers), "--quiet"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"(\d+) tokens in ([\d.]+) s", r.stderr)
    return float(m[2]), int(m[1])


def fetch_us(dataset, n=20_000):
    idx = np.random.default_rng(0).integers(0, len(dataset), n)
    with timed() as t:
        for i in idx:
            dataset[int(i)]
    return t.wall / n * 1e6


def batch_us(dataset, mbs=8, n=2_000):
    idx = np.random.default_rng(0).integers(0, len(dataset), (n, mbs)).tolist()
    with timed() as t:
        for ids in idx:
            get_batch(dataset, ids)
    return t.wall / n * 1e6


def preprocess_vs_megatron(args) -> tuple[dict, list]:
    """GPT-2's BPE on the generated corpus: megalite's tool and (with --megatron-lm) Megatron's,
    alternating, at each of --workers; returns (figures, summary figures)."""
    import text_corpus

    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    jsonl = scratch / f"corpus_{args.corpus_mb}mb.jsonl"
    if not jsonl.is_file():
        print(f"writing {jsonl} ...", file=sys.stderr)
        text_corpus.write_corpus(jsonl, args.corpus_mb)
    files = scratch / "gpt2"
    if not (files / "merges.txt").is_file():
        print(f"training a 50,257-entry byte-level BPE in {files} ...", file=sys.stderr)
        text_corpus.train_gpt2_files(files)
    common = ["--input", str(jsonl), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
              str(files / "vocab.json"), "--merge-file", str(files / "merges.txt"),
              "--append-eod", "--legacy-tokenizer"]  # fmt: skip
    tools = {"megalite": ([sys.executable, str(REPO / "tools" / "preprocess_data.py")], None)}
    if args.megatron_lm:
        meg = Path(args.megatron_lm).resolve()
        path = os.pathsep.join([str(meg), os.environ.get("PYTHONPATH", "")])
        tools["megatron"] = ([sys.executable, str(meg / "tools" / "preprocess_data.py")],
                             {**os.environ, "PYTHONPATH": path})  # fmt: skip
    runs = {}
    for r in range(args.rounds):
        for w in args.workers:
            for name, (cmd, env) in tools.items():
                prefix = scratch / f"out_{name}_{w}w"
                full = cmd + common + ["--output-prefix", str(prefix), "--workers", str(w)]
                m = measured_run(full, env=env, every=0.2)
                out = Path(f"{prefix}_text_document")
                m["tokens"] = out.with_suffix(".bin").stat().st_size // 2  # uint16 ids
                runs.setdefault((name, w), []).append(m)
                print(f"round {r} {name} {w} worker(s): {m}", file=sys.stderr)
            if "megatron" in tools:
                a, b = (scratch / f"out_{n}_{w}w_text_document" for n in ("megalite", "megatron"))
                for ext in (".bin", ".idx"):
                    if not filecmp.cmp(f"{a}{ext}", f"{b}{ext}", shallow=False):
                        raise SystemExit(f"{a}{ext} and {b}{ext} differ")
                runs[("same", w)] = True
    out = {"corpus_mb": jsonl.stat().st_size / 2**20, "rounds": args.rounds}
    if args.megatron_lm:
        info = (Path(args.megatron_lm) / "megatron" / "core" / "package_info.py").read_text()
        out["megatron_core"] = ".".join(re.findall(r"^(?:MAJOR|MINOR|PATCH) = (\d+)", info, re.M))
        print(f"peer: Megatron-LM tools/preprocess_data.py, megatron-core {out['megatron_core']}")
    print(f"machine: {machine()}")
    figures = []
    print(f"\nGPT-2 BPE, {out['corpus_mb']:.0f} MiB generated JSONL, {args.rounds} round(s)")
    print("tool       workers  tokens    tokens/CPU-s   CPU s   wall s   peak RSS MB  ratio")
    for w in args.workers:
        for name in tools:  # the least disturbed round of each
            out[f"{name}_{w}w"] = {
                "tok_per_cpu_s": max(m["tokens"] / m["cpu_s"] for m in runs[(name, w)]),
                "runs": runs[(name, w)],
            }
        ratio = None
        if "megatron" in tools:
            ratio = out[f"megalite_{w}w"]["tok_per_cpu_s"] / out[f"megatron_{w}w"]["tok_per_cpu_s"]
            out[f"ratio_{w}w"] = ratio
        for name in tools:
            ms, rate = runs[(name, w)], out[f"{name}_{w}w"]["tok_per_cpu_s"]
            m = min(ms, key=lambda m: m["cpu_s"])
            print(f"{name:10s} {w:5d} {m['tokens']:11,d} {rate:12,.0f} {m['cpu_s']:8.1f} "
                  f"{m['wall_s']:8.1f} {max(x['peak_rss'] for x in ms) / 2**20:10.0f}"
                  + (f"  {ratio:.2f}x" if name == "megalite" and ratio else ""))  # fmt: skip
        if "megatron" in tools:
            out[f"identical_{w}w"] = runs[("same", w)]
            figures.append(figure(
                f"GPT-2 BPE preprocessing tokens per CPU-second vs Megatron-LM's tool, {w} "
                f"worker(s), {out['corpus_mb']:.0f} MiB", round(out[f"ratio_{w}w"], 2),
                how=f"bench_data.py --corpus-mb {args.corpus_mb}, best of {args.rounds}",
            ))  # fmt: skip
    return out, figures


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--corpus-mb", type=int, default=1024, help="0 skips the large corpus")
    ap.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(), "megalite_bench"))
    ap.add_argument("--megatron-lm", help="a Megatron-LM checkout whose tool runs alongside")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds on the corpus")
    ap.add_argument("--skip-small", action="store_true", help="only the large corpus")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--summary", help="write the headline figures as JSON here (run_all.py)")
    args = ap.parse_args()
    out = {"cpu_count": os.cpu_count()}
    figures = []
    if not args.skip_small:
        out, figures = small_corpus(args)
    if args.corpus_mb:
        out["large"], more = preprocess_vs_megatron(args)
        figures += more
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    write_summary(args.summary, "bench_data", figures, " ".join(sys.argv))


def small_corpus(args) -> tuple[dict, list]:
    out = {"cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with timed() as t:
            jsonl = corpus.build_corpus(tmp)
        out["corpus_s"] = t.wall
        out["corpus_files"] = len(corpus.stdlib_files())
        out["corpus_mb"] = sum(f.stat().st_size for f in corpus.stdlib_files()) / 2**20
        with timed() as t:
            model = Tokenizer.train([str(jsonl)], tmp / "tok", args.vocab_size)
        out["tokenizer_train_s"] = t.wall

        try:
            import tokenizers  # noqa: F401
        except ImportError:
            hf_model = None
            print("tokenizers is not installed: the Hugging Face rows are skipped", file=sys.stderr)
        else:
            with timed() as t:
                hf_model = train_hf_bpe(jsonl, tmp / "tokenizer.json", args.vocab_size)
            out["hf_tokenizer_train_s"] = t.wall

        # Interleaved rounds: a burst of load from other users hits every method alike.
        # (name, tokenizer, how): plain loops in this process, or the tool with 1 or 2 workers
        methods = [("plain", model, "loop"), ("tool_1w", model, 1), ("tool_2w", model, 2)]
        if hf_model:
            methods += [("hf_plain", hf_model, "loop"), ("hf_batch", hf_model, "batch"),
                        ("hf_tool_1w", hf_model, 1), ("hf_tool_2w", hf_model, 2)]  # fmt: skip
        runs = {name: [] for name, _, _ in methods}
        counts = {}
        for _ in range(args.repeats):
            for name, tok, how in methods:
                if how == "loop" and tok == model:
                    secs, n = plain_encode_seconds(jsonl, model)
                elif how in ("loop", "batch"):
                    secs, n = plain_hf_seconds(jsonl, tok, batch=how == "batch")
                else:
                    secs, n = tool_seconds(jsonl, tok, tmp / name, how)
                assert counts.setdefault(tok, n) == n, (name, n, counts[tok])  # same tokens
                runs[name].append(secs)
        tokens = counts[model]
        out["tokens"] = tokens
        out["corpus_bytes"] = jsonl_bytes = sum(
            len(d.encode()) for d in corpus.iter_documents([str(jsonl)])
        )
        if hf_model:
            out["hf_tokens"] = counts[hf_model]
        for name, tok, _ in methods:
            n = counts[tok]
            key = "plain_encode" if name == "plain" else name
            out[f"{key}_tok_s"] = n / min(runs[name])
            out[f"{key}_median_tok_s"] = n / float(np.median(runs[name]))
            out[f"{key}_mb_s"] = jsonl_bytes / 2**20 / min(runs[name])

        indexed = Sequences.of(IndexedDataset(tmp / "tool_1w"))
        n = len(indexed.lengths)
        for seq in (128, 1024):
            ds = GPTDataset(indexed, 0, n, seq, seed=0)
            out[f"fetch_us_seq{seq}"] = best(lambda ds=ds: fetch_us(ds), args.repeats)
        ds = GPTDataset(indexed, 0, n, 128, seed=0)
        out["get_batch_us_mbs8_seq128"] = best(lambda: batch_us(ds), args.repeats)

    base = out["plain_encode_mb_s"]
    print(f"machine: {machine()}")
    print(f"corpus: {out['corpus_files']} files, {out['corpus_mb']:.2f} MB, {tokens} tokens")
    print(
        f"prepare: corpus {out['corpus_s']:.2f} s, tokenizer training {out['tokenizer_train_s']:.1f} s"
        + (f" (Hugging Face BPE {out['hf_tokenizer_train_s']:.1f} s)" if hf_model else "")
    )
    print("                                 best tokens/s    MB/s  ratio   (median tokens/s)")
    labels = {"plain": "plain sentencepiece loop", "tool_1w": "preprocess_data 1 worker",
              "tool_2w": "preprocess_data 2 workers", "hf_plain": "plain HF tokenizers loop",
              "hf_batch": "HF encode_batch (all cores)", "hf_tool_1w": "HF preprocess_data 1 worker",
              "hf_tool_2w": "HF preprocess_data 2 workers"}  # fmt: skip
    for name, _, _ in methods:
        key = "plain_encode" if name == "plain" else name
        tok_s, mb_s = out[f"{key}_tok_s"], out[f"{key}_mb_s"]
        print(
            f"{labels[name]:30s} {tok_s:12,.0f} {mb_s:7.2f}  {mb_s / base:.2f}x  "
            f"({out[f'{key}_median_tok_s']:,.0f})"
        )
    for k in ("fetch_us_seq128", "fetch_us_seq1024", "get_batch_us_mbs8_seq128"):
        print(f"{k:28s} {out[k]:8.2f} us")
    how = f"bench_data.py, best of {args.repeats} interleaved rounds"
    figures = [
        figure(
            f"preprocess_data.py tokens/s, {w} worker(s), vs a plain sentencepiece loop",
            round(out[f"tool_{w}w_mb_s"] / base, 2),
            how=how,
        )
        for w in (1, 2)
    ] + [figure("sample fetch, seq 1024", round(out["fetch_us_seq1024"], 1), unit="us", how=how)]
    return out, figures


if __name__ == "__main__":
    main()
