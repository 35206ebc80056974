"""megatron-core itself as the oracle for megalite's Megatron checkpoint converter (test-only).

A Megatron `GPTModel` (local layer spec, fp32) is built at a given tp/pp/vpp(/ep) on gloo ranks
spawned with `megalite.testing.spawn`, its logits are computed for fixed tokens, and it is saved
the two ways Megatron-LM's `megatron/training/checkpointing.py` saves one:

- **legacy** (`--ckpt-format torch`): `iter_0000007/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`,
  each a pickled dict `{'args': Namespace, 'checkpoint_version': 3.0, 'iteration': 7, 'model'
  (or 'model0', 'model1', .. one per virtual stage), 'optimizer', 'opt_param_scheduler',
  'rng_state', 'num_floating_point_operations_so_far'}`, written by data-parallel rank 0 (or
  expert-data-parallel rank 0), then `latest_checkpointed_iteration.txt`;
- **torch_dist**: the same dict with each model's `sharded_state_dict()` (layers stacked along a
  leading axis) and the rng state as a `ShardedObject`, through `dist_checkpointing.save`
  (optimizer left out, as `--no-save-optim` does).

The `args` Namespace holds what Megatron-LM's parser would: every TransformerConfig field (its
parser is built from that dataclass, so enums such as `attention_backend=AttnBackend.auto` and
dtypes travel in the pickle) and the training-level flags a converter reads (`swiglu`,
`untie_embeddings_and_output_weights`, `padded_vocab_size`, `position_embedding_type`, ...).

Loading goes back the way Megatron-LM loads: legacy `torch.load` + `load_state_dict(strict)` per
rank, torch_dist `dist_checkpointing.load` of the model's sharded state dict.

On CPU the model needs two patches and nothing else: `torch.cuda.current_device` returns "cpu"
(parameters and buffers are created there), and the CUDA RNG tracker's `fork` is a no-op (every
dropout is 0: which stream it would draw from does not matter). `use_cpu_initialization` builds
each weight whole and keeps this rank's slice, so no tracker is seeded. `Tensor.cuda` is the
identity while a model with tied embeddings over pp>1 is built (Megatron moves the last stage's
copy of the embedding to the GPU before summing it with the first stage's).
GELU is the tanh form, written out: Megatron-LM's default `--bias-gelu-fusion` computes exactly
that (megatron/core/fusions/fused_bias_gelu.py), but its `torch.compile` costs seconds on a CPU.
"""

import argparse
import contextlib
import enum
import random
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

ITERATION = 7
MAKE_VOCAB_DIVISIBLE_BY = 128
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Arch:
    """A tiny Megatron model: the architecture flags a Megatron-LM user would pass."""

    name: str
    normalization: str  # --normalization LayerNorm | RMSNorm
    swiglu: bool  # --swiglu (gated MLP: linear_fc1 holds [gate | up] per tp rank)
    rope: bool  # --position-embedding-type rope (else learned_absolute)
    bias: bool  # biases on every linear (else --disable-bias-linear)
    tied: bool  # else --untie-embeddings-and-output-weights
    num_layers: int = 4
    hidden: int = 32
    heads: int = 4
    groups: int | None = None  # --group-query-attention --num-query-groups
    ffn: int = 64
    vocab: int = 600  # the tokenizer's; Megatron pads it to a multiple of 128 * tp
    seq: int = 16
    num_experts: int | None = None
    topk: int = 2


GPT2 = Arch("gpt2", "LayerNorm", swiglu=False, rope=False, bias=True, tied=True, ffn=128)
LLAMA = Arch("llama", "RMSNorm", swiglu=True, rope=True, bias=False, tied=False, groups=2)
MOE = Arch("moe", "RMSNorm", swiglu=True, rope=True, bias=False, tied=False, groups=2,
           num_layers=2, num_experts=4)  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """Where a Megatron run put the model: world = tp * pp * dp, with dp = ep."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.ep

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    def padded_vocab(self, arch: Arch) -> int:
        multiple = MAKE_VOCAB_DIVISIBLE_BY * self.tp
        return -(-arch.vocab // multiple) * multiple

    def __str__(self) -> str:
        vpp = f"vpp{self.vpp}" if self.vpp else ""
        ep = f"ep{self.ep}" if self.ep > 1 else ""
        return f"tp{self.tp}pp{self.pp}{vpp}{ep}"


def tokens(arch: Arch, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Fixed token ids (batch, seq) within the unpadded vocabulary."""
    return torch.randint(
        0, arch.vocab, (batch, arch.seq), generator=torch.Generator().manual_seed(seed)
    )


