"""Tokenize text into a megalite indexed dataset (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input docs/ more.jsonl --output-prefix data/my \\
        --train-tokenizer --vocab-size 8192 --workers 4
    python tools/preprocess_data.py --input corpus.jsonl --json-key text \\
        --output-prefix data/my --tokenizer-model data/my.model
    python tools/preprocess_data.py --input shards/ --output-prefix data/hub \\
        --tokenizer-model hf_tokenizer/        # a tokenizer.json, or a directory holding one

Inputs are text files (each one document), directories (every file inside, in sorted order),
JSONL files (`.jsonl`/`.json`, one document per line under --json-key) and Parquet files (one
document per row, the --json-key column; needs pyarrow); JSONL and text may be gzip-compressed
(`.jsonl.gz`, `.txt.gz`). The tokenizer is a sentencepiece .model or a Hugging Face
tokenizer.json (needs tokenizers), told apart by the path or --tokenizer-type. Each document
ends with EOS. Train with `--data-path PREFIX --tokenizer-model M` (the same tokenizer).
"""

import argparse
import os
import sys

from megalite.data.corpus import iter_documents
from megalite.data.indexed_dataset import build_indexed_dataset
from megalite.data.tokenizer import KINDS, Tokenizer, load_tokenizer
from megalite.errors import MegaliteError, run_main


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise MegaliteError(f"{message}; see --help")


def parse_args(argv):
    p = _Parser(prog="preprocess_data.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--input", nargs="+", required=True, help="text, JSONL (.gz too), Parquet or directories"
    )
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument(
        "--json-key", default="text", help="JSONL field / Parquet column holding the text [text]"
    )
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument(
        "--tokenizer-model",
        help="an existing sentencepiece .model, Hugging Face tokenizer.json or a directory "
        "holding one",
    )
    tok.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a sentencepiece model on the input (PREFIX.model)",
    )
    p.add_argument(
        "--tokenizer-type",
        choices=tuple(KINDS),
        help="sentencepiece or huggingface (default: from --tokenizer-model's path)",
    )
    p.add_argument("--vocab-size", type=int, help="pieces of the trained tokenizer")
    p.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"))
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--quiet", action="store_true", help="no progress bar (none off a terminal)")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    args = p.parse_args(argv)
    if args.train_tokenizer and not args.vocab_size:
        raise MegaliteError("--train-tokenizer needs --vocab-size N (e.g. 8192)")
    if args.tokenizer_model and args.vocab_size:
        raise MegaliteError("--vocab-size only applies with --train-tokenizer; drop one of them")
    if (
        args.train_tokenizer
        and args.tokenizer_type
        and KINDS[args.tokenizer_type] != "sentencepiece"
    ):
        raise MegaliteError(
            "--train-tokenizer trains a sentencepiece model; train a Hugging Face tokenizer with "
            "the tokenizers package and pass its tokenizer.json to --tokenizer-model"
        )
    if args.workers < 1:
        raise MegaliteError(f"--workers {args.workers} must be at least 1")
    return args


def main(argv):
    args = parse_args(argv)
    model = args.tokenizer_model
    if args.train_tokenizer:
        model = Tokenizer.train(
            args.input, args.output_prefix, args.vocab_size, args.model_type, args.json_key
        )
        print(f"tokenizer: {model}", file=sys.stderr)
    # checks the tokenizer before any input is read
    tokenizer = load_tokenizer(model, args.tokenizer_type)
    stats = build_indexed_dataset(
        iter_documents(args.input, args.json_key),
        tokenizer.model_path,
        args.output_prefix,
        workers=args.workers,
        progress=not args.quiet,
        tokenizer_type=tokenizer.kind,
    )
    print(
        f"{stats['documents']} documents, {stats['tokens']} tokens in {stats['seconds']:.1f} s "
        f"({stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tokens/s) -> "
        f"{args.output_prefix}.bin/.idx",
        file=sys.stderr,
    )
    return 0


def cli():
    """The console entry point megalite-preprocess."""
    sys.exit(run_main(main))
