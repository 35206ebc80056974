"""Convert checkpoints between megalite, Hugging Face transformers and Megatron-LM.

    python tools/convert_checkpoint.py SRC DST --to hf|megalite|megatron [--from ...]
        [--tp N --pp N --vpp N --ep N] [--format torch_dist|legacy] [--vocab-size N]
        [--transformer-impl local|transformer_engine] [--apply-layernorm-1p] [--dtype D] [--force]

The source format is detected (or named by --from): a megalite checkpoint (a run directory
with `latest`, or one iter_* directory with index.json), a Hugging Face model directory
(config.json plus model.safetensors or a sharded model.safetensors.index.json), or a Megatron-LM
checkpoint (a --save directory with latest_checkpointed_iteration.txt, or one iter_* directory:
legacy mp_rank_* folders or torch_dist files).

  megalite -> hf        config.json + model.safetensors for GPT2LMHeadModel / LlamaForCausalLM
                        (vocabulary padding stripped), plus the run's tokenizer: its
                        sentencepiece tokenizer.model or Hugging Face tokenizer.json, with a
                        tokenizer_config.json that AutoTokenizer loads; config.json keeps
                        every field of the HF model the checkpoint came from that still says
                        this model, and the weights its dtype (--dtype to choose another)
  hf -> megalite        a weights-only megalite checkpoint (DST/iter_0000000 + DST/latest):
                        --load it to fine-tune; the trainer starts a fresh optimizer
  megalite -> megalite  a verified copy. The format is topology-free, so no resharding is
                        needed: any layout loads any checkpoint. --tp/--pp/--vpp are checked
                        against the model (heads, layers divisible) so a bad layout fails here.

  megatron -> megalite  a weights-only megalite checkpoint, the model config from the
                        Megatron args (checkpoint/megatron.py lists what is supported), any
                        tp/pp/vpp/ep of the source merged, the vocabulary padding stripped
                        (--vocab-size N when the args hold only the padded size)
  megalite -> megatron  --format torch_dist (Megatron's default; layout-free) or legacy at
                        --tp/--pp/--vpp/--ep, with args a Megatron run loads (--load, and
                        --finetune or --no-load-optim --no-load-rng: it holds weights only)

Optimizer state is not converted: the tool says so, and a run that loads the result starts a
fresh optimizer. From Hugging Face only safetensors and JSON are read (pytorch_model.bin is
refused); Megatron's pickled .pt files are read with torch.load(weights_only=True) (see
checkpoint/megatron_pickle.py). Progress bars show on a terminal only.

This module is the command (its flags, the source detected, DST written aside and renamed); the
Hugging Face directions are convert_hf.py's, the Megatron-LM ones convert_megatron.py's.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

from megalite.checkpoint import format as fmt
from megalite.checkpoint import megatron_files, writing
from megalite.cli.convert_common import check_layout, progress
from megalite.cli.convert_hf import DTYPES, hf_to_megalite, megalite_to_hf
from megalite.cli.convert_megatron import megalite_to_megatron, megatron_to_megalite
from megalite.config_read import from_dict
from megalite.errors import MegaliteError, run_main


def detect(src: Path) -> str:
    if not src.is_dir():
        raise MegaliteError(
            f"{src} does not exist or is not a directory; pass a checkpoint directory"
        )
    if fmt.has_checkpoint(src):
        return "megalite"
    if (src / "config.json").is_file():
        return "hf"
    if megatron_files.is_megatron(src):
        return "megatron"
    raise MegaliteError(
        f"{src} is neither a megalite checkpoint (index.json or latest), a Hugging Face model "
        "(config.json) nor a Megatron-LM checkpoint (latest_checkpointed_iteration.txt, mp_rank_* "
        "or common.pt)"
    )


def shard_bytes(text: str) -> int:
    """--max-shard-size: bytes, or a number with KB/MB/GB (powers of 1000, as transformers)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    unit = next((u for u in sorted(units, key=len, reverse=True) if t.endswith(u)), None)
    try:
        n = float(t[: -len(unit)]) * units[unit] if unit else float(t)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2GB, 500MB, 1000000)")
    return int(n)


