"""Conversion between Hugging Face transformers models and megalite checkpoints (cli/convert.py):
a model directory (config.json and safetensors, never pickle) read into a weights-only
checkpoint, and a checkpoint written back as config.json, safetensors shards and the run's
tokenizer, keeping what the source model's config.json said."""

import json
import os
import sys
from pathlib import Path

import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint import hf, writing
from megalite.checkpoint.megatron_direct import saved_config
from megalite.checkpoint.safetensors_file import MappedSafetensors
from megalite.cli.convert_common import check_layout, progress
from megalite.config import Config
from megalite.config_read import from_dict
from megalite.errors import MegaliteError
from megalite.model.gpt import VOCAB_TENSORS

HUB_FIELDS = hf.HUB_FIELDS
GENERATION_CONFIG = "generation_config.json"
DTYPES = ("bfloat16", "float16", "float32")


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
