"""Merge .bin/.idx shards preprocessed apart into one dataset, as Megatron-LM's
tools/merge_datasets.py does (its flags, its files byte for byte):

    python tools/merge_datasets.py --input shards/ --output-prefix data/corpus_text_document

--input is a directory holding the shards (X.bin + X.idx each, merged in sorted order of X;
megalite's X.idx.json beside them is merged too: one tokenizer for all). It streams: shards of
any size merge in a few MB of memory.
"""

import argparse
import sys

from megalite.data.merge_shards import merge
from megalite.errors import MegaliteError, run_main


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise MegaliteError(f"{message}; see --help")


def parse_args(argv):
    p = _Parser(prog="merge_datasets.py", allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="the directory holding the .bin/.idx shards")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument(
        "--multimodal", action="store_true", help="the shards carry sequence modes (Megatron's)"
    )
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    return p.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    stats = merge(args.input, args.output_prefix, args.multimodal)
    if stats["sidecar"]:
        print(f"no {args.output_prefix}.idx.json: {stats['sidecar']}", file=sys.stderr)
    print(
        f"{stats['shards']} shards, {stats['documents']} documents, {stats['tokens']} tokens in "
        f"{stats['seconds']:.1f} s -> {args.output_prefix}.bin/.idx",
        file=sys.stderr,
    )
    return 0


def cli():
    """The console entry point megalite-merge-datasets."""
    sys.exit(run_main(main))