# ---- a Megatron model on CPU ranks -------------------------------------------------------------


def _cpu_patches():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None  # (dist_checkpointing's save waits on copies)
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0  # (a debug log's number; it wants psutil)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # (0.16 names it without TransformerEngine)
        moe_utils.te_general_gemm = None


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def setup(layout: Layout):
    """Megatron's process groups over the gloo world `spawn` made."""
    _cpu_patches()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        layout.tp, layout.pp, virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
    )  # fmt: skip
    return ps


def transformer_config(arch: Arch, layout: Layout):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if arch.num_experts:
        moe = dict(num_moe_experts=arch.num_experts, moe_router_topk=arch.topk,
                   moe_ffn_hidden_size=arch.ffn, moe_aux_loss_coeff=0.0,
                   moe_token_dispatcher_type="allgather")  # fmt: skip
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
        num_query_groups=arch.groups, ffn_hidden_size=arch.ffn,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, use_cpu_initialization=True,
        normalization=arch.normalization, gated_linear_unit=arch.swiglu,
        activation_func=F.silu if arch.swiglu else _gelu_tanh,
        add_bias_linear=arch.bias, add_qkv_bias=arch.bias, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, **moe,
    )  # fmt: skip


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


def build(arch: Arch, layout: Layout, seed: int = 1234) -> list:
    """This rank's model chunks, one GPTModel per virtual stage (eval mode)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)  # every rank draws the same whole weights and keeps its slice
    config = transformer_config(arch, layout)
    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts, normalization=arch.normalization)
    p = ps.get_pipeline_model_parallel_rank()
    models = []
    with _tensor_cuda_is_identity():
        for c in range(layout.chunks):
            models.append(GPTModel(
                config, spec, vocab_size=layout.padded_vocab(arch), max_sequence_length=arch.seq,
                pre_process=p == 0 and c == 0,
                post_process=p == layout.pp - 1 and c == layout.chunks - 1,
                share_embeddings_and_output_weights=arch.tied,
                position_embedding_type="rope" if arch.rope else "learned_absolute",
                vp_stage=c if layout.vpp else None,
            ).eval())  # fmt: skip
    return models


def perturb(models: list, seed: int = 0, scale: float = 0.05):
    """Add noise to every parameter (norms at 1, biases at 0 would hide a mixed-up name).

    A slice of a split tensor gets its own noise; a tensor every tp rank holds whole gets the
    same noise on each (Megatron keeps them equal). The last stage's copy of a tied embedding
    is set from the first stage's again, as Megatron's setup does."""
    from megatron.core import parallel_state as ps

    where = f"{ps.get_pipeline_model_parallel_rank()}"
    with torch.no_grad():
        for c, m in enumerate(models):
            for name, param in m.named_parameters():
                key = f"{where}/{c}/{name}"
                if getattr(param, "tensor_model_parallel", False):
                    key += f"/tp{ps.get_tensor_model_parallel_rank()}"
                if not getattr(param, "allreduce", True):  # an expert's: its own per ep rank
                    key += f"/ep{ps.get_expert_model_parallel_rank()}"
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()) + seed)
                param.add_(torch.randn(param.shape, generator=g) * scale)
        with _tensor_cuda_is_identity():
            for m in models:
                m.setup_embeddings_and_output_layer()


def forward(models: list, layout: Layout, x: torch.Tensor):
    """Logits (batch, seq, padded vocab) on the last stage's ranks, None on the others.

    The stages run one after another (this is a test: no schedule), each stage's output
    [seq, batch, hidden] broadcast over the pipeline group to the next."""
    from megatron.core import parallel_state as ps

    b, s = x.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True: masked
    p, group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
    hidden = None
    with torch.no_grad():
        for g in range(layout.pp * layout.chunks):
            c, holder = divmod(g, layout.pp)
            out = None
            if p == holder:
                if g > 0:
                    models[c].set_input_tensor(hidden)
                out = models[c](x, pos, mask)
            if g == layout.pp * layout.chunks - 1:
                break
            hidden = out if out is not None else torch.empty(s, b, models[0].config.hidden_size)
            if layout.pp > 1:
                dist.broadcast(hidden, dist.get_global_rank(group, holder), group=group)
    if out is None:
        return None
    tp_group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(layout.tp)]
    dist.all_gather(parts, out.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


# ---- Megatron-LM's checkpoint files ------------------------------------------------------------


def megatron_args(arch: Arch, layout: Layout, ckpt_format: str, config) -> argparse.Namespace:
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
            arch.num_layers // (layout.pp * layout.vpp) if layout.vpp else None
        ),
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.tp,
        context_parallel_size=1, sequence_parallel=False, data_parallel_size=layout.ep,
        world_size=layout.world, rank=dist.get_rank(), transformer_impl="local",
        spec=None, fp16=False, bf16=False, ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format != "torch", use_distributed_optimizer=False,
        no_save_optim=ckpt_format != "torch", no_save_rng=False, micro_batch_size=1,
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
    sched = {"max_lr": 3e-4, "lr_warmup_steps": 0, "num_steps": ITERATION * 8,
             "lr_decay_style": "cosine", "lr_decay_steps": 80, "min_lr": 3e-5,
             "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 80}  # fmt: skip
    return opt.state_dict(), sched


def rank_dir(layout: Layout, tp: int, pp: int, ep: int = 0) -> str:
    """mp_rank_TT[_PPP][_EEE], as get_checkpoint_name names it."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


