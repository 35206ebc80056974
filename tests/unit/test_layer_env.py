"""The layers' one environment (megalite/model/env.py): defaults of one process, variations that
share or renew the dropout stream, and the sequence-parallel switch a chunk hands its layers."""

import torch

from megalite.config import ModelConfig
from megalite.model.env import LOCAL, LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel.comm import Group

CFG = ModelConfig(flavour="llama", num_layers=2, hidden_size=32, num_attention_heads=4,
                  seq_length=16, vocab_size=64, hidden_dropout=0.1)  # fmt: skip


def test_defaults_are_one_process():
    env = LayerEnv(dtype=torch.float64)
    assert env.tp is LOCAL and env.cp.size == 1 and env.experts.ep == 1 and env.experts.etp == 1
    assert env.sequence_parallel is False and env.cp_attention == "p2p"
    assert env.tensor_kw == {"dtype": torch.float64, "device": None}
    assert LayerEnv(meta=True).tensor_kw["device"] == "meta"


def test_sequence_parallelism_is_on_with_tp_only():
    two = Group("tp", [0, 1], 0)
    assert LayerEnv(tp=two, sequence_parallel=True).sequence_parallel is True
    assert LayerEnv(sequence_parallel=True).sequence_parallel is False  # tp = 1: nothing to split


def test_cp_levels_come_before_the_comm_type():
    inner, outer = Group("cp_a2a", [0, 1], 0), Group("cp_p2p", [0, 2], 0)
    env = LayerEnv(cp_comm_type="a2a+p2p", cp_levels=(inner, outer))
    assert env.cp_attention == (inner, outer)
    assert LayerEnv(cp_comm_type="a2a").cp_attention == "a2a"


def test_replace_shares_the_dropout_stream_unless_it_changes_what_it_is_made_from():
    env = LayerEnv()
    same = env.replace(dtype=torch.float64)
    assert same.rng is env.rng
    reseeded = env.replace(seed=7)
    assert reseeded.rng is not env.rng
    fresh = env.fresh()
    assert fresh == env and fresh.rng is not env.rng


def test_each_chunk_has_its_own_switch_and_stream_its_layers_share():
    env = LayerEnv(tp=Group("tp", [0, 1], 0), sequence_parallel=True, device="meta")
    a, b = GPTChunk(CFG, env), GPTChunk(CFG, env)
    assert a.sequence_parallel is not b.sequence_parallel and a.rng is not b.rng
    assert env.sequence_parallel is True  # the chunk's switch is in its own env, not the caller's
    assert a.env.sequence_parallel is a.sequence_parallel
    for layer in a.layers.values():
        assert layer.sequence_parallel is a.sequence_parallel and layer.rng is a.rng
    with a.full_sequences():
        assert not a.layers["0"].sequence_parallel and b.layers["0"].sequence_parallel


def test_a_chunk_from_the_default_env_equals_one_built_with_it_spelt_out():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    plain = GPTChunk(CFG, LayerEnv(dtype=torch.float64))(ids, ids)
    torch.manual_seed(1)
    spelt = LayerEnv(tp=LOCAL, seed=1234, recompute="none", dtype=torch.float64, device=None)
    assert torch.equal(GPTChunk(CFG, spelt)(ids, ids), plain)  # dropout on: the same stream
