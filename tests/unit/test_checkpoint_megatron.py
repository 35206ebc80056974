"""Megatron-LM checkpoints <-> megalite, against megatron-core itself, in one process.

A real megatron-core GPTModel (tp=1, local layer specs through `get_gpt_decoder_block_spec(...,
use_transformer_engine=False)`, on CPU: `torch.cuda.current_device` patched to "cpu", a one-rank
gloo group for parallel_state) in three configurations: GPT-2 style (LayerNorm, GELU, learned
positions, biases, tied), Llama style (GQA, SwiGLU, RoPE, untied) and Llama-style MoE (4 experts,
top-2, a shared expert, experts in every other layer). Each is saved by Megatron's own code in
the legacy layout and as torch_dist, converted to megalite (logits within 1e-5 of Megatron's,
fp32), and converted back in both formats, which Megatron loads (`load_state_dict(strict=True)`,
and `dist_checkpointing.load` into its sharded state dict) with the same logits. The tp/pp/vpp/ep
split and merge are checked against Megatron's rules by slicing global tensors in one process;
the multi-rank oracle is tests/distributed/test_megatron_checkpoints.py.
"""

import argparse
import contextlib
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.checkpoint import format as fmt
from megalite.checkpoint import megatron as mg
from megalite.checkpoint import megatron_args, megatron_files, megatron_layout, megatron_pickle
from megalite.checkpoint.checkpointer import load_model
from megalite.checkpoint.megatron_direct import open_checkpoint
from megalite.config_read import from_dict
from megalite.errors import MegaliteError
from megalite.model.env import LOCAL
from megalite.model.gpt import GPTChunk
from megalite.testing import perturbed

pytest.importorskip("megatron.core")
ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 100, 16

_spec = importlib.util.spec_from_file_location(
    "convert_checkpoint", ROOT / "tools/convert_checkpoint.py"
)
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """megatron-core set up for one CPU process; undone afterwards."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    mp.setattr(torch.cuda, "synchronize", lambda *a: None)  # its checkpoint writer waits on CUDA
    # dropout's RNG fork wants CUDA generators; the models here run without dropout
    mp.setattr(mrandom.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    # its checkpoint writer measures memory with psutil, which is not a dependency here
    mp.setattr(filesystem_async, "_process_memory", lambda: 0)
    # without TransformerEngine, megatron-core 0.16's router names a gemm it never defined
    from megatron.core.transformer.moe import moe_utils

    mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    mp.undo()


KINDS = {
    "gpt2": {"normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True,
             "position_embedding_type": "learned_absolute", "num_query_groups": 4,
             "ffn_hidden_size": 128, "untie_embeddings_and_output_weights": False},
    "moe": {"normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
            "position_embedding_type": "rope", "num_query_groups": 2, "ffn_hidden_size": 96,
            "untie_embeddings_and_output_weights": True, "num_experts": 4, "moe_router_topk": 2,
            "moe_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 48,
            "moe_layer_freq": 2},
    "llama": {"normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
              "position_embedding_type": "rope", "num_query_groups": 2, "ffn_hidden_size": 96,
              "untie_embeddings_and_output_weights": True, "rotary_base": 500000},
}  # fmt: skip


def margs(kind: str, **over) -> argparse.Namespace:
    """The args a Megatron run of this model would save."""
    a = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "kv_channels": 16,
         "group_query_attention": True, "seq_length": SEQ, "max_position_embeddings": SEQ,
         "vocab_size": VOCAB, "padded_vocab_size": 128, "make_vocab_size_divisible_by": 128,
         "layernorm_epsilon": 1e-5, "rotary_base": 10000, "rotary_percent": 1.0,
         "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "bias_gelu_fusion": True,
         **KINDS[kind], **over}  # fmt: skip
    return argparse.Namespace(**a)


def megatron_model(args: argparse.Namespace, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size, normalization=args.normalization,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear, bias_activation_fusion=not args.swiglu,
        layernorm_epsilon=args.layernorm_epsilon, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, num_moe_experts=getattr(args, "num_experts", None),
        moe_router_topk=getattr(args, "moe_router_topk", 2),
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
        moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None),
        moe_token_dispatcher_type="allgather", moe_layer_freq=getattr(args, "moe_layer_freq", 1),
    )  # fmt: skip
    # layers with experts and dense ones (moe_layer_freq): the block spec
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                      normalization=args.normalization)  # fmt: skip
    m = GPTModel(
        cfg, spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
    )  # fmt: skip
    return perturbed(m)


def megatron_logits(m, ids):
    s = ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return m(ids, torch.arange(s).expand_as(ids), mask)[..., :VOCAB]


def save_legacy(d: Path, m, args, iteration=7, extra=None):
    path = d / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    model = {**m.state_dict(), **(extra or {})}
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "model": model, "optimizer": {"state": {}}}, path)  # fmt: skip
    (d / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def save_torch_dist(d: Path, m, args, iteration=7):
    """As Megatron's training loop saves: the model's sharded state dict and the common state."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    it = d / f"iter_{iteration:07d}"
    it.mkdir(parents=True)
    state = {"model": m.sharded_state_dict(), "args": args, "checkpoint_version": 3.0,
             "iteration": iteration}  # fmt: skip
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(state, str(it), sharded_strategy=strategy)
    (d / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def megalite_model(path) -> GPTChunk:
    ckpt = fmt.Checkpoint(path)
    chunk = GPTChunk(from_dict({"model": ckpt.model_config}).model)
    load_model([chunk], LOCAL, ckpt)
    return chunk.eval()


IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=list(KINDS))
def imported(request, megatron, tmp_path_factory):
    """(kind, Megatron model, its logits, the megalite checkpoint converted from legacy)."""
    d = tmp_path_factory.mktemp(request.param)
    args = margs(request.param)
    m = megatron_model(args)
    save_legacy(d / "mt", m, args)
    convert.main([str(d / "mt"), str(d / "ml"), "--to", "megalite"])
    return request.param, m, megatron_logits(m, IDS), d / "ml"