def megalite_to_megalite(src: Path, dst: Path, args):
    ckpt = fmt.Checkpoint(src)
    cfg = from_dict({"model": ckpt.model_config})
    check_layout(cfg, args.tp, args.pp, args.vpp)
    for f in progress(sorted(ckpt.files), "verifying", "file"):
        ckpt.verify([f])
    shutil.copytree(ckpt.dir, dst / ckpt.dir.name)
    writing.write_atomic(dst / fmt.LATEST, ckpt.dir.name)


def main(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--to", choices=("hf", "megalite", "megatron"), required=True)
    p.add_argument("--from", dest="source", choices=("hf", "megalite", "megatron"),
                   help="the source format (default: detected)")  # fmt: skip
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="layout to check the model against; a legacy Megatron target's layout",
    )
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="a legacy Megatron target's expert layout")
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        p.add_argument(flag, type=int, default=None, help="a legacy Megatron target's uneven "
                       "stages: layers on the first / last pipeline rank")  # fmt: skip
    for flag in ("--account-for-embedding-in-pipeline-split",
                 "--account-for-loss-in-pipeline-split"):  # fmt: skip
        p.add_argument(flag, action="store_true", help="a legacy Megatron target's uneven stages")
    p.add_argument("--pipeline-model-parallel-layout", "--pp-layout", default=None,
                   help='a legacy Megatron target\'s stages spelled out, e.g. "Et|tt|tt|tL"')  # fmt: skip
    p.add_argument(
        "--format",
        choices=("torch_dist", "legacy"),
        default="torch_dist",
        help="--to megatron: Megatron's checkpoint format (default torch_dist)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="--from megatron: the real vocabulary when the args hold only the padded",
    )
    p.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="--to megatron: the layer spec whose parameter names to write (default local)",
    )
    p.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="--to megatron: for a Megatron run with --apply-layernorm-1p (each norm weight "
        "written as its offset from 1)",
    )
    p.add_argument(
        "--keep-position",
        action="store_true",
        help="--from megatron: keep the iteration and consumed samples, so --load continues the "
        "job (fresh optimizer) instead of starting at iteration 0",
    )
    p.add_argument(
        "--max-shard-size",
        type=shard_bytes,
        default=writing.SHARD_BYTES,
        help="the largest output file (megalite and Hugging Face targets; e.g. 2GB, 500MB): a "
        "conversion holds at most one such file's computed tensors (default 1GiB)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="--to hf: the weights' dtype (default: the dtype of the Hugging Face model the "
        "checkpoint came from, else the checkpoint's own)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing DST")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    args = p.parse_args(argv)
    source = detect(args.src)
    if args.source and args.source != source:
        raise MegaliteError(f"{args.src} is a {source} checkpoint, not {args.source}")
    if source == "hf" and args.to == "hf":
        raise MegaliteError(f"{args.src} is already a Hugging Face model; use --to megalite")
    if (
        source != "megalite"
        and args.to not in (source, "megalite")
        or source == args.to == "megatron"
    ):
        raise MegaliteError(
            f"{source} -> {args.to} is not a direct conversion; convert to megalite first "
            f"(--to megalite), then from that checkpoint --to {args.to}"
        )
    if args.dst.exists() and not args.force:
        raise MegaliteError(f"{args.dst} exists; pass --force to replace it")
    # Written aside and renamed, so a failed conversion leaves an existing DST as it was.
    tmp = args.dst.with_name(f".{args.dst.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    convert = {"hf": hf_to_megalite, "megalite": megalite_to_megalite,
               "megatron": megatron_to_megalite}[source]  # fmt: skip
    if source == "megalite" and args.to != "megalite":
        convert = {"hf": megalite_to_hf, "megatron": megalite_to_megatron}[args.to]
    try:
        tmp.mkdir(parents=True)
        convert(args.src, tmp, args)
        if args.dst.exists():
            shutil.rmtree(args.dst)
        os.replace(tmp, args.dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.dst} ({source} -> {args.to})", file=sys.stderr)


def cli():
    """The console entry point megalite-convert."""
    sys.exit(run_main(main))