def _model_keys(layout: Layout) -> list[str]:
    return ["model"] if layout.chunks == 1 else [f"model{i}" for i in range(layout.chunks)]


def save_legacy(models: list, arch: Arch, layout: Layout, root: Path):
    from megatron.core import parallel_state as ps

    root = Path(root)
    if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
        state = {"args": megatron_args(arch, layout, "torch", models[0].config),
                 "checkpoint_version": 3.0, "iteration": ITERATION}  # fmt: skip
        for key, m in zip(_model_keys(layout), models):
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


def _sharded_models(models: list, layout: Layout, ps) -> dict:
    md = _sharded_metadata(ps)
    return {k: m.sharded_state_dict(metadata=md) for k, m in zip(_model_keys(layout), models)}


def _without_rank(common: dict) -> dict:
    """What Megatron-LM compares across ranks before saving common.pt: args but for the rank."""
    args = argparse.Namespace(**{k: v for k, v in vars(common["args"]).items() if k != "rank"})
    return {**common, "args": args}


def save_torch_dist(models: list, arch: Arch, layout: Layout, root: Path):
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


def _check_args(args, layout: Layout):
    """What Megatron-LM's check_checkpoint_args insists on for a legacy load (and the vpp,
    which decides the model0.. keys)."""
    got = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
           args.virtual_pipeline_model_parallel_size)  # fmt: skip
    assert got == (layout.tp, layout.pp, layout.vpp), f"args say {got}, the layout is {layout}"


def load_legacy(models: list, layout: Layout, root: Path):
    from megatron.core import parallel_state as ps

    d = _iteration_dir(root) / rank_dir(
        layout, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )  # fmt: skip
    state = torch.load(d / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    assert state["checkpoint_version"] == 3.0, state["checkpoint_version"]
    _check_args(state["args"], layout)
    for key, m in zip(_model_keys(layout), models):
        m.load_state_dict(state[key], strict=True)
    return state


def load_torch_dist(models: list, layout: Layout, root: Path):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    d = str(_iteration_dir(root))
    common = dist_checkpointing.load_common_state_dict(d)
    assert common["checkpoint_version"] == 3.0, common["checkpoint_version"]
    # (Megatron-LM compares no layout here: torch_dist reshards on load)
    state = dist_checkpointing.load(_sharded_models(models, layout, ps), d)
    for key, m in zip(_model_keys(layout), models):
        m.load_state_dict(state[key], strict=True)
    return common


LOADERS = {"legacy": load_legacy, "torch_dist": load_torch_dist}


# ---- entry points for megalite.testing.spawn ----------------------------------------------------


def save_rank(rank, world, arch: Arch, layout: Layout, root: str, x: torch.Tensor, seed: int):
    """Build, perturb, save root/legacy and root/torch_dist; the logits (last stage) or None."""
    setup(layout)
    models = build(arch, layout)
    perturb(models, seed)
    logits = forward(models, layout, x)
    save_legacy(models, arch, layout, Path(root) / "legacy")
    save_torch_dist(models, arch, layout, Path(root) / "torch_dist")
    return logits


def load_rank(rank, world, arch: Arch, layout: Layout, root: str, fmt: str, x: torch.Tensor):
    """Fresh (differently initialised) models loaded from a checkpoint; their logits or None."""
    setup(layout)
    models = build(arch, layout, seed=999)
    LOADERS[fmt](models, layout, Path(root))
    return forward(models, layout, x)


def last_stage(results: list):
    """The logits among spawn's per-rank results (every last-stage rank has the same)."""
    found = [r for r in results if r is not None]
    for r in found[1:]:
        assert torch.equal(r, found[0])
    return found[0]
