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
import io
import pickle
import re
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalite.checkpoint import megatron as mg
from megalite.checkpoint import megatron_files as mf
from megalite.checkpoint.megatron_pickle import args_of, load_pickle
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
    """(args, a `megatron.State` whose tensors are read from the files one at a time (one
    layer's slice of a stacked tensor), facts)."""
    common = load_pickle(d / "common.pt")
    args = args_of(common, d / "common.pt")
    meta = _SafeReader(str(d)).read_metadata()
    parts, optimizer = {}, False  # local name -> [(DCP key, leading indices, shape)]
    for k, m in meta.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        if not k.startswith(mf.MODEL_PREFIXES):
            optimizer = optimizer or k.startswith("optimizer.")
            continue
        for name, (idx, shape) in _unstack(k, (), tuple(m.size), args).items():
            parts.setdefault(name, []).append((k, idx, shape, m.properties.dtype))
    if not parts:
        raise MegaliteError(f"{d} holds no model tensors (embedding.*, decoder.*)")
    parts = _join_swiglu_halves(parts)
    thunks = {n: partial(_read, d, meta, p) for n, p in parts.items()}
    shapes = {n: (sum(s[0] for _, _, s, _ in p), *p[0][2][1:]) if len(p) > 1 else p[0][2]
              for n, p in parts.items()}  # fmt: skip
    dtypes = {n: p[0][3] for n, p in parts.items()}
    facts = {"iteration": common.get("iteration", 0), "format": "torch_dist",
             "optimizer": optimizer, "layout": None,
             "scheduler": mf.scheduler_state(common)}  # fmt: skip
    return args, mg.State(thunks, shapes, dtypes), facts


class _ChunkPlanner(DefaultLoadPlanner):
    """Reads one box of each tensor named (its leading indices fixed) into the given tensors."""

    def __init__(self, boxes: dict):
        super().__init__()
        self.boxes = boxes  # key -> (offsets, sizes)

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (offsets, sizes) in self.boxes.items():
            box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key],
                                                      [box])  # fmt: skip
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the box itself (read items address it from 0)


def _read(d: Path, meta, parts: list) -> torch.Tensor:
    """The tensor the parts (DCP key, leading indices, shape) make, concatenated on dim 0."""
    out = []
    for key, idx, shape, dtype in parts:
        box = (tuple(idx) + (0,) * len(shape), (1,) * len(idx) + tuple(shape))
        t = _read_stored(d, meta, key, *box)
        if t is None:  # a box inside a stored chunk, or a transformed file: DCP reads it
            t = torch.empty(box[1], dtype=dtype)
            dcp.load({key: t}, storage_reader=_SafeReader(str(d)),
                     planner=_ChunkPlanner({key: box}), no_dist=True)  # fmt: skip
        out.append(t.reshape(shape))
    return out[0] if len(out) == 1 else torch.cat(out)


def _read_stored(d: Path, meta, key: str, offsets: tuple, sizes: tuple):
    """The stored chunk that is exactly this box, loaded straight into its tensor (DCP's own
    read would load it and then copy it into the destination: twice the memory); None when no
    stored chunk is the box."""
    chunk = next((c for c in meta.state_dict_metadata[key].chunks
                  if tuple(c.offsets) == offsets and tuple(c.sizes) == sizes), None)  # fmt: skip
    info = meta.storage_data.get(MetadataIndex(key, torch.Size(offsets))) if chunk else None
    if info is None or getattr(info, "transform_descriptors", None):
        return None
    name = str(info.relative_path)
    if Path(name).name != name:
        raise MegaliteError(f"{d / '.metadata'} names the file {name!r} outside the checkpoint")
    try:
        with open(d / name, "rb") as fh:
            t = torch.load(_Slice(fh, info.offset, info.length), map_location="cpu",
                           weights_only=True)  # fmt: skip
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as e:
        raise MegaliteError(f"{d / name} is not a readable DCP file ({e})") from None
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != sizes:
        raise MegaliteError(f"{d / name}: {key} at {offsets} is not a tensor of shape {sizes}")
    return t


