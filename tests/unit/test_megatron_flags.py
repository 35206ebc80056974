"""megatron_flags / megatron_translate: Megatron-LM's flags turned into megalite's, one at a time
(the whole example scripts are tests/e2e/test_megatron_examples.py); training/torch_profile.py."""

import pytest

from megalite.config_read import parse_args
from megalite.errors import MegaliteError

LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--disable-bias-linear"]  # fmt: skip


def test_architecture_flags_pick_the_flavour_with_those_features():
    assert parse_args([]).model.flavour == "gpt2"  # no architecture flag: megalite's default
    assert parse_args(LLAMA).model.flavour == "llama"
    assert parse_args([*LLAMA, "--add-qkv-bias"]).model.flavour == "qwen2"
    assert parse_args([*LLAMA, "--qk-layernorm"]).model.flavour == "qwen3"
    mla = parse_args([*LLAMA, "--qk-layernorm", "--multi-latent-attention", "--kv-channels", "128",
                      "--rotary-scaling-factor", "40", "--mscale", "0.7"])  # fmt: skip
    m = mla.model
    assert m.flavour == "deepseek_v3" and m.kv_channels is None  # Megatron's MLA ignores it
    assert (m.rope_scaling, m.rope_scaling_factor, m.yarn_mscale) == ("yarn", 40.0, 0.7)
    assert m.rope_original_max_position_embeddings == 4096
    with pytest.raises(MegaliteError, match="nearest is --flavour llama, which differs in norm"):
        parse_args(["--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear"])
    with pytest.raises(MegaliteError, match="describe --flavour llama, not the --flavour given"):
        parse_args([*LLAMA, "--flavour", "gpt2"])


def test_megatron_defaults_where_the_flavour_would_differ():
    """Tied embeddings unless untied; SwiGLU's width 8h/3 rounded down to 64, as Megatron."""
    m = parse_args([*LLAMA, "--hidden-size", "4096"]).model
    assert m.tied and m.ffn == 10880  # megalite's llama default rounds up: 10944
    m = parse_args(
        [*LLAMA, "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96"]
    ).model
    assert not m.tied and m.ffn == 96


@pytest.mark.parametrize("argv, field, value", [
    (["--use-distributed-optimizer"], "optimizer.zero_stage", 1),
    (["--use-megatron-fsdp"], "optimizer.zero_stage", 3),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads",
      "--use-distributed-optimizer"], "optimizer.zero_stage", 2),
    (["--moe-layer-freq", "[0]*2+[1]*3"], "model.moe_dense_layers", [0, 1]),
    (["--moe-layer-freq", "[1,0]*2"], "model.moe_dense_layers", [1, 3]),
    (["--moe-layer-freq", "2"], "model.moe_layer_freq", 2),
    (["--window-size", "127,0"], "model.sliding_window", 128),
    (["--activation-func-clamp-value", "5.0"], "model.swiglu_limit", 5.0),
    (["--wandb-exp-name", "run"], "logging.wandb_run_name", "run"),
    (["--recompute-activations"], "training.recompute", "selective"),
    (["--profile-step-start=3", "--profile"], "training.profile_step_start", 3),
    (["--apply-layernorm-1p"], "checkpoint.megatron_layernorm_1p", True),
])  # fmt: skip
def test_a_flag_by_its_meaning(argv, field, value):
    sec, name = field.split(".")
    assert getattr(getattr(parse_args(argv), sec), name) == value


@pytest.mark.parametrize("argv, line", [
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5 is not supported"),
    (["--position-embedding-type", "none"], "--position-embedding-type none is not supported"),
    (["--moe-router-load-balancing-type", "seq_aux_loss"], "seq_aux_loss is not supported"),
    (["--window-size", "127,4"], "megalite's windows are causal"),
    (["--moe-layer-freq", "[0]*2+[x]"], "an integer or a list like"),
    (["--tokenizer-type", "NullTokenizer"], "supported only with --mock-data"),
    (["--enable-gpt-oss"], "not a Megatron-LM flag"),
    (["--log-params-norm"], "--log-params-norm is not supported"),
])  # fmt: skip
def test_a_refused_flag_is_one_line(argv, line):
    with pytest.raises(MegaliteError, match=line) as e:
        parse_args(argv)
    assert "\n" not in str(e.value)


def test_notes_are_printed_once_on_rank_0(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    parse_args(["--use-mcore-models", "--attention-backend", "flash", "--lr", "1e-3"])
    err = capsys.readouterr().err.splitlines()
    assert err == ["megalite: note: --use-mcore-models: megalite's own model (there is no legacy one)",
                   "megalite: note: --attention-backend: megalite's attention is torch's "
                   "scaled_dot_product_attention or its Triton kernel (--kernels)"]  # fmt: skip
    monkeypatch.setenv("RANK", "1")
    parse_args(["--use-mcore-models"])
    assert capsys.readouterr().err == ""


def test_torch_profile_traces_megatrons_steps(tmp_path):
    """--profile-step-start 1 --profile-step-end 3: the trace starts when 1 step is done and
    stops when 3 are (steps 2 and 3), written once; a rank outside --profile-ranks traces none."""
    import torch

    from megalite.training.torch_profile import TorchProfile

    cfg = parse_args(["--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                      "--profile-dir", str(tmp_path)])  # fmt: skip
    assert TorchProfile.from_config(cfg, 1, "cpu") is None
    prof = TorchProfile.from_config(cfg, 0, "cpu")
    written = []
    for done in range(5):
        prof.before_step(done)
        assert (prof.prof is not None) == (done in (1, 2))
        with torch.profiler.record_function(f"step{done + 1}"):
            torch.ones(4).sum()
        written.append(prof.after_step(done + 1))
    path = str(tmp_path / "trace-rank0.json")
    assert written == [None, None, path, None, None]
    trace = open(path).read()
    assert '"step2"' in trace and '"step3"' in trace and '"step1"' not in trace


def test_megatrons_delayed_fp8_knobs_ask_for_delayed_scaling():
    """Megatron's default FP8 recipe is delayed scaling, whose amax history its scripts set."""
    t = parse_args(["--fp8-format", "hybrid", "--fp8-amax-history-len", "16"]).training
    assert (t.fp8_recipe, t.fp8_amax_history_len) == ("delayed", 16)
    t = parse_args(["--fp8-format", "hybrid", "--fp8-amax-compute-algo", "max",
                    "--fp8-recipe", "tensorwise"]).training  # fmt: skip
    assert t.fp8_recipe == "tensorwise"
    assert parse_args(["--fp8-format", "hybrid"]).training.fp8_recipe == "tensorwise"


def test_every_parser_matches_flags_whole():
    """Every argparse parser of megalite/, tools/, bench/ and pretrain_gpt.py is built with
    allow_abbrev=False: a prefix (--swiglu of --swiglu-limit) never takes another flag's meaning."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [root / "pretrain_gpt.py"]
    for d in ("megalite", "tools", "bench", "kernels"):
        files += sorted((root / d).rglob("*.py"))
    parsers = {"ArgumentParser", "_Parser"}
    seen, loose = 0, []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name not in parsers:
                continue
            seen += 1
            kw = {k.arg: k.value for k in node.keywords}
            if not (isinstance(kw.get("allow_abbrev"), ast.Constant) and
                    kw["allow_abbrev"].value is False):  # fmt: skip
                loose.append(f"{f.relative_to(root)}:{node.lineno}")
    assert seen > 10 and not loose, loose
