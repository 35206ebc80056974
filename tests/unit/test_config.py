import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.config import DEFAULT_ORDER, Config
from megalite.config_read import from_dict, parse_args
from megalite.errors import MegaliteError
from megalite.shape import validate

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_precedence_defaults_yaml_cli(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model:\n  num_layers: 6\n  hidden_size: 96\ntraining:\n  seed: 7\n")
    cfg = parse_args(
        ["--config", str(y), "--hidden-size", "128", "--tensor-model-parallel-size", "2"]
    )
    assert cfg.model.num_layers == 6  # from YAML
    assert cfg.model.hidden_size == 128  # CLI beats YAML
    assert cfg.training.seed == 7
    assert cfg.parallel.tp == 2  # Megatron alias
    assert cfg.training.micro_batch_size == 2  # default
    cfg = parse_args(
        ["--pp", "2", "--vpp", "2", "--gbs", "16", "--num-layers", "4", "--sequence-parallel"]
    )
    assert (cfg.parallel.pp, cfg.parallel.vpp, cfg.training.global_batch_size) == (2, 2, 16)
    shape = validate(cfg, world_size=8)
    assert shape.dp == 4  # inferred
    assert shape.schedule == "interleaved"
    assert shape.sequence_parallel is False  # ignored at tp=1 (documented)
    assert shape.microbatches == 2 and shape.hidden_shape == (2, 128, 64)
    # derived values live in the shape; the user's config is not written to
    assert cfg.parallel.dp is None and cfg.parallel.pp_schedule is None
    assert cfg.parallel.sequence_parallel is True
    cfg = parse_args(["--data-path", "0.7", "a", "0.3", "b"])
    assert cfg.data.data_path == ["0.7", "a", "0.3", "b"]


HIERARCHICAL = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes"]  # A P
BAD = [
    (["--tp", "3"], 8, "world size 8 is not divisible by tp*pp=3*1"),
    (["--tp", "2", "--dp", "2"], 8, "does not equal the world size 8"),
    (["--dp-replicate", "3", "--zero-stage", "1"], 4, "--dp-replicate 3 does not divide dp=4"),
    (
        ["--num-distributed-optimizer-instances", "2"],
        4,
        "--dp-replicate 2 needs a sharded optimizer",
    ),
    (["--tp", "8", "--num-attention-heads", "4"], 8, "tp=8 is larger than num_attention_heads=4"),
    (
        ["--tp", "4", "--num-attention-heads", "6", "--hidden-size", "96"],
        4,
        "num_attention_heads=6 is not divisible by tp=4",
    ),
    (
        [
            "--tp",
            "4",
            "--num-attention-heads",
            "12",
            "--hidden-size",
            "96",
            "--num-query-groups",
            "6",
        ],
        4,
        "num_query_groups=6 is not divisible by tp=4",
    ),
    (["--pp", "2", "--num-layers", "3"], 2, "num_layers=3 is not divisible by pp*vpp=2*1"),
    (
        ["--pp", "2", "--vpp", "2", "--num-layers", "6"],
        2,
        "num_layers=6 is not divisible by pp*vpp=2*2",
    ),
    (
        ["--gbs", "10", "--mbs", "2"],
        2,
        "global_batch_size=10 is not divisible by micro_batch_size*dp=2*2",
    ),
    # the schedule names are the pipeline registry's, checked by validate, not by the reader
    (["--pp-schedule", "zb-h2"], 1, "unknown pipeline schedule 'zb-h2'; choose one of gpipe, 1f1b"),
    (["--hidden-size", "0"], 1, "--hidden-size=0 must be a positive integer"),
    (["--tp", "-2"], 1, "--tp=-2 must be a positive integer"),
    (
        ["--pp", "2", "--vpp", "2", "--num-layers", "4", "--gbs", "6", "--mbs", "2"],
        2,
        "needs micro-batches per step (3) to be a multiple of pp=2",
    ),
    # context parallelism and packed documents
    (["--cp", "3"], 4, "world size 4 is not divisible by tp*pp*cp=1*1*3"),
    (["--cp", "2", "--seq-length", "18"], 2, "seq_length=18 is not divisible by 2*cp=4"),
    (
        ["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-length", "20"],
        8,
        "seq_length/cp=10 is not divisible by tp=4",
    ),
    (
        ["--context-parallel-size", "2", "--attention-dropout", "0.1"],
        2,
        "attention_dropout=0.1 is not supported with cp=2",
    ),
    (
        ["--cp", "2", "--cp-comm-type", "a2a", "--num-query-groups", "1"],
        2,
        "--cp-comm-type a2a splits each TP rank's 4 query and 1 key/value heads over cp=2",
    ),
    (  # a2a+p2p: its two levels must multiply to cp, A must divide the heads
        ["--cp", "4", *HIERARCHICAL, "2", "4"],
        4,
        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P with A*P = cp=4",
    ),
    (
        ["--cp", "4", "--cp-comm-type", "a2a+p2p"],
        4,
        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P with A*P = cp=4 "
        "(all-to-all among A adjacent cp ranks, the ring over P), not none",
    ),
    (
        ["--cp", "4", *HIERARCHICAL, "4", "1", "--num-query-groups", "2"],
        4,
        "--cp-comm-type a2a+p2p splits each TP rank's 4 query and 2 key/value heads over A=4",
    ),
    (
        ["--cp", "4", "--hierarchical-context-parallel-sizes", "2", "2"],
        4,
        "--hierarchical-context-parallel-sizes is read only by --cp-comm-type a2a+p2p (not p2p)",
    ),
    (
        ["--reset-attention-mask", "--attention-dropout", "0.1"],
        1,
        "--reset-attention-mask does not support attention dropout",
    ),
    (
        ["--num-experts", "4", "--zero-stage", "3"],
        2,
        "--zero-stage 3 does not shard mixture-of-experts models yet; use --zero-stage 2",
    ),
    (["--tp", "2", "--tp-comm-overlap"], 2, "--tp-comm-overlap overlaps sequence parallelism's"),
    (
        ["--tp", "2", "--sequence-parallel", "--tp-comm-overlap", "--fp8-format", "hybrid"],
        2,
        "--tp-comm-overlap cuts the bf16/fp32 matmuls into pieces, not FP8's linears: drop one",
    ),
]


@pytest.mark.parametrize("argv,world,message", BAD)
def test_validate_rejects(argv, world, message):
    with pytest.raises(MegaliteError, match=re.escape(message)):
        validate(parse_args(argv), world)


def test_hierarchical_context_parallel_shape():
    """--cp-comm-type a2a+p2p with sizes A P: the shape's topology carries A, and the groups of
    a rank are A adjacent cp ranks (the all-to-all) and the ranks at its place in each of them
    (the ring), within its own cp group (tp 2: cp ranks are every other rank)."""
    from megalite.parallel.groups import rank_groups

    topo = validate(parse_args(["--cp", "4", "--tp", "2", *HIERARCHICAL, "2", "2"]), 8).topology()
    assert topo.cp_a2a == 2 and topo.groups("cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    got = {r: (g["cp_a2a"], g["cp_p2p"]) for r in range(8) for g in [rank_groups(topo, r)]}
    assert got[0] == ([0, 2], [0, 4]) and got[2] == ([0, 2], [2, 6])
    assert got[4] == ([4, 6], [0, 4]) and got[7] == ([5, 7], [3, 7])
    assert validate(parse_args(["--cp", "4"]), 4).topology().cp_a2a is None


def test_parse_errors(tmp_path):
    with pytest.raises(
        MegaliteError,
        match="unknown flag --tensor-paralel-size; did you mean --tensor-model-parallel-size",
    ):
        parse_args(["--tensor-paralel-size", "2"])
    with pytest.raises(MegaliteError, match="does not exist"):
        parse_args(["--config", str(tmp_path / "nope.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: [4\n")
    with pytest.raises(MegaliteError, match="not valid YAML at line"):
        parse_args(["--config", str(bad)])
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  num_layyers: 4\n")
    with pytest.raises(MegaliteError, match="did you mean 'num_layers'"):
        parse_args(["--config", str(typo)])
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model:\n  num_layers: four\n")
    with pytest.raises(MegaliteError, match="'four' is not a valid int"):
        parse_args(["--config", str(wrong)])
    with pytest.raises(MegaliteError, match="invalid int value"):
        parse_args(["--num-layers", "x"])


def test_entry_point_prints_one_line_and_exits_nonzero():
    r = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--tp", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "megalite: error: world size 1 is not divisible by tp*pp=3*1; launch a multiple of 3 processes "
        "or change --tp/--pp"
    ]
    assert "Traceback" not in r.stdout + r.stderr


def test_config_is_data():
    """config/ and model_config.py import nothing of megalite (errors at most, and config/ its
    model part and its own sections): reading YAML, flags and dicts is config_read's, and the
    schedule names are the pipeline registry's."""
    sections = {f"megalite.config.{p.stem}" for p in Path(ROOT, "megalite", "config").glob("*.py")}
    allowed = {f"config/{p.name}": {"megalite.errors", "megalite.model_config", *sections}
               for p in Path(ROOT, "megalite", "config").glob("*.py")}  # fmt: skip
    allowed["model_config.py"] = {"megalite.errors"}
    for file, ok in allowed.items():
        tree = ast.parse(Path(ROOT, "megalite", file).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert [n for n in names if n.startswith("megalite") and n not in ok] == [], file
    assert not hasattr(Config, "from_dict")


def test_from_dict_applies_and_checks():
    cfg = from_dict({"model": {"hidden_size": 96, "flavour": "llama"}, "parallel": {"tp": 2}})
    assert (cfg.model.hidden_size, cfg.model.flavour, cfg.parallel.tp) == (96, "llama", 2)
    assert cfg.model.num_layers == Config().model.num_layers  # the rest are defaults
    with pytest.raises(MegaliteError, match="unknown field model.hiden_size; did you mean"):
        from_dict({"model": {"hiden_size": 96}})


def test_default_order_is_one_literal():
    from megalite.parallel.topology import Topology

    assert Config().parallel.order == DEFAULT_ORDER == Topology().order
    holders = []
    for path in Path(ROOT, "megalite").rglob("*.py"):
        tree = ast.parse(path.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings
        holders += [path.relative_to(ROOT).as_posix() for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and n.value == DEFAULT_ORDER and id(n) not in docs]  # fmt: skip
    assert holders == ["megalite/config/parallel.py"]


def test_dp_replicate_splits_dp_and_keeps_the_layout_of_plain_dp():
    """--dp counts every data-parallel rank: --dp-replicate 2 makes dp=4 two copies (dpr) of a
    shard group of 2 (the dp axis, `size("dp")`; `shape.dp` is the user's 4). The copies change
    only how gradients are reduced, so a checkpoint records the layout of plain dp=4 (RNG
    streams carry over across R)."""
    argv = ["--tp", "2", "--dp", "4", "--zero-stage", "1", "--global-batch-size", "8"]
    hsdp = validate(parse_args([*argv, "--num-distributed-optimizer-instances", "2"]), 8)
    plain = validate(parse_args(argv), 8)
    assert (hsdp.size("dp"), hsdp.dpr, hsdp.dp, plain.dp) == (2, 2, 4, 4)
    assert hsdp.microbatches == plain.microbatches  # (the batch split over all 4)
    assert str(hsdp) == "tp=2 pp=1 dp=4 dpr=2 zero=1"
    assert hsdp.layout() == plain.layout() == {"tp": 2, "dp": 4, "pp": 1, "vpp": 1, "world_size": 8}
    # copies laid out apart from their shard group number the ranks otherwise: recorded
    apart = parse_args([*argv, "--dp-replicate", "2", "--order", "tp-dpr-dp-pp"])
    assert validate(apart, 8).layout()["dpr"] == 2
