"""Weight names and configs between megalite and Hugging Face transformers.

Works on whole logical tensors (one process's view of the model, tp=1): `to_hf` and `from_hf`
map a state dict one way or the other. megalite pads the vocabulary (to a multiple of
`make_vocab_size_divisible_by`); padding rows are added on import and stripped on export.
GPT-2 stores linear weights as Conv1D (in, out) and fuses q, k, v into `c_attn`; megalite keeps
`nn.Linear` (out, in) and separate q, k, v. GPT2LMHeadModel always has biases: a bias-free model
(the nanogpt flavour) is written with zero biases, and read back only if they are all zero.
`export_tokenizer` writes the run's tokenizer so that
`AutoTokenizer.from_pretrained` encodes text to the ids megalite trained on. The layout follows
the model's features (`cfg.features.hf_model_type`, its biases, Qwen3's q_norm and k_norm);
config.json is read and written by megalite/checkpoint/hf_config.py (features matched to a row
of `megalite.model_config.FLAVOURS`). Llama, Qwen2, Qwen3, Mistral and Mixtral share Llama's names;
DeepSeek-V3's latent attention has its own (megalite/checkpoint/hf_deepseek.py).

Mixtral (a Llama-flavoured model with experts in every layer, no shared expert, top-k weights
renormalised): megalite's stacked expert tensors are the ones recent transformers keep in
memory, `mlp.experts.gate_up_proj` (E, 2f, h: gate rows, then up rows) and `down_proj`
(E, h, f), with the router as `mlp.gate`. Checkpoints on the hub store one tensor per expert,
`block_sparse_moe.experts.{j}.w1` (gate), `w3` (up) and `w2` (down), router
`block_sparse_moe.gate`. Both are read; the per-expert hub layout is written, which every
transformers version loads (recent ones fuse it on load, and write it back on save).
Qwen3-MoE is the same with its names (`MOE_NAMES`): router `mlp.gate`, hub experts
`mlp.experts.{j}.gate_proj/up_proj/down_proj`, and only on its MoE layers (the others keep
Llama's dense MLP names). gpt-oss keeps its in-memory names on disk: router `mlp.router`
(with a bias), attention `self_attn.sinks`, and experts `mlp.experts.gate_up_proj` (E, h, 2f:
(in, out), gate and up interleaved column by column) with `gate_up_proj_bias` (E, 2f, the same
interleaving), `down_proj` (E, f, h) and `down_proj_bias` (E, h); megalite's are (out, in), gate
rows then up rows.
"""

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from megalite.checkpoint import format as fmt
from megalite.checkpoint import hf_deepseek
from megalite.checkpoint.hf_config import hf_config, model_config_from_hf, with_source_fields
from megalite.checkpoint.hf_moe import moe_export
from megalite.config import ModelConfig
from megalite.data.tokenizer import SENTENCEPIECE, load_tokenizer
from megalite.errors import MegaliteError
from megalite.model.gpt import OUTPUT, VOCAB_TENSORS, WORD_EMBEDDING

# the conversion's one entry point: config.json both ways (hf_config.py) and the weights here
__all__ = [
    "export_tokenizer",
    "from_hf",
    "hf_config",
    "hub_fields",
    "with_source_fields",
    "model_config_from_hf",
    "to_hf",
]

# MoE architecture -> (router, the hub's per-expert prefix, its (gate, up, down) tensor names)
MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "gpt_oss": ("mlp.router", None, None),  # experts: _gpt_oss_experts_to/from_hf
}
FUSED = "mlp.experts.gate_up_proj"  # recent transformers' in-memory experts (router: mlp.gate)


def _moe_names(cfg: ModelConfig):
    """(router, per-expert prefix, (gate, up, down)) of this MoE model's architecture."""
    return MOE_NAMES[cfg.features.hf_moe_model_type]


def _gpt2_layout(cfg: ModelConfig) -> bool:
    """GPT-2's names: Conv1D (in, out) weights, q, k, v fused into c_attn."""
    return cfg.features.hf_model_type == "gpt2"


def _gpt2_names(cfg: ModelConfig):
    """(megalite name, hf name, transposed) for every tensor except c_attn (split in three);
    the megalite name is None for a bias the model lacks (zero in GPT-2's layout), and comes
    after its weight."""
    norm_bias, linear_bias = cfg.features.layer_norm_bias, cfg.features.linear_bias
    yield WORD_EMBEDDING, "transformer.wte.weight", False
    yield "embedding.position.weight", "transformer.wpe.weight", False
    for i in range(cfg.num_layers):
        m, h = f"layers.{i}.", f"transformer.h.{i}."
        for a, b in (("input_norm", "ln_1"), ("post_attention_norm", "ln_2")):
            yield m + a + ".weight", h + b + ".weight", False
            yield m + a + ".bias" if norm_bias else None, h + b + ".bias", False
        for a, b in (
            ("attention.out", "attn.c_proj"),
            ("mlp.up", "mlp.c_fc"),
            ("mlp.down", "mlp.c_proj"),
        ):
            yield m + a + ".weight", h + b + ".weight", True
            yield m + a + ".bias" if linear_bias else None, h + b + ".bias", False
    yield "final_norm.weight", "transformer.ln_f.weight", False
    yield "final_norm.bias" if norm_bias else None, "transformer.ln_f.bias", False


