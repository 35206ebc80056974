"""The model architecture from the checkpoint a run resumes (Megatron's --use-checkpoint-args).

The index of every checkpoint holds the full config of the run that wrote it ("config"; a
conversion from Hugging Face writes the converted model's). Before `validate()`, a run that
loads a checkpoint takes from it every model field that neither a flag nor the YAML gave, so
`--load DIR --data-path ... --tokenizer-model ...` trains the checkpoint's architecture. A given
field that contradicts the checkpoint ends the run with one line naming both values. Fields
that do not change the parameters (sequence length, dropout, initialisation, vocabulary
padding) may differ: they are the run's to choose.
"""

import copy
import dataclasses
import os
import shutil
from pathlib import Path

from megalite.config import Config, ModelConfig
from megalite.config_read import from_dict, where
from megalite.errors import MegaliteError

FREE = ("seq_length", "hidden_dropout", "attention_dropout", "init_method_std",
        "make_vocab_size_divisible_by")  # fmt: skip
FLAGS = {"untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights"}


def _effective(m: ModelConfig) -> dict:
    """What each architecture field means once defaults are resolved: num_query_groups None is
    the head count, ffn_hidden_size None is the flavour's default, ..."""
    return {
        "flavour": m.flavour,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.heads_kv,
        "kv_channels": m.head_dim,
        "ffn_hidden_size": m.ffn,
        "max_position_embeddings": (m.max_position_embeddings or m.seq_length)
        if m.features.learned_positions else None,
        "vocab_size": m.vocab_size,
        "norm_epsilon": m.norm_epsilon,
        "rotary_base": m.rotary_base if m.features.rotary else None,
        "untie_embeddings_and_output_weights": not m.tied,
        **_latent_attention(m),
        "mtp_num_layers": m.mtp_num_layers,
    }  # fmt: skip


def _latent_attention(m: ModelConfig) -> dict:
    """MLA's dims (model/mla.py), which shape its parameters; none without latent attention."""
    if not m.features.latent_attention:
        return {}
    names = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    return {name: getattr(m, name) for name in names}


def _shape_example(tensors: dict, model: ModelConfig) -> str:
    """' (tensor X has shape A there, B with the flags)' for the first parameter of `model`
    whose shape differs from the checkpoint's, built on the meta device ('' if none does)."""
    from megalite.model.assemble import build_chunks, layer_env
    from megalite.parallel.specs import spec_of

    run = Config(model=model)  # one process, as training builds it (model/assemble.py)
    layers = [0] if model.num_layers else []
    (chunk,) = build_chunks(model, layer_env(run, meta=True), [{"layers": layers}])
    for p in chunk.parameters():
        spec = spec_of(p)
        theirs = tensors.get(spec.name, {}).get("shape")
        if theirs is not None and list(theirs) != list(spec.shape):
            return f" (tensor {spec.name} has shape {list(theirs)} there, {list(spec.shape)} with the flags)"
    return ""


def with_checkpoint_model(cfg: Config, given: set, path) -> Config:
    """`cfg` with the model fields not in `given` ("model.<field>") taken from the checkpoint at
    `path`; refuses a given field whose value contradicts it. `cfg` itself is not changed."""
    from megalite.checkpoint.megatron_direct import open_checkpoint

    ckpt = open_checkpoint(path)  # megalite's own, or a Megatron checkpoint's args
    stored = ckpt.index.get("config", {}).get("model")
    if not isinstance(stored, dict):
        raise MegaliteError(f"{ckpt.dir} records no model config; pass every model flag")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        theirs = from_dict({"model": {k: v for k, v in stored.items() if k in fields}}).model
    except MegaliteError as e:
        raise MegaliteError(f"{ckpt.dir}/index.json: {e}") from None
    if theirs.max_position_embeddings is None and theirs.features.learned_positions:
        theirs.max_position_embeddings = theirs.seq_length  # the table keeps its size
    out = copy.deepcopy(cfg)
    for name in fields:
        if f"model.{name}" not in given:
            setattr(out.model, name, getattr(theirs, name))
    if out.model.vocab_size is None:
        out.model.vocab_size = theirs.vocab_size
    want, have = _effective(theirs), _effective(out.model)
    for name in sorted(want, key=lambda n: f"model.{n}" not in given):  # a given one first
        if have[name] != want[name]:
            flag = where(given, f"model.{name}") if f"model.{name}" in given else \
                FLAGS.get(name, "--" + name.replace("_", "-"))  # fmt: skip
            example = _shape_example(ckpt.tensors, out.model)
            raise MegaliteError(
                f"checkpoint {ckpt.dir} has {name}={want[name]} but this run's {flag} is "
                f"{have[name]}{example}; "
                "drop the flag to train the checkpoint's architecture, or load another checkpoint"
            )
    return out


