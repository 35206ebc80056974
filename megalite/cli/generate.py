"""Generate text from a checkpoint, in one process or at a tensor/pipeline layout.

    python tools/generate.py --load DIR --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N]
        [--greedy | --temperature T --top-k K --top-p P] [--seed S] [--stop STRING]
        [--tokenizer-model M] [--dtype auto|fp32|bf16|fp16|fp64] [--json]
    torchrun --nproc_per_node N tools/generate.py --load DIR --tp T --pp P [--ep E] [--cp C] ...

DIR is a megalite checkpoint (a --save directory or one iter_* folder, or the output of
tools/convert_checkpoint.py --to megalite). Each rank reads only the slices of the logical
tensors its (tp, pp) position needs, whatever layout saved it; world / (tp * pp) replicas
generate the same text. An MoE model's experts are whole on every rank, or split over --ep
ranks of each stage (the TP ranks, then the replicas), run by the trainer's MoE layer (its
all-to-all dispatch) in prefill and in each one-token step; a rank reads only its experts. The tokenizer is the one stored in the checkpoint unless
--tokenizer-model is given. Prompts are generated together in one batch (left-padded) with a KV
cache (megalite/generation.py); each stops after N tokens, at EOS, at a --stop string (cut
before it) or when the context is full. --cp C splits long prompts and the KV cache over C
ranks (megalite.generation.CPKVCache). Rank 0 prints.

The model is built on the meta device and materialised from the checkpoint's mapped files
(megalite/checkpoint/mapped.py): no weight is initialised, on the CPU a weight stored whole in
its dtype is the file's own bytes, and --dtype auto (the default) keeps the checkpoint's dtype.
"""

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint.checkpointer import agreed_errors, check_model
from megalite.checkpoint.mapped import load_mapped
from megalite.config import Config, ModelConfig
from megalite.config_read import from_dict
from megalite.data.tokenizer import Tokenizer, load_tokenizer
from megalite.errors import MegaliteError, run_main
from megalite.generation import check_prompts
from megalite.generation import generate as generate_ids
from megalite.model.assemble import build_chunks, layer_env
from megalite.model.env import LOCAL
from megalite.model.gpt import GPTChunk
from megalite.parallel import groups as pg
from megalite.parallel.sampling import Sampling
from megalite.parallel.topology import world_from_env

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}  # fmt: skip


def model_dtype(ckpt, dtype: str = "auto") -> torch.dtype:
    """The dtype to run in: `dtype` (a DTYPES name), or with "auto" the checkpoint's own (that
    of most of its weights' elements)."""
    if dtype != "auto":
        return DTYPES[dtype]
    count = {}
    for name in ckpt.names():
        e = ckpt.tensors[name]
        n = 1
        for d in e["shape"]:
            n *= d
        count[e["dtype"]] = count.get(e["dtype"], 0) + n
    stored = getattr(torch, max(count, key=count.get), None) if count else None
    return stored if stored in DTYPES.values() else torch.float32


def open_checkpoint(path, tokenizer_model=None):
    """The checkpoint (index read, nothing verified yet), its model config and the tokenizer."""
    ckpt = fmt.Checkpoint(path)
    cfg = from_dict({"model": ckpt.model_config}).model
    if tokenizer_model is None:
        stored = fmt.stored_tokenizer(ckpt.files)  # tokenizer.model or tokenizer.json
        if stored is None:
            raise MegaliteError(
                f"checkpoint {ckpt.dir} holds no tokenizer; pass the one it was trained with to "
                "--tokenizer-model"
            )
        tokenizer_model = ckpt.dir / stored
    tok = load_tokenizer(tokenizer_model)
    if tok.vocab_size != cfg.vocab_size:
        raise MegaliteError(
            f"tokenizer {tok.model_path} has {tok.vocab_size} pieces but the model in {ckpt.dir} "
            f"has a {cfg.vocab_size}-token vocabulary; pass the tokenizer it was trained with"
        )
    return ckpt, cfg, tok


def run_config(model: ModelConfig) -> Config:
    """The config generation builds its model with, through training's own builder
    (model/assemble.py): the checkpoint's model, the torch kernels, training's defaults for the
    rest (no FP8, no recompute)."""
    run = Config(model=model)
    run.training.kernels = "torch"  # generation has always run the torch ops
    return run


def load(path, tokenizer_model=None, dtype="auto") -> tuple[GPTChunk, Tokenizer]:
    """The whole model in one process (one chunk, eval mode) and its tokenizer."""
    ckpt, cfg, tok = open_checkpoint(path, tokenizer_model)
    checked = ckpt.verify_while_reading()  # hashed beside the build; the pages stay cached
    run = run_config(cfg)
    (chunk,) = build_chunks(cfg, layer_env(run, dtype=model_dtype(ckpt, dtype), meta=True), [{}])
    load_mapped([chunk], LOCAL, ckpt, "cpu")
    checked.result()
    return chunk.eval(), tok


@dataclass
class Model:
    """What generation needs on this rank: its chunks, groups, the tokenizer and config."""

    chunks: list
    groups: object
    tok: Tokenizer
    cfg: object

    def close(self):
        pg.destroy(barrier=True)