def _zero_bias(weight: torch.Tensor) -> torch.Tensor:
    """GPT-2's bias for a tensor the model has none of: zeros over the weight's outputs (the
    last dim of a Conv1D (in, out) weight or of a norm's (h,))."""
    return weight.new_zeros(weight.shape[-1])


def _absent_bias(hf_bias: torch.Tensor, name: str, cfg: ModelConfig) -> None:
    """A GPT-2 bias the model lacks must be zero: refused otherwise, never dropped."""
    if hf_bias.any():
        raise MegaliteError(
            f"Hugging Face tensor {name} is not zero, but the {cfg.flavour} flavour has no such "
            "bias; convert this GPT-2 model as the gpt2 flavour (activation gelu_new)"
        )


def _llama_names(cfg: ModelConfig):
    yield WORD_EMBEDDING, "model.embed_tokens.weight"
    for i in range(cfg.num_layers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        yield m + "input_norm.weight", h + "input_layernorm.weight"
        yield m + "post_attention_norm.weight", h + "post_attention_layernorm.weight"
        for a, b in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "o_proj")):
            yield m + f"attention.{a}.weight", h + f"self_attn.{b}.weight"
            if cfg.features.linear_bias if a == "out" else cfg.features.qkv_bias:
                yield m + f"attention.{a}.bias", h + f"self_attn.{b}.bias"
        if cfg.features.qk_norm:  # Qwen3
            for a in ("q_norm", "k_norm"):
                yield m + f"attention.{a}.weight", h + f"self_attn.{a}.weight"
        if cfg.features.attention_sinks:  # gpt-oss
            yield m + "attention.sinks", h + "self_attn.sinks"
        if cfg.is_moe_layer(i):  # the router; the experts in _experts_to/_from_hf
            yield m + "mlp.router.weight", h + _moe_names(cfg)[0] + ".weight"
            if cfg.features.moe_bias:  # gpt-oss
                yield m + "mlp.router.bias", h + _moe_names(cfg)[0] + ".bias"
            if cfg.moe_shared_expert_intermediate_size:  # DeepSeek-V3's shared experts
                for a in ("gate", "up", "down"):
                    yield m + f"mlp.shared.{a}.weight", h + f"mlp.shared_experts.{a}_proj.weight"
            continue
        for a in ("gate", "up", "down"):
            yield m + f"mlp.{a}.weight", h + f"mlp.{a}_proj.weight"
            if cfg.features.linear_bias:
                yield m + f"mlp.{a}.bias", h + f"mlp.{a}_proj.bias"
    yield "final_norm.weight", "model.norm.weight"
    if not cfg.tied:
        yield OUTPUT, "lm_head.weight"