def test_legacy_import_gives_megatrons_logits(imported):
    kind, _, theirs, ml = imported
    chunk = megalite_model(ml)
    assert chunk.cfg.flavour == {"moe": "llama"}.get(kind, kind)
    with torch.no_grad():
        ours = chunk(IDS)
    assert ours.shape == theirs.shape == (2, SEQ, VOCAB)
    assert (ours - theirs).abs().max() <= 1e-5
    ck = fmt.Checkpoint(ml)
    assert ck.index["optimizer"] is None and ck.shape("embedding.word.weight")[0] == VOCAB


def test_torch_dist_import_gives_megatrons_logits(imported, tmp_path):
    kind, m, theirs, _ = imported
    save_torch_dist(tmp_path / "mt", m, margs(kind))
    convert.main([str(tmp_path / "mt"), str(tmp_path / "ml"), "--to", "megalite"])
    with torch.no_grad():
        ours = megalite_model(tmp_path / "ml")(IDS)
    assert (ours - theirs).abs().max() <= 1e-5


@pytest.mark.parametrize("form", ["legacy", "torch_dist"])
def test_export_loads_into_megatron_with_the_same_logits(imported, form, tmp_path):
    kind, m, theirs, ml = imported
    convert.main([str(ml), str(tmp_path / "out"), "--to", "megatron", "--format", form])
    fresh = megatron_model(margs(kind), seed=1)
    assert (megatron_logits(fresh, IDS) - theirs).abs().max() > 1e-2  # it did change
    if form == "legacy":
        obj = megatron_pickle.load_pickle(
            tmp_path / "out/iter_0000000/mp_rank_00/model_optim_rng.pt"
        )
        assert obj["checkpoint_version"] == 3.0 and obj["args"].padded_vocab_size == 128
        fresh.load_state_dict(obj["model"], strict=True)
    else:
        from megatron.core import dist_checkpointing

        sd = fresh.sharded_state_dict()
        loaded = dist_checkpointing.load(sd, str(tmp_path / "out/iter_0000000"))
        fresh.load_state_dict(loaded, strict=False)
    assert (megatron_logits(fresh, IDS) - theirs).abs().max() <= 1e-5


