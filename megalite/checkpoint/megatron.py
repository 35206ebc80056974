"""Weight names and fused tensors between Megatron-LM (megatron-core's GPTModel) and megalite.

    megalite-convert MEGATRON_DIR OUT --to megalite [--from megatron] [--vocab-size N]
    megalite-convert MEGALITE_DIR OUT --to megatron [--format torch_dist|legacy]
                     [--tp N --pp N --vpp N --ep N] [--transformer-impl local|transformer_engine]

Works on whole tensors, as `checkpoint/hf.py` does: a *Megatron state* here is a flat dict of
global tensors (the tp/pp/vpp/ep shards already merged by `checkpoint/megatron_files.py`), one
entry per layer, under megatron-core's local-spec names:

    embedding.word_embeddings.weight        (V_padded, h)   embedding.position_embeddings.weight
    decoder.layers.{i}.input_layernorm.{weight,bias}       decoder.layers.{i}.pre_mlp_layernorm.*
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}   rows per query group g:
                                            [q heads of g | k of g | v of g] (each head hd rows)
    decoder.layers.{i}.self_attention.linear_proj.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc1.{weight,bias}   SwiGLU: [gate | up], each whole (ffn rows)
    decoder.layers.{i}.mlp.linear_fc2.{weight,bias}
    decoder.layers.{i}.mlp.router.weight   mlp.experts.local_experts.{j}.linear_fc{1,2}.weight
                                           (j the global expert), mlp.shared_experts.linear_fc*
    decoder.final_layernorm.{weight,bias}  output_layer.weight (untied models only)

TransformerEngine names (`self_attention.linear_qkv.layer_norm_{weight,bias}` for the input norm,
`mlp.linear_fc1.layer_norm_*` for the pre-MLP norm; torch_dist uses them for every spec) are
mapped onto these by `local_names`. The model config comes from the checkpoint's args
(`checkpoint/megatron_args.py`); the files are `megatron_files.py` (legacy) and
`megatron_dist.py` (torch_dist). The vocabulary padding is stripped on import and added on
export (`megatron_args.padded_vocab_size`, Megatron's rule: a multiple of make_vocab_size_divisible_by * tp).

Supported (everything else in the args is refused with one line, never dropped):
- GPT-2 style: LayerNorm, GELU (the tanh approximation, which megatron gives with
  --openai-gelu or with its default bias-GELU fusion; exact-erf GELU is refused), learned
  absolute positions, biases (--add-bias-linear), tied or untied output layer;
- Llama style: RMSNorm, SwiGLU, RoPE (rotary_percent 1, not interleaved; llama3 scaling as
  --use-rope-scaling/--rope-scaling-factor, linear as --rotary-seq-len-interpolation-factor,
  yarn refused), grouped-query attention, no biases, tied or untied;
- MoE (SequentialMLP local experts, TE/grouped experts by `megatron_files`): top-k softmax
  router (renormalised over the top k, or --moe-router-pre-softmax), optional shared expert,
  dropless (a capacity factor is refused);
- kv_channels must be hidden/heads; no qk-layernorm, MLA, MTP, post-LN;
- zero-centred gamma (--apply-layernorm-1p): the norm weights read plus 1 (`shift_norms`);
- weights only: optimizer and RNG state are not converted (the tool says so).
"""

from functools import partial

import torch
import torch.nn.functional as F

from megalite.checkpoint import format as fmt
from megalite.config import ModelConfig
from megalite.errors import MegaliteError
from megalite.model.gpt import OUTPUT, VOCAB_TENSORS, WORD_EMBEDDING

EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
LAYER = "decoder.layers.{}."
CHECKPOINT_VERSION = 3.0

# TransformerEngine's fused norm names -> megatron-core's local-spec names
TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def local_names(name: str) -> str:
    """A parameter name with TransformerEngine's fused-norm suffixes replaced by local ones."""
    for te, local in TE_NORMS.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    return name


