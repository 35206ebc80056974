"""Tokenize text into a megalite indexed dataset (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input docs/ more.jsonl --output-prefix data/my \\
        --train-tokenizer --vocab-size 8192 --workers 4
    python tools/preprocess_data.py --input corpus.jsonl --json-key text \\
        --output-prefix data/my --tokenizer-model data/my.model
    python tools/preprocess_data.py --input shards/ --output-prefix data/hub \\
        --tokenizer-model hf_tokenizer/        # a tokenizer.json, or a directory holding one

Inputs are text files (each one document), directories (every file inside, in sorted order),
JSONL files (`.jsonl`/`.json`, one document per line under --json-key) and Parquet files (one
document per row, the --json-key column; needs pyarrow); JSONL and text may be gzip- or
Zstandard-compressed (`.jsonl.gz`, `.txt.gz`; `.jsonl.zst` as the Pile ships, needs zstandard).
The tokenizer is a sentencepiece .model or a Hugging Face tokenizer.json (needs tokenizers),
told apart by the path or --tokenizer-type, or GPT-2's BPE (`--vocab-file vocab.json
--merge-file merges.txt`). Each document ends with EOS. Train with `--data-path PREFIX
--tokenizer-model M` (the same tokenizer).

Megatron-LM's command line works as well: with `--json-keys K [K ...]` or `--append-eod` the run
is Megatron's preprocessing, writing PREFIX_<key>_document.bin/.idx for every key, EOD only with
--append-eod, empty texts kept as empty documents, a list of strings read as a document's
sentences: the same files Megatron's tools/preprocess_data.py writes for the same input.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 8                    # -> data/my_text_document.bin/.idx
"""

import argparse
import os
import sys

from megalite.data.corpus import iter_documents, iter_records, text_bytes
from megalite.data.encode_docs import build_datasets_of_fields, build_indexed_dataset
from megalite.data.tokenizer import GPT2BPE, KINDS, SENTENCEPIECE, Tokenizer, load_tokenizer
from megalite.errors import MegaliteError, run_main


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise MegaliteError(f"{message}; see --help")


