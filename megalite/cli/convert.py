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
checkpoint/megatron_files.py). Progress bars show on a terminal only.
"""

import argparse
import copy
import json
import os
import shutil
import sys
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from megalite.checkpoint import format as fmt
from megalite.checkpoint import (
    hf,
    megatron_args,
    megatron_direct,
    megatron_dist,
    megatron_files,
    writing,
)
from megalite.checkpoint import megatron as mg
from megalite.checkpoint.megatron_direct import saved_config
from megalite.checkpoint.safetensors_file import MappedSafetensors
from megalite.config import Config
from megalite.config_read import from_dict
from megalite.errors import MegaliteError, run_main
from megalite.model.gpt import VOCAB_TENSORS
from megalite.shape import validate


def progress(items, what: str, unit: str = "tensor", total=None):
    """`items` with a progress bar on stderr when it is a terminal (quiet in logs and pipes)."""
    return tqdm(items, desc=what, unit=unit, disable=None, total=total)


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


def check_layout(cfg: Config, tp: int, pp: int, vpp: int, stages: dict | None = None):
    """Reject a layout this model cannot take, with validate()'s sentences. A copy is checked,
    with batch fields set so that only the model-vs-layout checks can fail: the conversion's
    layout never enters the saved config. `stages`: uneven pipeline stages (`split_flags`)."""
    cfg = copy.deepcopy(cfg)
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp = tp, pp, vpp
    for k, v in (stages or {}).items():  # (ParallelConfig's fields have Megatron's args names)
        setattr(cfg.parallel, k, v)
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 1, pp
    validate(cfg, tp * pp)


def split_flags(args) -> dict:
    """A legacy Megatron target's uneven pipeline stages, by Megatron's args names: the flags
    given (partition.py reads them)."""
    given = {k: getattr(args, k) for k in megatron_args.PIPELINE_SPLIT_ARGS}
    return {k: v for k, v in given.items() if v}


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


# ---- Hugging Face side -----------------------------------------------------------------------


def read_hf_config(src: Path) -> dict:
    try:
        return json.loads((src / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise MegaliteError(f"{src / 'config.json'} is not valid JSON ({e})") from None


def read_hf_weights(src: Path) -> dict:
    """The state dict of a Hugging Face model directory, from safetensors only: each tensor
    views the mapped file (no copy: the pages are the page cache's)."""
    if (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif (src / "model.safetensors.index.json").is_file():
        weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        raise MegaliteError(
            f"{src} has no model.safetensors; megalite never loads pickle (pytorch_model.bin): "
            "save the model with save_pretrained(safe_serialization=True)"
        )
    state = {}
    for f in files:
        mapped = MappedSafetensors(src / fmt._safe_name(f, src / "model.safetensors.index.json"))
        state.update((k, mapped.get(k)) for k in mapped.keys())
    return state


def read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MegaliteError(f"{path} is not valid JSON ({e})") from None


def hf_to_megalite(src: Path, dst: Path, args):
    hf_config = read_hf_config(src)
    cfg = Config()
    try:
        cfg.model = hf.model_config_from_hf(hf_config)  # unsupported architectures raise here
    except KeyError as e:
        raise MegaliteError(f"{src / 'config.json'} lacks the field {e}") from None
    check_layout(cfg, args.tp, args.pp, args.vpp)
    logical = hf.from_hf(read_hf_weights(src), cfg.model)  # views of the mapped files

    def tensors():
        for name, t in progress(logical.items(), "converting"):
            if name in VOCAB_TENSORS:
                t = t[: cfg.model.vocab_size]  # the format stores the real vocabulary
            yield name, t

    # a sentencepiece model where the directory has both (Llama's): what megalite always took
    tokenizer = next((src / n for n in fmt.TOKENIZERS if (src / n).is_file()), None)
    # what config.json says beyond the model (token ids) and generation_config.json: carried
    # to an export back to Hugging Face
    hub = {k: hf_config.get(k) for k in HUB_FIELDS if hf_config.get(k) is not None}
    if (gen := read_json(src / GENERATION_CONFIG)) is not None:
        hub["generation_config"] = gen
    hub["config"] = hf_config  # every field a user sees, for the export back (with its dtype)
    meta = {
        "iteration": 0,
        "consumed_samples": 0,
        "optimizer": None,  # weights only: a run that loads it starts a fresh optimizer
        "layout": None,
        "config": saved_config(cfg.model),
        "rng": None,
        "source": f"huggingface:{(hf_config.get('architectures') or ['?'])[0]}",
        "huggingface": hub,
    }
    writing.write_full_checkpoint(dst / fmt.iter_dirname(0), tensors(), meta, tokenizer,
                              args.max_shard_size)  # fmt: skip
    writing.write_atomic(dst / fmt.LATEST, fmt.iter_dirname(0))


HUB_FIELDS = hf.HUB_FIELDS
GENERATION_CONFIG = "generation_config.json"
DTYPES = ("bfloat16", "float16", "float32")


def source_dtype(config: dict) -> str | None:
    """The dtype a Hugging Face config.json states (transformers >= 5: dtype, else torch_dtype)."""
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in DTYPES else None


def megalite_to_hf(src: Path, dst: Path, args):
    ckpt = fmt.Checkpoint(src)
    checked = ckpt.verify_while_reading()  # trusted once it is done, before DST is renamed
    cfg = from_dict({"model": ckpt.model_config}).model
    out = hf.to_hf(ckpt.lazy(), cfg)  # views of the mapped files where no arithmetic is needed
    if cfg.tied:  # one tensor under two names cannot be saved; transformers re-ties lm_head
        out.pop("lm_head.weight", None)
    hub = ckpt.index.get("huggingface") or {}  # what the model it came from said
    source = hub.get("config") or {}
    have = next(iter(out.values())).dtype
    dtype_name = args.dtype or source_dtype(source) or fmt.dtype_name(have)
    dtype = getattr(torch, dtype_name)
    if dtype != have:
        why = "--dtype" if args.dtype else "the dtype its source model's config.json states"
        print(f"note: weights written in {dtype_name} ({why}); the checkpoint holds "
              f"{fmt.dtype_name(have)}", file=sys.stderr)  # fmt: skip
    shards = writing.ShardWriter(
        dst,
        lambda k: f"model-{k + 1:05d}.safetensors",
        args.max_shard_size,
        metadata={"format": "pt"},
    )
    for k, t in progress(out.items(), "writing"):
        shards.add(k, t.to(dtype))
    written, _ = shards.finish()
    del out
    if len(written) == 1:
        os.replace(dst / written[0][0], dst / "model.safetensors")
    else:
        weight_map = {}
        for i, (f, keys) in enumerate(written):
            name = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
            os.replace(dst / f, dst / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": shards.total}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = hf.hf_config(cfg)
    config["torch_dtype"] = dtype_name
    if "dtype" in source:  # transformers >= 5's name for it
        config["dtype"] = dtype_name
    config["bos_token_id"] = config["eos_token_id"] = None  # unknown without a tokenizer
    if name := fmt.stored_tokenizer(ckpt.files):  # the tokenizer the run trained with
        config.update(hf.export_tokenizer(ckpt.dir / name, dst))
    config.update({k: hub[k] for k in HUB_FIELDS if k in hub})
    # and every other field it read (the token ids: the record's above, else the tokenizer's)
    config = hf.with_source_fields(config, {k: v for k, v in source.items() if k not in HUB_FIELDS})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None
    }
    generation.update(hub.get("generation_config") or {})
    (dst / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2))
    checked.result()


# ---- Megatron-LM side ------------------------------------------------------------------------

WEIGHTS_ONLY = (
    "note: weights only: the optimizer state is not converted; a run that loads the result "
    "starts a fresh optimizer"
)


def megatron_to_megalite(src: Path, dst: Path, args):
    margs, state, facts = megatron_dist.read_megatron(src)
    cfg = Config()
    cfg.model = megatron_args.config_from_args(margs, args.vocab_size)
    if not (args.vocab_size or margs.get("vocab_size")):
        print(
            f"note: the Megatron args hold only the padded vocabulary ({cfg.model.vocab_size}); "
            "kept every row (pass --vocab-size N to strip the padding)",
            file=sys.stderr,
        )
    check_layout(cfg, args.tp, args.pp, args.vpp)
    lazy = mg.from_megatron_lazy(state, cfg.model, f"the Megatron checkpoint {src}")
    if megatron_args.zero_centred_gamma(margs):  # --apply-layernorm-1p: weight - 1 stored
        lazy = mg.shift_norms(lazy, 1.0)
    held = f" ({src} holds optimizer state)" if facts["optimizer"] else ""
    print(WEIGHTS_ONLY + held, file=sys.stderr)
    # --keep-position: a run that --loads the result continues Megatron's job where it stopped
    # (iteration, LR schedule, data stream: the sample order is Megatron's), with a fresh optimizer.
    iteration = int(facts["iteration"]) if args.keep_position else 0
    consumed = int(margs.get("consumed_train_samples") or 0) if args.keep_position else 0
    if args.keep_position and iteration and not consumed:
        raise MegaliteError(
            f"{src}'s args do not say how many samples were consumed (consumed_train_samples); "
            "convert without --keep-position and start from iteration 0"
        )
    meta = {
        "iteration": iteration,
        "consumed_samples": consumed,
        # Megatron's LR/WD schedule position (a fresh optimizer continues the schedule there)
        "schedule_samples": megatron_direct.schedule_position(facts)
        if args.keep_position
        else None,
        "optimizer": None,  # weights only: a run that loads it starts a fresh optimizer
        "layout": None,
        "config": saved_config(cfg.model),
        "rng": None,
        "source": f"megatron:{facts['format']}:iteration {facts['iteration']}",
    }
    if isinstance(margs.get("huggingface"), dict):  # written by megalite's export
        meta["huggingface"] = margs["huggingface"]
    # each tensor computed (tp shards merged, qkv split) when its file writes it, in its own bytes
    bar = progress(None, "converting", total=len(lazy))

    def made(f):
        t = f()
        bar.update()
        return t

    tensors = mg.State({n: partial(made, f) for n, f in dict.items(lazy)}, lazy.shapes, lazy.dtypes)
    writing.write_full_checkpoint(dst / fmt.iter_dirname(iteration), tensors, meta,
                              max_bytes=args.max_shard_size)  # fmt: skip
    writing.write_atomic(dst / fmt.LATEST, fmt.iter_dirname(iteration))


def megalite_to_megatron(src: Path, dst: Path, args):
    ckpt = fmt.Checkpoint(src)
    checked = ckpt.verify_while_reading()
    cfg = from_dict({"model": ckpt.model_config})
    stages = split_flags(args)
    check_layout(cfg, args.tp, args.pp, args.vpp, stages)
    print(WEIGHTS_ONLY, file=sys.stderr)
    megatron_direct.export_megatron(ckpt, dst, args.format, args.tp, args.pp, args.vpp, args.ep,
                                    args.transformer_impl, stages,
                                    layernorm_1p=args.apply_layernorm_1p)  # fmt: skip
    checked.result()


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
