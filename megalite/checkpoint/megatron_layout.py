"""How Megatron-LM lays a model out over ranks, from a run's args: which dim a tensor-parallel
shard of each tensor splits (SwiGLU fc1 as [gate_r | up_r] per rank) and the shards merged or
split so (`merge_tp`, `split_tp`, `tp_shard`), and which layers each (pp rank, virtual stage)
holds (`partition`: even, or uneven by the first/last, account-for or layout flags)."""

import re

import torch

from megalite.checkpoint import megatron as mg
from megalite.checkpoint.megatron_pickle import Opaque
from megalite.errors import MegaliteError
from megalite.pipeline.partition import Partition, expand_layout


def tp_dim(name: str) -> int | None:
    """The dim a tp shard of this (local-name) tensor splits, None when replicated."""
    if name in (mg.EMBEDDING, mg.OUTPUT_LAYER) or re.search(
        r"linear_(qkv|fc1)\.(weight|bias)$", name
    ):
        return 0
    if re.search(r"linear_(proj|fc2)\.weight$", name):
        return 1
    return None


def _swiglu_fc1(name: str, gated: bool) -> bool:
    return gated and bool(re.search(r"linear_fc1\.(weight|bias)$", name))


def merge_tp(name: str, shards: list, gated: bool) -> torch.Tensor:
    """tp shards of one tensor -> the global tensor ([gate | up] for SwiGLU fc1)."""
    dim = tp_dim(name)
    if dim is None:
        return shards[0]
    if _swiglu_fc1(name, gated):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim)


def merged_shape(name: str, shards: list, gated: bool) -> tuple:
    """The global shape merge_tp gives these shards, without merging them."""
    shape, dim = list(shards[0].shape), tp_dim(name)
    if dim is not None:
        shape[dim] = sum(s.shape[dim] for s in shards)
    return tuple(shape)


def tp_shard(name: str, t: torch.Tensor, tp: int, rank: int, gated: bool) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s shard of the global tensor, as Megatron lays it out (a
    view where it can be)."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return t
    if t.shape[dim] % tp:
        raise MegaliteError(f"{name} ({tuple(t.shape)}) does not split over tp={tp}")
    if _swiglu_fc1(name, gated):
        gate, up = t.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return t.chunk(tp, dim)[rank]


def split_tp(name: str, t: torch.Tensor, tp: int, gated: bool) -> list:
    """The global tensor -> its tp shards as Megatron lays them out."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return [t] * tp
    if t.shape[dim] % tp:
        raise MegaliteError(f"{name} ({tuple(t.shape)}) does not split over tp={tp}")
    if _swiglu_fc1(name, gated):
        gate, up = (x.chunk(tp) for x in t.chunk(2))
        return [torch.cat([g, u]).contiguous() for g, u in zip(gate, up)]
    return [s.contiguous() for s in t.chunk(tp, dim)]


def partition(args: dict, where: str) -> Partition:
    """Layers per (pp rank, virtual stage) of a Megatron run's args: its even split, or the
    uneven one its --decoder-first/last-pipeline-num-layers, --account-for-*-in-pipeline-split
    or --pipeline-model-parallel-layout give (megatron-core's `get_transformer_layer_offset`),
    virtual stage v of pp rank p being Megatron's v*pp + p."""
    pp = args.get("pipeline_model_parallel_size") or 1
    vpp = args.get("virtual_pipeline_model_parallel_size") or 1
    if args.get("num_layers_per_virtual_pipeline_stage"):
        vpp = args["num_layers"] // pp // args["num_layers_per_virtual_pipeline_stage"]
    text = _layout_text(args.get("pipeline_model_parallel_layout"))
    if text is not None:  # the string spells out every virtual stage
        vpp = max(1, len(expand_layout(text).split("|")) // pp)
    try:
        return Partition.from_flags(
            args["num_layers"], pp, vpp, first=args.get("decoder_first_pipeline_num_layers"),
            last=args.get("decoder_last_pipeline_num_layers"),
            embedding=bool(args.get("account_for_embedding_in_pipeline_split")),
            loss=bool(args.get("account_for_loss_in_pipeline_split")), layout=text,
            mtp_layers=args.get("mtp_num_layers") or 0,
        )  # fmt: skip
    except MegaliteError as e:
        raise MegaliteError(f"{where}: {e}") from None


# megatron-core's LayerType, by name and by its enum value (a pickled member's stand-in)
_LAYER_TYPES = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L", 1: "E", 2: "L", 4: "t",
                5: "m"}  # fmt: skip


def _layout_text(value) -> str | None:
    """Megatron's layout as its string: the flag's string, or the list of stages (of layer
    types) a PipelineParallelLayerLayout kept (a stand-in's pickled `input_data`)."""
    if isinstance(value, Opaque):
        value = getattr(value, "state", {}).get("input_data")
    if value is None or isinstance(value, str):
        return value

    def letter(x):
        key = x.args[0] if isinstance(x, Opaque) and x.args else str(x).strip().lower()
        if key not in _LAYER_TYPES:
            raise MegaliteError(f"the args' pipeline_model_parallel_layout holds {x!r}")
        return _LAYER_TYPES[key]

    return "|".join("".join(map(letter, stage)) for stage in value)


def layer_ranges(args: dict, where: str) -> dict:
    """{(pp rank, virtual stage): the global layers it holds}, from the run's args."""
    part = partition(args, where)
    return {(p, v): part.layers(p, v) for p in range(part.pp) for v in range(part.vpp)}


def layout(args: dict, where: str) -> tuple:
    """(tp, pp, vpp, ep) of a Megatron run's args."""
    tp = args.get("tensor_model_parallel_size") or 1
    part = partition(args, where)
    pp, vpp = part.pp, part.vpp
    ep = args.get("expert_model_parallel_size") or 1
    etp = args.get("expert_tensor_parallel_size") or tp
    if args.get("num_experts") and etp != tp:
        raise MegaliteError(
            f"{where}: expert_tensor_parallel_size={etp} != tensor_model_parallel_size={tp} is "
            "not supported"
        )
    return tp, pp, vpp, ep
