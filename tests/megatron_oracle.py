"""megatron-core itself as the oracle for megalite's Megatron checkpoint converter (test-only).

A Megatron `GPTModel` (local layer spec, fp32) is built at a given tp/pp/vpp(/ep) on gloo ranks
spawned with `megalite.testing.spawn`, its logits are computed for fixed tokens (gathered over
tp, the stages run one after another), and it is saved and loaded the two ways Megatron-LM does
(legacy mp_rank files and torch_dist: tests/megatron_oracle_files.py). `save_ranks` and
`load_ranks` are the spawn entry points (several models one after another in one world:
starting ranks and importing megatron is most of the time), `run` spawns them.

On CPU the model needs two patches: `torch.cuda.current_device` returns "cpu" (parameters and
buffers are created there), and the CUDA RNG tracker's `fork` is a no-op (every dropout is 0:
which stream it would draw from does not matter). `use_cpu_initialization` builds each weight
whole and keeps this rank's slice, so no tracker is seeded. Around them: `Tensor.cuda` is the
identity while the models are set up (Megatron moves the last stage's copy of a tied embedding
to the GPU before summing it with the first stage's); `torch.cuda.synchronize` is a no-op and a
debug log's memory probe returns 0 (dist_checkpointing's save; the probe wants psutil); the MoE
router's TransformerEngine gemm, a name megatron-core 0.16 leaves undefined without TE, is None.
GELU is the tanh form, written out: Megatron-LM's default `--bias-gelu-fusion` computes exactly
that (megatron/core/fusions/fused_bias_gelu.py), but its `torch.compile` costs seconds on a CPU.
"""

import contextlib
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.testing import spawn
from tests.megatron_oracle_files import (
    LOADERS,
    MAKE_VOCAB_DIVISIBLE_BY,
    save_legacy,
    save_torch_dist,
)


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
LLAMA6 = Arch("llama6", "RMSNorm", swiglu=True, rope=True, bias=False, tied=False, groups=2,
              num_layers=6)  # fmt: skip
MOE = Arch("moe", "RMSNorm", swiglu=True, rope=True, bias=False, tied=False, groups=2,
           num_layers=2, num_experts=4)  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """Where a Megatron run put the model: world = tp * pp * dp, with dp = ep."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    first: int | None = None  # --decoder-first-pipeline-num-layers (uneven stages)
    last: int | None = None  # --decoder-last-pipeline-num-layers

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
        uneven = "".join(f"{k}{v}" for k, v in (("first", self.first), ("last", self.last)) if v)
        return f"tp{self.tp}pp{self.pp}{vpp}{ep}{uneven}"

    def convert_flags(self) -> list:
        """megalite-convert's flags for a legacy export at this layout."""
        flags = ["--tp", self.tp, "--pp", self.pp, "--vpp", self.vpp or 1, "--ep", self.ep]
        for flag, n in (("first", self.first), ("last", self.last)):
            if n is not None:
                flags += [f"--decoder-{flag}-pipeline-num-layers", n]
        return flags


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
        num_layers_in_first_pipeline_stage=layout.first,
        num_layers_in_last_pipeline_stage=layout.last, pipeline_dtype=torch.float32, params_dtype=torch.float32, use_cpu_initialization=True,
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


# ---- entry points for megalite.testing.spawn ----------------------------------------------------


def save_ranks(rank, world, jobs: list) -> list:
    """Each job (arch, layout, root, tokens, seed): build, perturb, save root/legacy and
    root/torch_dist. Their logits (last stage) or None, in order."""
    out = []
    for arch, layout, root, x, seed in jobs:
        ps = setup(layout)
        models = build(arch, layout)
        perturb(models, seed)
        out.append(forward(models, layout, x))
        save_legacy(models, arch, layout, Path(root) / "legacy")
        save_torch_dist(models, arch, layout, Path(root) / "torch_dist")
        ps.destroy_model_parallel()
    return out


def load_ranks(rank, world, jobs: list) -> list:
    """Each job (arch, layout, checkpoint root, format, tokens): fresh (differently
    initialised) models loaded from it. Their logits (last stage) or None, in order."""
    out = []
    for arch, layout, root, fmt, x in jobs:
        ps = setup(layout)
        models = build(arch, layout, seed=999)
        LOADERS[fmt](models, layout, Path(root))
        out.append(forward(models, layout, x))
        ps.destroy_model_parallel()
    return out


def run(fn, jobs: list) -> list:
    """`save_ranks` or `load_ranks` over jobs, one spawn per world size; each job's logits."""
    out = [None] * len(jobs)
    for world in sorted({job[1].world for job in jobs}):
        mine = [i for i, job in enumerate(jobs) if job[1].world == world]
        results = spawn(fn, world, [jobs[i] for i in mine])
        for k, i in enumerate(mine):
            out[i] = last_stage([r[k] for r in results])
    return out


def last_stage(results: list):
    """The logits among spawn's per-rank results (every last-stage rank has the same)."""
    found = [r for r in results if r is not None]
    for r in found[1:]:
        assert torch.equal(r, found[0])
    return found[0]


# ---- megalite's side, in this process -----------------------------------------------------------


def megalite_logits(path, x: torch.Tensor) -> torch.Tensor:
    """The logits of a megalite checkpoint's whole model, read in one process."""
    from megalite.checkpoint import format as fmt
    from megalite.checkpoint.checkpointer import load_model
    from megalite.config_read import from_dict
    from megalite.model.env import LOCAL
    from megalite.model.gpt import GPTChunk

    ckpt = fmt.Checkpoint(path)
    ckpt.verify()
    chunk = GPTChunk(from_dict({"model": ckpt.model_config}).model)
    load_model([chunk], LOCAL, ckpt)
    with torch.no_grad():
        return chunk.eval()(x)
