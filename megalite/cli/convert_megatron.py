"""Conversion between Megatron-LM checkpoints and megalite's (cli/convert.py): legacy or
torch_dist files read into a weights-only checkpoint (optionally keeping the job's position),
and a checkpoint exported as Megatron's files at a layout."""

import sys
from functools import partial
from pathlib import Path

from megalite.checkpoint import format as fmt
from megalite.checkpoint import megatron as mg
from megalite.checkpoint import megatron_args, megatron_direct, megatron_dist, writing
from megalite.checkpoint.megatron_direct import saved_config
from megalite.cli.convert_common import check_layout, progress, split_flags
from megalite.config import Config
from megalite.config_read import from_dict
from megalite.errors import MegaliteError

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