def parse_args(argv):
    p = _Parser(allow_abbrev=False, prog="preprocess_data.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--input", nargs="+", required=True, help="text, JSONL (.gz/.zst too), Parquet or dirs"
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX.bin and PREFIX.idx (Megatron's way: PREFIX_<key>_document.*)",
    )
    p.add_argument("--json-key", help="JSONL field / Parquet column holding the text [text]")
    p.add_argument(
        "--json-keys",
        nargs="+",
        help="Megatron's preprocessing: the JSONL fields to tokenize, one dataset each",
    )
    p.add_argument(
        "--append-eod",
        action="store_true",
        help="Megatron's preprocessing, with an end-of-document token after each document",
    )
    tok = p.add_mutually_exclusive_group()
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
        help="sentencepiece or huggingface (default: from --tokenizer-model's path); Megatron's "
        "names too",
    )
    p.add_argument(
        "--legacy-tokenizer",
        action="store_true",
        help="Megatron's flag for its offline GPT2BPETokenizer (whose ids megalite's are); "
        "refused with the other types",
    )
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")
    p.add_argument("--vocab-size", type=int, help="pieces of the trained tokenizer")
    p.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"))
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument(
        "--split-sentences",
        action="store_true",
        help="Megatron's nltk splitting: refused; give a field's sentences as a JSON list",
    )
    p.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="off a terminal, a progress line every N documents [1000]",
    )
    p.add_argument(
        "--log-seconds",
        type=float,
        default=30.0,
        help="... or every S seconds, whichever comes first [30]",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    args = p.parse_args(argv)
    args.megatron = args.json_keys is not None or args.append_eod
    files = args.vocab_file is not None or args.merge_file is not None
    if not (args.tokenizer_model or args.train_tokenizer or files):
        raise MegaliteError(
            "no tokenizer given; pass --tokenizer-model, --train-tokenizer, or --tokenizer-type "
            "GPT2BPETokenizer with --vocab-file and --merge-file"
        )
    if args.train_tokenizer and files:
        raise MegaliteError(
            "--train-tokenizer trains its own tokenizer; drop --vocab-file/--merge-file"
        )
    if args.split_sentences:
        raise MegaliteError(
            "--split-sentences (nltk) is not supported; split the text beforehand and give each "
            "JSON field as a list of sentences, which is read as Megatron reads it"
        )
    if args.json_key and args.json_keys:
        raise MegaliteError("--json-key and --json-keys both given; keep one of them")
    if args.megatron and args.train_tokenizer:
        raise MegaliteError(
            "Megatron-style preprocessing (--json-keys, --append-eod) takes an existing "
            "tokenizer; train one first with --train-tokenizer, then pass it to --tokenizer-model"
        )
    if args.json_keys and len(set(args.json_keys)) != len(args.json_keys):
        raise MegaliteError(f"--json-keys {' '.join(args.json_keys)} names a key twice")
    args.json_key = args.json_key or "text"
    if args.train_tokenizer and not args.vocab_size:
        raise MegaliteError("--train-tokenizer needs --vocab-size N (e.g. 8192)")
    if args.tokenizer_model and args.vocab_size:
        raise MegaliteError("--vocab-size only applies with --train-tokenizer; drop one of them")
    if args.train_tokenizer and args.tokenizer_type and KINDS[args.tokenizer_type] != SENTENCEPIECE:
        raise MegaliteError(
            "--train-tokenizer trains a sentencepiece model; train a Hugging Face tokenizer with "
            "the tokenizers package and pass its tokenizer.json to --tokenizer-model"
        )
    if args.workers < 1:
        raise MegaliteError(f"--workers {args.workers} must be at least 1")
    gpt2 = files or (args.tokenizer_type and KINDS[args.tokenizer_type] == GPT2BPE)
    if args.legacy_tokenizer and not gpt2:
        # Megatron's legacy wrappers of the other types add ids of their own (sentencepiece's
        # <CLS>, <SEP>, <EOD>... past the vocabulary; BOS from a Hugging Face tokenizer)
        raise MegaliteError(
            "--legacy-tokenizer is taken with GPT2BPETokenizer only (whose ids are the legacy "
            "tokenizer's); other types get the ids of Megatron's current tokenizers: drop it"
        )
    if args.log_interval < 1 or args.log_seconds < 0:
        raise MegaliteError(
            f"--log-interval {args.log_interval} must be at least 1 and --log-seconds "
            f"{args.log_seconds} at least 0"
        )
    return args


def _log(args) -> dict:
    """How often to write progress lines off a terminal (encode_docs.Progress)."""
    return {
        "every_docs": args.log_interval,
        "every_s": args.log_seconds,
        "total_bytes": text_bytes(args.input),
    }


def main(argv):
    args = parse_args(argv)
    model = args.tokenizer_model
    if args.train_tokenizer:
        model = Tokenizer.train(
            args.input, args.output_prefix, args.vocab_size, args.model_type, args.json_key
        )
        print(f"tokenizer: {model}", file=sys.stderr)
    # checks the tokenizer before any input is read
    tokenizer = load_tokenizer(model, args.tokenizer_type, args.vocab_file, args.merge_file)
    if args.megatron:
        stats, out = _megatron(args, tokenizer)
    else:
        stats = build_indexed_dataset(
            iter_documents(args.input, args.json_key),
            tokenizer.model_path,
            args.output_prefix,
            workers=args.workers,
            progress=not args.quiet,
            tokenizer_type=tokenizer.kind,
            log=_log(args),
        )
        out = f"{args.output_prefix}.bin/.idx"
    print(
        f"{stats['documents']} documents, {stats['tokens']} tokens in {stats['seconds']:.1f} s "
        f"({stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tokens/s) -> {out}",
        file=sys.stderr,
    )
    return 0


def _megatron(args, tokenizer) -> tuple[dict, str]:
    """Megatron's preprocessing: one PREFIX_<key>_document dataset per --json-keys key."""
    keys = args.json_keys or ["text"]
    if args.append_eod and tokenizer.eos_id < 0:
        raise MegaliteError(
            f"--append-eod needs an end-of-document token, but tokenizer {tokenizer.model_path} "
            "has none; use a tokenizer that has one (e.g. </s> or <|endoftext|>)"
        )
    prefixes = [f"{args.output_prefix}_{key}_document" for key in keys]
    stats = build_datasets_of_fields(
        iter_records(args.input, keys),
        tokenizer,
        prefixes,
        args.append_eod,
        workers=args.workers,
        progress=not args.quiet,
        log=_log(args),
    )
    return stats, ", ".join(f"{p}.bin/.idx" for p in prefixes)


def cli():
    """The console entry point megalite-preprocess."""
    sys.exit(run_main(main))
