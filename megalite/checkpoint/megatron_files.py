"""Megatron-LM's checkpoint files: the legacy per-rank layout (read, written), shared helpers.

    legacy      ROOT/latest_checkpointed_iteration.txt, ROOT/iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/
                model_optim_rng.pt: a dict with `model` (or `model0..` per virtual stage), `args`
                (an argparse.Namespace), `checkpoint_version`, `iteration`; tp shards split
                column-parallel tensors on dim 0 (SwiGLU fc1 as [gate_r | up_r] per rank),
                row-parallel weights on dim 1; a stage numbers its layers from 0, an ep rank
                its experts; virtual stage v of pp rank p holds Megatron's split (`partition`:
                even, or uneven by the args' first/last, account-for or layout flags).
    torch_dist  ROOT/iter_NNNNNNN/{*.distcp, .metadata, common.pt, metadata.json}: in
                `megatron_dist.py`, which also reads either format (`read_megatron`).

`read_legacy` gives (args dict, Megatron state of global tensors with local names, facts);
`write_legacy` writes such a state at a layout. Which dim a tp shard splits and which layers a
stage holds are megatron_layout.py's; the pickled files are read by megatron_pickle.py's
`load_pickle` (no code in them runs).
"""

import argparse
import io
import json
import re
from functools import partial
from pathlib import Path

import torch

from megalite.checkpoint import megatron as mg
from megalite.checkpoint.megatron_layout import (
    layer_ranges,
    layout,
    merge_tp,
    merged_shape,
    tp_dim,
    tp_shard,
)
from megalite.checkpoint.megatron_pickle import args_of, load_pickle
from megalite.checkpoint.torch_stream import Later, save_streaming
from megalite.errors import MegaliteError

LATEST = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.*)$")
TE_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


# ---- finding the checkpoint -----------------------------------------------------------------


def iteration_dir(src: Path) -> Path:
    """The iter_*/release directory of a Megatron checkpoint (a root with LATEST, or one)."""
    if (src / LATEST).is_file():
        it = (src / LATEST).read_text().strip()
        name = "release" if it == "release" else f"iter_{int(it):07d}" if it.isdigit() else None
        if name is None or not (src / name).is_dir():
            raise MegaliteError(
                f"{src / LATEST} says {it!r} but {src} has no such iteration directory"
            )
        return src / name
    return src


def is_megatron(src: Path) -> bool:
    d = iteration_dir(src) if (src / LATEST).is_file() else src
    return (d / "common.pt").is_file() or any(MP_RANK.match(p.name) for p in d.glob("mp_rank_*"))


# ---- legacy: read -----------------------------------------------------------------------------


def mp_rank_name(t: int, p: int, e: int, pp: int, ep: int) -> str:
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")


def _localise(chunk: dict, layers: range, experts: range, cfg_args: dict, where) -> dict:
    """One shard's model dict -> global layer indices and expert numbers, tensors only."""
    out = {}
    for k, v in chunk.items():
        if not isinstance(v, torch.Tensor) or k.endswith("_extra_state"):
            continue
        m = LAYER.match(k)
        if m and int(m[1]) >= len(layers):
            raise MegaliteError(
                f"{where} holds layer {m[1]} of its stage, but the args give a stage "
                f"{len(layers)} layers; the args contradict the tensors"
            )
        if m:
            k = mg.LAYER.format(layers[int(m[1])]) + m[2]
        m = EXPERT.match(k)
        if m:
            k = f"{m[1]}local_experts.{experts[int(m[2])]}.{m[3]}"
        m = TE_EXPERT.match(k)
        if m:
            k = f"{m[1]}local_experts.{experts[int(m[3])]}.{m[2]}.weight"
        if k.endswith("mlp.experts.weight1") or k.endswith("mlp.experts.weight2"):
            out.update(_grouped(k, v, experts, cfg_args))
            continue
        out[mg.local_names(k)] = v
    return out