def test_layernorm_1p_checkpoints_import_and_export(imported, tmp_path):
    """--apply-layernorm-1p (megatron-core's layernorm_zero_centered_gamma) stores each norm
    weight as its offset from 1: FusedLayerNorm and TransformerEngine's norms compute with
    weight + 1 (neither runs on this CPU, so the model's own norm weights are saved minus 1 under
    args that say apply_layernorm_1p). Converted and read by --load, megalite gives the model's
    logits; exported with --apply-layernorm-1p, the files hold the offsets and their args say so."""
    kind, m, theirs, _ = imported
    offsets = {k: v - 1 for k, v in m.state_dict().items() if k.endswith("layernorm.weight")}
    assert len(offsets) == 2 * 4 + 1  # input and pre-MLP norm of every layer, the final norm
    save_legacy(tmp_path / "mt", m, margs(kind, apply_layernorm_1p=True), extra=offsets)
    convert.main([str(tmp_path / "mt"), str(tmp_path / "ml"), "--to", "megalite"])
    with torch.no_grad():
        ours = megalite_model(tmp_path / "ml")(IDS)
    assert (ours - theirs).abs().max() <= 1e-5
    direct, converted = open_checkpoint(tmp_path / "mt"), fmt.Checkpoint(tmp_path / "ml")
    for name in ("layers.0.input_norm.weight", "final_norm.weight"):
        assert torch.equal(direct.read(name), converted.read(name))
    convert.main([str(tmp_path / "ml"), str(tmp_path / "out"), "--to", "megatron", "--format",
                  "legacy", "--apply-layernorm-1p"])  # fmt: skip
    obj = megatron_pickle.load_pickle(tmp_path / "out/iter_0000000/mp_rank_00/model_optim_rng.pt")
    assert obj["args"].apply_layernorm_1p and obj["args"].layernorm_zero_centered_gamma
    for k, v in offsets.items():
        assert torch.allclose(obj["model"][k], v, atol=1e-6), k


def test_llama3_rope_scaling_round_trips_with_megatrons_logits(megatron, tmp_path):
    """Llama 3.x's RoPE scaling (--use-rope-scaling --rope-scaling-factor 32, megatron-core's
    fixed low/high factors and context 8192): imported, megalite gives megatron-core's logits;
    exported in either format, the args carry it and megatron-core loads the same logits."""
    args = margs("llama", use_rope_scaling=True, rope_scaling_factor=32.0)
    m = megatron_model(args)
    theirs = megatron_logits(m, IDS)
    unscaled = megatron_logits(megatron_model(margs("llama")), IDS)  # the same weights
    assert (theirs - unscaled).abs().max() > 1e-4  # the scaling changes these logits
    save_legacy(tmp_path / "mt", m, args)
    convert.main([str(tmp_path / "mt"), str(tmp_path / "ml"), "--to", "megalite"])
    model = fmt.Checkpoint(tmp_path / "ml").model_config
    assert (model["rope_scaling"], model["rope_scaling_factor"]) == ("llama3", 32.0)
    with torch.no_grad():
        assert (megalite_model(tmp_path / "ml")(IDS) - theirs).abs().max() <= 1e-5
    for form in ("legacy", "torch_dist"):
        out = tmp_path / form
        convert.main([str(tmp_path / "ml"), str(out), "--to", "megatron", "--format", form])
        common = "mp_rank_00/model_optim_rng.pt" if form == "legacy" else "common.pt"
        saved = megatron_pickle.load_pickle(out / "iter_0000000" / common)["args"]
        assert saved.use_rope_scaling and saved.rope_scaling_factor == 32.0
        fresh = megatron_model(saved, seed=1)
        if form == "legacy":
            fresh.load_state_dict(
                megatron_pickle.load_pickle(out / "iter_0000000" / common)["model"]
            )
        else:
            from megatron.core import dist_checkpointing

            loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(out / "iter_0000000"))
            fresh.load_state_dict(loaded, strict=False)
        assert (megatron_logits(fresh, IDS) - theirs).abs().max() <= 1e-5, form


def test_rope_scaling_megatron_cannot_express_is_refused(megatron, tmp_path):
    """yarn, or llama3 with another original context than megatron-core's 8192: one line."""
    for change in (
        {"rope_scaling": "yarn"},
        {"rope_scaling": "llama3", "rope_original_max_position_embeddings": 4096},
    ):
        cfg = dataclasses.replace(megatron_args.config_from_args(margs("llama")), **change)
        with pytest.raises(MegaliteError, match="Megatron-LM cannot express") as e:
            megatron_args.args_from_config(cfg)
        assert "\n" not in str(e.value)


