"""DeepseekV3ForCausalLM <-> megalite (`features.latent_attention`): weight names and config.json.

Names per layer i (model.layers.{i}.): input_layernorm, post_attention_layernorm, and MLA's
self_attn.q_a_proj, q_a_layernorm, q_b_proj (or q_proj without q_lora_rank),
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; a dense layer's mlp.gate_proj, up_proj,
down_proj. Layers from `first_k_dense_replace` on are MoE layers: router mlp.gate, shared
experts mlp.shared_experts.{gate,up,down}_proj, the experts per expert on the hub
(mlp.experts.{j}.gate_proj, ...; written so) or fused as transformers holds them in memory
(mlp.experts.gate_up_proj, down_proj; read too); the MoE fields of config.json are
checkpoint/hf_moe.py's. The router's e_score_correction_bias is megalite's expert bias
(mlp.expert_bias, fp32), read and written; zeros where one side has none.

RoPE: with `rope_interleave` (DeepSeek's default) the rotary dims of q and of the shared key are
stored as pairs (x0, x1), (x2, x3), ...; megalite rotates halves (x0..x_{d/2-1} with the rest),
so on import those rows of q_b_proj (q_proj) and kv_a_proj_with_mqa are reordered evens first
then odds, and back on export. Scores are unchanged: q and k are reordered alike.

Multi-token prediction: checkpoints on the hub store DeepSeek-V3's MTP modules as extra layers
model.layers.{num_hidden_layers + k}.* (`num_nextn_predict_layers` of them): enorm, hnorm,
eh_proj, shared_head.norm, the layer's own tensors, and copies of the shared embed_tokens and
shared_head.head. transformers' model has no MTP (it loads such a checkpoint without them, as
unexpected keys), yet its config says num_nextn_predict_layers=1 by default with no weights
behind it; so an imported config has no MTP (--mtp-num-layers 0: those layers are not read).
`from_hf` with a config whose mtp_num_layers is set reads them into `mtp.{k}.*`; export writes
a model's MTP modules in the hub's layout (the copies too) and num_nextn_predict_layers.
"""

import torch

from megalite.checkpoint.hf_moe import deepseek_v3_moe_config, deepseek_v3_moe_fields, moe_export
from megalite.config import ModelConfig
from megalite.errors import MegaliteError

ARCH = "DeepseekV3ForCausalLM"


def _attention_names(cfg: ModelConfig):
    """(megalite suffix, hf suffix, rope rows: (per-row-group size, offset) or None)."""
    dn, dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        yield "q_a.weight", "q_a_proj.weight", None
        yield "q_a_norm.weight", "q_a_layernorm.weight", None
        yield "q_b.weight", "q_b_proj.weight", (dn + dr, dn)  # each head's last dr rows
    else:
        yield "q.weight", "q_proj.weight", (dn + dr, dn)
    yield "kv_a.weight", "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + dr, cfg.kv_lora_rank)
    yield "kv_a_norm.weight", "kv_a_layernorm.weight", None
    yield "kv_b.weight", "kv_b_proj.weight", None
    yield "out.weight", "o_proj.weight", None


def _layer_names(cfg: ModelConfig, i: int, m: str, h: str):
    """Layer i's tensors (an MTP module's layer: i = num_layers + k), its experts aside."""
    yield m + "input_norm.weight", h + "input_layernorm.weight", None
    yield m + "post_attention_norm.weight", h + "post_attention_layernorm.weight", None
    for a, b, rope in _attention_names(cfg):
        yield m + "attention." + a, h + "self_attn." + b, rope
    if cfg.is_moe_layer(i):  # the router and the shared experts; the experts: experts_*_hf
        yield m + "mlp.router.weight", h + "mlp.gate.weight", None
        if cfg.moe_shared_expert_intermediate_size:
            for a in ("gate", "up", "down"):
                yield m + f"mlp.shared.{a}.weight", h + f"mlp.shared_experts.{a}_proj.weight", None
        return
    for a in ("gate", "up", "down"):
        yield m + f"mlp.{a}.weight", h + f"mlp.{a}_proj.weight", None


def _moe_layers(cfg: ModelConfig):
    """(megalite prefix, hf prefix) of every MoE layer, the MTP modules' included."""
    L = cfg.num_layers
    for i in range(L + cfg.mtp_num_layers):
        if cfg.is_moe_layer(i):
            m = f"layers.{i}." if i < L else f"mtp.{i - L}.layer."
            yield m + "mlp.", f"model.layers.{i}.mlp."


def experts_to_hf(state: dict, cfg: ModelConfig) -> dict:
    """Stacked experts -> the hub's per-expert tensors, and the router's correction bias."""
    out, f = {}, cfg.moe_ffn
    for m, h in _moe_layers(cfg):
        gate_up, down = state[m + "experts.gate_up.weight"], state[m + "experts.down.weight"]
        for j in range(cfg.num_experts):
            out[h + f"experts.{j}.gate_proj.weight"] = gate_up[j, :f]
            out[h + f"experts.{j}.up_proj.weight"] = gate_up[j, f:]
            out[h + f"experts.{j}.down_proj.weight"] = down[j]
        bias = state.get(m + "expert_bias")
        zeros = torch.zeros(cfg.num_experts, dtype=torch.float32)
        out[h + "gate.e_score_correction_bias"] = zeros if bias is None else bias.float().clone()
    return out


