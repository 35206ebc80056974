"""Data pipeline throughput: tools/preprocess_data.py against a plain sentencepiece loop, and
the cost of fetching a training sample.

    python bench/bench_data.py [--repeats 3] [--json out.json]

Everything runs on the built-in corpus, prepared in a temporary directory. Each figure is the
best of --repeats runs (the machine may be shared; the best run is the least disturbed one).
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

from megalite.data import corpus
from megalite.data.gpt_dataset import GPTDataset
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

        # Interleaved rounds: a burst of load from other users hits every method alike.
        runs = {"plain": [], 1: [], 2: []}
        for _ in range(args.repeats):
            secs, tokens = plain_encode_seconds(jsonl, model)
            runs["plain"].append(secs)
            for w in (1, 2):
                secs, n = tool_seconds(jsonl, model, tmp / "d", w)
                assert n == tokens, (n, tokens)
                runs[w].append(secs)
        out["tokens"] = tokens
        out["plain_encode_tok_s"] = tokens / min(runs["plain"])
        for w in (1, 2):
            out[f"tool_{w}w_tok_s"] = tokens / min(runs[w])
            out[f"tool_{w}w_median_tok_s"] = tokens / float(np.median(runs[w]))
        out["plain_encode_median_tok_s"] = tokens / float(np.median(runs["plain"]))

        indexed = IndexedDataset(tmp / "d")
        for seq in (128, 1024):
            ds = GPTDataset(indexed, 0, len(indexed), seq, seed=0)
            out[f"fetch_us_seq{seq}"] = best(lambda ds=ds: fetch_us(ds), args.repeats)
        ds = GPTDataset(indexed, 0, len(indexed), 128, seed=0)
        out["get_batch_us_mbs8_seq128"] = best(lambda: batch_us(ds), args.repeats)

    base = out["plain_encode_tok_s"]
    print(f"corpus: {out['corpus_files']} files, {out['corpus_mb']:.2f} MB, {tokens} tokens")
    print(
        f"prepare: corpus {out['corpus_s']:.2f} s, tokenizer training {out['tokenizer_train_s']:.1f} s"
    )
    print("                           best tokens/s  ratio   (median tokens/s)")
    print(
        f"plain sentencepiece loop  {base:12,.0f}   1.00x  ({out['plain_encode_median_tok_s']:,.0f})"
    )
    for w in (1, 2):
        r, med = out[f"tool_{w}w_tok_s"], out[f"tool_{w}w_median_tok_s"]
        print(f"preprocess_data {w} worker(s) {r:10,.0f}   {r / base:.2f}x  ({med:,.0f})")
    for k in ("fetch_us_seq128", "fetch_us_seq1024", "get_batch_us_mbs8_seq128"):
        print(f"{k:28s} {out[k]:8.2f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