def spec_names(state: dict, transformer_impl: str, sharded: bool) -> dict:
    """A Megatron state (local names) under the names one layer spec gives its norms.
    TransformerEngine fuses the input norm into linear_qkv and a dense MLP's norm into
    linear_fc1 (an MoE layer keeps `pre_mlp_layernorm`); the local spec's legacy state dict
    keeps both apart, but its torch_dist keys are TE's, the pre-MLP norm of MoE layers too."""
    te = transformer_impl == "transformer_engine"
    moe = {k.split(".")[2] for k in state if k.endswith(".mlp.router.weight")}
    out = {}
    for k, v in state.items():
        for te_name, local in TE_NORMS.items():
            pre_mlp = local.startswith("pre_mlp")
            layer = k.split(".")[2] if k.startswith("decoder.layers.") else None
            rename = (sharded and not te) or (te and not (pre_mlp and layer in moe))
            if k.endswith("." + local) and layer is not None and ".shared_experts." not in k \
                    and rename:  # fmt: skip
                k = k[: -len(local)] + te_name
                break
        out[k] = v
    return out


# ---- tensor names and shapes ----------------------------------------------------------------


def _mlp_names(cfg: ModelConfig, m: str, g: str, ffn: int):
    """(megalite, megatron, shape) of one dense MLP (or shared expert): fc1 is split below."""
    h, bias = cfg.hidden_size, cfg.features.linear_bias
    yield None, g + "linear_fc1.weight", ((2 if cfg.features.gated_mlp else 1) * ffn, h)
    if bias:
        yield None, g + "linear_fc1.bias", ((2 if cfg.features.gated_mlp else 1) * ffn,)
    yield m + "down.weight", g + "linear_fc2.weight", (h, ffn)
    if bias:
        yield m + "down.bias", g + "linear_fc2.bias", (h,)


def megatron_shapes(cfg: ModelConfig, padded_vocab: int) -> dict:
    """{megatron name: global shape} of every tensor of this model (the Megatron state)."""
    return {n: s for _, n, s in _names(cfg, padded_vocab)}


def _names(cfg: ModelConfig, padded_vocab: int):
    """(megalite name or None for the fused ones, megatron name, global shape)."""
    h, f = cfg.hidden_size, cfg.features
    yield WORD_EMBEDDING, EMBEDDING, (padded_vocab, h)
    if f.learned_positions:
        yield (
            "embedding.position.weight",
            POSITIONS,
            (cfg.max_position_embeddings or cfg.seq_length, h),
        )
    qkv = (cfg.num_attention_heads + 2 * cfg.heads_kv) * cfg.head_dim
    norms = ("weight",) if f.rms_norm else ("weight", "bias")
    for i in range(cfg.num_layers):
        m, g = f"layers.{i}.", LAYER.format(i)
        for x in norms:
            yield m + f"input_norm.{x}", g + f"input_layernorm.{x}", (h,)
            yield m + f"post_attention_norm.{x}", g + f"pre_mlp_layernorm.{x}", (h,)
        yield None, g + "self_attention.linear_qkv.weight", (qkv, h)
        if f.qkv_bias:
            yield None, g + "self_attention.linear_qkv.bias", (qkv,)
        yield m + "attention.out.weight", g + "self_attention.linear_proj.weight", (h, h)
        if f.linear_bias:
            yield m + "attention.out.bias", g + "self_attention.linear_proj.bias", (h,)
        if not cfg.is_moe_layer(i):
            yield from _mlp_names(cfg, m + "mlp.", g + "mlp.", cfg.ffn)
            continue
        yield m + "mlp.router.weight", g + "mlp.router.weight", (cfg.num_experts, h)
        fc1 = (2 if f.gated_mlp else 1) * cfg.moe_ffn
        for j in range(cfg.num_experts):
            e = g + f"mlp.experts.local_experts.{j}."
            yield None, e + "linear_fc1.weight", (fc1, h)
            yield None, e + "linear_fc2.weight", (h, cfg.moe_ffn)
        if cfg.moe_shared_expert_intermediate_size:
            size = cfg.moe_shared_expert_intermediate_size
            yield from _mlp_names(cfg, m + "mlp.shared.", g + "mlp.shared_experts.", size)
    for x in norms:
        yield f"final_norm.{x}", f"decoder.final_layernorm.{x}", (h,)
    if not cfg.tied:
        yield OUTPUT, OUTPUT_LAYER, (padded_vocab, h)


