"""Megatron-LM's checkpoint files as its `megatron/training/checkpointing.py` writes and reads
them, for the megatron-core models of tests/megatron_oracle.py (test-only; see that module).

- `save_legacy`: `iter_0000007/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` from data-parallel
  rank 0 (or expert-data-parallel rank 0), each `{'args', 'checkpoint_version': 3.0,
  'iteration', 'model' or 'model0'.., 'optimizer', 'opt_param_scheduler', 'rng_state',
  'num_floating_point_operations_so_far'}`, then `latest_checkpointed_iteration.txt`;
- `save_torch_dist`: the same dict with each model's `sharded_state_dict()` and the rng state as
  a `ShardedObject`, through `dist_checkpointing.save` (the scheduler state, no optimizer);
- `load_legacy` / `load_torch_dist`: back into models as Megatron-LM loads them;
- `as_transformer_engine`: a legacy checkpoint under the names a `--transformer-impl
  transformer_engine` run saves (TransformerEngine does not run on a CPU; its spec holds the
  same tensors under other names).

`megatron_args` is the Namespace Megatron-LM's parser makes: every TransformerConfig field (the
parser is built from that dataclass, so enums and dtypes travel in the pickle) and the
training-level flags a converter reads.
"""

import argparse
import enum
import io
import random
import re
import shutil
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ITERATION = 7
MAKE_VOCAB_DIVISIBLE_BY = 128
TRACKER = "latest_checkpointed_iteration.txt"
SCHEDULE_SAMPLES = (ITERATION - 1) * 8  # the scheduler's num_steps (both formats)


def megatron_args(arch, layout, ckpt_format: str, config) -> argparse.Namespace:
    """The Namespace Megatron-LM's parser would have made for this run."""
    from megatron.core import parallel_state as ps

    simple = (bool, int, float, str, type(None), torch.dtype, enum.Enum)
    args = {
        f.name: getattr(config, f.name)
        for f in fields(config)
        if isinstance(getattr(config, f.name), simple)
    }
    args.update(
        num_layers=arch.num_layers, hidden_size=arch.hidden, ffn_hidden_size=arch.ffn,
        num_attention_heads=arch.heads, group_query_attention=arch.groups is not None,
        num_query_groups=arch.groups or arch.heads, kv_channels=arch.hidden // arch.heads,
        max_position_embeddings=arch.seq, seq_length=arch.seq,
        position_embedding_type="rope" if arch.rope else "learned_absolute",
        add_position_embedding=not arch.rope, use_rotary_position_embeddings=arch.rope,
        rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False, use_rope_scaling=False,
        normalization=arch.normalization, norm_epsilon=1e-5, apply_layernorm_1p=False,
        swiglu=arch.swiglu, openai_gelu=False, squared_relu=False, bias_gelu_fusion=arch.bias,
        bias_swiglu_fusion=True, add_bias_linear=arch.bias, add_qkv_bias=arch.bias,
        untie_embeddings_and_output_weights=not arch.tied, qk_layernorm=False,
        num_experts=arch.num_experts, moe_router_topk=arch.topk,
        moe_ffn_hidden_size=arch.ffn if arch.num_experts else None, moe_grouped_gemm=False,
        vocab_size=arch.vocab, padded_vocab_size=layout.padded_vocab(arch),
        make_vocab_size_divisible_by=MAKE_VOCAB_DIVISIBLE_BY, tokenizer_type="NullTokenizer",
        vocab_file=None, merge_file=None, tokenizer_model=None,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_per_virtual_pipeline_stage=(
            arch.num_layers // (layout.pp * layout.vpp)
            if layout.vpp and layout.first is None and layout.last is None else None
        ),
        decoder_first_pipeline_num_layers=layout.first,
        decoder_last_pipeline_num_layers=layout.last,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.tp,
        context_parallel_size=1, sequence_parallel=False, data_parallel_size=layout.ep,
        world_size=layout.world, rank=dist.get_rank(), transformer_impl="local",
        spec=None, fp16=False, bf16=False, ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format != "torch", use_distributed_optimizer=False,
        no_save_optim=False, no_save_rng=False, micro_batch_size=1,
        global_batch_size=8, train_iters=10, lr=3e-4, min_lr=3e-5, seed=1234,
        init_method_std=0.02, iteration=ITERATION, consumed_train_samples=ITERATION * 8,
        consumed_valid_samples=0, save=None, load=None,
    )  # fmt: skip
    assert ps.get_tensor_model_parallel_world_size() == layout.tp
    return argparse.Namespace(**args)