def test_torch_dist_and_resharded_legacy_read_back_identically(imported, tmp_path):
    """megalite -> torch_dist / legacy at tp=2 pp=2 vpp=2 (ep=2), and at uneven stages (1 | 2 | 1
    layers; a layout string whose last virtual stage holds the head alone) -> megalite: the
    same tensors."""
    kind, _, _, ml = imported
    want = fmt.Checkpoint(ml)
    legacy = ["--format", "legacy", "--tp", "2", "--pp", "2", "--vpp", "2"]
    legacy += ["--ep", "2"] if kind == "moe" else []
    uneven = [["--format", "legacy", "--pp", "3", "--account-for-embedding-in-pipeline-split",
               "--account-for-loss-in-pipeline-split"],
              ["--format", "legacy", "--pp", "2", "--vpp", "2", "--pp-layout", "Et|tt|t|L"]]  # fmt: skip
    for i, extra in enumerate([["--format", "torch_dist"], legacy, *uneven]):
        out, back = tmp_path / f"mt{i}", tmp_path / f"ml{i}"
        convert.main([str(ml), str(out), "--to", "megatron", *extra])
        convert.main([str(out), str(back), "--to", "megalite"])
        got = fmt.Checkpoint(back)
        assert sorted(got.names()) == sorted(want.names())
        for n in want.names():
            assert torch.equal(got.read(n), want.read(n)), n
    # each stage numbers its layers from 0: pp rank 1 of the 1 | 2 | 1 split holds layers 1, 2
    stage = torch.load(tmp_path / "mt2" / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt",
                       weights_only=False)  # fmt: skip
    assert {int(k.split(".")[2]) for k in stage["model"] if k.startswith("decoder.layers.")} == {
        0,
        1,
    }
    assert stage["args"].account_for_embedding_in_pipeline_split
    last = torch.load(tmp_path / "mt3" / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt",
                      weights_only=False)  # fmt: skip
    assert not any(k.startswith("decoder.layers.") for k in last["model1"])  # L alone
    assert last["args"].pipeline_model_parallel_layout == "Et|tt|t|L"


def test_transformer_engine_names_read_back(imported, tmp_path):
    """--transformer-impl transformer_engine writes TE's fused-norm names; they import."""
    kind, _, _, ml = imported
    out, back = tmp_path / "te", tmp_path / "back"
    convert.main([str(ml), str(out), "--to", "megatron", "--format", "legacy",
                  "--transformer-impl", "transformer_engine"])  # fmt: skip
    keys = megatron_pickle.load_pickle(out / "iter_0000000/mp_rank_00/model_optim_rng.pt")["model"]
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in keys
    assert not [k for k in keys if k.endswith("input_layernorm.weight")]
    # an MoE layer keeps its pre-MLP norm apart (TE fuses it into a dense linear_fc1 only)
    assert ("decoder.layers.0.pre_mlp_layernorm.weight" in keys) == (kind == "moe")
    convert.main([str(out), str(back), "--to", "megalite"])
    want, got = fmt.Checkpoint(ml), fmt.Checkpoint(back)
    assert all(torch.equal(got.read(n), want.read(n)) for n in want.names())


# ---- the tensor-parallel layout, by slicing global tensors as Megatron does -------------------