def to_hf(state: dict, cfg: ModelConfig) -> dict:
    """megalite logical tensors (padded vocabulary) -> transformers state dict. A tensor that
    needs no arithmetic is the input itself or a view of it (no copy: a conversion streams
    views of mapped files to disk), so the result aliases `state`."""
    moe_export(cfg)  # an MoE model its architecture cannot express is refused before writing
    V = cfg.vocab_size
    out = {}
    unpad = set(VOCAB_TENSORS)
    if cfg.features.latent_attention:  # DeepSeek-V3: rotary rows back to pairs
        for m, h, rope in hf_deepseek.names(cfg):
            w = state[m][:V] if m in unpad else state[m]
            out[h] = hf_deepseek.reorder_rope(w, rope, False) if rope else w
        if cfg.tied:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        out.update(hf_deepseek.mtp_copies(cfg, out))
        if cfg.num_experts:
            out.update(hf_deepseek.experts_to_hf(state, cfg))
    elif _gpt2_layout(cfg):
        for m, h, t in _gpt2_names(cfg):
            if m is None:  # a bias-free model: zeros (the weight came just before)
                out[h] = _zero_bias(out[h.removesuffix(".bias") + ".weight"])
                continue
            w = state[m][:V] if m in unpad else state[m]
            out[h] = w.t().contiguous() if t else w
        for i in range(cfg.num_layers):
            a, c = f"layers.{i}.attention.", f"transformer.h.{i}.attn.c_attn."
            out[c + "weight"] = (
                torch.cat([state[a + x + ".weight"] for x in "qkv"]).t().contiguous()
            )
            qkv_bias = cfg.features.qkv_bias
            out[c + "bias"] = (torch.cat([state[a + x + ".bias"] for x in "qkv"]) if qkv_bias
                               else _zero_bias(out[c + "weight"]))  # fmt: skip
        out["lm_head.weight"] = out["transformer.wte.weight"]
    else:
        for m, h in _llama_names(cfg):
            out[h] = state[m][:V] if m in unpad else state[m]
        if moe_export(cfg):
            out.update(_experts_to_hf(state, cfg))  # gpt-oss's own layout there too
        if cfg.tied:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf(hf_state: dict, cfg: ModelConfig) -> dict:
    """transformers state dict -> megalite logical tensors, the vocabulary padded to tp=1's
    size; like to_hf's, the result aliases the input where no arithmetic is needed."""
    pad = cfg.padded_vocab_size(1) - cfg.vocab_size

    def get(name):
        if name not in hf_state:
            raise MegaliteError(
                f"Hugging Face checkpoint lacks tensor {name}; is it a complete {cfg.flavour} model?"
            )
        return hf_state[name]

    out = {}
    if cfg.features.latent_attention:  # DeepSeek-V3: rotary rows from pairs to halves
        for m, h, rope in hf_deepseek.names(cfg):
            out[m] = hf_deepseek.reorder_rope(get(h), rope, True) if rope else get(h)
        if cfg.num_experts:
            out.update(hf_deepseek.experts_from_hf(hf_state, cfg, get))
    elif _gpt2_layout(cfg):
        for m, h, t in _gpt2_names(cfg):
            if m is None:
                _absent_bias(get(h), h, cfg)
                continue
            out[m] = get(h).t().contiguous() if t else get(h)
        h_ = cfg.hidden_size
        for i in range(cfg.num_layers):
            w = get(f"transformer.h.{i}.attn.c_attn.weight").t()  # (3h, h)
            b = get(f"transformer.h.{i}.attn.c_attn.bias")
            if not cfg.features.qkv_bias:
                _absent_bias(b, f"transformer.h.{i}.attn.c_attn.bias", cfg)
            for j, x in enumerate("qkv"):
                out[f"layers.{i}.attention.{x}.weight"] = w[j * h_ : (j + 1) * h_].contiguous()
                if cfg.features.qkv_bias:
                    out[f"layers.{i}.attention.{x}.bias"] = b[j * h_ : (j + 1) * h_]
    else:
        moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        fused = bool(moe) and f"model.layers.{moe[0]}.{FUSED}" in hf_state
        fused = fused and not cfg.features.clamped_swiglu  # gpt-oss: its own names
        for m, h in _llama_names(cfg):
            if fused:  # recent transformers' in-memory names: the router is mlp.gate
                h = h.replace(f".{_moe_names(cfg)[0]}.", ".mlp.gate.")
            out[m] = get(h)
        if cfg.num_experts and cfg.features.clamped_swiglu:
            out.update(_gpt_oss_experts_from_hf(cfg, get))
        elif cfg.num_experts:
            out.update(_experts_from_hf(hf_state, cfg, get, fused))
    for name in VOCAB_TENSORS:
        if name in out and pad:
            out[name] = F.pad(out[name], (0, 0, 0, pad))
    return out


def _experts_to_hf(state: dict, cfg: ModelConfig) -> dict:
    """Stacked expert tensors -> the hub's per-expert gate, up and down (Mixtral: w1, w3, w2)."""
    if cfg.features.clamped_swiglu:
        return _gpt_oss_experts_to_hf(state, cfg)
    out, f = {}, cfg.moe_ffn
    _, prefix, (gate, up, down_name) = _moe_names(cfg)
    for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):
        gate_up = state[f"layers.{i}.mlp.experts.gate_up.weight"]  # (E, 2f, h)
        down = state[f"layers.{i}.mlp.experts.down.weight"]  # (E, h, f)
        for j in range(cfg.num_experts):
            h = f"model.layers.{i}.{prefix}.{j}."
            out[h + f"{gate}.weight"] = gate_up[j, :f]
            out[h + f"{up}.weight"] = gate_up[j, f:]
            out[h + f"{down_name}.weight"] = down[j]
    return out