def _rng_state():
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.get_rng_state(),  # (a CPU run has none: the same kind of bytes)
        "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()},
    }


def _optimizer_state(models: list) -> tuple[dict, dict]:
    """What an fp32 Megatron run's optimizer (torch AdamW inside) and LR scheduler save."""
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # its state exists; zero grads (and no decay) leave the weights as they were
    return opt.state_dict(), _scheduler_state()


def _scheduler_state() -> dict:
    """OptimizerParamScheduler.state_dict() at the save. num_steps counts the samples of the
    successful steps: one of the 7 was skipped (an fp16 overflow), so the schedule stands one
    batch behind consumed_train_samples."""
    return {"max_lr": 3e-4, "lr_warmup_steps": 0, "num_steps": SCHEDULE_SAMPLES,
            "lr_decay_style": "cosine", "lr_decay_steps": 80, "min_lr": 3e-5,
            "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 80}  # fmt: skip


def rank_dir(layout, tp: int, pp: int, ep: int = 0) -> str:
    """mp_rank_TT[_PPP][_EEE], as get_checkpoint_name names it."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


def model_keys(layout) -> list[str]:
    return ["model"] if layout.chunks == 1 else [f"model{i}" for i in range(layout.chunks)]


def save_legacy(models: list, arch, layout, root: Path):
    from megatron.core import parallel_state as ps

    root = Path(root)
    if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
        state = {"args": megatron_args(arch, layout, "torch", models[0].config),
                 "checkpoint_version": 3.0, "iteration": ITERATION}  # fmt: skip
        for key, m in zip(model_keys(layout), models):
            state[key] = m.state_dict_for_save_checkpoint()
        state["optimizer"], state["opt_param_scheduler"] = _optimizer_state(models)
        state["rng_state"] = [_rng_state()]
        state["num_floating_point_operations_so_far"] = 0.0
        d = root / f"iter_{ITERATION:07d}" / rank_dir(
            layout, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank(),
        )  # fmt: skip
        d.mkdir(parents=True, exist_ok=True)
        torch.save(state, d / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / TRACKER).write_text(str(ITERATION))


def _sharded_metadata(ps) -> dict:
    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}  # fmt: skip


def _sharded_models(models: list, layout, ps) -> dict:
    md = _sharded_metadata(ps)
    return {k: m.sharded_state_dict(metadata=md) for k, m in zip(model_keys(layout), models)}


def _without_rank(common: dict) -> dict:
    """What Megatron-LM compares across ranks before saving common.pt: args but for the rank."""
    args = argparse.Namespace(**{k: v for k, v in vars(common["args"]).items() if k != "rank"})
    return {**common, "args": args}


def save_torch_dist(models: list, arch, layout, root: Path):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    root = Path(root)
    d = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"args": megatron_args(arch, layout, "torch_dist", models[0].config),
             "checkpoint_version": 3.0, "iteration": ITERATION,
             **_sharded_models(models, layout, ps)}  # fmt: skip
    state["rng_state"] = ShardedObject(
        "rng_state", [_rng_state()], (layout.pp, layout.tp),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )  # fmt: skip
    state["num_floating_point_operations_so_far"] = 0.0
    # (a common item: Megatron-LM saves it unless --no-save-optim, with or without the
    # optimizer's sharded state -- this one has none)
    state["opt_param_scheduler"] = _scheduler_state()
    md = {k: v for k, v in _sharded_metadata(ps).items() if k != "dp_cp_group"}
    dist_checkpointing.save(
        state, str(d), content_metadata=md, preprocess_common_before_consistancy_check=_without_rank
    )
    dist.barrier()
    if dist.get_rank() == 0:
        (root / TRACKER).write_text(str(ITERATION))


def _iteration_dir(root: Path) -> Path:
    it = int((Path(root) / TRACKER).read_text().strip())
    return Path(root) / f"iter_{it:07d}"


def _check_args(args, layout):
    """What Megatron-LM's check_checkpoint_args insists on for a legacy load (and the vpp,
    which decides the model0.. keys)."""
    got = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
           args.virtual_pipeline_model_parallel_size)  # fmt: skip
    assert got == (layout.tp, layout.pp, layout.vpp), f"args say {got}, the layout is {layout}"


def load_legacy(models: list, layout, root: Path):
    from megatron.core import parallel_state as ps

    d = _iteration_dir(root) / rank_dir(
        layout, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )  # fmt: skip
    state = torch.load(d / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    assert state["checkpoint_version"] == 3.0, state["checkpoint_version"]
    _check_args(state["args"], layout)
    for key, m in zip(model_keys(layout), models):
        m.load_state_dict(state[key], strict=True)
    return state


def load_torch_dist(models: list, layout, root: Path):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    d = str(_iteration_dir(root))
    common = dist_checkpointing.load_common_state_dict(d)
    assert common["checkpoint_version"] == 3.0, common["checkpoint_version"]
    # (Megatron-LM compares no layout here: torch_dist reshards on load)
    state = dist_checkpointing.load(_sharded_models(models, layout, ps), d)
    for key, m in zip(model_keys(layout), models):
        m.load_state_dict(state[key], strict=True)
    return common


LOADERS = {"legacy": load_legacy, "torch_dist": load_torch_dist}


# ---- TransformerEngine's names ------------------------------------------------------------------

_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(.*)$")


def _te_layer(rest: str, moe: bool, grouped: bool) -> list[str]:
    """The TE-spec name(s) of one layer entry (local-spec name `rest`)."""
    norm = rest.rsplit(".", 1)[-1]  # weight | bias
    if rest.startswith("input_layernorm."):  # fused into linear_qkv
        return [f"self_attention.linear_qkv.layer_norm_{norm}"]
    if rest.startswith("pre_mlp_layernorm.") and not moe:  # fused into a dense linear_fc1
        return [f"mlp.linear_fc1.layer_norm_{norm}"]
    m = _LOCAL_EXPERT.match(rest)
    if m and grouped:  # TEGroupedMLP: one grouped linear per fc, expert j's weight as weight{j}
        return [f"mlp.experts.{m[2]}.weight{m[1]}"] if m[3] == "weight" else []
    if rest == "self_attention.linear_qkv._extra_state":  # TE's attention has state too
        return [rest, "self_attention.core_attention._extra_state"]
    if rest == "mlp.router.weight" and grouped:
        return [rest, "mlp.experts.linear_fc1._extra_state", "mlp.experts.linear_fc2._extra_state"]
    return [rest]


def _te_names(model: dict, grouped: bool) -> dict:
    moe = {k.split(".")[2] for k in model if k.endswith(".mlp.router.weight")}
    out = {}
    for k, v in model.items():
        names = [k]
        if k.startswith("decoder.layers."):
            _, _, layer, rest = k.split(".", 3)
            names = [f"decoder.layers.{layer}.{n}" for n in _te_layer(rest, layer in moe, grouped)]
        for n in names:
            # TE (1.x) keeps its fp8 metadata as a pickled BytesIO, empty without fp8
            out[n] = io.BytesIO() if n.endswith("._extra_state") else v
    return out


def as_transformer_engine(src: Path, dst: Path, grouped_experts: bool = False):
    """Copy the legacy checkpoint `src` to `dst` under TransformerEngine's layer-spec names;
    experts as --moe-grouped-gemm has them (TEGroupedMLP) or, without it, one TE linear each
    (SequentialMLP: the local names)."""
    shutil.copytree(src, dst)
    for f in Path(dst).glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, map_location="cpu", weights_only=False)
        for key in [k for k in state if k.startswith("model")]:
            state[key] = _te_names(state[key], grouped_experts)
        state["args"].transformer_impl = "transformer_engine"
        state["args"].moe_grouped_gemm = grouped_experts
        torch.save(state, f)
