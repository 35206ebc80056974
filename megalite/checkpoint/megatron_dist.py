"""Megatron's torch_dist checkpoints (PyTorch DCP), read and written in one process.

megatron-core's `dist_checkpointing` stores every tensor at its global shape under its sharded
key: a transformer layer's tensors stacked on a leading axis (`decoder.layers.<name>` (L, ...);
per layer, `decoder.layers.{i}.<name>`, when the layers differ, as with moe_layer_freq > 1),
experts on the next axis (`mlp.experts.experts.linear_fc1.weight` (L, E, ...)), the norms under
TransformerEngine's names whatever the spec, SwiGLU fc1 as [gate | up] (or `_w`/`_v` halves), and
each module's `_extra_state` as a pickled ShardedObject `<key>/shard_<offset>_<shape>`. The
non-tensor state (args, iteration, checkpoint_version) is `common.pt`; `metadata.json` names the
backend. Optimizer and RNG entries are left out on reading.

DCP is driven directly with `no_dist=True`: no process group is needed. Its `.metadata` is read
through an unpickler that admits only DCP's metadata classes and torch's value types.
"""

import argparse
import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megalite.checkpoint import megatron as mg
from megalite.checkpoint import megatron_files as mf
from megalite.errors import MegaliteError

STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.*)$")
STACKED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)experts\.(linear_fc[12]\.weight)$")


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes and plain torch/python value types may appear in .metadata:
    a class of torch.distributed.checkpoint (dataclasses, enums), never one of its functions."""

    SAFE_TORCH = {"Size", "device", "layout", "memory_format"}
    SAFE = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
            ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
            ("builtins", "slice")}  # fmt: skip

    def find_class(self, module, name):
        if (module, name) in self.SAFE:
            return super().find_class(module, name)
        if module == "torch" and (name in self.SAFE_TORCH or isinstance(getattr(torch, name, None),
                                                                       torch.dtype)):  # fmt: skip
            return super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as e:
            raise MegaliteError(f"{path} is not readable DCP metadata ({e})") from None
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def read_torch_dist(d: Path) -> tuple[dict, dict, dict]:
    common = mf.load_pickle(d / "common.pt")
    args = mf._args(common, d / "common.pt")
    reader = _SafeReader(str(d))
    meta = reader.read_metadata()
    want, optimizer = {}, False
    for k, m in meta.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        if not k.startswith(mf.MODEL_PREFIXES):
            optimizer = optimizer or k.startswith("optimizer.")
            continue
        want[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if not want:
        raise MegaliteError(f"{d} holds no model tensors (embedding.*, decoder.*)")
    dcp.load(want, storage_reader=reader, no_dist=True)
    state = {}
    for k, t in want.items():
        state.update(_unstack(k, t, args))
    facts = {"iteration": common.get("iteration", 0), "format": "torch_dist",
             "optimizer": optimizer, "layout": None}  # fmt: skip
    return args, _join_swiglu_halves(state), facts


def _unstack(k: str, t: torch.Tensor, args: dict) -> dict:
    """One DCP tensor -> per-layer (and per-expert) Megatron-state entries with local names."""
    m = STACKED.match(k)
    if m:
        if t.shape[0] != args["num_layers"]:
            raise MegaliteError(
                f"{k} stacks {t.shape[0]} layers but the checkpoint's args say "
                f"num_layers={args['num_layers']}; the args contradict the tensors"
            )
        out = {}
        for i in range(t.shape[0]):
            out.update(_unstack(mg.LAYER.format(i) + m[1], t[i], args))
        return out
    e = STACKED_EXPERT.match(k)
    if e:
        return {mg.local_names(f"{e[1]}local_experts.{j}.{e[2]}"): t[j].contiguous()
                for j in range(t.shape[0])}  # fmt: skip
    e = re.match(r"^(.*\.mlp\.experts\.)experts\.(\d+)\.(.*)$", k)  # singleton expert keys
    if e:
        k = f"{e[1]}local_experts.{e[2]}.{e[3]}"
    return {mg.local_names(k): t.contiguous()}


def _join_swiglu_halves(state: dict) -> dict:
    """Singleton-shard checkpoints store SwiGLU fc1 as `<key>_w` (gate) and `<key>_v` (up)."""
    out = {}
    for k, t in state.items():
        if k.endswith("_v") and k[:-2] + "_w" in state:
            continue
        if k.endswith("_w") and k[:-2] + "_v" in state:
            out[k[:-2]] = torch.cat([t, state[k[:-2] + "_v"]])
            continue
        out[k] = t
    return out


# ---- writing --------------------------------------------------------------------------------


def _stack_key(name: str, stacked: bool) -> tuple[str, int | None, int | None]:
    """Megatron-state name -> (DCP key, layer, expert), the layer/expert axes it goes on."""
    m = mf.LAYER.match(name)
    if m is None:
        return name, None, None
    i, rest = int(m[1]), m[2]
    x = re.match(r"^(mlp\.experts\.)local_experts\.(\d+)\.(.*)$", rest)
    expert = None
    if x:
        rest, expert = f"{x[1]}experts.{x[3]}", int(x[2])
    if stacked:
        return f"decoder.layers.{rest}", i, expert
    return f"decoder.layers.{i}.{rest}", None, expert


def write_torch_dist(dst: Path, state: dict, args: dict, iteration: int = 0,
                     transformer_impl: str = "local"):  # fmt: skip
    """Write a Megatron state as a torch_dist checkpoint (DST/iter_N + LATEST), with the keys
    a GPTModel of Megatron's `transformer_impl` layer spec loads."""
    state = mg.spec_names(state, transformer_impl, sharded=True)
    d = dst / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    L, E = args["num_layers"], args.get("num_experts") or 0
    freq = args.get("moe_layer_freq") or 1
    stacked = not (E and freq > 1)  # megatron keeps heterogeneous layers apart
    groups: dict = {}
    for name, t in state.items():
        key, layer, expert = _stack_key(name, stacked)
        groups.setdefault(key, {})[(layer, expert)] = t
    out = {}
    for key, parts in groups.items():
        out[key] = _assemble(key, parts, L, E)
    # every linear's _extra_state, as megatron-core's sharded state dict expects it
    for key in list(out):
        if re.search(r"linear_\w+\.weight$", key) or key == mg.OUTPUT_LAYER:
            module = key.rsplit(".", 1)[0]
            lead = tuple(out[key].shape[: _lead_axes(key, stacked, E)])
            out.update(_extra_state_objects(module + "._extra_state", lead))
    if not args.get("untie_embeddings_and_output_weights"):
        out.update(_extra_state_objects("output_layer._extra_state", ()))
    # not flattened: the [None] lists are whole objects, not containers of entries
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.save(out, storage_writer=FileSystemWriter(str(d)), planner=planner, no_dist=True)
    ns = argparse.Namespace(**args)
    mf.write_common(d, {"args": ns, "checkpoint_version": mg.CHECKPOINT_VERSION,
                        "iteration": iteration})  # fmt: skip
    mf.write_metadata_json(d)
    (dst / mf.LATEST).write_text(str(iteration))