def _experts_from_hf(hf_state: dict, cfg: ModelConfig, get, fused: bool) -> dict:
    """The hub's per-expert tensors, or recent transformers' fused ones -> stacked tensors."""
    out = {}
    _, prefix, (gate, up, down) = _moe_names(cfg)
    for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):
        m = f"layers.{i}.mlp.experts."
        if fused:
            out[m + "gate_up.weight"] = get(f"model.layers.{i}.mlp.experts.gate_up_proj")
            out[m + "down.weight"] = get(f"model.layers.{i}.mlp.experts.down_proj")
            continue
        h = f"model.layers.{i}.{prefix}."
        out[m + "gate_up.weight"] = torch.stack(
            [torch.cat([get(f"{h}{j}.{gate}.weight"), get(f"{h}{j}.{up}.weight")])
             for j in range(cfg.num_experts)]
        )  # fmt: skip
        out[m + "down.weight"] = torch.stack(
            [get(f"{h}{j}.{down}.weight") for j in range(cfg.num_experts)]
        )
    return out


def _gpt_oss_experts_to_hf(state: dict, cfg: ModelConfig) -> dict:
    """megalite's (E, 2f, h) gate rows then up rows -> gpt-oss's (E, h, 2f) interleaved."""
    out, f = {}, cfg.moe_ffn
    for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):
        m, h = f"layers.{i}.mlp.experts.", f"model.layers.{i}.mlp.experts."
        w, b = state[m + "gate_up.weight"], state[m + "gate_up.bias"]
        pairs = torch.stack([w[:, :f], w[:, f:]], 2).flatten(1, 2)  # (E, 2f, h): g0 u0 g1 u1 ...
        out[h + "gate_up_proj"] = pairs.transpose(1, 2).contiguous()
        out[h + "gate_up_proj_bias"] = torch.stack([b[:, :f], b[:, f:]], 2).flatten(1, 2)
        out[h + "down_proj"] = state[m + "down.weight"].transpose(1, 2).contiguous()
        out[h + "down_proj_bias"] = state[m + "down.bias"]
    return out


def _gpt_oss_experts_from_hf(cfg: ModelConfig, get) -> dict:
    """gpt-oss's interleaved (in, out) expert tensors -> megalite's stacked (out, in) ones."""
    out = {}
    for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):
        m, h = f"layers.{i}.mlp.experts.", f"model.layers.{i}.mlp.experts."
        w, b = get(h + "gate_up_proj"), get(h + "gate_up_proj_bias")  # (E, h, 2f), (E, 2f)
        out[m + "gate_up.weight"] = torch.cat([w[..., ::2], w[..., 1::2]], -1).transpose(1, 2)
        out[m + "gate_up.bias"] = torch.cat([b[:, ::2], b[:, 1::2]], -1)
        out[m + "down.weight"] = get(h + "down_proj").transpose(1, 2).contiguous()
        out[m + "down.bias"] = get(h + "down_proj_bias")
        out[m + "gate_up.weight"] = out[m + "gate_up.weight"].contiguous()
    return out


def export_tokenizer(path, dst: Path) -> dict:
    """Write the tokenizer file `path` (a checkpoint's tokenizer.model or tokenizer.json) into
    the transformers model directory `dst`, with a tokenizer_config.json that makes
    AutoTokenizer encode as megalite does; returns {"bos_token_id", "eos_token_id"} for
    config.json (None where the tokenizer has no such token)."""
    tok = load_tokenizer(path)
    shutil.copyfile(path, dst / tok.file_name)
    # megalite adds no BOS/EOS when encoding text, so neither may the exported tokenizer.
    conf = {"add_bos_token": False, "add_eos_token": False}
    if tok.kind == SENTENCEPIECE:
        # The sentencepiece model loads as a (slow) LlamaTokenizer with no dummy prefix.
        conf.update(tokenizer_class="LlamaTokenizer", add_prefix_space=False, legacy=True)
    else:
        # tokenizer.json as it is; a special token's text inside a document is text to
        # megalite (split_special_tokens), and decoding keeps spaces as they were.
        conf.update(tokenizer_class="PreTrainedTokenizerFast", split_special_tokens=True,
                    clean_up_tokenization_spaces=False, **tok.special_tokens)  # fmt: skip
    (dst / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    return {k: (v if v >= 0 else None) for k, v in ids.items()}


# what a Hugging Face config.json says beyond the model, kept in a checkpoint's index
# ("huggingface", with the source's generation_config.json) for an export back
HUB_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def hub_fields(ckpt) -> dict:
    """A checkpoint's record of the Hugging Face model it came from (token ids, generation
    config), else the token ids of the tokenizer it carries (nothing without one)."""
    hub = dict(ckpt.index.get("huggingface") or {})
    name = fmt.stored_tokenizer(ckpt.files)
    if name and not any(k in hub for k in HUB_FIELDS):
        tok = load_tokenizer(ckpt.dir / name)
        hub.update({k: v for k, v in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id))
                    if v is not None and v >= 0})  # fmt: skip
    return hub
