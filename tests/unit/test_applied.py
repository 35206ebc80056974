"""training/applied.py: what `parallelize` applied and where each parameter lives, read back from
the chunks; `--dry-run` prints both (training/dry_run.py `print_applied`). No process group: the
chunks are built on the meta device with groups that have no communicator."""

from megalite.parallel.groups import described_groups
from megalite.shape import validate
from megalite.testing import tiny_config
from megalite.training.applied import applied, module_plan
from megalite.training.build import parallelize
from megalite.training.dry_run import print_applied


def _cfg(**parallel):
    cfg = tiny_config()
    cfg.optimizer.zero_stage = parallel.pop("zero_stage", 0)
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _built(cfg, world):
    shape = validate(cfg, world)
    chunks, _ = parallelize(cfg, shape, described_groups(shape.topology(), 0), data_parallel=False,
                            meta=True)  # fmt: skip
    plan = dict(line.split(None, 1) for line in module_plan(chunks))
    return applied(cfg, shape, chunks), plan


def test_tp2_sp_zero1_lists_what_is_applied_and_each_parameters_placement():
    lines, plan = _built(_cfg(tp=2, sequence_parallel=True, zero_stage=1), 4)
    assert lines[0] == "pipeline stage 0 of pp=1 (1f1b): layers 0-1 + embedding + head"
    assert lines[1].startswith("tensor parallel tp=2 (column/row linears, vocab-parallel")
    assert lines[2].startswith("sequence parallel")
    assert lines[3].startswith("data parallel dp=2 zero-1 (sharded optimizer state)")
    assert "buckets of 25 MB, parameter gather overlapped" in lines[3]
    assert lines[4].startswith("gradient sums after the data-parallel reduction: tp (")
    assert "input_norm" in lines[4] and "attention.out" in lines[4]  # norms, row biases
    for name in ("q", "k", "v"):
        assert plan[f"layers.{{0-1}}.attention.{name}.weight"] == "column tp=2"
    assert plan["layers.{0-1}.attention.out.weight"] == "row tp=2"
    assert plan["layers.{0-1}.mlp.up.weight"] == "column tp=2"
    assert plan["layers.{0-1}.mlp.down.weight"] == "row tp=2"
    assert plan["embedding.word.weight"] == "vocab tp=2"
    assert plan["layers.{0-1}.input_norm.weight"] == "replicated, grad sum tp"  # under SP
    assert plan["final_norm.weight"] == "replicated, grad sum tp"


def test_another_layout_changes_the_list_and_the_plan():
    """tp=1 pp=2 with a tied embedding: no tensor or sequence parallelism, every parameter whole,
    the two halves of the tied embedding summed over `embed` on their stages; fp8, recompute and
    compile appear where the config asks for them, read from the layers."""
    cfg = _cfg(pp=2)
    cfg.training.recompute, cfg.training.fp8_format = "full", "hybrid"
    cfg.training.precision, cfg.training.compile = "bf16", True
    lines, plan = _built(cfg, 2)
    assert "fp8 hybrid tensorwise on layers 0" in lines
    assert "compile: each layer's math (1 on this stage)" in lines
    assert lines[0] == "pipeline stage 0 of pp=2 (1f1b): layers 0 + embedding"
    assert not any(line.startswith(("tensor", "sequence")) for line in lines)
    assert "recompute full" in lines
    assert "precision bf16, no loss scaling" in lines
    assert lines[-1] == "gradient sums after the data-parallel reduction: embed (embedding.word)"
    assert plan["layers.{0}.attention.q.weight"] == "replicated"
    assert plan["embedding.word.weight"] == "replicated, grad sum embed"


def test_dry_run_prints_the_list_and_the_plan(capsys):
    cfg = _cfg(tp=2, sequence_parallel=True, zero_stage=1)
    print_applied(cfg, validate(cfg, 4))
    out = capsys.readouterr().out
    assert "applied on pipeline stage 0, in order:\n  pipeline stage 0" in out
    assert "  tensor parallel tp=2" in out and "  sequence parallel" in out
    assert "zero-1" in out and "per-module plan" in out
    assert "layers.{0-1}.attention.q.weight" in out and "row tp=2" in out


def test_context_and_expert_parallelism_are_listed():
    lines, _ = _built(_cfg(cp=2, cp_comm_type="a2a"), 2)
    assert "context parallel cp=2 a2a" in lines
    cfg = _cfg(ep=2)
    cfg.model.num_experts, cfg.model.moe_router_topk = 4, 2
    lines, plan = _built(cfg, 2)
    assert "expert parallel ep=2 etp=1" in lines
    assert not any("expert biases" in line for line in lines)
    cfg.model.moe_router_enable_expert_bias = True
    assert "expert biases move toward balanced loads" in _built(cfg, 2)[0][-1]
    assert plan["layers.{0-1}.mlp.experts.down.weight"] == "expert ep=2"


def test_fp16_loss_scaling_and_dropout_are_listed():
    """The loss scale the optimizer holds and the executor applies, and dropout's streams, each
    one line where they apply (fp32 without dropout lists neither: the first test)."""
    cfg = _cfg(tp=2)
    cfg.training.precision = "fp16"
    cfg.model.hidden_dropout = 0.1
    lines, _ = _built(cfg, 2)
    assert any(
        line.startswith("precision fp16, loss scale dynamic, from 4.29497e+09") for line in lines
    )
    assert any(line.startswith("dropout 0.1 hidden, 0 attention") for line in lines)
    cfg.optimizer.loss_scale = 1024.0
    assert any("loss scale static 1024" in line for line in _built(cfg, 2)[0])