class _Slice(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a file of their own."""

    def __init__(self, fh, offset: int, length: int):
        super().__init__()
        self.fh, self.offset, self.length, self.pos = fh, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buf):
        n = min(len(buf), self.length - self.pos)
        self.fh.seek(self.offset + self.pos)
        got = self.fh.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


def _unstack(k: str, idx: tuple, size: tuple, args: dict) -> dict:
    """One DCP tensor (global `size`) -> {local name: (its leading indices in the tensor, its
    shape)}: per layer and per expert, with local names."""
    m = STACKED.match(k)
    if m:
        if size[0] != args["num_layers"]:
            raise MegaliteError(
                f"{k} stacks {size[0]} layers but the checkpoint's args say "
                f"num_layers={args['num_layers']}; the args contradict the tensors"
            )
        out = {}
        for i in range(size[0]):
            out.update(_unstack(mg.LAYER.format(i) + m[1], (*idx, i), size[1:], args))
        return out
    e = STACKED_EXPERT.match(k)
    if e:
        return {mg.local_names(f"{e[1]}local_experts.{j}.{e[2]}"): ((*idx, j), size[1:])
                for j in range(size[0])}  # fmt: skip
    e = re.match(r"^(.*\.mlp\.experts\.)experts\.(\d+)\.(.*)$", k)  # singleton expert keys
    if e:
        k = f"{e[1]}local_experts.{e[2]}.{e[3]}"
    return {mg.local_names(k): (idx, size)}


def _join_swiglu_halves(parts: dict) -> dict:
    """Singleton-shard checkpoints store SwiGLU fc1 as `<key>_w` (gate) and `<key>_v` (up)."""
    out = {}
    for k, p in parts.items():
        if k.endswith("_v") and k[:-2] + "_w" in parts:
            continue
        if k.endswith("_w") and k[:-2] + "_v" in parts:
            out[k[:-2]] = p + parts[k[:-2] + "_v"]
            continue
        out[k] = p
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
                     transformer_impl: str = "local", extra: dict | None = None):  # fmt: skip
    """Write a Megatron state (tensors, or a `megatron.State` that computes each when read) as
    a torch_dist checkpoint (DST/iter_N + LATEST), with the keys a GPTModel of Megatron's
    `transformer_impl` layer spec loads. A stacked tensor is written one layer at a time (a
    chunk per layer, as megatron-core's pipeline stages write theirs): DCP asks for each chunk
    as it writes it, so one layer is computed and held at a time."""
    if not isinstance(state, mg.State):
        state = mg.State({k: partial(_value, v) for k, v in state.items()},
                         {k: tuple(v.shape) for k, v in state.items()})  # fmt: skip
    renamed = mg.spec_names({k: k for k in state}, transformer_impl, sharded=True)
    d = dst / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    L, E = args["num_layers"], args.get("num_experts") or 0
    freq = args.get("moe_layer_freq") or 1
    stacked = not (E and freq > 1)  # megatron keeps heterogeneous layers apart
    groups: dict = {}
    for name, source in renamed.items():
        key, layer, expert = _stack_key(name, stacked)
        groups.setdefault(key, {})[(layer, expert)] = source
    out = {key: _Stacked(state, parts, L, E) for key, parts in groups.items()}
    # every linear's _extra_state, as megatron-core's sharded state dict expects it
    for key in list(out):
        if re.search(r"linear_\w+\.weight$", key) or key == mg.OUTPUT_LAYER:
            module = key.rsplit(".", 1)[0]
            lead = tuple(out[key].size[: _lead_axes(key, stacked, E)])
            out.update(_extra_state_objects(module + "._extra_state", lead))
    if not args.get("untie_embeddings_and_output_weights"):
        out.update(_extra_state_objects("output_layer._extra_state", ()))
    # not flattened: the [None] lists are whole objects, not containers of entries
    planner = _LazySavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.save(out, storage_writer=FileSystemWriter(str(d), thread_count=1), planner=planner,
             no_dist=True)  # fmt: skip
    ns = argparse.Namespace(**args)
    mf.write_common(d, {"args": ns, "checkpoint_version": mg.CHECKPOINT_VERSION,
                        "iteration": iteration, **(extra or {})})  # fmt: skip
    mf.write_metadata_json(d)
    (dst / mf.LATEST).write_text(str(iteration))


def _value(t):
    return t


class _Stacked:
    """A DCP tensor whose per-(layer, expert) parts are computed when DCP writes them: one
    write item per layer of a stacked key (the experts of a layer stacked inside it)."""

    def __init__(self, state, parts: dict, L: int, E: int):
        self.state, self.parts = state, parts
        (layer, expert), first = next(iter(parts.items()))
        self.dtype = state[first].dtype  # DCP's plan needs it before any chunk is written
        shape = tuple(state.shapes[first])
        self.layers, self.experts = layer is not None, expert is not None
        lead = ((L,) if self.layers else ()) + ((E,) if self.experts else ())
        self.size = torch.Size(lead + shape)

    def chunks(self):
        if not self.layers:
            return [(0,) * len(self.size)]
        return [(i,) + (0,) * (len(self.size) - 1) for i in range(self.size[0])]

    def __create_write_items__(self, fqn: str, obj):
        items = []
        for offsets in self.chunks():
            sizes = (1, *self.size[1:]) if self.layers else tuple(self.size)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(self.dtype),
                                            size=self.size),
            ))  # fmt: skip
        return items

    def chunk(self, offsets) -> torch.Tensor:
        """The tensor of the write item at `offsets` (a layer's, with its leading axis)."""
        layer = offsets[0] if self.layers else None
        if self.experts:
            E = self.size[1 if self.layers else 0]
            t = torch.stack([self.state[self.parts[layer, j]] for j in range(E)])
        else:
            t = self.state[self.parts[layer, None]]
        return t.unsqueeze(0) if self.layers else t


class _LazySavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return (
            obj.chunk(index.offset) if isinstance(obj, _Stacked) else super().lookup_object(index)
        )


def _lead_axes(key: str, stacked: bool, E: int) -> int:
    n = 1 if stacked and key.startswith("decoder.layers.") else 0
    return n + (1 if ".mlp.experts.experts." in f".{key}" else 0)


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