def experts_from_hf(hf_state: dict, cfg: ModelConfig, get) -> dict:
    """The hub's per-expert tensors, or transformers' fused ones -> stacked experts, and the
    router's correction bias."""
    out = {}
    for m, h in _moe_layers(cfg):
        if cfg.moe_router_enable_expert_bias:  # the choice of experts depends on it
            bias = hf_state.get(h + "gate.e_score_correction_bias")
            zeros = torch.zeros(cfg.num_experts, dtype=torch.float32)
            out[m + "expert_bias"] = zeros if bias is None else bias.float().clone()
        if h + "experts.gate_up_proj" in hf_state:  # transformers' in-memory layout
            out[m + "experts.gate_up.weight"] = get(h + "experts.gate_up_proj")
            out[m + "experts.down.weight"] = get(h + "experts.down_proj")
            continue
        e = range(cfg.num_experts)
        out[m + "experts.gate_up.weight"] = torch.stack(
            [torch.cat([get(f"{h}experts.{j}.gate_proj.weight"),
                        get(f"{h}experts.{j}.up_proj.weight")]) for j in e]
        )  # fmt: skip
        out[m + "experts.down.weight"] = torch.stack([get(f"{h}experts.{j}.down_proj.weight")
                                                      for j in e])  # fmt: skip
    return out


def names(cfg: ModelConfig):
    """(megalite name, hf name, rope rows) for every tensor (the embedding and head included)."""
    yield "embedding.word.weight", "model.embed_tokens.weight", None
    for i in range(cfg.num_layers):
        yield from _layer_names(cfg, i, f"layers.{i}.", f"model.layers.{i}.")
    yield "final_norm.weight", "model.norm.weight", None
    if not cfg.tied:
        yield "output.weight", "lm_head.weight", None
    for k in range(cfg.mtp_num_layers):  # the hub's MTP layers follow the model's
        m, h = f"mtp.{k}.", f"model.layers.{cfg.num_layers + k}."
        for a in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            yield m + a, h + a, None
        yield m + "final_norm.weight", h + "shared_head.norm.weight", None
        yield from _layer_names(cfg, cfg.num_layers + k, m + "layer.", h)


def mtp_copies(cfg: ModelConfig, out: dict) -> dict:
    """The hub's MTP layers also store the shared embedding and head: copies, written on export
    (and not read on import)."""
    head = out.get("lm_head.weight", out["model.embed_tokens.weight"])
    copies = {}
    for k in range(cfg.mtp_num_layers):
        h = f"model.layers.{cfg.num_layers + k}."
        copies[h + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
        copies[h + "shared_head.head.weight"] = head
    return copies


def reorder_rope(w: torch.Tensor, rows, to_halves: bool) -> torch.Tensor:
    """Rows of w grouped by `rows` = (group size, offset): each group's rows from the offset
    on (the rotary dims) from pairs to halves (`to_halves`) or back."""
    size, offset = rows
    g = w.reshape(-1, size, *w.shape[1:])
    rope = g[:, offset:]
    d = rope.shape[1]
    if to_halves:
        rope = torch.cat([rope[:, 0::2], rope[:, 1::2]], 1)
    else:
        rope = torch.stack([rope[:, : d // 2], rope[:, d // 2 :]], 2).reshape(rope.shape)
    return torch.cat([g[:, :offset], rope], 1).reshape(w.shape)


# ---- config.json ----------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, common: dict) -> dict:
    """config.json of DeepseekV3ForCausalLM; `common` holds the Llama-layout fields."""
    moe_export(cfg)  # an MoE model DeepSeek-V3 cannot express is refused here
    if cfg.sliding_window is not None:
        raise MegaliteError(f"{ARCH} has no sliding window; this model cannot be exported")
    out = {k: v for k, v in common.items() if k not in ("head_dim", "mlp_bias")}
    out.update({
        "architectures": [ARCH], "model_type": "deepseek_v3", "num_key_value_heads":
        cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "first_k_dense_replace": cfg.num_layers,
        "rope_interleave": True, "num_nextn_predict_layers": cfg.mtp_num_layers,
    })  # fmt: skip
    if cfg.num_experts:
        out.update(deepseek_v3_moe_config(cfg))
    return out


def model_fields(hf: dict) -> dict:
    """ModelConfig fields of a DeepseekV3 config.json beyond the Llama-layout ones; what megalite
    cannot honour is refused in one line."""
    n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    first_dense = hf.get("first_k_dense_replace", 3)
    moe = first_dense is not None and first_dense < n  # layers from first_dense on: experts
    if hf.get("num_key_value_heads") not in (None, heads):
        raise MegaliteError(
            f"{ARCH} with num_key_value_heads={hf['num_key_value_heads']} != "
            f"num_attention_heads={heads} is not supported (latent attention has one per head)"
        )
    if hf.get("attention_bias"):
        raise MegaliteError(f"{ARCH} with attention_bias=True is not supported")
    if not hf.get("rope_interleave", True):
        raise MegaliteError(f"{ARCH} with rope_interleave=False is not supported (pairs only)")
    return {
        "q_lora_rank": hf.get("q_lora_rank", 1536),
        "kv_lora_rank": hf.get("kv_lora_rank", 512),
        "qk_nope_head_dim": hf.get("qk_nope_head_dim", 128),
        "qk_rope_head_dim": hf.get("qk_rope_head_dim", 64),
        "v_head_dim": hf.get("v_head_dim") or 128,
        **(deepseek_v3_moe_fields(hf) if moe else {}),
    }