def check_shapes(state: dict, cfg: ModelConfig, where: str):
    """Every tensor the args imply is there with the shape they imply (one line if not);
    `state`: {megatron name: shape}."""
    vocab = state[EMBEDDING][0] if EMBEDDING in state else cfg.vocab_size
    if vocab < cfg.vocab_size:
        raise MegaliteError(
            f"{where}: {EMBEDDING} has {vocab} rows but the args say the vocabulary is "
            f"{cfg.vocab_size}; the args contradict the tensors"
        )
    shapes = megatron_shapes(cfg, vocab)
    extra = sorted(set(state) - set(shapes))
    if extra:  # a tensor nobody maps would be dropped silently
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise MegaliteError(
            f"{where} holds {extra[0]}{more}, which its args do not explain (a feature megalite "
            "does not have, or args that contradict the tensors)"
        )
    for name, shape in shapes.items():
        if name not in state:
            raise MegaliteError(
                f"{where} lacks the tensor {name} that its args imply; is it a complete "
                f"{cfg.flavour}-style model?"
            )
        if tuple(state[name]) != tuple(shape):
            raise MegaliteError(
                f"{where}: {name} has shape {tuple(state[name])} but the checkpoint's args "
                f"({_implied_by(name, cfg)}) imply {tuple(shape)}; the args contradict the tensors"
            )


def _implied_by(name: str, cfg: ModelConfig) -> str:
    """The Megatron args (as read) that set the shape of tensor `name`."""
    args = {"hidden_size": cfg.hidden_size}
    if "self_attention" in name:
        args.update(num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.heads_kv,
                    kv_channels=cfg.head_dim)  # fmt: skip
    elif "shared_experts" in name:
        args["moe_shared_expert_intermediate_size"] = cfg.moe_shared_expert_intermediate_size
    elif "experts" in name or "router" in name:
        args.update(num_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_ffn)
    elif "mlp" in name:
        args["ffn_hidden_size"] = cfg.ffn
    elif "position" in name:
        args["max_position_embeddings"] = cfg.max_position_embeddings or cfg.seq_length
    return ", ".join(f"{k}={v}" for k, v in args.items())


# ---- fused tensors ----------------------------------------------------------------------------


def split_qkv(w: torch.Tensor, cfg: ModelConfig):
    """linear_qkv rows (per query group: q heads of the group, k, v) -> q, k, v."""
    groups, hd = cfg.heads_kv, cfg.head_dim
    per = cfg.num_attention_heads // groups
    x = w.reshape(groups, per + 2, hd, *w.shape[1:])
    q = x[:, :per].reshape(groups * per * hd, *w.shape[1:])
    return q.contiguous(), x[:, per].reshape(groups * hd, *w.shape[1:]).contiguous(), \
        x[:, per + 1].reshape(groups * hd, *w.shape[1:]).contiguous()  # fmt: skip


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig):
    groups, hd = cfg.heads_kv, cfg.head_dim
    per = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    parts = (q.reshape(groups, per, hd, *rest), k.reshape(groups, 1, hd, *rest),
             v.reshape(groups, 1, hd, *rest))  # fmt: skip
    return torch.cat(parts, 1).reshape(-1, *rest).contiguous()


State = fmt.LazyTensors  # a Megatron state read lazily: {name: a function}, `.shapes`