def layout(ckpt, world: int, tp=1, pp=1, ep=1, cp=1):
    """The run shape of generation at tp x pp over `world` ranks (world / (tp pp) replicas),
    with an MoE model's experts split over `ep` ranks of each pipeline stage (the TP ranks
    first, then the replicas: Topology.experts). A layout the model or the world cannot take
    (tp vs heads, pp vs layers, ep vs the experts or the ranks of a stage) is refused in one
    line here, before any process group exists. `cp`: prompts and the KV cache split."""
    from megalite.shape import validate

    run = from_dict({
        "model": ckpt.model_config, "parallel": {"tp": tp, "pp": pp, "ep": ep, "cp": cp},
        "training": {"micro_batch_size": 1, "global_batch_size": world * pp},
    })  # fmt: skip
    return validate(run, world)


def load_chunks(ckpt, cfg, shape, groups, dtype="auto") -> list[GPTChunk]:
    """This rank's chunks (eval mode) of `layout`'s shape, each holding only its experts (those
    of its ep rank), built on the meta device and materialised from this rank's slices only
    (`load_mapped`), in the checkpoint's dtype unless `dtype` names another. Every rank agrees
    on an error."""
    run = run_config(cfg)
    env = layer_env(run, groups, shape.sequence_parallel, dtype=model_dtype(ckpt, dtype), meta=True)
    chunks = [c.eval() for c in build_chunks(cfg, env, shape.partition.rank_chunks(groups.pp.rank))]
    with agreed_errors(groups.world):
        files = sorted(ckpt.files)  # each file hashed by one rank, beside the loading
        checked = ckpt.verify_while_reading(files[groups.rank :: groups.world.size])
        check_model(chunks, groups.tp, ckpt)
    with agreed_errors(groups.world):
        load_mapped(chunks, groups.tp, ckpt, groups.device)
        checked.result()
    return chunks


def load_at_layout(opened, tp=1, pp=1, dtype="auto", ep=1, cp=1) -> Model:
    """This rank's chunks at tp x pp (experts over ep) from `open_checkpoint`'s result. Bad
    input fails before torch.distributed starts (identically on every rank), or every rank
    agrees on the error."""
    from megalite.training.launch import setup

    ckpt, cfg, tok = opened
    world = world_from_env()[1]
    shape = layout(ckpt, world, tp, pp, ep, cp)
    groups = pg.single_process_groups() if world == 1 else setup(shape)
    chunks = load_chunks(ckpt, cfg, shape, groups, dtype)
    ckpt.close()
    return Model(chunks, groups, tok, cfg)


def stop_at(tok, stops):
    """A stop condition on a row's new ids: its text contains one of `stops` (or None)."""
    if not stops:
        return None
    return lambda ids: any(s in tok.decode(ids) for s in stops)


def finish(tok, ids, eos_id, stops) -> tuple[str, str]:
    """(text, finish reason) of a row's new ids: cut before a stop string, EOS not shown."""
    text = tok.decode([t for t in ids if t != eos_id])
    cuts = [text.index(s) for s in stops or () if s in text]
    if cuts:
        return text[: min(cuts)], "stop"
    return text, "stop" if eos_id in ids else "length"


def encode(tok, text: str) -> list[int]:
    return tok.encode(text) if text else [tok.bos_id]


@torch.no_grad()
def generate(chunk, ids, max_new_tokens, eos_id=None, greedy=True, temperature=1.0, top_k=0,
             top_p=1.0, seed=0) -> list[int]:  # fmt: skip
    """The new token ids after the prompt `ids`, from a single-process chunk."""
    sampling = Sampling(0.0 if greedy else temperature, top_k, top_p)
    g = torch.Generator().manual_seed(seed)
    return generate_ids([chunk], pg.single_process_groups(), [list(ids)], max_new_tokens,
                        sampling, g, eos_id)[0]  # fmt: skip


def main(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory")
    p.add_argument("--prompt", action="append", help="text to continue (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop a prompt's text at this string")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (long prompts)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="compute dtype (auto: the checkpoint's)")  # fmt: skip
    p.add_argument("--tokenizer-model", help="sentencepiece model (default: the checkpoint's)")
    p.add_argument("--json", action="store_true", help="print prompt and new token ids as JSON")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    a = p.parse_args(argv)
    sampling = Sampling(0.0 if a.greedy else a.temperature, a.top_k, a.top_p)
    sampling.check()
    if a.max_new_tokens < 0:
        raise MegaliteError(f"--max-new-tokens={a.max_new_tokens} must be >= 0")
    texts = a.prompt or [""]
    opened = open_checkpoint(a.load, a.tokenizer_model)
    cfg, tok = opened[1:]
    prompts = [encode(tok, t) for t in texts]
    check_prompts(prompts, cfg)  # before any process group
    m = load_at_layout(opened, a.tp, a.pp, a.dtype, a.ep, a.cp)
    g = torch.Generator().manual_seed(a.seed)
    new = generate_ids(m.chunks, m.groups, prompts, a.max_new_tokens, sampling, g,
                       tok.eos_id, stop_at(tok, a.stop))  # fmt: skip
    if m.groups.rank == 0:
        for text, ids, out in zip(texts, prompts, new):
            completion, reason = finish(tok, out, tok.eos_id, a.stop)
            if a.json:
                row = {
                    "prompt_ids": ids,
                    "new_ids": out,
                    "text": completion,
                    "finish_reason": reason,
                }
                print(json.dumps(row), flush=True)
            else:
                sys.stdout.write(text + completion + "\n")
        sys.stdout.flush()
    m.close()


def cli():
    """The console entry point megalite-generate."""
    sys.exit(run_main(main))
