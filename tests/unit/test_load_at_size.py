"""Loading a model as real sizes need it (issue 42 item 4): built on the meta device and given
the checkpoint's own bytes in the checkpoint's dtype, no weight initialised first; one rotary
table per model, as long as the positions used."""

import dataclasses

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint import writing
from megalite.checkpoint.resume import resume_path
from megalite.cli import generate as gen_tool
from megalite.config_read import from_dict
from megalite.generation import generate
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.model_config import ModelConfig
from megalite.parallel.groups import single_process_groups
from megalite.parallel.specs import spec_of
from megalite.shape import validate
from megalite.testing import tiny_config
from megalite.training.build import parallelize

GROUPS = single_process_groups()


def small(**kw):
    base = dict(flavour="llama", num_layers=3, hidden_size=32, num_attention_heads=4,
                num_query_groups=2, seq_length=4096, vocab_size=80,
                make_vocab_size_divisible_by=16)  # fmt: skip
    return ModelConfig(**{**base, **kw})


@pytest.fixture
def saved(tmp_path):
    """(reference bf16 model, its checkpoint directory, the model config it holds)."""
    cfg = small()
    ref = GPTChunk(cfg, LayerEnv(seed=3, dtype=torch.bfloat16)).eval()
    state = {spec_of(p).name: p.detach() for p in ref.parameters()}  # no vocabulary padding
    meta = {"config": {"model": dataclasses.asdict(cfg)}}
    writing.write_full_checkpoint(tmp_path / "ml", state, meta)
    return ref, tmp_path / "ml", from_dict({"model": meta["config"]["model"]}).model


def _never_initialised(monkeypatch):
    def refuse(self, seed):
        raise AssertionError("a model about to be loaded was initialised")

    monkeypatch.setattr(GPTChunk, "init_parameters", refuse)


def _in_mapped_file(t, directory) -> bool:
    """Whether tensor `t`'s bytes lie in a mapping of one of `directory`'s files."""
    for line in open("/proc/self/maps"):
        span, *_, where = line.split(maxsplit=5)
        if where.strip().startswith(str(directory)):
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= t.data_ptr() < hi:
                return True
    return False


def _cos_tables(chunk):
    return {id(b): b for n, b in chunk.named_buffers(remove_duplicate=False) if n.endswith("cos")}


def test_generation_loads_the_checkpoint_bytes_in_its_dtype_uninitialised(saved, monkeypatch):
    ref, path, cfg = saved
    _never_initialised(monkeypatch)
    ckpt = fmt.Checkpoint(path)
    (chunk,) = gen_tool.load_chunks(ckpt, cfg, gen_tool.layout(ckpt, 1), GROUPS)  # dtype auto
    assert {p.dtype for p in chunk.parameters()} == {torch.bfloat16}
    for (name, p), q in zip(chunk.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    # the weights are views of the mapped files (copy-on-write), not an anonymous copy
    assert all(_in_mapped_file(p, path) for p in chunk.parameters())
    prompt = [[5, 9, 2, 7]]
    assert generate([chunk], GROUPS, prompt, 3) == generate([ref], GROUPS, prompt, 3)
    # one table for every layer, grown to the cache's positions (4 + 3 - 1), not seq_length
    (table,) = _cos_tables(chunk).values()
    assert table.shape == (6, cfg.head_dim // 2)


def test_one_rotary_table_per_model():
    chunk = GPTChunk(small(num_layers=4), LayerEnv(seed=1))
    (table,) = _cos_tables(chunk).values()  # not one per layer
    assert table.shape == (4096, 4)


def test_a_run_that_loads_a_checkpoint_builds_without_initialising(saved, monkeypatch):
    _, path, _ = saved
    cfg = tiny_config()
    cfg.model = small()
    cfg.checkpoint.load = str(path)
    _never_initialised(monkeypatch)
    loading = resume_path(cfg) is not None
    (chunk,), _ = parallelize(cfg, validate(cfg, 1), GROUPS, data_parallel=False, loading=loading)
    assert not any(p.is_meta for p in chunk.parameters())
    assert not any(b.is_meta for b in chunk.buffers())
    cfg.checkpoint.load = None  # from scratch: initialised as always
    with pytest.raises(AssertionError, match="was initialised"):
        loading = resume_path(cfg) is not None
        parallelize(cfg, validate(cfg, 1), GROUPS, data_parallel=False, loading=loading)