def _grouped(k: str, w: torch.Tensor, experts: range, args: dict) -> dict:
    """megatron-core's legacy GroupedMLP weights (h, E*fc1) and (E*ffn, h) -> per expert."""
    base, h, n = k[: -len("weight1")], args["hidden_size"], len(experts)
    if k.endswith("weight1"):
        per = w.view(n, h, -1)  # (E_local, h, fc1/tp), the matmul's right-hand side
        return {f"{base}local_experts.{e}.linear_fc1.weight": per[j].t().contiguous()
                for j, e in enumerate(experts)}  # fmt: skip
    per = w.view(n, -1, h)  # (E_local, ffn/tp, h)
    return {f"{base}local_experts.{e}.linear_fc2.weight": per[j].t().contiguous()
            for j, e in enumerate(experts)}  # fmt: skip


def read_legacy(d: Path) -> tuple[dict, dict, dict]:
    ranks = sorted(p.name for p in d.iterdir() if MP_RANK.match(p.name))
    first = load_pickle(d / ranks[0] / MODEL_FILE, mmap=True)
    args = args_of(first, d / ranks[0] / MODEL_FILE)
    version = first.get("checkpoint_version", 0)
    model = first.get("model", first.get("model0", {}))
    if version < mg.CHECKPOINT_VERSION or any(k.startswith("language_model.") for k in model):
        raise MegaliteError(
            f"{d} is an older Megatron-LM checkpoint (checkpoint_version {version}, "
            "megatron/legacy model names); only megatron-core GPTModel checkpoints "
            f"(checkpoint_version {mg.CHECKPOINT_VERSION}) convert"
        )
    tp, pp, vpp, ep = layout(args, str(d))
    num_experts = args.get("num_experts") or 0
    ranges = layer_ranges(args, str(d))
    per_rank = num_experts // ep
    gated = bool(args.get("swiglu"))
    shards, optimizer = {}, False  # name -> {ep rank: {tp rank: tensor}}
    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                name = mp_rank_name(t, p, e, pp, ep)
                path = d / name / MODEL_FILE
                if not path.is_file():
                    raise MegaliteError(
                        f"{d} lacks {name}/{MODEL_FILE} (its args say tp={tp} pp={pp} ep={ep}); "
                        "the checkpoint is incomplete"
                    )
                obj = first if name == ranks[0] else load_pickle(path, mmap=True)
                optimizer = optimizer or "optimizer" in obj
                for v in range(vpp):
                    chunk = obj.get("model" if vpp == 1 else f"model{v}")
                    if chunk is None:
                        raise MegaliteError(f"{path} holds no model{'' if vpp == 1 else v} dict")
                    experts = range(e * per_rank, (e + 1) * per_rank)
                    for k, x in _localise(chunk, ranges[p, v], experts, args, path).items():
                        if k == mg.OUTPUT_LAYER and not args.get(
                            "untie_embeddings_and_output_weights"
                        ):
                            continue  # the last stage's copy of the tied embedding
                        shards.setdefault(k, {}).setdefault(e, {})[t] = x
    # merged when read: the shards are views of the mapped files until then
    thunks, shapes, dtypes = {}, {}, {}
    for k, by_ep in shards.items():
        ts = by_ep[min(by_ep)]  # a tensor outside the experts is the same on every ep rank
        parts = [ts[t] for t in sorted(ts)]
        thunks[k] = partial(merge_tp, k, parts, gated)
        shapes[k], dtypes[k] = merged_shape(k, parts, gated), parts[0].dtype
    state = mg.State(thunks, shapes, dtypes)
    facts = {"iteration": first.get("iteration", 0), "format": "legacy", "optimizer": optimizer,
             "layout": (tp, pp, vpp, ep), "scheduler": scheduler_state(first)}  # fmt: skip
    return args, state, facts


def scheduler_state(obj: dict) -> dict | None:
    """The LR/WD scheduler state (OptimizerParamScheduler.state_dict(): num_steps = the samples
    of its successful steps) a legacy rank file or torch_dist's common.pt holds, or None."""
    sched = obj.get("opt_param_scheduler", obj.get("lr_scheduler"))  # (its older name)
    return sched if isinstance(sched, dict) else None


# ---- legacy: write ----------------------------------------------------------------------------


def _extra_states(chunk: dict) -> dict:
    """megatron-core's linears carry an `_extra_state` entry that a strict load expects."""
    linears = {k.rsplit(".", 1)[0] for k in chunk if re.search(r"linear_\w+\.weight$", k)}
    return {f"{m}._extra_state": None for m in linears}


