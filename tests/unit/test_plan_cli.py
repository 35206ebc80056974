"""tools/plan.py as a user runs it: --help, --tp-comm-overlap, --hf-config, the layout given
placed among those searched, the layout preferred for its headroom, and the launch line that
ends the answer, checked by `pretrain_gpt.py --dry-run` at its world (megalite/plan/launch.py)."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megalite.cli.plan import main
from megalite.errors import MegaliteError
from megalite.plan.launch import preferred

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--seq-length", "2048", "--vocab-size", "32000", "--gbs", "64", "--precision", "bf16"]  # fmt: skip


def test_help_needs_no_other_flag(capsys):
    main(["--help"])  # returns: exit 0
    out = capsys.readouterr().out
    assert "--hf-config" in out and "--num-layers" in out and "--gpus" in out
    with pytest.raises(MegaliteError, match="--gpus is required"):
        main(MODEL)


def test_tp_comm_overlap_with_sequence_parallel_is_planned(capsys):
    """It used to be refused ("add --sequence-parallel"): the model check ran without SP."""
    main(["--gpus", "16", "--tp", "4", "--sequence-parallel", "--tp-comm-overlap", *MODEL,
          "--top", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("layout tp=4 pp=1 dp=4 zero=0 sp:")
    assert "the layout given (tp=4 pp=1 dp=4 zero=0 sp, mbs 2)" in out


def test_layout_given_is_planned_as_given_and_ranked(capsys):
    main(["--gpus", "16", "--tp", "2", "--pp", "2", "--mbs", "1", *MODEL, "--top", "3"])
    out = capsys.readouterr().out
    assert out.startswith("layout tp=2 pp=2 dp=4 zero=0:")
    line = next(s for s in out.splitlines() if "the layout given" in s)
    assert "(tp=2 pp=2 dp=4 zero=0, mbs 1)" in line and " ranks #" in line and "of " in line


def test_hf_config_reads_the_model(tmp_path, capsys):
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2816,
          "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 4,
          "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
          "rope_theta": 500000.0, "hidden_act": "silu"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    main(["--gpus", "8", "--hf-config", str(tmp_path), "--seq-length", "1024", "--gbs", "32",
          "--top", "1"])  # fmt: skip
    launch = capsys.readouterr().out.splitlines()[-1].split()
    flags = dict(zip(launch, launch[1:]))
    assert flags["--flavour"] == "llama" and flags["--num-layers"] == "6"
    assert flags["--num-query-groups"] == "4" and flags["--ffn-hidden-size"] == "2816"
    assert flags["--seq-length"] == "1024"  # the flag given over max_position_embeddings
    with pytest.raises(MegaliteError, match="no such file"):
        main(["--gpus", "8", "--hf-config", str(tmp_path / "missing.json")])


def test_launch_line_passes_dry_run(capsys):
    """The answer's last line launches the layout it prefers: torchrun's world, given to
    pretrain_gpt.py --dry-run (WORLD_SIZE as torchrun sets it), plans that very layout."""
    main(["--gpus", "32", "--gpu-memory", "16", "--flavour", "llama", "--num-layers", "24",
          "--hidden-size", "4096", "--num-attention-heads", "32", "--num-query-groups", "8",
          "--seq-length", "4096", "--vocab-size", "32000", "--gbs", "64", "--precision", "bf16",
          "--tp-comm-overlap", "--top", "3"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    words = shlex.split(out[-1])
    assert words[:6] == ["torchrun", "--nnodes", "4", "--nproc_per_node", "8", "pretrain_gpt.py"]
    layout = out[-2].removeprefix("  launch (").split(", mbs")[0]
    assert " sp" in layout and "--tp-comm-overlap" in words  # 16 GiB: TP with SP
    # above it, what losing a node would cost the chosen layout (plan/restart.py)
    assert out[-4].startswith("    restart after a lost node, local tier: ")
    assert out[-3].startswith("    restart, persistent tier: ")
    env = {**os.environ, "WORLD_SIZE": "32", "RANK": "0", "LOCAL_WORLD_SIZE": "8",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *words[6:], "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith(f"layout {layout}:"), (layout, first)


def _plan(seconds, gib):
    return SimpleNamespace(step_time=seconds, memory={"total": gib * 2**30})


def test_preferred_trades_a_few_percent_for_headroom():
    usable = 72 * 2**30
    tight, roomy, slow = _plan(1.0, 70.6), _plan(1.026, 50.0), _plan(1.2, 20.0)
    assert preferred([tight, roomy, slow], usable) == (roomy, tight)
    # a little more room is not worth it, nor a layout more than 3% slower
    assert preferred([tight, _plan(1.01, 68.0), slow], usable)[0] is tight


def test_launch_config_validates_to_each_layout_searched():
    """Every layout of a search, its flags read back (parse_args) and validated at its world,
    is that layout: the same axes, vpp, ZeRO stage, micro-batch size and pipeline split."""
    from megalite.config_read import parse_args
    from megalite.plan import layouts
    from megalite.plan.launch import config_flags, launch_config
    from megalite.plan.ranking import Cluster
    from megalite.shape import validate
    from tests.unit.plan_configs import big, flops

    cfg = big("llama", 30, 4096, 32, 4096, 32000, mbs=1, gbs=64)
    cfg.parallel.tp_comm_overlap = True
    cluster = Cluster(32, gpu_memory_gib=24)
    plans = layouts.search(cfg, cluster, flops(cfg), micro_batch_sizes=(1, 2))
    assert any(p.split for p in plans) and any(p.layout.vpp > 1 for p in plans)
    for p in plans:
        back = validate(parse_args(config_flags(launch_config(cfg, p))), 32)
        assert (str(back), back.micro_batch_size) == (str(p.layout), p.layout.micro_batch_size)
        assert back.stage_layers == p.layout.stage_layers and back.schedule == p.layout.schedule


def test_recompute_and_cp_are_searched(capsys):
    """Without --recompute-granularity the search tries none, selective and full: on one 20 GiB
    GPU a 0.8B model's Adam state leaves too little for its activations unless it recomputes,
    and the launch line says how; cp is tried at 8K (2,048 tokens a rank or more), not only
    from 16K."""
    from megalite.plan.layouts import cp_sizes
    from tests.unit.plan_configs import big

    assert cp_sizes(big("llama", 2, 1024, 8, 8192, 1000, mbs=1, gbs=8), 64) == [1, 2, 4]
    main(["--gpus", "1", "--gpu-memory", "20", "--flavour", "llama", "--num-layers", "16",
          "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096",
          "--vocab-size", "32000", "--gbs", "8", "--precision", "bf16", "--mbs", "1",
          "--top", "3"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    kinds = {"none", "selective", "full"}
    rows = [r.split() for r in out if r.split()[:1] in (["1"], ["2"], ["3"])]
    chosen = [next(w for w in r if w in kinds) for r in rows]
    assert chosen and "none" not in chosen, out
    launch = out[-1].split()
    assert launch[launch.index("--recompute") + 1] in kinds - {"none"}


def test_expert_layouts_are_searched_and_launched():
    """An MoE model: ep with and without tp, and etp, are searched (it used to keep the
    configured ep = 1); every plan's launch flags validate back to its layout, ep and etp too."""
    from megalite.config_read import parse_args
    from megalite.plan import layouts
    from megalite.plan.launch import config_flags, launch_config
    from megalite.plan.ranking import Cluster
    from megalite.shape import validate
    from tests.unit.plan_configs import big, flops

    cfg = big("llama", 8, 2048, 16, 4096, 32000, mbs=1, gbs=64)
    cfg.model.num_experts, cfg.model.moe_router_topk, cfg.model.num_query_groups = 8, 2, 8
    cfg.model.moe_ffn_hidden_size = 2048
    plans = layouts.search(cfg, Cluster(16), flops(cfg))
    experts = {(p.layout.tp > 1, p.layout.ep, p.layout.etp) for p in plans}
    assert {(False, 8, 1), (True, 4, 1), (True, 4, 2)} <= experts, experts
    assert plans[0].layout.ep > 1  # the grouped GEMMs' tokens: an expert's GEMM at ep=1 is small
    for p in plans:
        back = validate(parse_args(config_flags(launch_config(cfg, p))), 16)
        assert (str(back), back.etp) == (str(p.layout), p.layout.etp)