def _lead_axes(key: str, stacked: bool, E: int) -> int:
    n = 1 if stacked and key.startswith("decoder.layers.") else 0
    return n + (1 if ".mlp.experts.experts." in f".{key}" else 0)


def _assemble(key, parts: dict, L: int, E: int) -> torch.Tensor:
    """Stack a key's per-(layer, expert) tensors on its leading axes."""
    (layer, expert), t = next(iter(parts.items()))
    if layer is None and expert is None:
        return t
    if layer is None:
        return torch.stack([parts[None, j] for j in range(E)])
    if expert is None:
        return torch.stack([parts[i, None] for i in range(L)])
    return torch.stack([torch.stack([parts[i, j] for j in range(E)]) for i in range(L)])


def _extra_state_objects(key: str, shape: tuple) -> dict:
    """`key/shard_<offset>_<shape>` entries, one per position: [None], the list of objects
    megatron-core writes for a local-spec linear (DCP pickles it as bytes)."""
    shape = shape or (1,)  # megatron-core's offsets for an object outside the layers
    idx = torch.cartesian_prod(*(torch.arange(n) for n in shape)).reshape(-1, len(shape))
    dims = ".".join(map(str, shape))
    return {f"{key}/shard_{'.'.join(map(str, i.tolist()))}_{dims}": [None] for i in idx}


def read_megatron(src: Path) -> tuple[dict, dict, dict]:
    """Either format: (args, Megatron state of global tensors with local names, facts:
    iteration, format, optimizer (whether the files hold optimizer state), layout)."""
    d = mf.iteration_dir(src)
    if (d / "common.pt").is_file():
        return read_torch_dist(d)
    if not any(mf.MP_RANK.match(p.name) for p in d.iterdir()):
        raise MegaliteError(
            f"{d} holds neither mp_rank_* directories (legacy) nor common.pt (torch_dist); pass "
            "a Megatron checkpoint directory"
        )
    return mf.read_legacy(d)