def _stable_copy(src: Path, cache_dir) -> str:
    """`src` copied (once, atomically) to --data-cache-dir/tokenizers/<sha256>/: the checkpoint
    it came from may be pruned by --keep-checkpoints while the run still saves it."""
    from megalite.checkpoint import format as fmt

    digest = fmt.sha256_file(src)
    dst = Path(cache_dir) / "tokenizers" / digest[:16] / src.name
    if not dst.is_file() or fmt.sha256_file(dst) != digest:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    return str(dst)


def with_checkpoint_tokenizer(cfg: Config, given: set, path) -> tuple[Config, str | None]:
    """(`cfg` with the checkpoint's tokenizer where the run names none, a line saying so).

    Every megalite checkpoint carries the tokenizer its run read (tokenizer.model or
    tokenizer.json), so `--load DIR --data-path ...` needs no --tokenizer-model, and the
    built-in corpus is tokenized by the model's own tokenizer. Refused in one line: a
    checkpoint without one whose vocabulary differs from the built-in corpus's tokenizer's (its
    saves and exports would ship that demo tokenizer as the model's), and a given tokenizer
    larger than the checkpoint's vocabulary (naming where each size came from)."""
    from megalite.checkpoint import format as fmt
    from megalite.checkpoint.megatron_direct import open_checkpoint
    from megalite.data.splits import split_blends
    from megalite.data.tokenizer import load_tokenizer

    ckpt = open_checkpoint(path)  # megalite's own, or a Megatron checkpoint (no tokenizer)
    d, vocab = cfg.data, cfg.model.vocab_size
    saved = fmt.stored_tokenizer(ckpt.files)
    from_flag = "model.vocab_size" in given  # else the checkpoint's (with_checkpoint_model)
    if d.tokenizer_model or d.vocab_file or d.merge_file:
        if from_flag:
            return cfg, None  # the flag's size: build_datasets checks the tokenizer against it
        tok = load_tokenizer(d.tokenizer_model, d.tokenizer_type, d.vocab_file, d.merge_file)
        flag = "--tokenizer-model" if d.tokenizer_model else "--vocab-file, --merge-file"
        if tok.vocab_size > vocab:
            hint = f"pass its own (--tokenizer-model {ckpt.dir / saved})" if saved else \
                f"pass one of at most {vocab} pieces"  # fmt: skip
            raise MegaliteError(
                f"tokenizer {tok.model_path} ({flag}) has {tok.vocab_size} pieces but "
                f"checkpoint {ckpt.dir} has a vocabulary of {vocab} (its vocab_size); {hint}"
            )
        return cfg, None
    builtin = not any(b and b.prefixes for b in split_blends(d, cfg.training.eval_only)[0])
    if saved:
        out = copy.deepcopy(cfg)
        out.data.tokenizer_model = _stable_copy(ckpt.dir / saved, d.data_cache_dir)
        return out, f"tokenizer: checkpoint {ckpt.dir}'s {saved} (no --tokenizer-model given)"
    if builtin and not from_flag and vocab != d.tokenizer_vocab_size:
        raise MegaliteError(
            f"checkpoint {ckpt.dir} has a vocabulary of {vocab} (its vocab_size) and holds no "
            f"tokenizer, and the built-in corpus's tokenizer has {d.tokenizer_vocab_size} pieces: "
            "pass your data with --data-path and the model's tokenizer with --tokenizer-model"
        )
    return cfg, None