def test_qkv_shards_hold_their_query_groups():
    """Megatron's tp rank r holds query groups r*G/tp.. of linear_qkv, each [q | k | v]."""
    cfg = megatron_args.config_from_args(
        margs("llama", num_attention_heads=8, num_query_groups=4, kv_channels=8)
    )
    hd, h = cfg.head_dim, cfg.hidden_size
    q, k, v = torch.randn(8 * hd, h), torch.randn(4 * hd, h), torch.randn(4 * hd, h)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    shards = megatron_layout.split_tp(name, mg.merge_qkv(q, k, v, cfg), 2, gated=True)
    # rank 1: groups 2, 3 -> query heads 4..7, kv heads 2, 3
    g2 = torch.cat([q[4 * hd : 6 * hd], k[2 * hd : 3 * hd], v[2 * hd : 3 * hd]])
    assert torch.equal(shards[1][: len(g2)], g2)
    assert [tuple(s.shape) for s in shards] == [((8 + 8) * hd // 2, h)] * 2
    assert all(torch.equal(a, b) for a, b in zip(mg.split_qkv(mg.merge_qkv(q, k, v, cfg), cfg),
                                                 (q, k, v)))  # fmt: skip


def test_swiglu_fc1_shards_are_gate_then_up_per_rank():
    gate, up = torch.arange(8.0)[:, None], 100 + torch.arange(8.0)[:, None]
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    shards = megatron_layout.split_tp(name, torch.cat([gate, up]), 2, gated=True)
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    assert torch.equal(megatron_layout.merge_tp(name, shards, gated=True), torch.cat([gate, up]))
    row = "decoder.layers.0.mlp.linear_fc2.weight"
    w = torch.randn(4, 6)
    assert torch.equal(megatron_layout.split_tp(row, w, 2, gated=True)[1], w[:, 3:])


def test_megatron_tp2_shapes_match_the_split(megatron):
    """The shard shapes megatron-core builds at tp=2 (from its own partition arithmetic)."""
    from megatron.core.utils import divide

    args = margs("llama")
    cfg = megatron_args.config_from_args(args)
    state = mg.to_megatron(_random_logical(cfg), cfg, megatron_args.padded_vocab_size(cfg, 2))
    qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"]
    shard = megatron_layout.split_tp(
        "decoder.layers.0.self_attention.linear_qkv.weight", qkv, 2, True
    )
    per_rank = divide(args.num_attention_heads + 2 * args.num_query_groups, 2) * args.kv_channels
    assert shard[0].shape == (per_rank, args.hidden_size)
    assert state[mg.EMBEDDING].shape[0] == 256  # 100 padded to a multiple of 128 * tp


def test_layer_placement_follows_megatrons_virtual_stages():
    r = megatron_layout.layer_ranges(
        {"num_layers": 8, "pipeline_model_parallel_size": 2,
         "virtual_pipeline_model_parallel_size": 2}, "x"
    )  # fmt: skip
    assert r[0, 0] == range(0, 2) and r[1, 0] == range(2, 4)
    assert r[0, 1] == range(4, 6) and r[1, 1] == range(6, 8)


# (num_layers, pp, vpp, first, last, account for embedding, account for loss)
UNEVEN = [(8, 2, None, 3, None, False, False), (9, 3, None, 1, 2, False, False),
          (8, 2, 2, 2, None, False, False), (8, 4, None, 2, 0, False, False),
          (10, 4, None, None, None, True, True), (14, 4, 2, None, None, True, True),
          (7, 2, 2, None, None, True, False)]  # fmt: skip


@pytest.mark.parametrize("case", UNEVEN, ids=str)
def test_uneven_layer_placement_is_megatron_cores(case):
    """Each rank file's layers (megalite's Partition from the args' first/last and account-for
    flags) are where megatron-core's get_transformer_layer_offset and get_num_layers_to_build
    put a stage's (its local layer 0 is global layer `offset`)."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    L, pp, vpp, first, last, emb, loss = case
    config = SimpleNamespace(num_layers=L, pipeline_model_parallel_size=pp,
                             virtual_pipeline_model_parallel_size=vpp,
                             num_layers_in_first_pipeline_stage=first,
                             num_layers_in_last_pipeline_stage=last,
                             account_for_embedding_in_pipeline_split=emb,
                             account_for_loss_in_pipeline_split=loss,
                             pipeline_model_parallel_layout=None)  # fmt: skip
    args = {"num_layers": L, "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vpp,
            "decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last,
            "account_for_embedding_in_pipeline_split": emb,
            "account_for_loss_in_pipeline_split": loss}  # fmt: skip
    ours = megatron_layout.layer_ranges(args, "x")
    for (p, v), layers in ours.items():
        vs = v if vpp else None
        start = get_transformer_layer_offset(config, vs, p)
        assert layers == range(start, start + get_num_layers_to_build(config, vs, p)), (p, v)
    assert not megatron_layout.partition(args, "x").even_split


@pytest.mark.parametrize("text,pp", [("Et|tt|ttt|tL", 2), ("E|t*3|(tt|)*2,t|L", 3),
                                     ("Ett|tt|tt|mmL", 2)])  # fmt: skip
def test_layout_string_placement_is_megatron_cores(text, pp, tmp_path):
    """--pipeline-model-parallel-layout: a string, or megatron-core's PipelineParallelLayerLayout
    pickled in a checkpoint's args (read without its classes: from the stages of LayerType
    members it keeps, given as a list)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout as Layout,
    )

    theirs = Layout.from_str(text, pp)
    L, mtp = (theirs.flatten_layout.count(t) for t in (LayerType.decoder, LayerType.mtp))
    # megatron-core's stages in pipeline order: virtual stage v of pp rank p is v * pp + p
    order = [(i % pp, i // pp) for i in range(pp * theirs.virtual_pipeline_model_parallel_size)]
    counts = [theirs.layout[p][v].count(LayerType.decoder) for p, v in order]
    stages = [list(theirs.layout[p][v]) for p, v in order]
    torch.save({"layout": Layout(stages, pp)}, tmp_path / "args.pt")
    pickled = megatron_pickle.load_pickle(tmp_path / "args.pt")["layout"]
    assert isinstance(pickled, megatron_pickle.Opaque)  # (no megatron class was built)
    for layout in (text, pickled):
        args = {"num_layers": L, "pipeline_model_parallel_size": pp, "mtp_num_layers": mtp,
                "pipeline_model_parallel_layout": layout}  # fmt: skip
        ours = megatron_layout.layer_ranges(args, "x")
        for (p, v), layers in ours.items():
            i = order.index((p, v))
            assert layers == range(sum(counts[:i]), sum(counts[: i + 1])), (text, p, v)


def _random_logical(cfg):
    chunk = GPTChunk(cfg)
    return {n: p.detach().clone() for n, p in chunk.state_dict().items()}


# ---- bad input: one line, nothing written ----------------------------------------------------


def test_unsupported_args_are_refused(tmp_path):
    with pytest.raises(MegaliteError, match="rotary_percent"):
        megatron_args.config_from_args(margs("llama", rotary_percent=0.5))
    with pytest.raises(MegaliteError, match="exact"):
        megatron_args.config_from_args(margs("gpt2", bias_gelu_fusion=False))
    with pytest.raises(MegaliteError, match="token dropping"):
        megatron_args.config_from_args(margs("moe", moe_expert_capacity_factor=1.0))
    with pytest.raises(MegaliteError, match="position_embedding_type='alibi'"):
        megatron_args.config_from_args(margs("llama", position_embedding_type="alibi"))
    with pytest.raises(MegaliteError, match="kv_channels"):
        megatron_args.config_from_args(margs("gpt2", kv_channels=8))
    # a GPT-2 layout without biases (openai_gelu: tanh) is not nanogpt: Megatron's LayerNorms
    # keep their bias; and nanogpt's bias-free LayerNorms cannot be written as Megatron's
    # (matched as the same Megatron flags on a command line are: megatron_translate's one table)
    with pytest.raises(MegaliteError, match="args describe a model no megalite flavour is: "
                       "nearest is --flavour nanogpt, which differs in mlp"):  # fmt: skip
        megatron_args.config_from_args(margs("gpt2", add_bias_linear=False, openai_gelu=True))
    nano = from_dict({"model": {"flavour": "nanogpt", "vocab_size": VOCAB}}).model
    with pytest.raises(MegaliteError, match="LayerNorms without a bias"):
        megatron_args.args_from_config(nano)


class _BadArgs:
    """Unpickles as argparse.Namespace(1, 2): a TypeError inside the allow-listed unpickler."""

    def __reduce__(self):
        return argparse.Namespace, (1, 2)


def test_args_contradicting_tensors_and_missing_ranks(imported, tmp_path):
    kind, m, _, _ = imported
    save_legacy(tmp_path / "bad", m, margs(kind, hidden_size=32, kv_channels=8))
    with pytest.raises(
        MegaliteError, match=r"args \(hidden_size=32\) imply .* args contradict the tensors"
    ):
        convert.main([str(tmp_path / "bad"), str(tmp_path / "o1"), "--to", "megalite"])
    extra = {"decoder.layers.0.self_attention.q_layernorm.weight": torch.ones(16)}  # qk-norm
    save_legacy(tmp_path / "qk", m, margs(kind), extra=extra)
    with pytest.raises(MegaliteError, match="q_layernorm.weight, which its args do not explain"):
        convert.main([str(tmp_path / "qk"), str(tmp_path / "o3"), "--to", "megalite"])
    save_legacy(tmp_path / "pp", m, margs(kind, pipeline_model_parallel_size=2))
    with pytest.raises(MegaliteError, match="lacks mp_rank_00_000"):
        convert.main([str(tmp_path / "pp"), str(tmp_path / "o2"), "--to", "megalite"])
    (tmp_path / "odd" / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "odd" / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save(
        {"args": _BadArgs()},
        tmp_path / "odd" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt",
    )
    with pytest.raises(MegaliteError, match="is not a readable Megatron checkpoint file"):
        convert.main([str(tmp_path / "odd"), str(tmp_path / "o4"), "--to", "megalite"])
    assert not [p for p in ("o1", "o2", "o3", "o4") if (tmp_path / p).exists()]
    assert not list(tmp_path.glob(".o*"))


def test_pickles_load_without_their_classes(tmp_path):
    """TE's extra states (BytesIO, an empty one pickled through builtins.bytes) and classes
    torch does not allow (an enum in the args) load under weights_only. (megatron-core, imported
    here, allow-lists its own classes; tests/e2e/test_megatron_workflows.py loads without it.)"""
    import io

    from megatron.core.transformer.enums import AttnBackend

    obj = {"args": argparse.Namespace(attention_backend=AttnBackend.auto, num_layers=2),
           "model": {"a._extra_state": io.BytesIO(), "b._extra_state": io.BytesIO(b"x"),
                     "w": torch.ones(2)}}  # fmt: skip
    torch.save(obj, tmp_path / "f.pt")
    got = megatron_pickle.load_pickle(tmp_path / "f.pt")
    assert got["args"].num_layers == 2 and torch.equal(got["model"]["w"], torch.ones(2))
    assert set(got["model"]) == {"a._extra_state", "b._extra_state", "w"}


@pytest.mark.parametrize("imported", ["moe"], indirect=True)
@pytest.mark.parametrize("grouped", ["GroupedMLP", "TEGroupedMLP"])
def test_grouped_expert_forms_import_alike(imported, grouped, tmp_path):
    """Experts stored as megatron-core's GroupedMLP (weight1 (h, E*fc1), weight2 (E*ffn, h),
    viewed per expert as (E, h, fc1) and (E, ffn, h)) or TEGroupedMLP (linear_fc1.weight{j})."""
    _, _, _, ml = imported
    out = tmp_path / "mt"
    convert.main([str(ml), str(out), "--to", "megatron", "--format", "legacy"])
    path = out / "iter_0000000/mp_rank_00/model_optim_rng.pt"
    obj = megatron_pickle.load_pickle(path)
    model, experts = {}, {}
    for k, v in obj["model"].items():
        m = megatron_files.EXPERT.match(k)
        if m is None:
            model[k] = v
        elif not k.endswith("_extra_state"):
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = v
    for base, by_name in experts.items():
        fc1, fc2 = by_name["linear_fc1.weight"], by_name["linear_fc2.weight"]
        n = len(fc1)
        if grouped == "GroupedMLP":
            h = fc1[0].shape[1]
            model[base + "weight1"] = torch.stack([fc1[j].t() for j in range(n)]).reshape(h, -1)
            model[base + "weight2"] = torch.stack([fc2[j].t() for j in range(n)]).reshape(-1, h)
        else:
            for j in range(n):
                model[f"{base}linear_fc1.weight{j}"] = fc1[j]
                model[f"{base}linear_fc2.weight{j}"] = fc2[j]
    obj["model"] = model
    torch.save(obj, path)
    convert.main([str(out), str(tmp_path / "back"), "--to", "megalite"])
    want, got = fmt.Checkpoint(ml), fmt.Checkpoint(tmp_path / "back")
    assert all(torch.equal(got.read(n), want.read(n)) for n in want.names())


@pytest.mark.parametrize("imported", ["gpt2"], indirect=True)
def test_dcp_metadata_runs_no_code(imported, tmp_path):
    """.metadata is a pickle: one that would call a function is refused with one line."""
    import pickle

    _, _, _, ml = imported
    out = tmp_path / "mt"
    convert.main([str(ml), str(out), "--to", "megatron"])

    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    (out / "iter_0000000/.metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(MegaliteError, match="pathlib.Path.touch is not allowed in DCP metadata"):
        convert.main([str(out), str(tmp_path / "o"), "--to", "megalite"])
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "o").exists()


def test_keep_position_continues_megatrons_job(megatron, tmp_path):
    # the default import starts at iteration 0; --keep-position keeps Megatron's step and data
    # position (a fresh optimizer either way), and refuses args that do not say the position
    m = megatron_model(margs("gpt2"))
    save_legacy(tmp_path / "mt", m, margs("gpt2", consumed_train_samples=56), iteration=7)
    convert.main([str(tmp_path / "mt"), str(tmp_path / "a"), "--to", "megalite"])
    convert.main([str(tmp_path / "mt"), str(tmp_path / "b"), "--to", "megalite", "--keep-position"])
    a, b = fmt.Checkpoint(tmp_path / "a"), fmt.Checkpoint(tmp_path / "b")
    assert (a.iteration, a.index["consumed_samples"]) == (0, 0)
    assert (b.iteration, b.index["consumed_samples"]) == (7, 56) and b.index["optimizer"] is None
    assert b.index["schedule_samples"] is None  # no scheduler saved: the run counts its own
    # the LR scheduler's position (its num_steps: one step skipped, 48 of the 56 samples) is kept
    # by --keep-position and read by --load MEGATRON_DIR alike
    f = tmp_path / "mt/iter_0000007/mp_rank_00/model_optim_rng.pt"
    obj = torch.load(f, weights_only=False)
    obj["opt_param_scheduler"] = {"num_steps": 48, "max_lr": 3e-4, "min_lr": 0.0}
    torch.save(obj, f)
    convert.main([str(tmp_path / "mt"), str(tmp_path / "d"), "--to", "megalite", "--keep-position"])
    assert fmt.Checkpoint(tmp_path / "d").index["schedule_samples"] == 48
    assert open_checkpoint(tmp_path / "mt").index["schedule_samples"] == 48
    save_legacy(tmp_path / "mt2", m, margs("gpt2"), iteration=7)
    with pytest.raises(MegaliteError, match="consumed_train_samples"):
        convert.main([str(tmp_path / "mt2"), str(tmp_path / "c"), "--to", "megalite",
                      "--keep-position"])  # fmt: skip
    assert not (tmp_path / "c").exists()


def test_ckpt_format_refuses_what_megatron_cannot_hold_in_one_line():
    """--ckpt-format torch_dist|torch checks at startup that every save can be Megatron's."""
    from megalite.checkpoint.megatron_direct import check_exportable

    model = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": VOCAB}
    moe = from_dict({"model": {**model, "flavour": "llama", "num_experts": 4},
                     "parallel": {"tp": 2, "etp": 1}, "checkpoint": {"ckpt_format": "torch"}})  # fmt: skip
    with pytest.raises(MegaliteError, match="--expert-tensor-parallel-size") as e:
        check_exportable(moe.model, moe)
    assert "\n" not in str(e.value)
    moe.checkpoint.ckpt_format = "torch_dist"  # layout-free: the experts are whole there
    check_exportable(moe.model, moe)
    nano = from_dict({"model": {**model, "flavour": "nanogpt"},
                      "checkpoint": {"ckpt_format": "torch_dist"}})  # fmt: skip
    with pytest.raises(MegaliteError, match="cannot be exported"):
        check_exportable(nano.model, nano)


def test_a_rope_models_context_is_not_the_runs_sequence_length():
    """A RoPE model declaring 2*SEQ positions, trained at SEQ/2: Megatron's args carry its
    max_position_embeddings (not the run's seq_length) and an import reads it back."""
    cfg = dataclasses.replace(megatron_args.config_from_args(margs("llama")),
                              seq_length=SEQ // 2, max_position_embeddings=2 * SEQ)  # fmt: skip
    args = megatron_args.args_from_config(cfg)
    assert (args["max_position_embeddings"], args["seq_length"]) == (2 * SEQ, SEQ // 2)
    back = megatron_args.config_from_args(args)
    assert (back.max_position_embeddings, back.seq_length) == (2 * SEQ, SEQ // 2)
    # a run longer than the declared context: Megatron's args need max >= seq
    cfg = dataclasses.replace(cfg, seq_length=4 * SEQ)
    assert megatron_args.args_from_config(cfg)["max_position_embeddings"] == 4 * SEQ