def _whole(state, name):
    return state[name]


def from_megatron_lazy(state: State, cfg: ModelConfig, where: str) -> State:
    """{megalite name: a function that computes it from `state`} (reading only the Megatron
    tensors it needs): a conversion computes, writes and frees one tensor at a time. Where the
    state knows its dtypes, the result knows every shape and dtype before a tensor is read
    (the same functions run on meta tensors)."""
    local = {local_names(k): k for k in state}
    state = State({n: dict.__getitem__(state, k) for n, k in local.items()},
                  {n: state.shapes[k] for n, k in local.items()},
                  {n: state.dtypes[k] for n, k in local.items()} if state.dtypes else None)  # fmt: skip
    check_shapes(state.shapes, cfg, where)
    out = _from_megatron(state, cfg)
    if state.dtypes is None:
        return State(out)
    meta = State({k: partial(torch.empty, s, dtype=state.dtypes[k], device="meta")
                  for k, s in state.shapes.items()}, state.shapes)  # fmt: skip
    made = {k: f() for k, f in _from_megatron(meta, cfg).items()}
    return State(out, {k: tuple(t.shape) for k, t in made.items()},
                 {k: t.dtype for k, t in made.items()})  # fmt: skip


def _from_megatron(state: State, cfg: ModelConfig) -> dict:
    vocab = state.shapes[EMBEDDING][0]
    out = {}
    for m, g, _ in _names(cfg, vocab):
        if m is not None:
            out[m] = partial(_whole, state, g)
    for i in range(cfg.num_layers):
        m, g = f"layers.{i}.", LAYER.format(i)
        a = g + "self_attention.linear_qkv."
        for x in ("weight", "bias") if cfg.features.qkv_bias else ("weight",):
            for j, y in enumerate("qkv"):
                out[m + f"attention.{y}.{x}"] = partial(_qkv_part, state, a + x, cfg, j)
        if not cfg.is_moe_layer(i):
            out.update(_fc1_from(state, cfg, m + "mlp.", g + "mlp."))
            continue
        if cfg.moe_shared_expert_intermediate_size:
            out.update(_fc1_from(state, cfg, m + "mlp.shared.", g + "mlp.shared_experts."))
        e = g + "mlp.experts.local_experts.{}."
        first = "gate_up" if cfg.features.gated_mlp else "up"
        for fc, x in (("linear_fc1", first), ("linear_fc2", "down")):
            names = [e.format(j) + f"{fc}.weight" for j in range(cfg.num_experts)]
            out[m + f"mlp.experts.{x}.weight"] = partial(_stack, state, names)
    for name in VOCAB_TENSORS:
        if name in out:
            out[name] = partial(_rows, out[name], cfg.vocab_size)
    return out


# the weights of the norms Megatron's --apply-layernorm-1p (layernorm_zero_centered_gamma) stores
# as their offset from 1 (its norms compute with weight + 1), by megalite's names
NORM_WEIGHTS = ("input_norm.weight", "post_attention_norm.weight", "final_norm.weight")


def shift_norms(logical: State, delta: float) -> State:
    """megalite's logical tensors with every norm weight plus `delta`: +1 reads a checkpoint
    saved with --apply-layernorm-1p (megalite keeps the weight itself), -1 writes one."""
    out = {k: partial(_plus, f, delta) if k.endswith(NORM_WEIGHTS) else f
           for k, f in dict.items(logical)}  # fmt: skip
    return State(out, logical.shapes, logical.dtypes)


def _plus(f, delta: float) -> torch.Tensor:
    return f() + delta


def _rows(f, n: int) -> torch.Tensor:
    return f()[:n]


def _stack(state, names: list) -> torch.Tensor:
    return torch.stack([state[n] for n in names])


def _qkv_part(state, name: str, cfg: ModelConfig, j: int) -> torch.Tensor:
    return split_qkv(state[name], cfg)[j]


