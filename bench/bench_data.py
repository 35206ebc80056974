"""Data pipeline throughput: tools/preprocess_data.py against a plain tokenizer loop, with a
sentencepiece model and a Hugging Face byte-level BPE (tokenizer.json) of the same vocabulary
side by side, and the cost of fetching a training sample.

    python bench/bench_data.py [--repeats 5] [--json out.json] [--summary PATH]

Everything runs on the built-in corpus, prepared in a temporary directory. Each figure is the
best of --repeats runs (the machine may be shared; the best run is the least disturbed one).
The Hugging Face rows need the tokenizers package (megalite[hf]); without it they are skipped.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import figure, machine, write_summary  # noqa: E402
from megalite.data import corpus
from megalite.data.gpt_dataset import GPTDataset, Sequences
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.sampler import get_batch
from megalite.data.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def best(fn, repeats):
    return min(fn() for _ in range(repeats))


def plain_encode_seconds(jsonl, model):
    """The baseline: one process, sentencepiece's own encode, one document at a time."""
    docs = list(corpus.iter_documents([str(jsonl)]))
    sp = spm.SentencePieceProcessor(model_file=str(model))
    t = time.perf_counter()
    tokens = sum(len(sp.encode(d)) + 1 for d in docs)  # + EOS, as the tool counts
    return time.perf_counter() - t, tokens


def plain_hf_seconds(jsonl, tokenizer_json, batch=False):
    """The same loop with a tokenizers.Tokenizer: one document at a time in this thread, or
    (batch) every document in one encode_batch_fast over the library's thread pool."""
    from tokenizers import Tokenizer as HF

    docs = list(corpus.iter_documents([str(jsonl)]))
    tok = HF.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True  # as megalite encodes documents
    t = time.perf_counter()
    if batch:
        tokens = sum(len(e.ids) + 1 for e in tok.encode_batch_fast(docs, add_special_tokens=False))
    else:
        tokens = sum(len(tok.encode(d, add_special_tokens=False).ids) + 1 for d in docs)
    return time.perf_counter() - t, tokens


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
    t = time.perf_counter()
    for i in idx:
        dataset[int(i)]
    return (time.perf_counter() - t) / n * 1e6


def batch_us(dataset, mbs=8, n=2_000):
    idx = np.random.default_rng(0).integers(0, len(dataset), (n, mbs)).tolist()
    t = time.perf_counter()
    for ids in idx:
        get_batch(dataset, ids)
    return (time.perf_counter() - t) / n * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--summary", help="write the headline figures as JSON here (run_all.py)")
    args = ap.parse_args()
    out = {"cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        jsonl = corpus.build_corpus(tmp)
        out["corpus_s"] = time.perf_counter() - t
        out["corpus_files"] = len(corpus.stdlib_files())
        out["corpus_mb"] = sum(f.stat().st_size for f in corpus.stdlib_files()) / 2**20
        t = time.perf_counter()
        model = Tokenizer.train([str(jsonl)], tmp / "tok", args.vocab_size)
        out["tokenizer_train_s"] = time.perf_counter() - t

        try:
            import tokenizers  # noqa: F401
        except ImportError:
            hf_model = None
            print("tokenizers is not installed: the Hugging Face rows are skipped", file=sys.stderr)
        else:
            t = time.perf_counter()
            hf_model = train_hf_bpe(jsonl, tmp / "tokenizer.json", args.vocab_size)
            out["hf_tokenizer_train_s"] = time.perf_counter() - t

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
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    how = f"bench_data.py, best of {args.repeats} interleaved rounds"
    figures = [
        figure(
            f"preprocess_data.py tokens/s, {w} worker(s), vs a plain sentencepiece loop",
            round(out[f"tool_{w}w_mb_s"] / base, 2),
            how=how,
        )
        for w in (1, 2)
    ] + [figure("sample fetch, seq 1024", round(out["fetch_us_seq1024"], 1), unit="us", how=how)]
    write_summary(args.summary, "bench_data", figures, " ".join(sys.argv))


if __name__ == "__main__":
    main()
