"""parallel/zero.py: each ZeRO stage answers the questions the buffers, the optimizer, the run
shape and the planner ask (the distributed runs: tests/distributed/test_zero.py, test_zero3.py)."""

import pytest

from megalite.config import Config, ModelConfig
from megalite.errors import MegaliteError
from megalite.model.gpt import GPTChunk
from megalite.parallel.buffers import Buffers
from megalite.parallel.data_parallel import build_buffers
from megalite.parallel.groups import single_process_groups
from megalite.parallel.zero import GATHERS, ZERO
from megalite.shape import validate
from tests.unit.plan_configs import tiny


def test_collectives_per_bucket_and_step():
    """m = 4 micro-batches: stage 0 all-reduces once, 1 reduce-scatters once, 2 every
    micro-batch; 1 and 2 all-gather the updated shards; 3 gathers before use instead."""
    assert ZERO[0].collectives(4) == {"all_reduce": 1}
    assert ZERO[1].collectives(4) == {"reduce_scatter": 1, "all_gather": 1, "shard_all_reduce": 1}
    assert ZERO[2].collectives(4) == {"reduce_scatter": 4, "all_gather": 1, "shard_all_reduce": 1}
    assert ZERO[3].collectives(4, "forward") == {
        "reduce_scatter": 4, "param_gather": 8, "shard_all_reduce": 1}  # fmt: skip
    assert ZERO[3].collectives(4, "step")["param_gather"] == 1
    assert [GATHERS[p](4) for p in ("forward", "backward", "step")] == [8, 4, 1]


def test_reshard_policy_is_the_stages():
    assert [ZERO[z].reshard(False, False) for z in (0, 1, 2)] == [None] * 3
    assert ZERO[3].reshard(False, False) == "forward"
    assert ZERO[3].reshard(False, True) == "backward"
    assert ZERO[3].reshard(True, False) == ZERO[3].reshard(True, True) == "step"


def test_the_run_shape_carries_its_stage():
    cfg = Config()
    cfg.model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                            vocab_size=100)  # fmt: skip
    cfg.optimizer.zero_stage = 2
    shape = validate(cfg, 4)
    assert shape.zero is ZERO[2] and str(shape) == "tp=1 pp=1 dp=4 zero=2"
    cfg.model.num_experts, cfg.optimizer.zero_stage = 4, 3  # a stage that cannot shard experts
    with pytest.raises(MegaliteError, match="--zero-stage 3 does not shard mixture-of-experts"):
        validate(cfg, 4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_builds_buffers_behind_one_interface(stage):
    """build_buffers gives each stage an object with every member of parallel/buffers.Buffers
    (what the optimizer reads), its gradients handed to the reducer the stage picks."""
    cfg = tiny("gpt2", layers=2)
    cfg.optimizer.zero_stage = stage
    buf = build_buffers([GPTChunk(cfg.model)], single_process_groups(), cfg)
    assert isinstance(buf, Buffers)
    assert type(buf.reducer) is ZERO[stage].reducer
    assert ZERO[stage].reduce_each_microbatch == (stage >= 2) == (not ZERO[stage].grad_buffer)
    assert ZERO[stage].shard_state == (stage >= 1)