def write_legacy(dst: Path, state: dict, args: dict, tp: int, pp: int, vpp: int, ep: int = 1,
                 iteration: int = 0, transformer_impl="local", extra: dict | None = None):  # fmt: skip
    """Write a Megatron state (tensors, or a `megatron.State` that computes each when read) as
    a legacy checkpoint at this layout under dst, with the norm names of Megatron's
    `transformer_impl` layer spec (local or transformer_engine). One rank file is built and
    written at a time, a tensor at a time (torch_stream.py), each in its own bytes."""
    vpp = vpp or 1
    num_experts = args.get("num_experts") or 0
    if num_experts % ep or (ep > 1 and not num_experts):
        raise MegaliteError(
            f"--ep {ep} needs a mixture-of-experts model with a multiple of {ep} experts "
            f"(this one has {num_experts})"
        )
    ranges = layer_ranges(args, "--to megatron")
    per_rank, gated = num_experts // ep, bool(args.get("swiglu"))
    tied = not args.get("untie_embeddings_and_output_weights")
    for k in state:  # every split checked before anything is written
        shape = state.shapes[k] if isinstance(state, mg.State) else tuple(state[k].shape)
        dim = tp_dim(k)
        if dim is not None and shape[dim] % tp:
            raise MegaliteError(f"{k} ({tuple(shape)}) does not split over tp={tp}")
    namespace = argparse.Namespace(**args)
    it_dir = dst / f"iter_{iteration:07d}"

    def shard(k: str, t: int) -> Later:  # tp rank t's shard of state[k], made when written
        lazy = isinstance(state, mg.State)
        shape = list(state.shapes[k] if lazy else state[k].shape)
        dim = tp_dim(k)
        if dim is not None and tp > 1:
            shape[dim] //= tp
        dtype = args["params_dtype"] if lazy else state[k].dtype
        return Later(shape, dtype, lambda: tp_shard(k, state[k], tp, t, gated))

    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                obj = {"args": namespace, "checkpoint_version": mg.CHECKPOINT_VERSION,
                       "iteration": iteration, **(extra or {})}  # fmt: skip
                for v in range(vpp):
                    first, last = p == 0 and v == 0, p == pp - 1 and v == vpp - 1
                    experts = range(e * per_rank, (e + 1) * per_rank)
                    chunk = {}
                    for k, name in _chunk_names(state, ranges[p, v], experts, first, last):
                        chunk[name] = shard(k, t)
                    if last and tied and pp > 1:  # the last stage's copy of the embedding
                        chunk[mg.OUTPUT_LAYER] = shard(mg.EMBEDDING, t)
                    if last:
                        chunk["output_layer._extra_state"] = None
                    chunk.update(_extra_states(chunk))
                    chunk = mg.spec_names(chunk, transformer_impl, sharded=False)
                    obj["model" if vpp == 1 else f"model{v}"] = chunk
                path = it_dir / mp_rank_name(t, p, e, pp, ep) / MODEL_FILE
                path.parent.mkdir(parents=True)
                save_streaming(obj, path)  # each shard made as it is written
                del obj, chunk
    (dst / LATEST).write_text(str(iteration))


def _chunk_names(state, layers: range, experts: range, first: bool, last: bool):
    """(global name, the name in this stage's and ep rank's model dict) of what it holds."""
    for k in state:
        m = LAYER.match(k)
        if m is None:
            if (k.startswith("embedding.") and first) or (not k.startswith("embedding.") and last):
                yield k, k
            continue
        i, rest = int(m[1]), m[2]
        if i not in layers:
            continue
        x = EXPERT.match(k)
        if x:
            j = int(x[2])
            if j not in experts:
                continue
            rest = rest.replace(f"local_experts.{j}.", f"local_experts.{j - experts[0]}.")
        yield k, f"decoder.layers.{i - layers[0]}.{rest}"


# ---- torch_dist helpers --------------------------------------------------------------------


def write_common(d: Path, obj: dict):
    """torch.save into a file (used by torch_dist's common.pt)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    (d / "common.pt").write_bytes(buf.getvalue())


def write_metadata_json(d: Path):
    (d / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1,
    }))  # fmt: skip