def _fc1_from(state, cfg, m, g):
    out = {}
    for x in ("weight", "bias") if cfg.features.linear_bias else ("weight",):
        if cfg.features.gated_mlp:
            out[m + f"gate.{x}"] = partial(_half, state, g + f"linear_fc1.{x}", 0)
            out[m + f"up.{x}"] = partial(_half, state, g + f"linear_fc1.{x}", 1)
        else:
            out[m + f"up.{x}"] = partial(_whole, state, g + f"linear_fc1.{x}")
    return out


def _half(state, name: str, j: int) -> torch.Tensor:
    return state[name].chunk(2)[j]


def to_megatron(logical: dict, cfg: ModelConfig, padded_vocab: int) -> dict:
    """megalite's logical tensors (any vocabulary padding) -> a Megatron state with the
    vocabulary padded to `padded_vocab` rows (zeros, as Megatron initialises nothing there)."""
    state = to_megatron_lazy(logical, cfg, padded_vocab)
    return {k: state[k].contiguous() for k in state}


def to_megatron_lazy(logical, cfg: ModelConfig, padded_vocab: int) -> State:
    """The Megatron state of `logical` (a mapping that reads a megalite tensor by name) as
    functions, each computing one Megatron tensor when it is called; `.shapes` says them all."""
    out = {}
    for m, g, _ in _names(cfg, padded_vocab):
        if m is not None:
            out[g] = partial(_whole, logical, m)
    for name in (EMBEDDING, OUTPUT_LAYER):
        if name in out:
            out[name] = partial(_pad_rows, out[name], cfg.vocab_size, padded_vocab)
    for i in range(cfg.num_layers):
        m, g = f"layers.{i}.", LAYER.format(i)
        a = g + "self_attention.linear_qkv."
        for x in ("weight", "bias") if cfg.features.qkv_bias else ("weight",):
            names = [m + f"attention.{y}.{x}" for y in "qkv"]
            out[a + x] = partial(_merge_qkv, logical, names, cfg)
        if not cfg.is_moe_layer(i):
            out.update(_fc1_to(logical, cfg, m + "mlp.", g + "mlp."))
            continue
        if cfg.moe_shared_expert_intermediate_size:
            out.update(_fc1_to(logical, cfg, m + "mlp.shared.", g + "mlp.shared_experts."))
        first = "gate_up" if cfg.features.gated_mlp else "up"
        for j in range(cfg.num_experts):
            e = g + f"mlp.experts.local_experts.{j}."
            fc1, fc2 = m + f"mlp.experts.{first}.weight", m + "mlp.experts.down.weight"
            out[e + "linear_fc1.weight"] = partial(_expert, logical, fc1, j)
            out[e + "linear_fc2.weight"] = partial(_expert, logical, fc2, j)
    shapes = megatron_shapes(cfg, padded_vocab)
    return State({k: out[k] for k in shapes}, shapes)


def _pad_rows(f, vocab: int, padded: int) -> torch.Tensor:
    t = f()[:vocab]
    return t if t.shape[0] == padded else F.pad(t, (0, 0, 0, padded - t.shape[0]))


def _merge_qkv(logical, names: list, cfg: ModelConfig) -> torch.Tensor:
    return merge_qkv(*(logical[n] for n in names), cfg)


def _expert(logical, name: str, j: int) -> torch.Tensor:
    return logical[name][j]


def _fc1_to(logical, cfg, m, g):
    out = {}
    for x in ("weight", "bias") if cfg.features.linear_bias else ("weight",):
        parts = ("gate", "up") if cfg.features.gated_mlp else ("up",)
        out[g + f"linear_fc1.{x}"] = partial(_cat, logical, [m + f"{p}.{x}" for p in parts])
    return out


def _cat(logical, names: list) -> torch.Tensor:
    return torch.cat([logical[n] for n in names]) if len(names) > 1 else logical[names[0]]
